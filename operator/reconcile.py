"""The reconcile steps behind the kopf handlers: judge the spec, apply or refuse, then recompute status.

Level-based and idempotent: every call builds the full desired set from the spec and applies it with
server-side apply, deletes children the spec no longer wants, and recomputes the whole status from what the
cluster shows. It never branches on the event that caused it. An incompatible spec changes no child: on
create nothing exists, and on update the running topology stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from disagg.operator import conditions as cond
from disagg.operator.api import ConditionStatus, DisaggDeploymentSpec
from disagg.operator.builders import Owner, build
from disagg.operator.builders_engine import arg_violations
from disagg.operator.compat import CompatReport, evaluate
from disagg.operator.k8s_apply import Kube
from disagg.operator.kv_status import pod_kv
from disagg.operator.status import compute, incompatibility_message, to_json, workload
from disagg.worker.errors import Violation


@dataclass(frozen=True)
class Verdict:
    spec: DisaggDeploymentSpec | None
    report: CompatReport | None
    violations: tuple[Violation, ...]

    @property
    def message(self) -> str:
        message: str = incompatibility_message(self.violations)
        return message


@dataclass(frozen=True)
class Outcome:
    applied: tuple[str, ...]
    deleted: tuple[str, ...]
    refused: str | None


def judge(raw_spec: Mapping[str, Any]) -> Verdict:
    """Every reason to refuse a spec: schema errors, pre-flight rules, engine arguments that contradict it."""
    try:
        spec = DisaggDeploymentSpec.model_validate(dict(raw_spec))
    except ValidationError as error:
        problems = "; ".join(
            f"spec.{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
        )
        return Verdict(None, None, (Violation("InvalidSpec", problems),))
    report = evaluate(spec)
    return Verdict(spec, report, (*report.violations, *arg_violations(spec)))


def _owner(body: Mapping[str, Any]) -> Owner:
    metadata = body["metadata"]
    return Owner(
        name=metadata["name"],
        namespace=metadata["namespace"],
        uid=metadata["uid"],
        generation=int(metadata.get("generation") or 1),
    )


def reconcile(kube: Kube, body: Mapping[str, Any]) -> Outcome:
    """Converge the children on the spec (or refuse it), then write the status."""
    owner = _owner(body)
    verdict = judge(body.get("spec") or {})
    if verdict.violations:
        refresh_status(kube, owner.namespace, owner.name)
        return Outcome((), (), verdict.message)
    # judge() reports a violation whenever the spec cannot be parsed or planned.
    assert verdict.spec is not None and verdict.report is not None and verdict.report.plan is not None
    desired = build(verdict.spec, owner, verdict.report.plan, verdict.report.hashes)
    for obj in desired:
        kube.apply(obj)
    wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in desired}
    deleted = []
    for child in kube.children(owner.namespace, owner.name, owner.uid):
        key = (child["kind"], child["metadata"]["name"])
        if key not in wanted:
            kube.delete(key[0], owner.namespace, key[1])
            deleted.append(f"{key[0]} {key[1]}")
    refresh_status(kube, owner.namespace, owner.name)
    return Outcome(tuple(f"{kind} {name}" for kind, name in sorted(wanted)), tuple(deleted), None)


def refresh_status(kube: Kube, namespace: str, name: str) -> bool:
    """Recompute the status from the spec, the children and the pods; write it only if it changed."""
    body = kube.read_deployment(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    metadata = body["metadata"]
    verdict = judge(body.get("spec") or {})
    if verdict.report is None:
        # The stored object breaks the schema (possible only without the CRD's validation): say so and stop.
        return _write_invalid(kube, body, verdict)
    children = kube.children(namespace, name, metadata["uid"])
    workloads = [workload(child) for child in children if child["kind"] in ("StatefulSet", "Deployment")]
    current = body.get("status") or {}
    status = compute(
        generation=int(metadata.get("generation") or 1),
        previous=cond.parse(current.get("conditions")),
        violations=verdict.violations,
        report=verdict.report,
        workloads=workloads,
        pods=[pod_kv(pod) for pod in kube.pods(namespace, name)],
        now=datetime.now(UTC),
    )
    rendered = to_json(status)
    if rendered == current:
        return False
    kube.patch_status(namespace, name, rendered)
    return True


def _write_invalid(kube: Kube, body: Mapping[str, Any], verdict: Verdict) -> bool:
    metadata = body["metadata"]
    generation = int(metadata.get("generation") or 1)
    current = body.get("status") or {}
    conditions = cond.set_condition(
        cond.parse(current.get("conditions")),
        cond.COMPATIBLE,
        ConditionStatus.FALSE,
        verdict.violations[0].reason,
        verdict.message,
        generation=generation,
        now=datetime.now(UTC),
    )
    rendered = {**current, "observedGeneration": generation, "conditions": cond.to_json(conditions)}
    if rendered == current:
        return False
    kube.patch_status(metadata["namespace"], metadata["name"], rendered)
    return True
