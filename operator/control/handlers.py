"""kopf handlers: each unpacks its arguments and calls one reconcile step (`control.reconcile`).

The DisaggDeployment's spec handlers queue a reconcile of its key (`specs.SpecReconciles`), which converges
its children in the operator's own threads. Events of its StatefulSets, Deployments and Pods (watched with a
server-side label selector) update the operator's stores of what the status reads of them (`Kept`: a
`Workload`, a Pod's `engine_pods.essentials`) and queue a recompute of the owner's status (a `WorkQueue` of
status refreshes), so `Available` follows the workloads and `KVTransferReady` the sidecars' Pod conditions
without listing anything; a store of the DisaggDeployments themselves (`owners`) spares those reconciles and
refreshes a GET of their deployment. The pods and deployments are kept frozen (`frozen`: shared tuples, a
fraction of the decoded JSON) and thawed into fresh dicts for each reader.
Every handler of a watched object's event is async and does no I/O: a sync one would queue for kopf's
executor, holding its event's whole body (and all kopf built to call it) meanwhile. kopf holds every other
handler back until the indexers have seen the initial listing, so a restarted operator never judges a
deployment from half of its children; the operator's clock (`ticker`: a rollout under way, the planner)
starts with the first spec handler for the same reason. No handler sleeps or swallows an error. Events are
posted only for news: an apply that wrote something, a prune, a refusal that changed the status, a failed
reconcile.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import kopf

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.control.k8s_apply import PARALLEL_REQUESTS, Kube, api_client
from disagg.operator.control.kopf_tuning import KopfEvents, tune
from disagg.operator.control.reconcile import Observed, refresh_status
from disagg.operator.control.scaling import Planners
from disagg.operator.control.specs import spec_reconciles
from disagg.operator.control.ticks import ticks
from disagg.operator.naming import DEPLOYMENT_ANNOTATION, FIELD_MANAGER, MANAGED_BY_LABEL
from disagg.operator.runtime.frozen import freeze, thaw, view
from disagg.operator.runtime.stores import Key, Store
from disagg.operator.runtime.ticker import Ticker
from disagg.operator.runtime.work_queue import WorkQueue
from disagg.operator.settings import Settings
from disagg.operator.status import Workload, workload
from disagg.worker.contracts.engine_pods import essentials

CHILD_LABELS = {MANAGED_BY_LABEL: FIELD_MANAGER}
V = TypeVar("V")


def _owner_key(annotations: kopf.Annotations, namespace: str | None) -> Key | None:
    # Interned: each event's body holds fresh copies of both strings; the stores keep one.
    owner = annotations.get(DEPLOYMENT_ANNOTATION)
    return (sys.intern(namespace), sys.intern(owner)) if owner and namespace else None


@dataclass(frozen=True)
class Kept:
    """What the operator keeps of the objects it watches (`stores`), filled by the indexers below."""

    owners: Store[object] = field(default_factory=Store)
    statefulsets: Store[Workload] = field(default_factory=Store)
    deployments: Store[Workload] = field(default_factory=Store)
    pods: Store[object] = field(default_factory=Store)

    def observed(self) -> Observed:
        """The readers of a reconcile or a status refresh, from any thread; each read thaws what it reads
        into fresh dicts, so no reader sees another's."""

        def workloads(namespace: str, name: str) -> list[Workload]:
            key = (namespace, name)
            return [*self.statefulsets.get(key), *self.deployments.get(key)]

        def pods(namespace: str, name: str) -> list[dict[str, Any]]:
            return [thaw(pod) for pod in self.pods.get((namespace, name))]

        def deployment(namespace: str, name: str) -> dict[str, Any] | None:
            found = self.owners.get((namespace, name))
            return thaw(found[0]) if found else None

        return Observed(workloads=workloads, pods=pods, deployment=deployment)

    def forget(self, uid: str) -> None:
        """The object `uid`, of whatever kind, is gone: uids are unique across kinds."""
        for store in (self.owners, self.statefulsets, self.deployments, self.pods):
            store.forget(uid)

    def owner_views(self) -> list[Mapping[str, Any]]:
        """Every kept deployment, read in place (`frozen.view`): the clock looks at a field or two of each,
        twice a second, and thawing a thousand whole deployments for that would cost more than the rest of
        it."""
        return [view(body) for body in self.owners.values()]


# The indexers put what they read of an object into the operator's stores (`Kept`) and give kopf nothing to
# keep: kopf still runs them before any other handler and holds every other handler back until they have
# seen the initial listing of every kind, which is all the operator wants of kopf's indexing. kopf calls no
# indexer for a deletion: `child_changed` and `owner_changed` forget the object. Each is async (see the
# module's doc): with sync indexers, 200 deployments created together left some 1,200 child events waiting
# for the executor at once, and the operator's RSS at twice what it was.


