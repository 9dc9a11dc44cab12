"""The engine container's command, arguments and environment for each role. Pure.

For vLLM engines the builders own every argument the spec decides: `--kv-transfer-config` (the push or pull
connector, producer on prefill and consumer on decode, and the engine id), the parallel sizes, block size,
dtypes, `--attention-backend` (vLLM no longer reads `VLLM_ATTENTION_BACKEND`), the layer partition and the
side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST` is the pod IP, because vLLM both binds it and advertises it to
peers, vLLM #27083).

The engine id is pinned, because watchers and routers must know it and vLLM would otherwise draw a uuid per
start, and it is new on every start, because decoders cache remote agents by engine id and a prefill
restarted under the same id is a known crash path (vllm #49238). So the engine command is a small shell
launcher (`STAGE_LAUNCHER`, `PREFILL_LAUNCHER`, `DECODE_LAUNCHER`) that replaces `ENGINE_ID_PLACEHOLDER` in
the arguments with `<stable prefix>-<8 random hex digits>`, drawn at each start. The stable prefix is the
sidecar's engine id: the StatefulSet name for a prefill engine (all its stages), the pod name for a decode
pod. A watcher knows only the prefix and accepts an engine id that is the prefix plus one such suffix
(`wire.engine_id_matches`); the full id is what the side channel answers. vLLM broadcasts TP rank 0's id
over the TP and PP groups, so every stage of a prefill engine advertises the head's id.

Which of these an engine is, is `engine_kind`: `spec.engine.kind`, or by default what the image's name
suggests (`kind_of_image`); nothing else asks what an image is called.

The project's own reference engine (`EngineKind.REFERENCE`) runs `disagg engine serve` (the
OpenAI-compatible server of `disagg.worker.engine`), configured by the same pod environment and topology
file as its transfer sidecar; the builders add only its port and, on the stages of a PP prefill engine, the
head pod's rendezvous address (`policies.reference_engine` refuses what it cannot run).

A user's extra arguments to vLLM are kept; one that repeats an owned flag with the spec's own value is
dropped as redundant, and one that contradicts the spec is refused with a violation, never silently
overridden. A `Custom` engine receives the user's arguments and the `DISAGG_*` environment only.

Arguments are judged as vLLM's `FlexibleArgumentParser` reads them (vllm/utils/argparse_utils.py, 0.33):
underscores are dashes; argparse's `allow_abbrev` is left on, so a prefix of one option is that option
(`--block 8` is `--block-size 8`, `-t 4` is `-tp 4`) and a prefix of several is an error, so any prefix of an
owned spelling is judged as that flag (no vLLM option is itself a strict prefix of an owned one); a dotted
key (`--kv-transfer-config.kv_role x`) becomes a whole new value of its base flag, appended after every other
argument, so it replaces what the operator wrote; and `--config FILE` inserts arguments from a file the
operator cannot read, so it is refused.

A spelling near an owned flag that vLLM's parser refuses (it exits with status 2 and the engine crash-loops)
is refused at admission too (`_parser_refuses`): argparse splits an attached value only from a one-letter
short option (`-n2` is `-n 2`, `-r0` is `-r 0`), so `-tp4`, `-pp2`, `-t4` and `--block-size32` name no option
(a long one splits only at `=`); and a negation exists only where vLLM declared it (`--enable-x` and
`--no-disable-x` for `--disable-x`), so `--no-enable-hybrid-kv-cache-manager` or `--no-block-size` names none.
Only spellings near owned flags are judged: the operator carries no table of vLLM's other options.
tests/interop/test_engine_args_interop.py checks that every argv it admits parses with each supported
release's own parser.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg.operator.api import DisaggDeploymentSpec, EngineKind, Role
from disagg.operator.engine_kind import engine_kind
from disagg.operator.hma import hma_enabled
from disagg.operator.plan import TopologyPlan
from disagg.worker.contracts.pod_contract import POD_IP_ENV, POD_NAME_ENV
from disagg.worker.kv.errors import Violation

HTTP_PORT: Final = 8000
# vLLM's torch.distributed rendezvous between the pipeline stages of one prefill instance.
MASTER_PORT: Final = 29500
ARG_CONFLICT_REASON: Final = "EngineArgumentConflict"

ENGINE_ID_PLACEHOLDER: Final = "@DISAGG_ENGINE_ID@"


def _engine_id_step(prefix: str) -> str:
    """sh that sets `id` to `<prefix>-<8 random hex>` and puts it in place of the placeholder in "$@".
    Backquotes, not `$(...)`: Kubernetes expands `$(NAME)` in a container's command."""
    marker = ENGINE_ID_PLACEHOLDER
    return (
        f"id=\"{prefix}-`od -An -N4 -tx1 /dev/urandom | tr -d ' \\n'`\"; "
        "for a; do shift; "
        f'case "$a" in *{marker}*) a="${{a%%{marker}*}}$id${{a#*{marker}}}";; esac; '
        'set -- "$@" "$a"; done; '
    )


