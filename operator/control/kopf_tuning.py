"""Everything the operator changes in kopf (1.45.2, pinned in pyproject.toml), in one place.

kopf runs the operator's handlers; what this operator needs of it beyond the handlers' decorators is here:
its settings (`tune`, through `kopf.OperatorSettings`), its diff base and progress storage (subclasses of the
public `kopf.AnnotationsDiffBaseStorage` and `kopf.AnnotationsProgressStorage`), its retries (a
`settings.networking.error_backoffs` iterable), its per-object memories (`ChildrenForgotten`) and its Event
poster, reached from the operator's threads (`KopfEvents`).

Two of these lean on kopf's internals, which is why kopf is pinned to one release (a new one is taken by
running `tests/unit/test_memories.py`, `test_kopf_workers.py` and `test_specs.py` against it):
- `ChildrenForgotten` subclasses `kopf._core.reactor.inventory.ResourceMemories`: `kopf.run(memories=...)`
  takes an instance, but kopf exports no name for the class, and no public setting keeps a kind's memories
  only for the length of its event.
- `KopfEvents` posts through `kopf.event` (public) from threads kopf did not start: kopf finds its poster in
  the context variables of its handlers' tasks, and has no public way to post from elsewhere, so a handler's
  context is captured and run.

## The diff base

kopf's diff base (the "essence" it compares with `last-handled-configuration` on every event of a
DisaggDeployment), built and cleared without copying what it then throws away.

kopf's own `DiffBaseStorage.build` deep-copies the whole body, managedFields and status included, and then
deletes the metadata and status: a profile of `disagg bench operator` at 300 deployments found that copy at
about a seventh of the operator's busy samples, all of it on kopf's event loop, which every watch event of
every kind waits for. `LeanDiffBaseStorage` hands kopf's build only the parts it keeps or reads (the spec and
other top-level fields, the labels, annotations and owner references, and any metadata or status field a
handler names), so the essence, and which causes kopf sees, are the same. `LeanProgressStorage.clear` drops
kopf's progress annotations from an essence by copying the levels it edits, where kopf's deep-copies the
whole essence, spec included, twice per event (the old essence and the new): at 300 deployments those copies
were about two thirds of the deep copying left on the event loop.

## Retries

How long kopf retries a failed API request: until it succeeds. Pure.

kopf retries a request that fails with a connection error, a timeout, a 5xx, 403 or 429 on the delays of
`settings.networking.error_backoffs` (by default 8 retries, about 54 s) and then raises. Its watches swallow
an escalated connection error and start over, but not a 5xx: a kube-apiserver that comes back answering
503 "server is starting" for longer than the retries makes the CRD and Namespace watches that kopf's
resource and namespace observers run raise, those root tasks end, and kopf ends the operator when any root
task ends (the 70 s outage of issue 22). The same escalation ends each per-kind watcher's task, which kopf
never restarts, so the operator would live on blind to that kind. An operator must outlast outages of any
length and carry on once the server is back: `EndlessBackoffs` gives every request the same growing
delays, capped, forever. (Events are posted on kopf's own schedule and may still be given up on.)

## Memories

kopf's per-object memories, kept only for the objects whose handlers need them.

kopf keeps a `ResourceMemory` for every object of every watched kind until the object is deleted: a copy of
the memo, an error throttler, the indexing and daemon state, keyed by the object's uid (about 1 KiB with its
key). The operator watches some nine children per DisaggDeployment (its StatefulSets, Deployments and Pods),
and their handlers are an indexer and an event handler each: nothing in such a memory outlives the event.
kopf reads a memory's daemon state only for daemons and timers, its `noticed_by_listing` and
`fully_handled_once` only for change-detecting handlers, and its indexing state only to retry an indexer that
raised, where ours run again on every event anyway. So a child's memory is made for its event and dropped
after it, as kopf itself does for an admission request (`ephemeral`); a DisaggDeployment's, and any kind not
named here, is kept. From 100 to 400 deployments, settled, the operator's live blocks rose by 282 per
deployment with this and the kept-status fix of `Kube.patch_status`, and by 448 without them.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import kopf

# kopf exports no name for it; `kopf.run(memories=...)` takes an instance (see the module's doc).
from kopf._core.reactor.inventory import ResourceMemories, ResourceMemory

from disagg.operator.api import GROUP, KIND, VERSION
from disagg.operator.naming import FIELD_MANAGER, MANAGED_BY_LABEL

CHILD_SELECTOR: Final = f"{MANAGED_BY_LABEL}={FIELD_MANAGER}"
# kopf's executor runs only the startup and cleanup handlers and the admission webhook's validation.
KOPF_WORKERS = 2
LIST_PAGE = 500
WORKER_IDLE_S = 0.2


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
    # operator (the Retries above).
    settings.networking.error_backoffs = API_BACKOFFS
    # kopf lists a kind again whenever its watch must restart from scratch (410 Gone: the API server no
    # longer has the version it would resume from); paged, that holds one page of Pods, not thousands.
    settings.watching.chunk_size = LIST_PAGE


# The metadata kopf's build keeps (labels, annotations) or reads (ownerReferences, to name its key).
_METADATA_READ = ("labels", "annotations", "ownerReferences")


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        paths = [
            tuple(field.split(".")) if isinstance(field, str) else tuple(field)
            for field in extra_fields or ()
        ]
        metadata = body.get("metadata") or {}
        if any(path[:1] == ("metadata",) and len(path) == 1 for path in paths):
            kept_metadata = dict(metadata)
        else:
            named = {path[1] for path in paths if len(path) > 1 and path[0] == "metadata"}
            kept_metadata = {
                key: value for key, value in metadata.items() if key in {*_METADATA_READ, *named}
            }
        lean: dict[str, Any] = {
            key: value for key, value in body.items() if key not in ("metadata", "status")
        }
        lean["metadata"] = kept_metadata
        if "status" in body and any(path[:1] == ("status",) for path in paths):
            lean["status"] = body["status"]
        return super().build(body=kopf.Body(cast(kopf.RawBody, lean)), extra_fields=extra_fields)


class LeanProgressStorage(kopf.AnnotationsProgressStorage):
    def clear(self, *, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        # kopf's clear edits only the essence's top level, its metadata and its annotations (it drops keys
        # there): copies of those three levels leave the caller's essence as it was, and share the rest,
        # which kopf only reads (it diffs the essences and stores the new one as JSON).
        cleared = cast(dict[str, Any], dict(essence))
        metadata = cleared.get("metadata")
        if isinstance(metadata, dict):
            metadata = cleared["metadata"] = dict(metadata)
            if isinstance(metadata.get("annotations"), dict):
                metadata["annotations"] = dict(metadata["annotations"])
        annotations = (metadata or {}).get("annotations") or {}
        mine = {key for key in annotations if self.prefix and key.startswith(f"{self.prefix}/")}
        lean = cast(kopf.BodyEssence, cleared)
        self.remove_annotations(lean, mine)
        self.remove_empty_stanzas(lean)
        return lean


@dataclass(frozen=True)
class EndlessBackoffs:
    """The delays (seconds) before each retry: `first`, then `then` forever.

    An iterable, not an iterator: kopf iterates it afresh for every request, so each request starts from
    `first`; it has no length, so kopf counts attempts without a total ("attempt #12") and never escalates.
    """

    first: Sequence[float]
    then: float

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(self.first, itertools.repeat(self.then))


# kopf's own schedule, then its last delay for as long as the outage lasts.
API_BACKOFFS: Final = EndlessBackoffs(first=(1, 1, 2, 3, 5, 8, 13), then=21)


# kopf exports no name for it; `kopf.run(memories=...)` takes an instance.

# (apiVersion, kind) of the children: watched for indexers and event handlers only (`handlers`).
TRANSIENT = frozenset({("v1", "Pod"), ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment")})


class ChildrenForgotten(ResourceMemories):
    """kopf's memories, less those of the kinds in `TRANSIENT` (see the module's doc)."""

    async def recall(self, raw_body: Mapping[str, Any], **kwargs: Any) -> ResourceMemory:
        if (raw_body.get("apiVersion"), raw_body.get("kind")) in TRANSIENT:
            kwargs["ephemeral"] = True
        return await super().recall(raw_body, **kwargs)  # type: ignore[arg-type]


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
