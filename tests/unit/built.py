"""What the builders' unit tests share: the owner, the built objects by (kind, name), pod accessors."""

from __future__ import annotations

from typing import Any

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.compat import evaluate

OWNER = Owner(name="gemma-pp2", namespace="ns1", uid="0f0e-uid", generation=7)
CHART_DEFAULT = Installation()


def objects(
    model: DisaggDeploymentSpec, owner: Owner = OWNER, installation: Installation = CHART_DEFAULT
) -> dict[tuple[str, str], dict[str, Any]]:
    report = evaluate(model)
    assert report.compatible and report.plan is not None, report.violations
    built = build(model, owner, report.plan, report.hashes, installation)
    return {(o["kind"], o["metadata"]["name"]): o for o in built}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = obj["spec"]["template"]["spec"]
    return result


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in c["env"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]