# A stage pod learns its pipeline rank from its StatefulSet ordinal (the `-N` suffix of its name): Kubernetes
# 1.20 has no pod-index label for the downward API. Rank 0 serves the API; the other stages run headless.
STAGE_LAUNCHER: Final = (
    _engine_id_step(f"${{{POD_NAME_ENV}%-*}}") + f'rank="${{{POD_NAME_ENV}##*-}}"; '
    'if [ "$rank" = 0 ]; then exec vllm serve "$@" --node-rank 0; '
    'else exec vllm serve "$@" --node-rank "$rank" --headless; fi'
)
# A prefill engine without PP is one pod of a StatefulSet too; a decode pod is an engine of its own.
PREFILL_LAUNCHER: Final = _engine_id_step(f"${{{POD_NAME_ENV}%-*}}") + 'exec vllm serve "$@"'
DECODE_LAUNCHER: Final = _engine_id_step(f"${{{POD_NAME_ENV}}}") + 'exec vllm serve "$@"'
ENGINE_LAUNCHER_NAME: Final = "vllm-serve"


@dataclass(frozen=True)
class EngineContainer:
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class _Owned:
    """A flag the builder writes: its spellings, and the value the spec implies (None: a switch)."""

    spellings: tuple[str, ...]
    value: str | None
    spec_field: str
    switch_on: bool = False
    # The spellings that turn a switch off (vLLM's EnableDisableAction pairs --disable-x with --enable-x).
    negations: tuple[str, ...] = ()
    why: str = "the operator decides it"


# Flags no spec value may be given by: the model is the operator's positional argument (vLLM moves a `--model`
# in front of it), and a config file can set any argument.
_REFUSED: Final = (
    _Owned(
        ("--model",), None, "spec.model.name", why="the operator passes the model as vLLM's first argument"
    ),
    _Owned(
        ("--config",),
        None,
        "the spec",
        why="vLLM would read engine arguments from that file, which the operator cannot see to check",
    ),
)


def reference_engine_args(spec: DisaggDeploymentSpec, role: Role, master: str | None) -> tuple[str, ...]:
    """`disagg engine serve`'s arguments; `master` is the head pod's DNS name on a PP prefill engine."""
    rendezvous = ("--master-addr", master, "--master-port", str(MASTER_PORT)) if master is not None else ()
    return ("engine", "serve", "--port", str(HTTP_PORT), *rendezvous, *user_args(spec, role))


def user_args(spec: DisaggDeploymentSpec, role: Role) -> tuple[str, ...]:
    return (*spec.engine.extra_args, *spec.role(role).extra_args)


def kv_transfer_config(spec: DisaggDeploymentSpec, role: Role) -> dict[str, Any]:
    kv = spec.kv_transfer
    return {
        "kv_connector": kv.connector.vllm_class,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": ENGINE_ID_PLACEHOLDER,
        # A decoder whose KV did not arrive whole fails the request rather than answering from what it has
        # (vLLM's default in 0.31-0.34, written out so that no release's other default can answer wrong).
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "backends": [backend.value for backend in kv.backends],
            "kv_lease_duration": kv.lease_seconds,
        },
    }


