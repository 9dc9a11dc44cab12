"""`disagg check`, `disagg plan` and `disagg crd generate`: the offline side of the operator.

Exit codes: 0 the spec is compatible (or the command succeeded), 1 the spec breaks a compatibility rule (or
the committed CRD is stale), 2 the file is not a valid DisaggDeployment (YAML or schema error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import yaml

    from disagg.operator.api import DisaggDeployment, DisaggDeploymentSpec, Role
    from disagg.operator.policies.compat import CompatReport

EXIT_OK = 0
EXIT_INCOMPATIBLE = 1
EXIT_INVALID = 2
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str


class SpecFileError(Exception):
    """A file that is not a valid DisaggDeployment: unreadable, not YAML, or failing the schema."""

    def __init__(self, summary: str, errors: list[FieldError] | None = None) -> None:
        super().__init__(summary)
        self.summary = summary
        self.errors = errors or []


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(document)"


def load_deployment(path: Path) -> DisaggDeployment:
    """Read and validate one DisaggDeployment document; raises SpecFileError naming each bad field."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecFileError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise SpecFileError(f"{path} is not UTF-8 text: {error.reason} at byte {error.start}") from None
    return parse_deployment(text, str(path))


def parse_deployment(text: str, path: str) -> DisaggDeployment:
    """Validate one DisaggDeployment document given as YAML text; `path` names it in the errors."""
    import yaml
    from pydantic import ValidationError

    from disagg.operator.api import DisaggDeployment

    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise SpecFileError(f"{path} is not valid YAML: {error}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively; a document this deep is no DisaggDeployment.
        raise SpecFileError(f"{path} is nested too deeply to be a DisaggDeployment") from None
    if len(documents) != 1:
        raise SpecFileError(f"{path} must hold exactly one DisaggDeployment document, found {len(documents)}")
    if not isinstance(documents[0], dict):
        raise SpecFileError(f"{path} must hold a YAML mapping, found {type(documents[0]).__name__}")
    try:
        # By the wire names alone, as the API server reads it: `kubectl apply` refuses `max_surge` as an
        # unknown field, so a check that passed it would pass a file that cannot be applied.
        return DisaggDeployment.model_validate(documents[0], by_alias=True, by_name=False)
    except ValidationError as error:
        errors = [
            FieldError(_field_path(tuple(item["loc"])), _field_message(item))
            for item in error.errors(include_url=False)
        ]
        raise SpecFileError(f"{path} is not a valid DisaggDeployment", errors) from None


def _field_message(item: Mapping[str, Any]) -> str:
    """Pydantic's message, with an unknown field named as the API server names it (and the wire spelling
    of a snake_case one)."""
    from pydantic.alias_generators import to_camel

    if item["type"] != "extra_forbidden":
        return str(item["msg"]).removeprefix("Value error, ")
    name = str(item["loc"][-1])
    camel = to_camel(name)
    hint = f" (did you mean {camel}?)" if camel != name and "_" in name else ""
    return f"unknown field {name!r}{hint}"


def _object_name(dd: DisaggDeployment) -> str:
    name = dd.metadata.name or "(unnamed)"
    return f"{dd.metadata.namespace}/{name}" if dd.metadata.namespace else name


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _print_invalid(error: SpecFileError, path: Path, output: str, out: TextIO) -> int:
    if output == "json":
        errors = [{"path": e.path, "message": e.message} for e in error.errors]
        json.dump(
            {"file": str(path), "valid": False, "error": error.summary, "errors": errors}, out, indent=2
        )
        out.write("\n")
    else:
        out.write(f"{error.summary}\n")
        for field_error in error.errors:
            out.write(f"  {field_error.path}: {field_error.message}\n")
    return EXIT_INVALID


def _report_json(path: Path, dd: DisaggDeployment, report: CompatReport) -> dict[str, Any]:
    return {
        "file": str(path),
        "valid": True,
        "name": dd.metadata.name,
        "namespace": dd.metadata.namespace,
        "compatible": report.compatible,
        "violations": [{"reason": v.reason, "message": v.message} for v in report.violations],
        "notes": list(report.notes),
        "topology": report.plan.to_dict() if report.plan is not None else None,
        "compatibilityHashes": dict(report.hashes),
    }


def _summary_lines(dd: DisaggDeployment, report: CompatReport) -> list[str]:
    from disagg.operator.hma import hma_choice

    spec = dd.spec
    prefill, decode = spec.prefill, spec.decode
    lines = [
        f"  prefill: {_plural(prefill.replicas, 'replica')} x "
        f"{_plural(prefill.pipeline_parallel_size, 'stage')} x TP {prefill.tensor_parallel_size}, "
        f"block size {prefill.block_size}",
        f"  decode:  {_plural(decode.replicas, 'replica')} x TP {decode.tensor_parallel_size}, "
        f"block size {decode.block_size}",
    ]
    plan = report.plan
    if plan is not None:
        cache = "hybrid KV cache (HMA)" if plan.hma else "uniform KV cache"
        transfer = f"  transfer: {plan.transfer_mode} connector, {cache}, {plan.routing_mode.value} routing"
        if plan.transfer_mode == "push":
            count = _plural(plan.notifications_per_request, "completion notification")
            transfer += f", {count} per request"
        lines.append(transfer)
        choice = hma_choice(spec)
        if choice.chosen_by == "operator" and choice.why != "Auto":
            lines.append(f"  hybrid KV cache manager {'on' if choice.enabled else 'off'}: {choice.why}")
    engines = {role: _engine_text(spec, role) for role in ("prefill", "decode")}
    if engines["prefill"] == engines["decode"]:
        lines.append(f"  engine: {engines['prefill']} (prefill and decode)")
    else:
        lines.append(f"  engine: prefill {engines['prefill']}, decode {engines['decode']}")
    # The operator's prediction is vLLM's own computation (the interop tests check it against vLLM's code).
    if report.hashes["prefill"] == report.hashes["decode"]:
        lines.append(f"  compatibility hash vLLM computes: {report.hashes['prefill']} (prefill and decode)")
    else:
        lines.append(f"  compatibility hash vLLM computes: prefill {report.hashes['prefill']}")
        lines.append(f"                                    decode  {report.hashes['decode']}")
    lines.append(_router_text(dd))
    return lines


def _router_text(dd: DisaggDeployment) -> str:
    from disagg.operator.builders.router import router_endpoint
    from disagg.operator.naming import router_name

    router = dd.spec.router
    if not router.enabled:
        return "  router: none (spec.router.enabled is false)"
    replicas = _plural(router.replicas, "replica")
    if not dd.metadata.name:
        return f"  router: {replicas}, port {router.port}"
    url = router_endpoint(router_name(dd.metadata.name), _plan_namespace(dd), router.port)
    return f"  router: {replicas} behind {url} (OpenAI-compatible API)"


def _engine_text(spec: DisaggDeploymentSpec, role: Role) -> str:
    from disagg.operator.api import EngineKind
    from disagg.operator.engine_kind import engine_kind
    from disagg.worker.contracts.releases import release_of

    version = spec.effective(role, "version", spec.engine.version)
    release = release_of(version)
    known = f"NIXL connector version {release.connector_version}" if release else "not a supported release"
    kind = engine_kind(spec, role)
    if kind is EngineKind.REFERENCE:
        return f"the reference engine (disagg engine serve) as vLLM {version} ({known})"
    if kind is EngineKind.CUSTOM:
        return f"a custom engine as vLLM {version} ({known})"
    return f"vLLM {version} ({known})"


def run_check(args: argparse.Namespace) -> int:
    out = sys.stdout
    path = Path(args.file)
    try:
        dd = load_deployment(path)
    except SpecFileError as error:
        return _print_invalid(error, path, args.output, out)
    report = judge(dd)
    code = EXIT_OK if report.compatible else EXIT_INCOMPATIBLE
    if args.output == "json":
        json.dump(_report_json(path, dd, report), out, indent=2)
        out.write("\n")
        return code
    if report.compatible:
        out.write(f"{path}: DisaggDeployment {_object_name(dd)} is compatible\n")
    else:
        count = _plural(len(report.violations), "problem")
        out.write(f"{path}: DisaggDeployment {_object_name(dd)} is incompatible ({count})\n")
        for violation in report.violations:
            out.write(f"  {violation.reason}: {violation.message}\n")
    for line in _summary_lines(dd, report):
        out.write(line + "\n")
    # What the verdict leaves to the live handshake, after what it decided.
    for note in report.notes:
        out.write(f"  note: {note}\n")
    return code


def judge(dd: DisaggDeployment) -> CompatReport:
    """The operator's verdict (`policies.REFUSAL_CHAIN`), with this environment as the installation: its
    DISAGG_WORKER_IMAGE is the sidecar image of a spec that names none."""
    from disagg.operator.policies.chain import REFUSAL_CHAIN
    from disagg.operator.policies.compat import evaluate
    from disagg.operator.settings import installation_from_environ

    return evaluate(dd.spec, REFUSAL_CHAIN, installation_from_environ(os.environ))


def _plan_namespace(dd: DisaggDeployment) -> str:
    return dd.metadata.namespace or DEFAULT_NAMESPACE


def plan_manifests(dd: DisaggDeployment, report: CompatReport) -> list[dict[str, Any]] | None:
    """The objects the operator would apply for this file, built by the operator's own builders.

    A file has no uid, so the owner reference (which the operator adds) is left out. None when the operator
    would refuse the spec or the file names no object.
    """
    from disagg.operator.builders.children import build
    from disagg.operator.naming import Owner
    from disagg.operator.settings import installation_from_environ

    if not report.compatible or report.plan is None or not dd.metadata.name:
        return None
    owner = Owner(
        name=dd.metadata.name,
        namespace=_plan_namespace(dd),
        uid=None,
        generation=dd.metadata.generation or 1,
    )
    return build(
        dd.spec, owner, report.plan, report.hashes, installation_from_environ(os.environ), report.factors
    )


def run_plan(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    import yaml

    path = Path(args.file)
    try:
        dd = load_deployment(path)
    except SpecFileError as error:
        return _print_invalid(error, path, "json" if args.output == "json" else "text", out)
    report = judge(dd)
    manifests = plan_manifests(dd, report)
    if args.output in ("json", "yaml"):
        document = {
            **_report_json(path, dd, report),
            "manifests": manifests,
            "ownerReferencesOmitted": manifests is not None,
        }
        if args.output == "json":
            json.dump(document, out, indent=2)
            out.write("\n")
        else:
            yaml.dump(document, out, Dumper=_manifest_dumper(), sort_keys=False, width=110)
    else:
        _print_plan_text(dd, report, out)
        if manifests is not None:
            _print_manifest_header(dd, manifests, out)
            out.write(_dump_manifests(manifests))
    if report.compatible and manifests is None:
        err.write(
            f"{path}: metadata.name is missing, so no manifests can be named; only the topology is shown\n"
        )
    return EXIT_OK if report.compatible else EXIT_INCOMPATIBLE


def _manifest_dumper() -> type[yaml.SafeDumper]:
    """A safe dumper for people who read and diff manifests: multi-line strings (the topology) as blocks, and
    no anchors or aliases (`&id001` / `*id001`) where the builders share one list between two containers."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper


def _dump_manifests(manifests: list[dict[str, Any]]) -> str:
    """YAML documents as `kubectl apply -f` reads them."""
    import yaml

    dumped: str = yaml.dump_all(
        manifests, Dumper=_manifest_dumper(), sort_keys=False, width=110, explicit_start=True
    )
    return dumped


def _print_manifest_header(dd: DisaggDeployment, manifests: list[dict[str, Any]], out: TextIO) -> None:
    out.write(f"# manifests: the {len(manifests)} objects the operator server-side-applies, in order:\n")
    for obj in manifests:
        out.write(f"#   - {obj['kind']} {obj['metadata']['name']}\n")
    out.write(
        "# The operator also sets each object's metadata.ownerReferences to the DisaggDeployment (whose uid\n"
        "# exists only once the API server stores it), so deleting the DisaggDeployment deletes them.\n"
    )
    if dd.metadata.namespace is None:
        out.write(
            f"# namespace: the file names none, so {DEFAULT_NAMESPACE} is shown; the operator uses the "
            "namespace the DisaggDeployment is created in.\n"
        )


def _print_plan_text(dd: DisaggDeployment, report: CompatReport, out: TextIO) -> None:
    verdict = "compatible" if report.compatible else "incompatible"
    out.write(f"# DisaggDeployment {_object_name(dd)} ({verdict})\n")
    for violation in report.violations:
        out.write(f"#   {violation.reason}: {violation.message}\n")
    for line in _summary_lines(dd, report):
        out.write(f"#{line}\n")
    plan = report.plan
    if plan is None:
        out.write("# no topology: the prefill layers cannot be split into stages\n")
        return
    for stage in plan.stages:
        first, last = stage.layers.start, stage.layers.stop - 1
        out.write(
            f"# prefill stage {stage.stage}: layers {first}-{last} ({_plural(len(stage.layers), 'layer')}), "
            f"{stage.routing_mode.value} routing\n"
        )
        wrapped = textwrap.wrap(", ".join(stage.layer_names), width=106, break_on_hyphens=False)
        for line in wrapped:
            out.write(f"#     {line}\n")
    out.write(f"# decode: every layer (0-{plan.stages[-1].layers.stop - 1}), region-index routing\n")


def run_crd_generate(args: argparse.Namespace) -> int:
    out = sys.stdout
    from disagg.operator import crd

    if args.output_dir is None:
        out.write(crd.render(crd.build_crd(with_cel=args.cel)))
        return EXIT_OK
    output_dir = Path(args.output_dir)
    if args.check:
        stale = [
            str(output_dir / relative)
            for relative, text in crd.rendered_files().items()
            if not (output_dir / relative).is_file() or (output_dir / relative).read_text("utf-8") != text
        ]
        for name in stale:
            out.write(
                f"{name} differs from the models: run `disagg crd generate --output-dir {output_dir}`\n"
            )
        return EXIT_INCOMPATIBLE if stale else EXIT_OK
    for written in crd.write_all(output_dir):
        out.write(f"wrote {written}\n")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = subparsers.add_parser(
        "check",
        help="pre-flight compatibility of a DisaggDeployment file",
        description="Check a DisaggDeployment file against every prefill/decode compatibility rule. "
        "Exit 0: compatible; 1: incompatible (reasons printed); 2: not a valid DisaggDeployment.",
    )
    check.add_argument("file", help="DisaggDeployment YAML file")
    check.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    check.set_defaults(func=run_check)

    plan = subparsers.add_parser(
        "plan",
        help="the topology and the manifests a DisaggDeployment would create",
        description="Print the prefill stages (layer names, routing mode) and the Kubernetes objects the "
        "operator would apply (built by the operator's own builders; the owner reference it adds is left "
        "out, because a file has no uid). An incompatible spec prints no objects. Exit codes as for `check`.",
    )
    plan.add_argument("file", help="DisaggDeployment YAML file")
    plan.add_argument(
        "-o", "--output", choices=("text", "json", "yaml"), default="text", help="output format"
    )
    plan.set_defaults(func=run_plan)

    crd_parser = subparsers.add_parser("crd", help="the DisaggDeployment CustomResourceDefinition")
    crd_commands = crd_parser.add_subparsers(dest="crd_command", metavar="COMMAND", required=True)
    generate = crd_commands.add_parser(
        "generate",
        help="generate the CRD from the API models",
        description="Without --output-dir, print one CRD variant; with it, write both (crds/ without CEL "
        "rules for Kubernetes 1.20+, crds/cel/ with CEL rules for clusters that enforce them).",
    )
    generate.add_argument("--output-dir", help="write both variants under this directory (e.g. crds)")
    generate.add_argument("--cel", action="store_true", help="print the variant with CEL validation rules")
    generate.add_argument(
        "--check", action="store_true", help="with --output-dir: exit 1 if the files there are stale"
    )
    generate.set_defaults(func=run_crd_generate)
