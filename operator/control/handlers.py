"""kopf handlers: each unpacks its arguments and calls one reconcile step (`control.reconcile`).

The DisaggDeployment's spec handlers queue a reconcile of its key (`specs.SpecReconciles`), which converges
its children in the operator's own threads. Events of its StatefulSets, Deployments and Pods (watched with a
server-side label selector) update kopf indices of what the status reads of them (a `Workload`, a Pod's
`engine_pods.essentials`) and queue a recompute of the owner's status (a `WorkQueue` of status refreshes), so
`Available` follows the workloads and `KVTransferReady` the sidecars' Pod conditions without listing anything;
an index of the DisaggDeployments themselves (`owners`) spares those reconciles and refreshes a GET of their
deployment. The pods and deployments are kept frozen (`frozen`: shared tuples, a fraction of the decoded
JSON) and thawed into fresh dicts for each reader.
Every handler of a watched object's event is async and does no I/O: a sync one would queue for kopf's
executor, holding its event's whole body (and all kopf built to call it) meanwhile. kopf holds every other
handler back until the indices have seen the initial listing, so a restarted operator never judges a
deployment from half of its children; the operator's clock (`ticker`: a rollout under way, the planner)
starts with the first spec handler for the same reason. No handler sleeps or swallows an error. Events are
posted only for news: an apply that wrote something, a prune, a refusal that changed the status, a failed
reconcile.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import kopf

from disagg.operator.api import GROUP, KIND, PLURAL, VERSION
from disagg.operator.control.backoffs import API_BACKOFFS
from disagg.operator.control.diffbase import LeanDiffBaseStorage, LeanProgressStorage
from disagg.operator.control.frozen import freeze, thaw, view
from disagg.operator.control.k8s_apply import PARALLEL_REQUESTS, Kube, api_client
from disagg.operator.control.reconcile import Observed, refresh_status
from disagg.operator.control.scaling import Planners
from disagg.operator.control.specs import spec_reconciles
from disagg.operator.control.ticker import Ticker
from disagg.operator.control.ticks import ticks
from disagg.operator.control.work_queue import WorkQueue
from disagg.operator.naming import DEPLOYMENT_ANNOTATION, FIELD_MANAGER, MANAGED_BY_LABEL, Installation
from disagg.operator.status import Workload, workload
from disagg.worker.contracts.engine_pods import essentials

CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={FIELD_MANAGER}"
CHILD_LABELS = {MANAGED_BY_LABEL: FIELD_MANAGER}
# The threads of the spec reconciles and of the status refreshes. Each thread is another malloc arena and
# stack, and the API server, not Python, bounds the throughput.
SPEC_WORKERS = 4
REFRESH_WORKERS = 4
# kopf's executor runs only the startup and cleanup handlers and the admission webhook's validation.
KOPF_WORKERS = 2
# How long a status refresh waits after the request that queued it: a new child's events (its pods created,
# its status updated two or three times by its controller) come within about a second when the API server
# keeps up, and one refresh after them writes the status once, not once per event (measured: a lone
# deployment's status is written twice, by its reconcile and one refresh). Under a loaded API server the pods
# come seconds apart and each still changes, and is written to, the status.
SETTLE_S = 1.0
LIST_PAGE = 500
WORKER_IDLE_S = 0.2
Key = tuple[str, str]


def _owner_key(annotations: kopf.Annotations, namespace: str | None) -> Key | None:
    # Interned: kopf keeps this key once per child, each event's body a fresh copy of both strings.
    owner = annotations.get(DEPLOYMENT_ANNOTATION)
    return (sys.intern(namespace), sys.intern(owner)) if owner and namespace else None


@kopf.index("apps", "v1", "statefulsets", labels=CHILD_LABELS)
async def statefulsets(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, **_: Any
) -> dict[Key, Workload]:
    # Async (see the module's doc): with sync indexers, 200 deployments created together left some 1,200
    # child events waiting for the executor at once, and the operator's RSS at twice what it is now.
    key = _owner_key(annotations, namespace)
    return {} if key is None else {key: workload(body)}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployments(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, **_: Any
) -> dict[Key, Workload]:
    key = _owner_key(annotations, namespace)
    return {} if key is None else {key: workload(body)}


@kopf.index("v1", "pods", labels=CHILD_LABELS)
async def pods(
    body: kopf.Body, annotations: kopf.Annotations, namespace: str | None, **_: Any
) -> dict[Key, object]:
    # Frozen (`frozen`): a pod's essentials as dicts were ~5 KiB, most of it the same from pod to pod.
    key = _owner_key(annotations, namespace)
    return {} if key is None else {key: freeze(essentials(body))}


# What a status refresh and the clock read of a deployment's metadata.
OWNER_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")


@kopf.index(GROUP, VERSION, PLURAL)
async def owners(
    body: kopf.Body, namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any
) -> dict[Key, object]:
    # What a status refresh reads of the deployment, so it needs no GET, frozen (`frozen`): the spec of
    # deployments stamped from one template is kept once. Not the managedFields and annotations nobody reads.
    if namespace is None or name is None:
        return {}
    metadata = body["metadata"]
    memo.kube.saw(metadata)
    kept = {
        "metadata": {key: metadata[key] for key in OWNER_METADATA if key in metadata},
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }
    return {(sys.intern(namespace), sys.intern(name)): freeze(kept)}


def _observed(
    owners: kopf.Index[Key, object],
    statefulsets: kopf.Index[Key, Workload],
    deployments: kopf.Index[Key, Workload],
    pods: kopf.Index[Key, object],
) -> Observed:
    # Read from the refresh threads while kopf's loop updates them: list() copies a store's values in one
    # C call under the GIL, so a reader sees each store whole, before or after an update. Each read thaws
    # what it reads into fresh dicts: no reader sees another's.
    def workloads(namespace: str, name: str) -> list[Workload]:
        key = (namespace, name)
        return [*list(statefulsets.get(key, ())), *list(deployments.get(key, ()))]

    def pods_of(namespace: str, name: str) -> list[dict[str, Any]]:
        return [thaw(pod) for pod in list(pods.get((namespace, name), ()))]

    def deployment(namespace: str, name: str) -> dict[str, Any] | None:
        found = list(owners.get((namespace, name), ()))
        return thaw(found[0]) if found else None

    return Observed(workloads=workloads, pods=pods_of, deployment=deployment)


def _owner_views(owners: kopf.Index[Key, object]) -> list[Mapping[str, Any]]:
    """Every indexed deployment, read in place (`frozen.view`): the clock looks at a field or two of each,
    twice a second, and thawing a thousand whole deployments for that would cost more than the rest of it."""
    return [view(body) for key in list(owners) for body in list(owners.get(key, ()))]


def tune(settings: kopf.OperatorSettings) -> None:
    """kopf's settings for this operator: where its state is kept, what it posts, what it watches, how it
    queues and retries."""
    settings.persistence.progress_storage = LeanProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = LeanDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Routine logs stay logs; Events are posted explicitly with CamelCase reasons (and by kopf on failures).
    settings.posting.level = logging.WARNING
    # `kubectl describe` names who posted an Event ("From"); kopf would say "kopf".
    settings.posting.reporting_component = FIELD_MANAGER
    for resource in (("v1", "pods"), ("apps", "v1", "statefulsets"), ("apps", "v1", "deployments")):
        settings.watching.label_selectors[resource] = CHILD_SELECTOR
    settings.execution.max_workers = KOPF_WORKERS
    # kopf's worker for an object keeps the object's last event until it exits, `idle_timeout` after its
    # last event; at kopf's 5 s, 400 deployments created one after another left ~360 idle workers holding
    # a Pod or a StatefulSet each: the operator's RSS peaked 40 MiB over its start, 16 MiB at 0.2 s.
    # Starting a worker again costs a task and a queue.
    settings.queueing.idle_timeout = WORKER_IDLE_S
    # Retry the API server for as long as it is away: kopf's default gives up after ~54 s and ends the
    # operator (`backoffs`).
    settings.networking.error_backoffs = API_BACKOFFS
    # kopf lists a kind again whenever its watch must restart from scratch (410 Gone: the API server no
    # longer has the version it would resume from); paged, that holds one page of Pods, not thousands.
    settings.watching.chunk_size = LIST_PAGE


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **indices: Any) -> None:
    tune(settings)
    webhook = getattr(memo, "webhook", None)
    if webhook is not None:
        settings.admission.server = webhook.server
        settings.admission.managed = webhook.managed
    # One connection per thread that may be in a request at once (the spec workers wait on the request
    # threads); urllib3's default, five per core, would drop and re-handshake the rest.
    kube = Kube(api_client(connections=SPEC_WORKERS + REFRESH_WORKERS + PARALLEL_REQUESTS))
    installation = Installation.from_environ(os.environ)
    # kopf passes every index to every handler by its function's name.
    observed = _observed(indices["owners"], indices["statefulsets"], indices["deployments"], indices["pods"])
    memo.kube = kube
    memo.installation = installation
    memo.observed = observed
    memo.refresh = WorkQueue(
        lambda key: refresh_status(kube, *key, installation, observed),
        what="Status refresh",
        logger=logging.getLogger("disagg.operator.status"),
        workers=REFRESH_WORKERS,
        settle=SETTLE_S,
    )
    # Set here, not in a handler: kopf gives each object's handlers a shallow copy of this memo.
    memo.events = KopfEvents()
    memo.specs = spec_reconciles(
        kube, installation, observed, memo.refresh.holding, memo.events, workers=SPEC_WORKERS
    )
    memo.planners = Planners()
    owners = indices["owners"]
    memo.ticker = Ticker(
        lambda: _owner_views(owners),
        ticks(kube, installation, observed, memo.refresh, memo.planners),
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
    # Async, and only queues the key (see `specs`): the reconcile reads the deployment from the index, which
    # kopf updated with this event before calling any handler.
    # The clock's indices are whole once kopf runs a handler (see the module's doc).
    memo.ticker.start()
    memo.events.keep(contextvars.copy_context())
    metadata = body["metadata"]
    created = reason == kopf.Reason.CREATE and retry == 0
    memo.specs.request(
        (sys.intern(metadata["namespace"]), sys.intern(metadata["name"])),
        created_uid=metadata["uid"] if created else None,
    )


class KopfEvents:
    """Posts an Event on a deployment through kopf's poster, from any thread: queued, not waited for, retried
    by kopf on its schedule. kopf finds its poster in context variables of its handlers' tasks: a handler
    gives one (`keep`) before anything here posts."""

    def __init__(self) -> None:
        self._context: contextvars.Context | None = None

    def keep(self, context: contextvars.Context) -> None:
        if self._context is None:
            self._context = context

    def __call__(self, deployment: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        if self._context is None:
            raise RuntimeError("no kopf handler has run: kopf's poster is not known yet")
        metadata = deployment["metadata"]
        reference = kopf.Body(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "metadata": {
                    "name": metadata["name"],
                    "namespace": metadata["namespace"],
                    "uid": metadata["uid"],
                },
            }
        )
        self._context.copy().run(kopf.event, reference, type=type_, reason=reason, message=message)


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_LABELS)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def child_changed(
    annotations: kopf.Annotations, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    # Async: it only queues a key (a lock held for microseconds), so it needs no executor thread.
    key = _owner_key(annotations, namespace)
    if key is not None:
        memo.refresh.request(key)