def _owned_flags(spec: DisaggDeploymentSpec, role: Role, stage_service: str | None) -> list[_Owned]:
    this = spec.role(role)
    path = f"spec.{role}"
    revision = spec.effective(role, "revision", spec.model.revision)
    owned = [
        _Owned(
            ("--tensor-parallel-size", "-tp"), str(this.tensor_parallel_size), f"{path}.tensorParallelSize"
        ),
        _Owned(
            ("--pipeline-parallel-size", "-pp"),
            str(this.pipeline_parallel_size),
            f"{path}.pipelineParallelSize",
        ),
        _Owned(("--block-size",), str(this.block_size), f"{path}.blockSize"),
        _Owned(("--dtype",), str(spec.effective(role, "dtype", spec.model.dtype).value), "spec.model.dtype"),
        _Owned(
            ("--kv-cache-dtype",),
            str(spec.effective(role, "kv_cache_dtype", spec.model.kv_cache_dtype).value),
            "spec.model.kvCacheDtype",
        ),
        _Owned(
            ("--kv-transfer-config",),
            json.dumps(kv_transfer_config(spec, role), sort_keys=True, separators=(",", ":")),
            "spec.kvTransfer",
        ),
        _Owned(
            ("--attention-backend",),
            str(spec.effective(role, "attention_backend", spec.engine.attention_backend)),
            "spec.engine.attentionBackend",
        ),
        _Owned(("--port",), str(HTTP_PORT), "the operator's engine port"),
        _Owned(
            ("--disable-hybrid-kv-cache-manager",),
            None,
            "spec.engine.hybridKvCacheManager",
            switch_on=not hma_enabled(spec),
            negations=("--enable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"),
        ),
    ]
    if revision is not None:
        owned.append(_Owned(("--revision",), str(revision), "spec.model.revision"))
    if stage_service is not None:
        owned += [
            _Owned(("--nnodes", "-n"), str(this.pipeline_parallel_size), f"{path}.pipelineParallelSize"),
            _Owned(("--master-addr",), stage_service, "the prefill instance's stage-0 pod"),
            _Owned(("--master-port",), str(MASTER_PORT), "the operator's rendezvous port"),
            _Owned(("--node-rank", "-r"), "", "the pod's StatefulSet ordinal"),
            _Owned(("--headless",), None, "the pod's StatefulSet ordinal"),
        ]
    return [*owned, *_REFUSED]


def _normalise(flag: str) -> str:
    # vLLM's FlexibleArgumentParser accepts underscores for dashes.
    return flag.replace("_", "-") if flag.startswith("--") else flag


def _read_as(flag: str, by_spelling: Mapping[str, _Owned]) -> list[str]:
    """The owned spellings vLLM's parser could read `flag` as: itself, or every one it abbreviates."""
    if flag in by_spelling:
        return [flag]
    if flag in ("-", "--") or not flag.startswith("-"):
        return []
    return sorted(spelling for spelling in by_spelling if spelling.startswith(flag))


def _attached_short(token: str, by_spelling: Mapping[str, _Owned]) -> tuple[str, str] | None:
    """(owned one-letter short option, its attached value) where argparse reads `token` so: `-n2` is `-n 2`
    (argparse splits a value off the first two characters only, and the whole rest is the value, `=` and
    all: `-n4=5` is `-n 4=5`)."""
    head = token[:2]
    if len(token) > 2 and token[1] != "-" and head in by_spelling:
        return head, token[2:]
    return None


