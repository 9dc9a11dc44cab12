"""kopf handlers: each unpacks its arguments and calls one reconcile step (`disagg.operator.reconcile`).

The DisaggDeployment's spec handlers converge its children; events of its StatefulSets, Deployments and Pods
(watched with a server-side label selector) queue a recompute of its status (`RefreshQueue`), so `Available`
follows the workloads and `KVTransferReady` the sidecars' Pod conditions. No handler sleeps or swallows an
error: kopf retries an exception, and a refused spec raises `kopf.PermanentError` after its status says why.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes import client, config

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.builders import DEPLOYMENT_ANNOTATION, FIELD_MANAGER, MANAGED_BY_LABEL, Installation
from disagg.operator.k8s_apply import Kube
from disagg.operator.reconcile import RefreshQueue, reconcile, refresh_status

CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={FIELD_MANAGER}"


def _client() -> client.ApiClient:
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Routine logs stay logs; Events are posted explicitly with CamelCase reasons (and by kopf on failures).
    settings.posting.level = logging.WARNING
    for resource in (("v1", "pods"), ("apps", "v1", "statefulsets"), ("apps", "v1", "deployments")):
        settings.watching.label_selectors[resource] = CHILD_SELECTOR
    settings.execution.max_workers = 8
    webhook = getattr(memo, "webhook", None)
    if webhook is not None:
        settings.admission.server = webhook.server
        settings.admission.managed = webhook.managed
    kube = Kube(_client())
    installation = Installation.from_environ(os.environ)
    memo.kube = kube
    memo.installation = installation
    memo.refresh = RefreshQueue(lambda key: refresh_status(kube, *key, installation))


@kopf.on.cleanup()
def stop_refreshing(memo: kopf.Memo, **_: Any) -> None:
    memo.refresh.stop()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_spec(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    outcome = reconcile(memo.kube, body, memo.installation)
    if outcome.refused is not None:
        kopf.event(body, type="Warning", reason="SpecRefused", message=outcome.refused)
        raise kopf.PermanentError(outcome.refused)
    if outcome.deleted:
        kopf.event(body, type="Normal", reason="Pruned", message="Deleted " + ", ".join(outcome.deleted))
    kopf.event(body, type="Normal", reason="Applied", message="Applied " + ", ".join(outcome.applied))
    logger.info("Applied %d objects", len(outcome.applied))


@kopf.on.event("apps", "v1", "statefulsets", labels={MANAGED_BY_LABEL: FIELD_MANAGER})
@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: FIELD_MANAGER})
@kopf.on.event("v1", "pods", labels={MANAGED_BY_LABEL: FIELD_MANAGER})
def child_changed(annotations: kopf.Annotations, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    owner = annotations.get(DEPLOYMENT_ANNOTATION)
    if owner and namespace:
        memo.refresh.request((namespace, owner))
