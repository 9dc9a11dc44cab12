"""Generated specs through `disagg check`'s judge and the webhook's verdict: seeded, bounded, every outcome
checked. No spec raises, every refusal has a CamelCase reason, the two verdicts agree, and every accepted spec
builds into objects of bounded size (so what `check` and the webhook accept, reconcile can apply)."""

from __future__ import annotations

import copy
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from dd_specs import valid_document
from pydantic import ValidationError

from disagg.operator.api import MAX_REPLICAS, DisaggDeployment
from disagg.operator.builders.children import build
from disagg.operator.cli import check as cli_check
from disagg.operator.control.reconcile import judge
from disagg.operator.control.webhook import refusal
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.chain import MAX_OBJECT_BYTES

pytestmark = pytest.mark.fuzz

SEED = 15
COUNT = 10_000
# One in this many specs goes through the YAML text `disagg check` reads, not only the parsed document.
YAML_EVERY = 10
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
INSTALLED = Installation(worker_image="ghcr.io/disagg/disagg:0.1.0")
OWNER = Owner(name="fuzz", namespace="default", uid="00000000-0000-0000-0000-000000000001", generation=1)
# A deployment's objects: ConfigMap, ServiceAccount, RoleBinding, per prefill replica a Service and a
# StatefulSet, the decode Service and Deployment, and the router's ServiceAccount, Role, RoleBinding,
# Service and Deployment.
MAX_OBJECTS = 3 + 2 * MAX_REPLICAS + 2 + 5

INTS = [0, 1, 2, 3, 4, 6, 8, 16, 32, 62, 64, 255, 256, 257, 4096, 4097, -1, 2**31, 2**32, 2**63, 10**30]
FLAGS = [
    "--tensor-parallel-size",
    "--tensor-parallel",
    "--tensor_parallel_size",
    "-tp",
    "-t",
    "--pipeline-parallel-size",
    "-pp",
    "--block-size",
    "--block",
    "--b",
    "--dtype",
    "--kv-cache-dtype",
    "--kv-transfer-config",
    "--kv-transfer-config.kv_role",
    "--kv_transfer.kv_connector",
    "--port",
    "--p",
    "--disable-hybrid-kv-cache-manager",
    "--enable-hybrid-kv-cache-manager",
    "--no-disable-hybrid-kv-cache-manager",
    "--revision",
    "--nnodes",
    "-n",
    "--master-addr",
    "--node-rank",
    "-r",
    "--headless",
    "--config",
    "--conf",
    "--config-format",
    "--model",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--compilation-config.level",
    "--",
    "-",
    "-O3",
    "--prefill-context-parallel-size",
    "-pcp",
]
VALUES = [
    "1",
    "2",
    "4",
    "16",
    "32",
    "bfloat16",
    "auto",
    "kv_producer",
    "x.yaml",
    '{"kv_role":"kv_consumer"}',
    "",
]
TEMPLATE_PARTS = [
    "model.layers.",
    "{i}",
    "{j}",
    "{",
    "}",
    "{{",
    "}}",
    "{0}",
    "{i:>9}",
    "{i!r}",
    ".attn",
    "x" * 60,
]