def _parser_refuses(flag: str, by_spelling: Mapping[str, _Owned]) -> tuple[str, str] | None:
    """(the owned spelling it is near, why vLLM's parser refuses it) for a `flag` that vLLM reads as no
    option, where it names an owned flag in a way argparse does not accept; None otherwise. Only spellings
    near owned ones are judged: the operator does not carry vLLM's whole option table."""
    if flag.startswith("--no-"):
        # `--no-X` exists only for a BooleanOptionalAction X (vLLM's EnableDisableAction adds `--no-` of
        # the declared spelling only): any other negation of an owned flag, or of an abbreviation of one,
        # is an unrecognized argument. `_read_as` found no owned spelling starting with it.
        negated = _read_as("--" + flag[len("--no-") :], by_spelling)
        if negated and len({id(by_spelling[match]) for match in negated}) == 1:
            return negated[0], f"vLLM's parser has no {flag} and refuses it"
        return None
    if flag.startswith("--"):
        # `--block-size32`: argparse splits a long option's value only at `=`. vLLM's option names go on
        # from an owned one only with another dashed word (`--kv-cache-dtype-skip-layers`, kept as vLLM's).
        for spelling in sorted(by_spelling):
            rest = flag[len(spelling) :]
            if spelling.startswith("--") and flag.startswith(spelling) and not rest.startswith("-"):
                return spelling, f"vLLM's parser has no {flag}: write {spelling}={rest}"
        return None
    if len(flag) < 3:
        return None
    for spelling in sorted(by_spelling):
        # A short option of several letters takes its value only after a space or `=`: `-tp4` is no option
        # (argparse would split `-t` off, and vLLM has no `-t`).
        if len(spelling) > 2 and spelling[1] != "-" and flag.startswith(spelling):
            return spelling, f"vLLM's parser refuses it: write {spelling} and its value as two arguments"
    if flag[2:].isdigit():
        # `-t4`: `-t` abbreviates `-tp`, but an abbreviation cannot carry an attached value either.
        near = [s for s in sorted(by_spelling) if len(s) > 2 and s[1] != "-" and s.startswith(flag[:2])]
        if near:
            return near[0], f"vLLM's parser refuses it: write {near[0]} and its value as two arguments"
    return None


def _split_user_args(
    args: Sequence[str], owned: Sequence[_Owned], role: Role
) -> tuple[list[str], list[Violation]]:
    """(kept user arguments, violations): an owned flag is dropped if redundant, refused if contradictory."""
    by_spelling = {spelling: item for item in owned for spelling in (*item.spellings, *item.negations)}
    kept: list[str] = []
    violations: list[Violation] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        name, has_inline, inline = token.partition("=")[0], "=" in token, token.partition("=")[2]
        if token.startswith("-") and "." in name:
            # A dotted key: vLLM takes the next argument as its value even when it starts with a dash.
            value = [] if has_inline else list(args[index : index + 1])
            index += len(value)
            base = _normalise(name.split(".", 1)[0])
            attached = _attached_short(base, by_spelling)
            refuses = _parser_refuses(base, by_spelling)
            matches = _read_as(base, by_spelling) or [r[0] for r in (attached, refuses) if r is not None][:1]
            if not matches:
                kept += [token, *value]
                continue
            why = f"vLLM turns dotted keys into a new {matches[0]} that replaces the operator's"
            violations.append(_conflict(role, " ".join([token, *value]), by_spelling[matches[0]], why))
            continue
        flag = _normalise(name)
        matches = _read_as(flag, by_spelling)
        if not matches and (attached := _attached_short(token, by_spelling)) is not None:
            # Judged as the one-letter option with the rest as its inline value, as argparse reads it.
            matches, has_inline, inline = [attached[0]], True, attached[1]
        if not matches:
            refused = _parser_refuses(flag, by_spelling)
            if refused is None:
                kept.append(token)
            else:
                violations.append(_conflict(role, token, by_spelling[refused[0]], refused[1]))
            continue
        spelling = matches[0]
        item = by_spelling[spelling]
        read_as = "" if flag == spelling else f" (vLLM reads {flag} as {' or '.join(matches)})"
        if len({id(by_spelling[match]) for match in matches}) > 1:
            violations.append(_conflict(role, token + read_as, item, "it is ambiguous"))
            continue
        if item.value is None:
            # A switch agrees only when it sets what the operator writes; one with no negation that the
            # operator does not write (`--headless`, `--config`) never does.
            sets_on = spelling not in item.negations
            if sets_on != item.switch_on or not (item.switch_on or item.negations):
                violations.append(_conflict(role, token + read_as, item, item.why))
            continue
        if has_inline:
            given = inline
        elif index < len(args):
            given = args[index]
            index += 1
        else:
            given = ""
        if not _same_value(spelling, given, item.value):
            shown = (token if has_inline else f"{token} {given}".strip()) + read_as
            violations.append(_conflict(role, shown, item, f"the spec gives {item.value!r}"))
    return kept, violations


def _same_value(flag: str, given: str, expected: str) -> bool:
    if flag == "--kv-transfer-config":
        try:
            return bool(json.loads(given) == json.loads(expected))
        except ValueError:
            return False
    return given == expected and expected != ""


