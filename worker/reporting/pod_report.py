"""The sidecar's Kubernetes reporter: its own Pod's `disagg.io/kv-transfer-ready` condition, its peer report
(the `disagg.io/kv-peers` annotation), and Events.

The operator's builders declare a readiness gate on that condition type; the sidecar owns the condition and
writes it with a strategic-merge patch on `pods/status` (merged by `type`, so the kubelet's own conditions are
left alone; a JSON merge patch would replace the whole list). It writes only when status, reason or message
change, and `lastTransitionTime` moves only when the status flips (apimachinery's SetStatusCondition rule).

Every refusal by a peer is posted as a Warning Event on the Pod with the refusal's CamelCase reason. Repeats
are one Event whose `count` grows (as the kubelet's probe events do): its name is derived from the reason and
message, so even a restarted sidecar finds and bumps the Event it posted before.

The round's peer report (`peer_report.PeerReport`: this engine's live id and hash, a verdict per peer) is
written as the annotation in the same `pods/status` patch, only when its text changed, so routers and the
operator, which pair pods by it (`pairing`), see a write only when a verdict, a hash or an engine id changes.
While the Pod is draining (`disagg.io/draining`, the operator's mark), each round's report also carries the
engine's requests in flight and when they were measured (`peer_report.InFlight`, read by the `in_flight`
probe the reporter is given): the operator ends the drain once a report made after the mark says 0.

The pure parts (`condition_patch`, `annotation_patch`, `event_name`, `event_body`) are separate from the
client calls.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import msgspec
from kubernetes import client, config

from disagg.worker.contracts.peer_report import InFlight, PeerReport, PeerReportError, encode_peer_report
from disagg.worker.contracts.pod_contract import DRAINING_ANNOTATION, PEER_REPORT_ANNOTATION, POD_CONDITION
from disagg.worker.reporting.peer_check import Outcome, refusal_message

COMPONENT: Final = "disagg-kv-worker"
FIELD_MANAGER: Final = "disagg-kv-worker"

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]
InFlightProbe = Callable[[], int | None]
"""The engine's requests in flight now, or None when it cannot tell."""


def rfc3339(moment: datetime) -> str:
    """metav1.Time's form: seconds precision, UTC, `Z`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == POD_CONDITION), None)


def condition_patch(
    conditions: Sequence[Mapping[str, Any]] | None, outcome: Outcome, now: datetime
) -> dict[str, Any] | None:
    """The strategic-merge patch of `pods/status` that records `outcome`, or None when it is already there."""
    previous = find_condition(conditions)
    if previous is not None and (
        previous.get("status"),
        previous.get("reason"),
        previous.get("message"),
    ) == (outcome.status, outcome.reason, outcome.message):
        return None
    since = rfc3339(now)
    if previous is not None and previous.get("status") == outcome.status:
        since = previous.get("lastTransitionTime") or since
    condition = {
        "type": POD_CONDITION,
        "status": outcome.status,
        "reason": outcome.reason,
        "message": outcome.message,
        "lastTransitionTime": since,
    }
    return {"status": {"conditions": [condition]}}


def annotation_patch(
    annotations: Mapping[str, str] | None, report: PeerReport | None
) -> dict[str, Any] | None:
    """The patch that writes `report` as the Pod's `disagg.io/kv-peers` annotation, or None when it is already
    there (or there is no report this round, or it cannot be encoded)."""
    if report is None:
        return None
    try:
        text = encode_peer_report(report)
    except PeerReportError as exc:
        log.warning("the peer report is not written: %s", exc.message)
        return None
    if (annotations or {}).get(PEER_REPORT_ANNOTATION) == text:
        return None
    return {"metadata": {"annotations": {PEER_REPORT_ANNOTATION: text}}}


def with_in_flight(
    report: PeerReport | None,
    annotations: Mapping[str, str] | None,
    probe: InFlightProbe | None,
    clock: Clock,
) -> PeerReport | None:
    """`report` with the engine's requests in flight when the Pod is draining and `probe` can tell; else
    `report` as it is. Stamped before the probe runs: whatever was in flight at the stamp is counted."""
    if report is None or probe is None or DRAINING_ANNOTATION not in (annotations or {}):
        return report
    at = clock()
    requests = probe()
    if requests is None:
        return report
    return msgspec.structs.replace(report, in_flight=InFlight(requests=requests, at=at))


def event_name(pod: str, reason: str, message: str) -> str:
    """`<pod>.<digest of reason and message>`: equal refusals share one Event (and its count)."""
    digest = hashlib.sha256(f"{reason}\n{message}".encode()).hexdigest()[:16]
    return f"{pod}.{digest}"


def event_body(
    pod: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """A core/v1 Event about `pod` (its metadata: name, namespace, uid), first seen `now`."""
    metadata = pod["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(metadata["name"], reason, message),
            "namespace": metadata["namespace"],
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid"),
        },
        "type": event_type,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": metadata["name"],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def kube_client() -> client.ApiClient:
    """In a pod, the service account; elsewhere (tests, the demo), `KUBECONFIG`."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def _json(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body


