"""The design docs agree with the code, and every claim names a test that exists.

`docs/layer-name-routing.md` and `docs/compatibility-matrix.md` cite tests as `tests/<file>.py::<name>` and
code as `` `module.attr` ``, and mark their machine-checked tables with `<!-- doc:table -->` comments. Rules,
error types, the hash and the layouts are always the real ones, called here; nothing is re-derived.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from disagg.operator import crd, rollout
from disagg.operator.api import DisaggDeployment
from disagg.operator.builders.engine import ARG_CONFLICT_REASON
from disagg.operator.policies.compat import deployment_factors, evaluate
from disagg.worker.contracts import releases
from disagg.worker.contracts.pairing import DRAINING
from disagg.worker.kv import errors, wire
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout, transfer_group_index_by_layer
from disagg.worker.kv.routing import RegionGeometry, TransferLayers, plan_transfer

ROOT = Path(__file__).resolve().parents[2]
ROUTING_DOC = "layer-name-routing.md"
MATRIX_DOC = "compatibility-matrix.md"
DOCS = (ROUTING_DOC, MATRIX_DOC)
TEST_REF = re.compile(r"\b(tests/[\w/]+\.py)::(\w+(?:::\w+)?)")
CODE_REF = re.compile(r"`([a-z_]+(?:\.[A-Za-z_]\w*)+)`")
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
BACKTICKED = re.compile(r"`([^`]+)`")
CODE_PACKAGES = (
    "disagg.worker.kv",
    "disagg.worker.contracts",
    "disagg.worker.link",
    "disagg.worker.connector",
    "disagg.worker.sidecar",
    "disagg.worker.reporting",
    "disagg.operator",
)
# Modules whose Violation(...) / reason="..." strings are reasons a deployment can show.
REASON_SOURCES = (
    "worker/kv/rules.py",
    "worker/kv/routing/regions.py",
    "worker/kv/routing/desc_ids.py",
    "worker/kv/routing/descriptors.py",
    "worker/kv/routing/plan.py",
    "worker/kv/routing/runs.py",
    "worker/connector/transport.py",
    "worker/connector/side_channel.py",
    "worker/connector/push.py",
    "worker/connector/producer.py",
    "worker/connector/consumer.py",
    "worker/reporting/peer_check.py",
    "worker/reporting/watch.py",
    *(f"operator/policies/{path.name}" for path in sorted((ROOT / "operator" / "policies").glob("*.py"))),
    "operator/control/reconcile.py",
    "operator/kv_status.py",
    "operator/status.py",
)
# Tables whose every row must cite at least one test.
TESTED_TABLES = (
    (ROUTING_DOC, "routing:invariants"),
    (MATRIX_DOC, "compat:handshake-checks"),
    (MATRIX_DOC, "compat:may-differ"),
    (MATRIX_DOC, "compat:preflight"),
    (MATRIX_DOC, "compat:handshake"),
    (MATRIX_DOC, "compat:releases"),
)


@cache
def doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


@cache
def table(name: str, marker: str) -> tuple[dict[str, str], ...]:
    """The markdown table right after `<!-- marker -->`: one dict per row, keyed by the lower-cased header."""
    lines = doc(name).splitlines()
    start = lines.index(f"<!-- {marker} -->") + 1
    rows: list[list[str]] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, _separator, *body = rows
    assert body, f"{name}: the table after <!-- {marker} --> has no rows"
    keys = [cell.lower() for cell in header]
    return tuple(dict(zip(keys, row, strict=True)) for row in body)


def backticked(cell: str) -> list[str]:
    return BACKTICKED.findall(cell)


def reason_of(row: dict[str, str]) -> str:
    (reason,) = backticked(row["reason"])
    return str(reason)


@cache
def defined_tests(path: str) -> frozenset[str]:
    """Test functions of a file, and `Class::method` for test classes, read with ast (nothing is imported)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            found.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return frozenset(name for name in found if name.split("::")[-1].startswith("test"))


def resolve(ref: str) -> Any:
    """`module[.module].attr[.attr]` in one of CODE_PACKAGES: the longest prefix that is a module, then
    attributes."""
    parts = ref.split(".")
    for package in CODE_PACKAGES:
        for split in range(len(parts) - 1, 0, -1):
            try:
                target: Any = importlib.import_module(".".join([package, *parts[:split]]))
            except ModuleNotFoundError:
                continue
            for attr in parts[split:]:
                target = getattr(target, attr)
            return target
    raise LookupError(f"no module {parts[0]!r} in {CODE_PACKAGES}")


def call_kwargs(text: str) -> dict[str, Any]:
    """`a=1, b="x"` -> {"a": 1, "b": "x"}: literals only, so a doc row can never run code."""
    call = ast.parse(f"f({text})", mode="eval").body
    assert isinstance(call, ast.Call) and not call.args, text
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}


def outcome(rule: Callable[..., Any], kwargs: dict[str, Any]) -> str | None:
    """The reason a rule gives: a returned Violation's or a raised DisaggError's, or None when it holds."""
    try:
        result = rule(**kwargs)
    except errors.DisaggError as error:
        reason: str = error.reason
        return reason
    return result.reason if isinstance(result, errors.Violation) else None