def hostile(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, sometimes a deep or wide one."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1:
        return rng.choice(["", "x", "{i}", "é", "\x00", "1Gi", "500m", "two", "x" * 600, "-1"])
    if kind == 2:
        return rng.choice([True, False, None, 0.5, -0.0, 1e300])
    if kind == 3 and depth < 3:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 4 and depth < 3:
        return {rng.choice(["a", "limits", "requests", "cpu", "nvidia.com/gpu"]): hostile(rng, depth + 1)}
    if kind == 5:
        deep: Any = {}
        for _ in range(rng.choice([5, 33, 200])):
            deep = {"a": deep} if rng.random() < 0.5 else [deep]
        return deep
    return rng.choice([*INTS, "x", None])


def quantity(rng: random.Random) -> Any:
    return rng.choice([1, 2, 8, "500m", "1.5Gi", "16Gi", "2", "1e3", "0.5", "-1", "two", 0.5, True, 2**63])


def resources(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return hostile(rng)
    names = ["cpu", "memory", "nvidia.com/gpu", "hugepages-2Mi", "not a name!", "rdma/ib"]
    return {
        section: {rng.choice(names): quantity(rng) for _ in range(rng.randrange(3))}
        for section in rng.sample(["requests", "limits", "claims"], rng.randrange(3))
    }


def extra_args(rng: random.Random) -> list[Any]:
    args: list[Any] = []
    for _ in range(rng.randrange(5)):
        flag = rng.choice(FLAGS)
        if rng.random() < 0.3:
            args.append(f"{flag}={rng.choice(VALUES)}")
        else:
            args += [flag, rng.choice(VALUES)] if rng.random() < 0.7 else [flag]
    if rng.random() < 0.05:
        args.append(rng.choice([5, None, "x" * 5000]))
    return args


def template(rng: random.Random) -> str:
    return "".join(rng.choice(TEMPLATE_PARTS) for _ in range(rng.randrange(1, 6)))


def role_patch(rng: random.Random) -> dict[str, Any]:
    fields = {
        "replicas": lambda: rng.choice([0, 1, 2, 3, 256, 257, 4294967296]),
        "pipelineParallelSize": lambda: rng.choice([1, 2, 3, 4, 9, 10, 62, 63, 64, 300]),
        "tensorParallelSize": lambda: rng.choice([1, 2, 3, 4, 8, 16, 1025, 2**40]),
        "blockSize": lambda: rng.choice([1, 16, 32, 64, 4097]),
        "layerPartition": lambda: [rng.choice([0, 1, 10, 31, 62]) for _ in range(rng.randrange(4))],
        "extraArgs": lambda: extra_args(rng),
        "resources": lambda: resources(rng),
        "overrides": lambda: {
            rng.choice(
                ["image", "version", "attentionBackend", "revision", "dtype", "kvCacheDtype"]
            ): rng.choice(
                ["vllm/vllm-openai:v0.15.0", "0.15.0", "FLASHINFER", "main", "float16", "fp8", "", 5]
            )
        },
        "scheduling": lambda: {
            rng.choice(["nodeSelector", "tolerations", "affinity"]): rng.choice(
                [{"pool": "a"}, [{"key": "gpu", "operator": "Exists"}], hostile(rng)]
            )
        },
    }
    return {name: make() for name, make in rng.sample(list(fields.items()), rng.randrange(1, 4))}


def spec_patch(rng: random.Random) -> dict[str, Any]:
    parts = {
        "model": lambda: {
            rng.choice(["numLayers", "numKvHeads", "headSize"]): rng.choice([*INTS, 9]),
            **({"layerNameTemplate": template(rng)} if rng.random() < 0.5 else {}),
            **({"layerPattern": {"fullEvery": rng.choice([0, 1, 2, 6, 100])}} if rng.random() < 0.2 else {}),
            **(
                {"attentionKind": rng.choice(["Full", "MLA", "Mamba", "SlidingWindow", "x"])}
                if rng.random() < 0.2
                else {}
            ),
        },
        "engine": lambda: {
            rng.choice(["image", "version", "attentionBackend"]): rng.choice(
                [
                    "vllm/vllm-openai:v0.14.0",
                    "ghcr.io/disagg/reference-engine:0.1.0",
                    # The reference engine's own image: its policy splits the layers itself (issue 22, #7).
                    "ghcr.io/disagg/disagg-transfer:0.1.0",
                    "",
                    "x" * 600,
                    7,
                ]
            ),
            **({"extraArgs": extra_args(rng)} if rng.random() < 0.6 else {}),
            **({"hybridKvCacheManager": rng.choice(["Enabled", "Disabled"])} if rng.random() < 0.3 else {}),
            **({"kvCacheLayout": "BlockOutermost"} if rng.random() < 0.2 else {}),
        },
        "kvTransfer": lambda: {
            rng.choice(["connector", "sideChannelPort", "leaseSeconds", "kvPool", "rdma", "nodeSelector"]): (
                rng.choice(
                    [
                        "Pull",
                        0,
                        65536,
                        8000,
                        {"medium": "HugePages-2Mi", "sizeLimit": rng.choice(["16Gi", "3Mi", "1"])},
                        {
                            "resourceName": rng.choice(["rdma/ib", "", "bad name"]),
                            "count": rng.choice([0, 1, 2**40]),
                        },
                        {"rdma": "true"},
                        hostile(rng),
                    ]
                )
            )
        },
        "prefill": lambda: role_patch(rng),
        "decode": lambda: role_patch(rng),
        "worker": lambda: {
            rng.choice(["image", "resources", "metricsPort"]): rng.choice(
                ["w:1", "", resources(rng), 9400, 0, 8000, hostile(rng)]
            )
        },
    }
    patch = {name: make() for name, make in rng.sample(list(parts.items()), rng.randrange(1, 4))}
    if rng.random() < 0.05:
        patch[rng.choice(list(parts))] = hostile(rng)
    return patch


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


REFERENCE_IMAGE = "ghcr.io/disagg/disagg-transfer:0.1.0"


def image_of(spec: Any) -> Any:
    engine = spec.get("engine") if isinstance(spec, dict) else None
    return engine.get("image") if isinstance(engine, dict) else None


def check_judge(document: dict[str, Any], via_yaml: bool) -> tuple[str, ...] | None:
    """`disagg check`'s verdict: None when the file is invalid, else the violations' reasons."""
    try:
        if via_yaml:
            dd = cli_check.parse_deployment(yaml.safe_dump(document), "fuzz.yaml")
        else:
            dd = DisaggDeployment.model_validate(document)
    except cli_check.SpecFileError:
        return None
    except ValidationError:  # what load_deployment reports as a SpecFileError
        return None
    report = cli_check.judge(dd)
    # What `check` prints after the verdict, text and JSON, must not raise either.
    assert cli_check._summary_lines(dd, report)
    json.dumps(cli_check._report_json(Path("fuzz.yaml"), dd, report))
    return tuple(report.reasons)


def test_generated_specs_never_crash_and_what_is_accepted_builds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISAGG_WORKER_IMAGE", INSTALLED.worker_image or "")
    rng = random.Random(SEED)
    base = valid_document()
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for index in range(COUNT):
        document = merged(base, {"spec": spec_patch(rng)})
        spec = document["spec"]
        verdict = judge(spec, INSTALLED)
        message = refusal(spec)
        found = tuple(v.reason for v in verdict.violations)
        assert (message is None) == (not found), spec
        for violation in verdict.violations:
            assert CAMEL.match(violation.reason), (violation, spec)
            assert violation.message, (violation, spec)
            reasons[violation.reason] += 1
        assert "BuildFailed" not in found, (verdict.violations, spec)
        # A policy that raised: `check` and the webhook survive it, but it is a gap in that policy.
        assert "PolicyFailed" not in found, (verdict.violations, spec)
        if image_of(spec) == REFERENCE_IMAGE:
            outcomes["reference engine"] += 1
            outcomes["reference engine, stages unfillable"] += "InvalidLayerPartition" in found
        checked = check_judge(document, via_yaml=index % YAML_EVERY == 0)
        if checked is None:
            assert found == ("InvalidSpec",), (found, spec)
        else:
            assert checked == found, (checked, found, spec)
        if found:
            outcomes["refused"] += 1
            continue
        outcomes["accepted"] += 1
        assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
        objects = build(verdict.spec, OWNER, verdict.report.plan, verdict.report.hashes, INSTALLED)
        assert len(objects) <= MAX_OBJECTS
        assert all(len(json.dumps(obj)) <= MAX_OBJECT_BYTES for obj in objects)
    with capsys.disabled():
        print(
            f"\nspec fuzz (seed {SEED}): {COUNT} specs, {outcomes['accepted']} accepted and built, "
            f"{outcomes['refused']} refused, {outcomes['reference engine']} on the reference engine "
            f"({outcomes['reference engine, stages unfillable']} with stages its layers cannot fill), "
            f"0 uncaught exceptions; reasons: {dict(reasons.most_common())}"
        )
    assert outcomes["accepted"] >= COUNT // 20 and outcomes["refused"] >= COUNT // 2
    assert outcomes["reference engine"] >= COUNT // 100
    assert outcomes["reference engine, stages unfillable"] >= 3