@kopf.index("apps", "v1", "statefulsets", labels=CHILD_LABELS)
async def statefulsets(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    _keep(memo.kept.statefulsets, _owner_key(annotations, namespace), uid, lambda: workload(body))


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployments(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    _keep(memo.kept.deployments, _owner_key(annotations, namespace), uid, lambda: workload(body))


@kopf.index("v1", "pods", labels=CHILD_LABELS)
async def pods(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    # Frozen (`frozen`): a pod's essentials as dicts were ~5 KiB, most of it the same from pod to pod.
    _keep(memo.kept.pods, _owner_key(annotations, namespace), uid, lambda: freeze(essentials(body)))


# What a status refresh and the clock read of a deployment's metadata.
OWNER_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")


@kopf.index(GROUP, VERSION, PLURAL)
async def owners(
    body: kopf.Body, namespace: str | None, name: str | None, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    # What a status refresh reads of the deployment, so it needs no GET, frozen (`frozen`): the spec of
    # deployments stamped from one template is kept once. Not the managedFields and annotations nobody reads.
    metadata = body["metadata"]
    memo.kube.saw(metadata)
    key = (sys.intern(namespace), sys.intern(name)) if namespace and name else None
    _keep(
        memo.kept.owners,
        key,
        uid,
        lambda: freeze(
            {
                "metadata": {field: metadata[field] for field in OWNER_METADATA if field in metadata},
                "spec": body.get("spec") or {},
                "status": body.get("status") or {},
            }
        ),
    )


def _keep(store: Store[V], key: Key | None, uid: str, value: Callable[[], V]) -> None:
    # An object whose value cannot be made is not kept at all (as kopf's own indices do), rather than kept
    # as it was before this event.
    try:
        made = value()
    except BaseException:
        store.forget(uid)
        raise
    store.put(key, uid, made)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    tune(settings)
    # `disagg operator run` read them at its start, and refused what it could not read.
    ours: Settings = memo.settings
    webhook = getattr(memo, "webhook", None)
    if webhook is not None:
        settings.admission.server = webhook.server
        settings.admission.managed = webhook.managed
    # One connection per thread that may be in a request at once (the spec workers wait on the request
    # threads); urllib3's default, five per core, would drop and re-handshake the rest.
    kube = Kube(api_client(connections=ours.spec_workers + ours.refresh_workers + PARALLEL_REQUESTS))
    installation = ours.installation
    # Set here, before any watch starts: the indexers put into it from their first event.
    kept = Kept()
    observed = kept.observed()
    memo.kube = kube
    memo.kept = kept
    memo.installation = installation
    memo.observed = observed
    memo.refresh = WorkQueue(
        lambda key: refresh_status(kube, *key, installation, observed),
        what="Status refresh",
        logger=logging.getLogger("disagg.operator.status"),
        workers=ours.refresh_workers,
        settle=ours.settle_s,
    )
    # Set here, not in a handler: kopf gives each object's handlers a shallow copy of this memo.
    memo.events = KopfEvents()
    memo.specs = spec_reconciles(
        kube, installation, observed, memo.refresh.holding, memo.events, workers=ours.spec_workers
    )
    memo.planners = Planners()
    memo.ticker = Ticker(
        kept.owner_views,
        ticks(kube, installation, observed, memo.refresh, memo.planners, ours.planner_interval_s),
        forget=memo.planners.forget,
    )


@kopf.on.cleanup()
def stop_refreshing(memo: kopf.Memo, **_: Any) -> None:
    # The reconciles first: they hold keys of the refresh queue.
    memo.ticker.stop()
    memo.specs.stop()
    memo.refresh.stop()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile_spec(body: kopf.Body, memo: kopf.Memo, reason: str, retry: int, **_: Any) -> None:
    # Async, and only queues the key (see `specs`): the reconcile reads the deployment from the store, which
    # the indexer filled with this event before kopf called any other handler.
    # The stores the clock reads are whole once kopf runs a handler (see the module's doc).
    memo.ticker.start()
    memo.events.keep(contextvars.copy_context())
    metadata = body["metadata"]
    created = reason == kopf.Reason.CREATE and retry == 0
    memo.specs.request(
        (sys.intern(metadata["namespace"]), sys.intern(metadata["name"])),
        created_uid=metadata["uid"] if created else None,
    )


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_LABELS)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def child_changed(
    type: str, uid: str, annotations: kopf.Annotations, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    # Async: it only queues a key (a lock held for microseconds), so it needs no executor thread.
    if type == "DELETED":
        memo.kept.forget(uid)
    key = _owner_key(annotations, namespace)
    if key is not None:
        memo.refresh.request(key)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def owner_changed(type: str, uid: str, memo: kopf.Memo, **_: Any) -> None:
    # kopf calls no indexer for a deletion (see `Kept`).
    if type == "DELETED":
        memo.kept.forget(uid)