# ---- references -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCS)
def test_every_cited_test_exists(name: str) -> None:
    refs = TEST_REF.findall(doc(name))
    assert refs
    missing = [
        f"{path}::{test}"
        for path, test in refs
        if not (ROOT / path).is_file() or test not in defined_tests(path)
    ]
    assert missing == []


@pytest.mark.parametrize(("name", "marker"), TESTED_TABLES)
def test_every_row_cites_a_test(name: str, marker: str) -> None:
    untested = [next(iter(row.values())) for row in table(name, marker) if not TEST_REF.search(row["tests"])]
    assert untested == []


@pytest.mark.parametrize("name", DOCS)
def test_every_cited_code_object_exists(name: str) -> None:
    refs = {
        ref
        for ref in CODE_REF.findall(doc(name))
        if ref.split(".")[0]
        in {"rules", "routing", "layout", "wire", "errors", "push", "compat", "policies", "releases"}
        or ref.startswith(("push_", "transport."))
    }
    assert refs
    for ref in sorted(refs):
        assert resolve(ref) is not None, ref


# ---- the compatibility matrix -----------------------------------------------------------------------------


def test_hash_factors_are_the_workers() -> None:
    documented = [backticked(row["factor"])[0] for row in table(MATRIX_DOC, "compat:hash-factors")]
    assert documented == list(wire.COMPAT_FACTOR_KEYS)


def test_the_release_table_is_the_workers() -> None:
    rows = table(MATRIX_DOC, "compat:releases")
    assert [row["release"] for row in rows] == [release.name for release in releases.RELEASES]
    for row, release in zip(rows, releases.RELEASES, strict=True):
        assert int(row["connector version"]) == release.connector_version
        assert int(row["agent metadata fields"].split()[0]) == len(release.metadata_fields)
        columns = ("push", "pp push", "pp + hma push (layer-name routing)", "packed layouts")
        capabilities = ("push", "pp_push", "pp_hma_push", "packed_layouts")
        for column, capability in zip(columns, capabilities, strict=True):
            assert row[column] == ("yes" if release.can(capability) else "no"), (release.name, column)


def test_unhashed_factors_are_the_operators() -> None:
    documented = [backticked(row["factor"])[0] for row in table(MATRIX_DOC, "compat:deployment-factors")]
    spec = DisaggDeployment.model_validate(yaml.safe_load((ROOT / "examples/pp2-hma.yaml").read_text())).spec
    assert sorted(documented) == sorted(deployment_factors(spec, "prefill"))


PREFLIGHT = table(MATRIX_DOC, "compat:preflight")


@pytest.mark.parametrize("row", PREFLIGHT, ids=[reason_of(row) for row in PREFLIGHT])
def test_preflight_refusal_comes_from_the_named_rule(row: dict[str, str]) -> None:
    reason = reason_of(row)
    (rule_ref,) = backticked(row["rule"])
    rule = resolve(rule_ref)
    (refuses,) = backticked(row["refuses"])
    (accepts,) = backticked(row["accepts"])
    assert outcome(rule, call_kwargs(refuses)) == reason
    assert outcome(rule, call_kwargs(accepts)) is None
    for example in backticked(row["example"]):
        document = yaml.safe_load((ROOT / example).read_text(encoding="utf-8"))
        assert reason in evaluate(DisaggDeployment.model_validate(document).spec).reasons


HANDSHAKE = table(MATRIX_DOC, "compat:handshake")


@cache
def constructed_names() -> frozenset[str]:
    """Names called anywhere in worker/ and operator/ outside errors.py: where an error type is raised."""
    names: set[str] = set()
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("operator/**/*.py")]:
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return frozenset(names)


@pytest.mark.parametrize("row", HANDSHAKE, ids=[reason_of(row) for row in HANDSHAKE])
def test_handshake_refusal_is_the_named_error_type(row: dict[str, str]) -> None:
    (ref,) = backticked(row["raised as"])
    error_type = resolve(ref)
    assert issubclass(error_type, errors.DisaggError)
    assert error_type.reason == reason_of(row)
    assert error_type.__name__ in constructed_names(), f"nothing raises {ref}"


