"""What the operator registers with kopf, read from kopf's own registry, and what its stores keep.

Events of Pods, StatefulSets, Deployments and DisaggDeployments arrive by the thousand at scale. A sync
handler runs on kopf's executor, and every event queued for it holds its object's whole body: with sync
indexers, 200 deployments created together doubled the operator's memory.

The pods and deployments the indices keep are frozen (`runtime.frozen`) and thawed for each reader: every
field a reader reads must come back, exactly (a served pod and deployment, with what nobody reads beside).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.control.handlers import OWNER_METADATA, Kept, child_changed, owner_changed, owners
from disagg.operator.control.handlers import pods as pods_index
from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import Observed
from disagg.operator.control.ticks import planned, rolling_out
from disagg.operator.kv_status import peers_reported, pod_kv
from disagg.operator.naming import REVISION_LABEL, SLOT_LABEL, Owner
from disagg.operator.policies.compat import evaluate
from disagg.operator.rollout import revision_pairs, slot_of
from disagg.worker.contracts.engine_pods import engine_pod, essentials
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    DRAINING_ANNOTATION,
    PEER_REPORT_ANNOTATION,
    POD_CONDITION,
    ROLE_LABEL,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pp2-hma.yaml"

CHILD_PLURALS = {"pods", "statefulsets", "deployments"}


def test_every_handler_of_a_childs_event_runs_on_kopfs_loop_not_its_executor() -> None:
    registry = kopf.get_default_registry()
    handlers = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    children = [h for h in handlers if h.selector is not None and h.selector.any_name in CHILD_PLURALS]
    # Three indices and the refresh request, registered for all three kinds.
    assert {h.selector.any_name for h in children if h.selector is not None} == CHILD_PLURALS
    assert len(children) == 6
    assert [h.id for h in children if not inspect.iscoroutinefunction(h.fn)] == []


def test_the_spec_handlers_run_on_kopfs_loop_and_only_queue_the_reconcile() -> None:
    # Sync, 400 deployments created together left 262 of them waiting for kopf's executor at once, each with
    # its event's body and all kopf built to call it. The reconcile's API calls run in `specs`' threads.
    spec = list(kopf.get_default_registry()._changing.get_all_handlers())
    assert len(spec) == 3 and all(inspect.iscoroutinefunction(h.fn) for h in spec)


# What the operator's stores keep (`handlers.pods`, `handlers.owners`) and `Kept.observed` hands its readers.


def served_pod(name: str, deployment: str = "dd") -> dict[str, Any]:
    """An engine pod of the pp2-hma example as the API server serves it: managedFields, a label and an
    annotation of someone else's, an env variable from a reference, conditions with their times."""
    spec = DisaggDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    report = evaluate(spec)
    assert report.plan is not None
    objects = build(spec, Owner(deployment, "ns", "uid-1", 1), report.plan, report.hashes)
    kind = "StatefulSet" if "prefill" in name else "Deployment"
    template = copy.deepcopy(
        next(o for o in objects if o["kind"] == kind and "router" not in o["metadata"]["name"])["spec"][
            "template"
        ]
    )
    metadata = template["metadata"]
    metadata |= {
        "name": name,
        "namespace": "ns",
        "uid": f"uid-{name}",
        "resourceVersion": "4711",
        "creationTimestamp": "2026-12-01T10:00:00Z",
        "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}] * 5,
    }
    metadata["labels"] |= {"team": "search", "pod-template-hash": "7c9"}
    metadata["annotations"] |= {
        "example.com/owner": "someone",
        DRAINING_ANNOTATION: "2026-12-01T10:05:00Z",
        PEER_REPORT_ANNOTATION: '{"v": 1, "peers": []}',
    }
    for container in template["spec"]["containers"]:
        container.setdefault("env", []).append(
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "startTime": "2026-12-01T10:00:01Z",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-12-01T10:00:01Z"},
                {
                    "type": POD_CONDITION,
                    "status": "False",
                    "reason": "CompatibilityHashMismatch",
                    "message": "prefill stage 1 differs",
                    "lastTransitionTime": "2026-12-01T10:00:09Z",
                },
                {"type": "Ready", "status": "True", "lastProbeTime": None},
            ],
        },
    }