def _conflict(role: Role, shown: str, item: _Owned, why: str) -> Violation:
    return Violation(
        ARG_CONFLICT_REASON,
        f"spec.engine.extraArgs or spec.{role}.extraArgs sets {shown!r}, which {item.spec_field} decides "
        f"({why}): remove the argument and set {item.spec_field} instead",
    )


def arg_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """Extra arguments that contradict the spec, for both roles (vLLM engines only)."""
    found: list[Violation] = []
    for role in ("prefill", "decode"):
        if engine_kind(spec, role) is EngineKind.VLLM:
            owned = _owned_flags(spec, role, "stage-0" if _multi_node(spec, role) else None)
            found += _split_user_args(user_args(spec, role), owned, role)[1]
    return found


def vllm_serve_args(spec: DisaggDeploymentSpec, role: Role) -> tuple[list[str], list[str]] | None:
    """What the role's `vllm serve` is given (after `serve`): the operator's arguments (the model first) and
    the user's kept extra arguments; None for an engine that is not vLLM, or extra arguments that contradict
    the spec (`arg_violations` says why)."""
    if engine_kind(spec, role) is not EngineKind.VLLM:
        return None
    owned = _owned_flags(spec, role, "stage-0" if _multi_node(spec, role) else None)
    kept, violations = _split_user_args(user_args(spec, role), owned, role)
    return None if violations else (_written(spec, owned), kept)


def _written(spec: DisaggDeploymentSpec, owned: Sequence[_Owned]) -> list[str]:
    written: list[str] = [spec.model.name]
    for item in owned:
        if item.value is None:
            if item.switch_on:
                written.append(item.spellings[0])
        elif item.value != "":
            written += [item.spellings[0], item.value]
    return written


def _multi_node(spec: DisaggDeploymentSpec, role: Role) -> bool:
    return role == "prefill" and spec.prefill.pipeline_parallel_size > 1


def engine_container(
    spec: DisaggDeploymentSpec,
    role: Role,
    plan: TopologyPlan,
    *,
    stage_service: str | None,
    identity_env: Sequence[dict[str, Any]],
) -> EngineContainer:
    """Command, args and env of the engine container; `stage_service` is the DNS name of stage 0 (PP > 1)."""
    env = list(identity_env)
    args = user_args(spec, role)
    master = stage_service if _multi_node(spec, role) else None
    kind = engine_kind(spec, role)
    if kind is EngineKind.REFERENCE:
        return EngineContainer(("disagg",), reference_engine_args(spec, role, master), tuple(env))
    if kind is EngineKind.CUSTOM:
        return EngineContainer(command=(), args=args, env=tuple(env))
    owned = _owned_flags(spec, role, master)
    kept, violations = _split_user_args(args, owned, role)
    if violations:
        # Handlers check arg_violations before building; reaching this is a programming error.
        raise ValueError("; ".join(str(violation) for violation in violations))
    written = _written(spec, owned)
    env += _vllm_env(spec, role, plan)
    launcher = (
        STAGE_LAUNCHER if master is not None else PREFILL_LAUNCHER if role == "prefill" else DECODE_LAUNCHER
    )
    return EngineContainer(("/bin/sh", "-c", launcher, ENGINE_LAUNCHER_NAME), (*written, *kept), tuple(env))


def _vllm_env(spec: DisaggDeploymentSpec, role: Role, plan: TopologyPlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        # $(POD_IP) expands from the downward-API variable the identity env defines first.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": f"$({POD_IP_ENV})"},
        # The address vLLM gives its peers: a PP stage 0 publishes its scheduler queue to the other stages at
        # it. Unset, vLLM takes the source address of a route to 8.8.8.8, and where pods have no default
        # route (an isolated cluster) it falls back to 0.0.0.0, which the other stages cannot reach.
        {"name": "VLLM_HOST_IP", "value": f"$({POD_IP_ENV})"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.kv_transfer.side_channel_port)},
    ]
    if role == "prefill":
        partition = ",".join(str(len(stage.layers)) for stage in plan.stages)
        env.append({"name": "VLLM_PP_LAYER_PARTITION", "value": partition})
    return env


def stage_dns(statefulset: str, service: str, namespace: str) -> str:
    return f"{statefulset}-0.{service}.{namespace}.svc"