def _reasons_in_source(path: Path) -> set[str]:
    """CamelCase reasons a module writes: Violation("X", ...), reason="X", KVVerdict(_, "X", _), a Pod's
    Outcome(_, "X", _), and the reason of a `desired(COMPATIBLE, _, "X", ...)` condition."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        candidates: list[ast.expr] = [kw.value for kw in node.keywords if kw.arg == "reason"]
        if name == "Violation" and node.args:
            candidates.append(node.args[0])
        if name in ("KVVerdict", "Outcome") and len(node.args) > 1:
            candidates.append(node.args[1])
        if (
            name == "desired"
            and len(node.args) > 2
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "COMPATIBLE"
        ):
            candidates.append(node.args[2])
        found.update(
            c.value
            for c in candidates
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value
        )
    return found


@cache
def code_reasons() -> frozenset[str]:
    error_types: list[type[errors.DisaggError]] = [
        obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, errors.DisaggError)
    ]
    from_types = {cls.reason for cls in error_types if cls is not errors.DisaggError}
    from_sources = set().union(*(_reasons_in_source(ROOT / path) for path in REASON_SOURCES))
    from_cel = {rule.reason for rule in crd.SPEC_RULES}
    # A rollout's Progressing reasons, and the exclusion of a draining pod's pairs.
    from_rollout = {rollout.WAITING, rollout.DRAINING_OLD, rollout.STUCK, rollout.COMPLETE, DRAINING}
    return frozenset(from_types | from_sources | from_cel | from_rollout | {ARG_CONFLICT_REASON})


def documented_reasons() -> list[str]:
    return [reason_of(row) for row in table(MATRIX_DOC, "compat:conditions")]


def test_every_reason_the_code_gives_is_documented() -> None:
    assert sorted(reason for reason in code_reasons() if not CAMEL.match(reason)) == []
    assert sorted(code_reasons() - set(documented_reasons())) == []


def test_every_documented_reason_is_one_the_code_gives() -> None:
    documented = documented_reasons()
    assert len(documented) == len(set(documented)), "a reason is listed twice"
    assert sorted(set(documented) - code_reasons()) == []


def test_every_refusal_has_a_condition_row() -> None:
    refusals = {reason_of(row) for row in (*PREFLIGHT, *HANDSHAKE)}
    assert sorted(refusals - set(documented_reasons())) == []


# ---- the worked example of layer-name routing -------------------------------------------------------------

GEMMA_30 = ModelGeometry.with_full_every(30, 6, num_kv_heads=8, head_size=128, dtype_bytes=2)


def layer_name(cell: str) -> str:
    name: str = GEMMA_30.layer_name(int(cell.strip().removeprefix("L")))
    return name


def ints(cell: str) -> list[int]:
    return [int(part) for part in cell.split(",")]


def region_holding(regions: list[list[str]], name: str) -> int:
    (region,) = [r for r, members in enumerate(regions) if name in members]
    return region


def test_worked_example_layers_pool_where_the_layout_puts_them() -> None:
    stages = [
        build_stage_layout(GEMMA_30, pp_rank=rank, pp_size=2, tp_size=1, block_size=16, num_blocks=8)
        for rank in (0, 1)
    ]
    decoder = build_stage_layout(GEMMA_30, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=8)
    groups = transfer_group_index_by_layer(GEMMA_30)
    covered: list[str] = []
    for row in table(ROUTING_DOC, "routing-example:layers"):
        names = [layer_name(cell) for cell in row["layers"].split(",")]
        stage = stages[int(row["prefill stage"])]
        assert [groups[name] for name in names] == ints(row["groups"])
        for name in names:
            assert region_holding(stage.region_members, name) == int(row["prefill region"]), name
            assert region_holding(decoder.region_members, name) == int(row["decode region"]), name
        covered.extend(names)
    assert sorted(covered) == sorted(GEMMA_30.layer_names)


def test_worked_example_descriptor_ids_are_what_routing_computes() -> None:
    text = doc(ROUTING_DOC)
    capacities = re.search(r"each prefill region holds (\d+) blocks and each decode region (\d+)", text)
    assert capacities is not None
    request = text[text.index("**One request.**") :].split("\n\n", 1)[0]
    block_lists = [ints(ids) for _group, ids in re.findall(r"`G(\d): \[([\d, ]+)\]`", request)]
    assert len(block_lists) == 12
    prefill_blocks, decode_blocks = block_lists[:6], block_lists[6:]

    def geometry(pp_rank: int, pp_size: int, num_blocks: int) -> tuple[Any, RegionGeometry]:
        layout = build_stage_layout(
            GEMMA_30, pp_rank=pp_rank, pp_size=pp_size, tp_size=1, block_size=16, num_blocks=num_blocks
        )
        meta = RegionGeometry.from_layout(
            layout, base_addr=0, device_id=0, mem_type="DRAM", advertise_members=True
        )
        return layout, meta

    stage, stage_meta = geometry(1, 2, int(capacities[1]))
    decoder, decoder_meta = geometry(0, 1, int(capacities[2]))
    layers = TransferLayers.from_layout(stage)
    plan, _aligned = plan_transfer(stage_meta, decoder_meta, transfer_layers=layers)
    local_ids, remote_ids = plan.desc_ids(prefill_blocks, decode_blocks)
    per_layer = len(prefill_blocks[0])
    rows = table(ROUTING_DOC, "routing-example:desc-ids")
    for row in rows:
        k = int(row["k"])
        name = layer_name(row["layer"])
        assert layers.names[k] == name
        assert layers.group_ids[k] == int(row["group"])
        assert layers.region_indices[k] == int(row["prefill region"])
        assert region_holding(decoder.region_members, name) == int(row["decode region"])
        window = slice(k * per_layer, (k + 1) * per_layer)
        assert np.array_equal(local_ids[window], ints(row["prefill desc ids"])), name
        assert np.array_equal(remote_ids[window], ints(row["decode desc ids"])), name