def index(fn: Any, body: dict[str, Any], kept: Kept) -> None:
    """Run the indexer `fn` on `body` as kopf does, into the operator's stores `kept`."""
    metadata = body["metadata"]
    returned = asyncio.run(
        fn(
            body=kopf.Body(copy.deepcopy(body)),
            annotations=metadata.get("annotations") or {},
            namespace=metadata.get("namespace"),
            name=metadata.get("name"),
            uid=metadata["uid"],
            # What `owners` asks of the operator's client (`Kube.saw`) needs no API server.
            memo=kopf.Memo(kube=Kube(None), kept=kept),  # type: ignore[arg-type]
        )
    )
    # Nothing for kopf's own index to keep (`handlers.Kept`).
    assert returned is None


def observed(pods: list[dict[str, Any]], deployments: list[dict[str, Any]]) -> Observed:
    """The readers over the stores the indexers filled with `pods` and `deployments`."""
    kept = Kept()
    for body in deployments:
        index(owners, body, kept)
    for body in pods:
        index(pods_index, body, kept)
    return kept.observed()


# Every field of a pod some reader reads (`engine_pods.engine_pod`, `kv_status`, `pairing`, `rollout`,
# `scaling`), by its path.
POD_FIELDS_READ = [
    ("metadata", "name"),
    ("metadata", "namespace"),
    ("metadata", "creationTimestamp"),
    ("metadata", "labels", ROLE_LABEL),
    ("metadata", "labels", DEPLOYMENT_LABEL),
    ("metadata", "labels", REVISION_LABEL),
    ("metadata", "labels", SLOT_LABEL),
    ("metadata", "annotations", DRAINING_ANNOTATION),
    ("metadata", "annotations", PEER_REPORT_ANNOTATION),
    ("status", "podIP"),
]


