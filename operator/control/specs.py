"""The spec reconciles: queued by key by the DisaggDeployment's spec handler, run by the operator's threads.

kopf ran each spec handler on its executor with the state it built for the call (the event's body, the diff,
the cause, a logger): a burst of creates left hundreds of those waiting for the executor's four threads at
once, each holding its deployment's whole event, and that burst's high-water mark was most of the operator's
RSS growth past its first hundred deployments. The spec handler only queues the deployment's key
(`SpecReconciles.request`, on kopf's loop, microseconds) and returns; a `WorkQueue` runs one reconcile per
key, never two at a time, and reads the deployment from the operator's store when it starts, so the newest
spec is what it applies (level-based, as controller-runtime's reconcilers are), and what waits is a key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from disagg.operator.control.k8s_apply import Kube
from disagg.operator.control.reconcile import Observed, Outcome, reconcile
from disagg.operator.naming import Installation
from disagg.operator.runtime.work_queue import Key, WorkQueue

_LOG = logging.getLogger("disagg.operator.reconcile")
Reconcile = Callable[[Mapping[str, Any], bool], Outcome]
# `post(deployment, type, reason, message)`: an Event on the deployment.
Post = Callable[[Mapping[str, Any], str, str, str], None]


class SpecReconciles:
    """`request(key)` reconciles the deployment `key` in one of `workers` threads (`WorkQueue`), inside
    `hold(key)`, so that no status refresh nor clock step of the deployment runs meanwhile, and posts the
    Events of what it changed. A deployment gone, or being deleted, is not reconciled. A failed reconcile is
    logged, posted as a Warning Event and retried (`WorkQueue`); a refused spec is not retried: its status
    and an Event say why, and its next spec is requested by its spec handler."""

    def __init__(
        self,
        reconcile: Reconcile,
        deployment: Callable[[str, str], Mapping[str, Any] | None],
        hold: Callable[[Key], contextlib.AbstractContextManager[object]],
        post: Post,
        *,
        workers: int,
    ) -> None:
        self._reconcile = reconcile
        self._deployment = deployment
        self._hold = hold
        self._post = post
        self._lock = threading.Lock()
        # The uid of each queued deployment whose spec handler was kopf's create handler (see `request`).
        self._created: dict[Key, str] = {}
        self._queue = WorkQueue(self._run, what="Reconcile", logger=_LOG, workers=workers)

    def request(self, key: Key, *, created_uid: str | None = None) -> None:
        """Queue a reconcile of `key`. `created_uid`: the deployment of this uid was just created (kopf's
        create handler, first try), so it may own no child yet (`reconcile`'s `created`)."""
        if created_uid is not None:
            with self._lock:
                self._created[key] = created_uid
        self._queue.request(key)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.stop(timeout)

    def _run(self, key: Key) -> None:
        with self._hold(key):
            body = self._deployment(*key)
            with self._lock:
                created_uid = self._created.pop(key, None)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            created = created_uid is not None and created_uid == body["metadata"].get("uid")
            try:
                outcome = self._reconcile(body, created)
            except Exception as error:
                self._post(body, "Warning", "ReconcileFailed", f"{type(error).__name__}: {error}; retrying")
                raise
        for type_, reason, message in outcome.news():
            self._post(body, type_, reason, message)
        if outcome.refused is not None:
            _LOG.warning("%s/%s: spec refused: %s", *key, outcome.refused)
        else:
            _LOG.info("%s/%s: %d children changed", *key, len(outcome.changed))


def spec_reconciles(
    kube: Kube,
    installation: Installation,
    observed: Observed,
    hold: Callable[[Key], contextlib.AbstractContextManager[object]],
    post: Post,
    *,
    workers: int,
) -> SpecReconciles:
    """The operator's: `reconcile` with its API client, installation and indices."""
    return SpecReconciles(
        lambda body, created: reconcile(kube, body, installation, observed, created=created),
        observed.deployment,
        hold,
        post,
        workers=workers,
    )
