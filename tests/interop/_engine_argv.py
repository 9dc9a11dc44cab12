"""What each engine pod the operator generates runs: its argv after the operator's own launcher ran.

The pod's engine command (`/bin/sh -c <launcher> vllm-serve <args>`) is run by a real `sh`, with POD_NAME set
as the downward API sets it and a `vllm` on PATH that only prints the argv it was given, so the engine id
substitution and the stage branch are the launcher's own. The argv then goes to vLLM's parser (the peer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg.operator.api import DisaggDeployment, DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import CompatReport, evaluate

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="dd", namespace="ns1", uid="uid-1", generation=1)
PRINT_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


@dataclass(frozen=True)
class EnginePod:
    pod: str
    role: str
    argv: list[str]
    env: dict[str, str]


def example_document(patch: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/pp2-hma.yaml with `patch` merged into its spec (a None value removes the key)."""
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pp2-hma.yaml").read_text())
    _merge(document["spec"], patch or {})
    return document


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def example_spec(patch: dict[str, Any] | None = None) -> DisaggDeploymentSpec:
    return DisaggDeployment.model_validate(example_document(patch)).spec


def judged(spec: DisaggDeploymentSpec) -> CompatReport:
    report = evaluate(spec, REFUSAL_CHAIN, Installation(worker_image="w:1"))
    assert report.compatible and report.plan is not None, report.violations
    return report


def engine_pods(spec: DisaggDeploymentSpec, tmp: Path) -> list[EnginePod]:
    """Every engine pod of the spec (each prefill stage, one decode pod), as its launcher starts vLLM."""
    report = judged(spec)
    assert report.plan is not None
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "vllm").write_text(f"#!{sys.executable}\n{PRINT_ARGV}\n")
    (fake / "vllm").chmod(0o755)
    pods = []
    for obj in build(spec, OWNER, report.plan, report.hashes, Installation(worker_image="w:1")):
        # The engine workloads; the router's Deployment runs no engine.
        if (
            obj["kind"] not in ("StatefulSet", "Deployment")
            or "disagg.io/component" in obj["metadata"]["labels"]
        ):
            continue
        template = obj["spec"]["template"]["spec"]
        engine = next(c for c in template["containers"] if c["name"] == ENGINE_CONTAINER)
        names = (
            [f"{obj['metadata']['name']}-{i}" for i in range(obj["spec"]["replicas"])]
            if obj["kind"] == "StatefulSet"
            else [f"{obj['metadata']['name']}-7d9f8b6c5-x2k4q"]
        )
        env = {item["name"]: item["value"] for item in engine["env"] if "value" in item}
        for name in names:
            run = subprocess.run(
                [*engine["command"], *engine["args"]],
                env={"PATH": f"{fake}:{os.environ['PATH']}", "POD_NAME": name},
                capture_output=True,
                text=True,
                check=True,
            )
            argv = json.loads(run.stdout)
            assert argv[0] == "serve", argv
            role = obj["metadata"]["labels"].get("disagg.io/role") or (
                "prefill" if "prefill" in name else "decode"
            )
            pods.append(EnginePod(name, role, argv[1:], env))
    return pods


def kv_transfer_config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config
