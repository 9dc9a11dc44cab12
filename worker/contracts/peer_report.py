"""The peer report: what one engine pod's sidecar found in its latest round of peer checks. Pure.

Every engine pod's sidecar (transfer and watch modes) writes it on its own Pod as the annotation
`disagg.io/kv-peers` (`pod_contract.PEER_REPORT_ANNOTATION`): its own engine's live engine id and
compatibility hash, and one verdict per peer pod it handshook. Routers and the operator read it to pair
prefill engines with decode pods (`pairing.routing_from_pods`), so both sides of a pair must have vouched for
each other before a request is sent to them.

An annotation is untrusted input: anyone who may patch the Pod can write anything there. So a report is
decoded only below a size bound (checked before any parsing), with a bounded number of peers and bounded,
typed fields; anything else is a `PeerReportError`, never another exception. Unknown fields are ignored, so
a newer sidecar may add some; a change that would make an older reader misread the report bumps `version`,
which an older reader refuses.

A draining pod's report (`pod_contract.DRAINING_ANNOTATION`) also says how many requests its engine has in
flight and when the sidecar measured that (`InFlight`): the operator ends a drain once every drained pod
reports 0 after its mark (`operator.rollout.drain_progress`). Other pods' reports leave it out, so a busy
pod's count does not turn every round into an annotation write.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Final

import msgspec

from disagg.worker.kv.errors import DisaggError

PEER_REPORT_VERSION: Final = 1
# A prefill stage reports on every decode pod of its deployment; a verdict is some 250 bytes. Kubernetes
# allows 256 KiB for all of a Pod's annotations together.
MAX_PEERS: Final = 512
MAX_PEER_REPORT_BYTES: Final = 160 * 1024
# A pod name is a DNS subdomain (253); an engine id is a name plus a per-start suffix.
MAX_NAME_CHARS: Final = 253
MAX_ENGINE_ID_CHARS: Final = 320
MAX_HASH_CHARS: Final = 128
MAX_REASON_CHARS: Final = 128
# What a refusal found different, for the router's and the status's exclusion messages: its start.
MAX_DIFFERS_CHARS: Final = 160
REASON_PATTERN: Final = "^[A-Z][A-Za-z0-9]*$"
MAX_IN_FLIGHT: Final = 1_000_000
OK_REASON: Final = "HandshakesSucceeded"
MAX_TRANSPORT_CHARS: Final = 64
MAX_LANES_CHARS: Final = 96

PodName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
EngineId = Annotated[str, msgspec.Meta(max_length=MAX_ENGINE_ID_CHARS)]
KVHash = Annotated[str, msgspec.Meta(max_length=MAX_HASH_CHARS)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS, pattern=REASON_PATTERN)]


class PeerReportError(DisaggError, ValueError):
    """A `disagg.io/kv-peers` value that is not a peer report this version can read."""

    reason = "InvalidPeerReport"


class PeerVerdict(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """This pod's sidecar's verdict on one peer pod from its latest handshake with it."""

    pod: PodName
    engine_id: EngineId
    """The peer's live engine id as its side channel answered ("" if it did not)."""
    ok: bool
    """The handshake succeeded and the connector's checks accepted the peer."""
    reason: Reason
    """`HandshakesSucceeded` when ok, else the refusal's reason (e.g. `CompatibilityHashMismatch`)."""
    kv_hash: KVHash
    """The compatibility hash the peer advertised ("" if unknown)."""
    differs: Annotated[str, msgspec.Meta(max_length=MAX_DIFFERS_CHARS)] = ""
    """For a hash refusal: what the payloads show of the difference (its start), "" if unknown. Readers of
    reports written before it read ""."""
    transport: Annotated[str, msgspec.Meta(max_length=MAX_TRANSPORT_CHARS)] = ""
    """A prefill pod's word on the pair's KV: the family of the lanes UCX chose for its WRITEs to the peer
    (`shm`, `rdma`, `tcp`, `cuda_ipc`, or several joined by `+`; `contracts.ucx_lanes`), "" until known."""
    lanes: Annotated[str, msgspec.Meta(max_length=MAX_LANES_CHARS)] = ""
    """Those lanes as UCX printed them, comma-separated (`cma/memory`, `rc_mlx5/mlx5_0:1`)."""
    kv_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Bytes of KV this pod's worker wrote to the peer's engine (the canary's and clients' requests)."""
    gbps: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0
    """Those bytes over the WRITEs' seconds, in GB/s."""


class InFlight(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The requests this pod's engine had in flight (running or waiting, by the engine's own scheduler
    gauges; a PP engine's head answers for its stages) when the sidecar measured them, by its clock."""

    requests: Annotated[int, msgspec.Meta(ge=0, le=MAX_IN_FLIGHT)]
    at: Annotated[datetime, msgspec.Meta(tz=True)]


class PeerReport(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One engine pod's latest peer checks; `version` is `PEER_REPORT_VERSION`."""

    version: int
    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENGINE_ID_CHARS)]
    """This pod's engine's full live id (for vLLM: the stable prefix plus the per-start suffix)."""
    kv_hash: KVHash
    """The compatibility hash this pod's engine advertises ("" if it advertises none)."""
    peers: Annotated[tuple[PeerVerdict, ...], msgspec.Meta(max_length=MAX_PEERS)] = ()
    in_flight: InFlight | msgspec.UnsetType = msgspec.UNSET
    """Only while the pod is draining (see the module docstring); unset otherwise, and then not written."""

    def verdict(self, pod: str) -> PeerVerdict | None:
        return next((verdict for verdict in self.peers if verdict.pod == pod), None)


_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder(PeerReport)


def _checked(report: PeerReport) -> PeerReport:
    if report.version != PEER_REPORT_VERSION:
        raise PeerReportError(
            f"peer report version {report.version} is not {PEER_REPORT_VERSION}, the one this reader knows"
        )
    pods = [verdict.pod for verdict in report.peers]
    if len(set(pods)) != len(pods):
        raise PeerReportError("peer report names a peer pod more than once")
    return report


def encode_peer_report(report: PeerReport) -> str:
    """The annotation's value. Raises `PeerReportError` for a report `decode_peer_report` would refuse, so
    a writer never writes what its readers cannot read."""
    text = _ENCODER.encode(report).decode()
    decode_peer_report(text)
    return text


def decode_peer_report(text: str) -> PeerReport:
    """Parse an annotation's value; `PeerReportError` for anything but a valid report within the bounds."""
    if not isinstance(text, str):
        raise PeerReportError(f"peer report is a {type(text).__name__}, not a string")
    # Checked before encoding or parsing: a character is at most 4 bytes.
    if len(text) > MAX_PEER_REPORT_BYTES:
        raise PeerReportError(f"peer report of {len(text)} characters exceeds {MAX_PEER_REPORT_BYTES} bytes")
    data = text.encode("utf-8", errors="replace")
    if len(data) > MAX_PEER_REPORT_BYTES:
        raise PeerReportError(f"peer report of {len(data)} bytes exceeds {MAX_PEER_REPORT_BYTES} bytes")
    try:
        report = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerReportError(f"not a peer report: {_clip(str(exc))}") from None
    except RecursionError:
        raise PeerReportError("not a peer report: nested too deeply") from None
    return _checked(report)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