def at(body: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        body = body[part]
    return body


def test_a_pod_reads_back_from_the_index_with_every_field_its_readers_read() -> None:
    full = [served_pod(name) for name in ("dd-prefill-0-0", "dd-prefill-0-1", "dd-decode-7c9-abcde")]
    full[1]["metadata"]["deletionTimestamp"] = "2026-12-01T10:06:00Z"
    seen = list(observed(full, []).pods("ns", "dd"))
    assert len(seen) == 3
    for pod, kept in zip(full, seen, strict=True):
        assert kept == essentials(pod)
        for path in POD_FIELDS_READ:
            assert at(kept, path) == at(pod, path), path
        assert kept["metadata"].get("deletionTimestamp") == pod["metadata"].get("deletionTimestamp")
        assert engine_pod(kept) == engine_pod(pod)
        assert pod_kv(kept) == pod_kv(pod)
        assert kept["status"]["conditions"] == [
            {key: c[key] for key in ("type", "status", "reason", "message") if key in c}
            for c in pod["status"]["conditions"]
            if c["type"] in ("Ready", POD_CONDITION)
        ]
        assert "managedFields" not in kept["metadata"] and "team" not in kept["metadata"]["labels"]
    assert routing_from_pods(seen) == routing_from_pods(full)
    assert peers_reported(seen) and peers_reported(full)
    assert revision_pairs(routing_from_pods(seen), seen) == revision_pairs(routing_from_pods(full), full)
    assert [slot_of(p) for p in seen] == [slot_of(p) for p in full]


def test_each_read_of_the_pods_is_a_fresh_copy() -> None:
    seen = observed([served_pod("dd-prefill-0-0")], [])
    first = list(seen.pods("ns", "dd"))
    first[0]["metadata"]["annotations"].clear()
    first[0]["spec"]["containers"].clear()
    again = list(seen.pods("ns", "dd"))
    assert again[0] == essentials(served_pod("dd-prefill-0-0"))
    assert list(seen.pods("ns", "other")) == []


def served_deployment(name: str = "dd") -> dict[str, Any]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["decode"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "target": {"kvCacheUsage": 0.75},
    }
    document["metadata"] = {
        "name": name,
        "namespace": "ns",
        "uid": f"uid-{name}",
        "generation": 3,
        "resourceVersion": "812",
        "deletionTimestamp": "2026-12-01T11:00:00Z",
        "creationTimestamp": "2026-12-01T10:00:00Z",
        "annotations": {"disagg.io/last-handled-configuration": "{}"},
        "managedFields": [{"manager": "kubectl"}],
    }
    document["status"] = {
        "observedGeneration": 3,
        "oldRevision": "22f0f8af7e",
        "conditions": [{"type": "Compatible", "status": "True", "reason": "Compatible", "message": "m"}],
        "revisions": [{"revision": "22f0f8af7e", "draining": False, "routablePairs": 0}],
        "decode": {"desiredReplicas": 2, "replicas": 2},
    }
    return document


def test_a_deployment_reads_back_from_the_index_as_it_was_served_less_what_nobody_reads() -> None:
    body = served_deployment()
    seen = observed([], [body]).deployment("ns", "dd")
    assert seen is not None
    assert seen["metadata"] == {key: body["metadata"][key] for key in OWNER_METADATA}
    assert set(OWNER_METADATA) == {
        "name",
        "namespace",
        "uid",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
    }
    assert seen["spec"] == body["spec"] and seen["status"] == body["status"]
    # Exactly: true stays true and 0.75 a float, or a judged spec or a compared status would differ.
    assert json.dumps(seen["spec"], sort_keys=True) == json.dumps(body["spec"], sort_keys=True)
    assert json.dumps(seen["status"], sort_keys=True) == json.dumps(body["status"], sort_keys=True)
    seen["status"]["conditions"].clear()
    seen["spec"]["decode"]["replicas"] = 9
    again = observed([], [body]).deployment("ns", "dd")
    assert again is not None and again["status"] == body["status"] and again["spec"] == body["spec"]


def test_a_deployment_without_a_status_reads_back_with_an_empty_one() -> None:
    body = served_deployment()
    del body["status"]
    seen = observed([], [body]).deployment("ns", "dd")
    assert seen is not None and seen["status"] == {}
    assert observed([], [body]).deployment("ns", "gone") is None


def test_the_clock_reads_each_deployment_as_a_status_refresh_does() -> None:
    bodies = [served_deployment("dd"), served_deployment("idle")]
    bodies[1]["status"].pop("oldRevision")
    del bodies[1]["spec"]["decode"]["autoscaling"]
    kept = Kept()
    for body in bodies:
        index(owners, body, kept)
    views = kept.owner_views()
    assert [view["metadata"]["name"] for view in views] == ["dd", "idle"]
    for view, body in zip(views, bodies, strict=True):
        assert rolling_out(view) == rolling_out(body)
        assert planned(view) == planned(body)
        assert view["metadata"].get("deletionTimestamp") == body["metadata"]["deletionTimestamp"]
        assert view["metadata"].get("uid") == body["metadata"]["uid"]
    assert [rolling_out(v) for v in views] == [True, False]
    assert [planned(v) for v in views] == [True, False]


class Refreshes:
    """The status refreshes `child_changed` asks for, recorded (the queue is `test_work_queue`'s)."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []

    def request(self, key: tuple[str, str]) -> None:
        self.keys.append(key)


def event(fn: Any, type_: str, body: dict[str, Any], kept: Kept, refresh: Refreshes) -> None:
    metadata = body["metadata"]
    asyncio.run(
        fn(
            type=type_,
            uid=metadata["uid"],
            annotations=metadata.get("annotations") or {},
            namespace=metadata.get("namespace"),
            memo=kopf.Memo(kept=kept, refresh=refresh),
        )
    )


def test_a_deleted_pod_or_deployment_is_forgotten_and_its_owner_refreshed() -> None:
    # kopf calls no indexer for a deletion: the event handlers forget the object.
    kept, refresh = Kept(), Refreshes()
    deployment = served_deployment()
    pods = [served_pod("dd-prefill-0-0"), served_pod("dd-prefill-0-1")]
    index(owners, deployment, kept)
    for pod in pods:
        index(pods_index, pod, kept)
    event(child_changed, "MODIFIED", pods[0], kept, refresh)
    assert len(list(kept.observed().pods("ns", "dd"))) == 2
    event(child_changed, "DELETED", pods[0], kept, refresh)
    assert [p["metadata"]["name"] for p in kept.observed().pods("ns", "dd")] == ["dd-prefill-0-1"]
    assert refresh.keys == [("ns", "dd"), ("ns", "dd")]
    event(owner_changed, "MODIFIED", deployment, kept, refresh)
    assert kept.observed().deployment("ns", "dd") is not None
    event(owner_changed, "DELETED", deployment, kept, refresh)
    assert kept.observed().deployment("ns", "dd") is None and kept.owner_views() == []
    # The pod's own deletion comes in its own event.
    assert len(list(kept.observed().pods("ns", "dd"))) == 1


def test_a_pod_the_indexer_cannot_read_is_not_kept_as_it_was() -> None:
    kept = Kept()
    pod = served_pod("dd-prefill-0-0")
    index(pods_index, pod, kept)
    pod["metadata"]["annotations"]["example.com/odd"] = {1, 2}  # no JSON value: freezing it raises
    with pytest.raises(TypeError):
        index(pods_index, pod, kept)
    assert list(kept.observed().pods("ns", "dd")) == []
