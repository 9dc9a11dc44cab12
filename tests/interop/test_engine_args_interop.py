"""The engine arguments and environment the operator generates are ones vLLM runs: every pod's argv parses
with `vllm serve`'s parser and builds a VllmConfig, and every VLLM_* variable is one vllm.envs knows."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
from _engine_argv import OWNER, engine_pods, example_spec, judged, kv_transfer_config
from _vllm_peer import RELEASES, PeerFactory, VllmPeer
from test_hash_interop import DEEPSEEK, GEMMA, LLAMA

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.builders.engine import ARG_CONFLICT_REASON
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.naming import Installation
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate

SPECS: dict[str, dict[str, Any]] = {
    "pp2-hybrid": GEMMA,
    "tp2-dense-pp1": {**LLAMA, "prefill": {"pipelineParallelSize": 1, "tensorParallelSize": 2}},
    "pp2-tp1-mla": {**DEEPSEEK, "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}},
}
SUFFIX = re.compile(r"-[0-9a-f]{8}")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_generated_argv_builds_a_vllm_config(vllm_peer: VllmPeer, tmp_path: Path, name: str) -> None:
    spec = example_spec(SPECS[name])
    pods = engine_pods(spec, tmp_path)
    for pod in pods:
        parsed = vllm_peer.call("parse_argv", argv=pod.argv)
        role = spec.prefill if pod.role == "prefill" else spec.decode
        assert parsed["headless"] == (pod.role == "prefill" and not pod.pod.endswith("-0")), pod.pod
        built = vllm_peer.call("config_hash", argv=pod.argv)
        assert built["tensor_parallel_size"] == role.tensor_parallel_size
        assert built["pipeline_parallel_size"] == role.pipeline_parallel_size
        assert parsed["block_size"] == role.block_size
        # vLLM's CPU platform forces block size 16 on MLA models (its CPU MLA kernel); a GPU keeps the flag's.
        if spec.model.attention_kind.value != "MLA":
            assert built["block_size"] == role.block_size
        assert built["attention_backend"] == spec.engine.attention_backend
        assert built["kv_role"] == ("kv_producer" if pod.role == "prefill" else "kv_consumer")
        # A decoder whose KV did not arrive whole fails the request (issue 42), as vLLM reads the argv.
        assert built["kv_load_failure_policy"] == "fail"
        # The pinned engine id: the stable prefix (the sidecar's engine id) plus a per-start suffix.
        prefix = pod.pod.rsplit("-", 1)[0] if pod.role == "prefill" else pod.pod
        assert built["engine_id"].startswith(prefix) and SUFFIX.fullmatch(built["engine_id"][len(prefix) :])
        assert kv_transfer_config(pod.argv)["engine_id"] == built["engine_id"]


def test_the_engine_id_is_new_on_every_start(vllm_peer: VllmPeer, tmp_path: Path) -> None:
    spec = example_spec(GEMMA)
    first = {p.pod: kv_transfer_config(p.argv)["engine_id"] for p in engine_pods(spec, tmp_path)}
    again = {p.pod: kv_transfer_config(p.argv)["engine_id"] for p in engine_pods(spec, tmp_path)}
    assert first.keys() == again.keys()
    assert all(first[pod] != again[pod] for pod in first)
    # vLLM takes it as given (it draws a uuid only when none is set).
    decode = next(p for p in engine_pods(spec, tmp_path) if p.role == "decode")
    config = vllm_peer.call("kv_transfer_config", config=kv_transfer_config(decode.argv))
    assert config["engine_id"] == kv_transfer_config(decode.argv)["engine_id"]
    assert config["connector_class"].endswith(".NixlPushConnector") and config["supports_hma"]
    assert config["kv_connector_extra_config"] == {"backends": ["UCX"], "kv_lease_duration": 120}


@pytest.mark.parametrize("version", RELEASES)
def test_every_vllm_variable_the_operator_sets_is_known_to_the_release(
    vllm_peers: PeerFactory, version: str
) -> None:
    known = set(vllm_peers(version).call("env_names"))
    for name, patch in SPECS.items():
        spec = example_spec({**patch, "engine": {**patch.get("engine", {}), "version": version}})
        report = judged(spec)
        assert report.plan is not None
        for obj in build(spec, OWNER, report.plan, report.hashes, Installation(worker_image="w:1")):
            if obj["kind"] not in ("StatefulSet", "Deployment"):
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                names = {item["name"] for item in container.get("env", [])}
                unknown = sorted(n for n in names if n.startswith("VLLM_") and n not in known)
                assert unknown == [], (name, container["name"], obj["metadata"]["name"])
                if container["name"] == ENGINE_CONTAINER:
                    assert {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"} <= names


# Issue 22 (finding 8): what vLLM 0.33's parser refused (exit status 2) while admission let it through.
PARSER_REFUSED = (("-tp4",), ("-pp2",), ("--no-enable-hybrid-kv-cache-manager",))
# The owned spellings the variations are made of, with a value the example spec agrees with and one it
# does not (None: a switch).
OWNED_SPELLINGS: dict[str, tuple[str, str] | None] = {
    "--tensor-parallel-size": ("2", "4"),
    "-tp": ("2", "4"),
    "--pipeline-parallel-size": ("2", "1"),
    "-pp": ("2", "1"),
    "--block-size": ("32", "16"),
    "--port": ("8000", "8001"),
    "--nnodes": ("2", "3"),
    "-n": ("2", "3"),
    "-r": ("0", "1"),
    "--master-port": ("29500", "29501"),
    "--attention-backend": ("FLASH_ATTN", "TRITON_ATTN"),
    "--disable-hybrid-kv-cache-manager": None,
    "--enable-hybrid-kv-cache-manager": None,
    "--no-disable-hybrid-kv-cache-manager": None,
    "--headless": None,
}
# vLLM options the operator does not own, some of them spelt like owned ones.
OTHER_OPTIONS = (
    ("--max-model-len", "2048"),
    ("--enforce-eager",),
    ("--gpu-memory-utilization=0.8",),
    ("--max_num_seqs", "8"),
    ("--no-enable-prefix-caching",),
    ("--seed", "1"),
)
# Owned only on the stages of a PP prefill engine: elsewhere they are vLLM options the operator leaves alone.
STAGE_ONLY = ("--nnodes", "-n", "-r", "--master-port", "--headless")
VARIATIONS = 72
UNKNOWN = "UnknownEngineArgument"
# Arguments unrelated to any owned flag: real options in their accepted spellings, misspelt and invented
# ones, missing values, ambiguous abbreviations.
UNRELATED: tuple[tuple[str, ...], ...] = (
    *OTHER_OPTIONS,
    ("--frobnicate",),
    ("--max-model-lenn", "2048"),
    ("--enforce-eagr",),
    ("--enforce_eager",),
    ("--gpu-memory-util", "0.5"),
    ("--max-num-seqs",),
    ("--max-num",),
    ("--seed", "1", "extra-positional"),
    ("--disable-log-stats",),
    ("--no-disable-log-stats",),
    ("--enable-prefix-caching", "--no-enable-prefix-caching"),
    ("-O3",),
    ("--swap-space", "4"),
    ("--served-model-name", "a", "b"),
    ("--", "--seed", "1"),
    ("--compilation-config.mode", "3"),
    ("--compilation-config", '{"mode": 3}'),
    ("--enable-lora", "--max-loras", "2"),
    ("--trust-remote-code",),
    ("--limit-mm-per-prompt.image", "2"),
)


def _variation(rng: random.Random) -> list[str]:
    """One spelling of an owned flag: plain, abbreviated, with its value attached or after `=`, negated,
    dotted, with underscores, or extended into a flag no release has."""
    spelling = rng.choice(sorted(OWNED_SPELLINGS))
    values = OWNED_SPELLINGS[spelling]
    value = rng.choice(values) if values is not None else None
    tail = [value] if value is not None else []
    short = not spelling.startswith("--")
    form = rng.choice(("plain", "abbrev", "attached", "equals", "negated", "dotted", "underscore", "unknown"))
    if form == "abbrev":
        cut = spelling[: rng.randrange(2 if short else 4, len(spelling))] if len(spelling) > 2 else spelling
        return [cut, *tail]
    if form == "attached" and value is not None:
        return [spelling + value]
    if form == "equals" and value is not None:
        return [f"{spelling}={value}"]
    if form == "negated" and not short:
        return ["--no-" + spelling[2:][: rng.randrange(4, len(spelling) - 1)]]
    if form == "dotted":
        return rng.choice(([f"{spelling}.x", "1"], [f"{spelling}.x=1"]))
    if form == "underscore" and not short:
        return ["--" + spelling[2:].replace("-", "_"), *tail]
    if form == "unknown":
        return [spelling + rng.choice(("x", "9", "s")) if short else "--no-" + spelling[2:]]
    return [spelling, *tail]


def variations(seed: int = 22) -> list[tuple[str, list[str]]]:
    """(where, the user's extra arguments): the issue's three, then seeded combinations of owned spellings
    and vLLM options the operator does not own."""
    rng = random.Random(seed)
    cases = [("prefill", list(args)) for args in PARSER_REFUSED]
    while len(cases) < VARIATIONS:
        parts = [_variation(rng) for _ in range(rng.randint(1, 2))]
        parts += [list(rng.choice(OTHER_OPTIONS)) for _ in range(rng.randint(0, 2))]
        rng.shuffle(parts)
        flat = [a for part in parts for a in part]
        # Abbreviations (`--nnode`) and negations (`--no-headl`) name their flag too.
        names = [a.removeprefix("--no-").lstrip("-").split("=")[0].split(".")[0] for a in flat]
        stage_only = any(
            (o.startswith("--") and (o[2:].startswith(n) or n.startswith(o[2:])))
            or (a[:2] == o and a[2:3] != "-")
            for a, n in zip(flat, names, strict=True)
            for o in STAGE_ONLY
        )
        cases.append((rng.choice(("prefill",) if stage_only else ("engine", "prefill", "decode")), flat))
    return cases


def _with_args(version: str, where: str, args: list[str]) -> DisaggDeploymentSpec:
    return example_spec({"engine": {"version": version}, where: {"extraArgs": args}})


@pytest.mark.parametrize("version", RELEASES)
def test_every_argv_the_operator_admits_parses_with_vllms_own_parser(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    """For seeded user arguments near the owned flags: every argv of an admitted spec (the operator's own
    plus the user's it keeps) parses with the release's parser; a refused one is either refused by that
    parser too or is an owned flag the operator refuses by design."""
    peer = vllm_peers(version)
    base = {pod.pod: pod for pod in engine_pods(example_spec({"engine": {"version": version}}), tmp_path)}
    for pod in base.values():
        assert peer.call("parse_refusal", argv=pod.argv) is None, pod.argv
    counts = {"admitted": 0, "refused by both": 0, "refused by the operator only": 0}
    for where, args in variations():
        spec = _with_args(version, where, args)
        report = evaluate(spec, REFUSAL_CHAIN, Installation(worker_image="w:1"))
        if report.compatible:
            for pod in engine_pods(spec, tmp_path):
                refusal = peer.call("parse_refusal", argv=pod.argv)
                assert refusal is None, (version, where, args, pod.pod, refusal)
            counts["admitted"] += 1
            continue
        assert {v.reason for v in report.violations} <= {ARG_CONFLICT_REASON, UNKNOWN}, report.violations
        # What vLLM would have been given had the operator passed the user's arguments through.
        passed = [pod.argv + args for pod in base.values() if where == "engine" or pod.role == where]
        if any(peer.call("parse_refusal", argv=argv) is not None for argv in passed):
            counts["refused by both"] += 1
        else:
            counts["refused by the operator only"] += 1
    print(f"vLLM {version}: {len(variations())} user-argument variations: {counts}")
    for args in PARSER_REFUSED:
        head = next(pod for pod in base.values() if pod.role == "prefill" and pod.pod.endswith("-0"))
        assert peer.call("parse_refusal", argv=[*head.argv, *args]) is not None, args
        assert not evaluate(
            _with_args(version, "prefill", list(args)), REFUSAL_CHAIN, Installation(worker_image="w:1")
        ).compatible
    assert min(counts.values()) > 0, counts


@pytest.mark.parametrize("version", RELEASES)
def test_the_operator_refuses_exactly_the_unrelated_arguments_vllms_parser_refuses(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    """Arguments that name no owned flag are judged by the release's option table: a spec is admitted
    exactly when every argv its pods pass parses with that release's own parser (issue 22, finding 8)."""
    peer = vllm_peers(version)
    base = {pod.pod: pod for pod in engine_pods(example_spec({"engine": {"version": version}}), tmp_path)}
    counts = {"admitted by both": 0, "refused by both": 0}
    for args in UNRELATED:
        for where in ("engine", "decode"):
            spec = _with_args(version, where, list(args))
            report = evaluate(spec, REFUSAL_CHAIN, Installation(worker_image="w:1"))
            passed = [
                pod.argv + list(args) for pod in base.values() if where == "engine" or pod.role == where
            ]
            refusals = [peer.call("parse_refusal", argv=argv) for argv in passed]
            if report.compatible:
                assert refusals == [None] * len(passed), (version, where, args, refusals)
                counts["admitted by both"] += 1
            else:
                assert {v.reason for v in report.violations} == {UNKNOWN}, report.violations
                assert any(r is not None for r in refusals), (version, where, args, report.violations)
                counts["refused by both"] += 1
    print(f"vLLM {version}: {2 * len(UNRELATED)} unrelated-argument specs: {counts}")
    assert min(counts.values()) > 0, counts
