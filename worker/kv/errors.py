"""Typed errors shared by the worker and the operator.

Every refusal carries a CamelCase `reason` that is stable across the code base: the worker raises it at
startup or handshake, the sidecar writes it into its Pod condition, and the operator uses the same reasons
for pre-flight checks and the aggregated `KVTransferReady` condition. The message says what is wrong and,
where it can, what to change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken compatibility rule: a CamelCase reason and a message a person can act on."""

    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class DisaggError(Exception):
    """Base of every refusal with a reason."""

    reason: str = "Error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.message = message

    @property
    def violation(self) -> Violation:
        return Violation(self.reason, self.message)


class CompatibilityError(DisaggError):
    """A topology that cannot work (startup gate or pre-flight rule)."""

    reason = "Incompatible"


class HandshakeError(DisaggError):
    """A peer refused at handshake, before any NIXL agent for it is added."""

    reason = "HandshakeFailed"


class WireFormatError(HandshakeError):
    """Bytes that are not a valid payload of the expected connector version."""

    reason = "ConnectorVersionMismatch"


class CompatibilityHashMismatch(HandshakeError):
    reason = "CompatibilityHashMismatch"

    def __init__(self, message: str, *, reason: str | None = None, differences: tuple[str, ...] = ()) -> None:
        super().__init__(message, reason=reason)
        self.differences = differences
        """What the payloads show of the difference (`payload_facts.live_differences`), where known."""


class EngineIdMismatch(HandshakeError):
    reason = "EngineIdMismatch"


class MissingLayers(HandshakeError):
    """A local transfer layer the remote does not advertise (or advertises twice, or no layers at all)."""

    reason = "MissingLayers"


class BlockSizeMismatch(HandshakeError):
    reason = "BlockSizeMismatch"


class KernelBlockSizeMismatch(HandshakeError):
    """The peer's (kernel block size, kernel blocks per logical block) is not this worker's: push moves whole
    kernel blocks, block id for block id (vLLM 0.34 refuses it too)."""

    reason = "KernelBlockSizeMismatch"


class RegionGeometryMismatch(HandshakeError):
    """Per-region lists of different lengths, block lengths or strides that cannot pair."""

    reason = "RegionGeometryMismatch"


class KVCacheLayoutMismatch(HandshakeError):
    """The peer orders a block's heads and tokens otherwise (HND against NHD); disagg does not permute."""

    reason = "KVCacheLayoutMismatch"


class PackedRowsNotSupported(RegionGeometryMismatch):
    """The peer describes block-outermost (packed) rows, one region per row of every layer's page."""

    reason = "PackedRowsNotSupported"


class PeerUnreachable(HandshakeError):
    reason = "PeerUnreachable"


class TransferFailed(DisaggError):
    reason = "TransferFailed"


class KVTransportUnavailable(DisaggError):
    """UCX cannot make the transport `spec.kvTransfer.transport` demands (its own reason in the message)."""

    reason = "KVTransportUnavailable"


class RegistrationTimeout(TransferFailed):
    """A decoder's push registration that no prefill worker completed before the watchdog fired."""

    reason = "RegistrationTimeout"


class LayoutError(DisaggError):
    """A model geometry, partition or KV layout that cannot be built (a local configuration error)."""

    reason = "InvalidKVLayout"


class BlockIdOutOfRange(TransferFailed):
    """A block id that does not fit the capacity of the region it would be written to or read from."""

    reason = "BlockIdOutOfRange"


class WorkerConfigError(DisaggError):
    """A sidecar configuration (environment, topology file) that is missing, malformed or contradictory."""

    reason = "InvalidWorkerConfig"


class EngineLayoutMismatch(CompatibilityError):
    """The layout an engine registers contradicts the sidecar's configuration (names the first difference)."""

    reason = "EngineLayoutMismatch"


class EngineProtocolError(DisaggError):
    """A local-socket message the sidecar cannot act on (malformed, out of order, wrong role)."""

    reason = "InvalidEngineMessage"


class UnknownRequest(EngineProtocolError):
    reason = "UnknownRequest"


class DuplicateRequest(EngineProtocolError):
    reason = "DuplicateRequest"


class LayoutNotRegistered(EngineProtocolError):
    reason = "LayoutNotRegistered"


class WrongRole(EngineProtocolError):
    """A prefill call sent to a decode sidecar, or the other way round."""

    reason = "WrongRole"


class KVPoolUnavailable(EngineProtocolError):
    """The engine's KV pool cannot be mapped (missing file, wrong size)."""

    reason = "KVPoolUnavailable"


class LeaseExpired(TransferFailed):
    """A finished request's blocks were released because no decoder took them before the lease ran out."""

    reason = "LeaseExpired"


class InvalidRegistration(HandshakeError):
    """A decoder's `PUSH_REG` whose sizes (TP, block ids, list and string lengths) this worker cannot serve,
    or one over the registration caps; `request_id` names the decoder's request when it could be read."""

    reason = "InvalidRegistration"

    def __init__(self, message: str, *, reason: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.request_id = request_id


class UnsupportedPeerTopology(CompatibilityError):
    """A peer engine's parallel layout (TP, PP) this worker cannot pair with: out of bounds, or TP sizes
    that do not divide one another."""

    reason = "UnsupportedPeerTopology"


class InternalError(DisaggError):
    """An unexpected exception while handling one message or request: that one fails, the process serves
    on."""

    reason = "InternalError"