class PodReporter:
    """Writes one Pod's KV condition and Events; lists the pods of its deployment for the peer check."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        pod: str,
        *,
        clock: Clock = lambda: datetime.now(UTC),
        in_flight: InFlightProbe | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.pod = pod
        self._clock = clock
        self._in_flight = in_flight
        self._counts: dict[str, int] = {}

    def list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        """Pods as camelCase dicts (the form `peer_check` reads)."""
        response = self.core.list_namespaced_pod(
            self.namespace, label_selector=label_selector, _preload_content=False
        )
        items: list[dict[str, Any]] = _json(response).get("items") or []
        return items

    def read_pod(self) -> dict[str, Any]:
        return _json(self.core.read_namespaced_pod_status(self.pod, self.namespace, _preload_content=False))

    def report(self, outcome: Outcome) -> bool:
        """Record `outcome` on the Pod (its condition, and its peer report as the annotation) and post its
        refusals (and a recovery) as Events; True if it wrote to the Pod."""
        now = self._clock()
        pod = self.read_pod()
        previous = find_condition((pod.get("status") or {}).get("conditions"))
        patch = condition_patch((pod.get("status") or {}).get("conditions"), outcome, now)
        annotations = (pod.get("metadata") or {}).get("annotations")
        report = with_in_flight(outcome.report, annotations, self._in_flight, self._clock)
        annotation = annotation_patch(annotations, report)
        if patch is not None or annotation is not None:
            # One write through pods/status, which keeps metadata changes (the API server's pod status
            # strategy resets only the spec, deletion timestamp and owner references): the worker's Role
            # needs no write on the Pod itself.
            self.core.patch_namespaced_pod_status(
                self.pod, self.namespace, {**(patch or {}), **(annotation or {})}, field_manager=FIELD_MANAGER
            )
        if patch is not None:
            log.info(
                "%s: %s=%s (%s) %s", self.pod, POD_CONDITION, outcome.status, outcome.reason, outcome.message
            )
        if annotation is not None and report is not None:
            vouched = sum(verdict.ok for verdict in report.peers)
            log.info(
                "%s: %s: engine %s vouches for %d of %d peers%s",
                self.pod,
                PEER_REPORT_ANNOTATION,
                report.engine_id,
                vouched,
                len(report.peers),
                f", {report.in_flight.requests} requests in flight (draining)"
                if isinstance(report.in_flight, InFlight)
                else "",
            )
        for refusal in outcome.refusals:
            assert refusal.error is not None
            self.post_event(pod, "Warning", refusal.error.reason, refusal_message(refusal), now)
        for reason, message in outcome.warnings:
            self.post_event(pod, "Warning", reason, message, now)
        recovered = previous is not None and previous.get("status") == "False" and outcome.status == "True"
        if recovered:
            self.post_event(pod, "Normal", outcome.reason, outcome.message, now)
        return patch is not None or annotation is not None

    def post_event(
        self, pod: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime
    ) -> int:
        """Create the Event, or bump its count if it exists; returns the count it now has."""
        body = event_body(pod, event_type, reason, message, now)
        name = body["metadata"]["name"]
        known = self._counts.get(name)
        if known is None:
            try:
                self.core.create_namespaced_event(self.namespace, client.CoreV1Event.model_validate(body))
                self._counts[name] = 1
                return 1
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            existing = _json(self.core.read_namespaced_event(name, self.namespace, _preload_content=False))
            known = int(existing.get("count") or 1)
        count = known + 1
        try:
            self.core.patch_namespaced_event(
                name, self.namespace, {"count": count, "lastTimestamp": rfc3339(now)}
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            # The Event expired (the API server's event TTL) since we last saw it: start a new series.
            self._counts.pop(name, None)
            return self.post_event(pod, event_type, reason, message, now)
        self._counts[name] = count
        return count
