"""A thin, typed wrapper over the NIXL Python API (UCX backend).

NIXL is not thread-safe: one thread owns a `NixlTransport` and makes every call on it; other threads hand
work to that thread. Errors from NIXL (which raises instead of returning "ERR") become `TransferFailed`, with
the NIXL error class name kept in the message, so callers never import NIXL's binding types.

Design choices, from measurements on this project's CPU machines (see the NIXL-on-CPU note):
- the progress thread is off by default: on a 2-core machine it competes with the polling thread and halves
  throughput; with it off, progress happens inside `state()` and `notifs()`.
- each physical allocation is registered once, by (address, length, memory type, device); descriptor lists are
  prepared once per peer and reused by index.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.worker.connector.ucx_log import UcxLog
from disagg.worker.contracts.ucx_lanes import put_lanes
from disagg.worker.kv.errors import KVTransportUnavailable, PeerUnreachable, TransferFailed

LOCAL_AGENT = "NIXL_INIT_AGENT"
MEM_TYPES = ("DRAM", "VRAM")

# Single-host runs (tests, benchmarks) keep UCX on loopback; without it UCX stripes TCP over every interface.
LOOPBACK_UCX_ENV: Mapping[str, str] = {"UCX_NET_DEVICES": "lo"}

# UCX's CMA transport copies in 512 KiB `process_vm_writev` calls by default and each call has a fixed cost:
# into the same huge-page pool, 512 KiB calls move 10.6 GB/s where 8 MiB calls move 12.1 (one call: 12.4).
# UCX ignores the key where it has no CMA transport; a caller's own `engine_config` replaces this one.
UCX_ENGINE_CONFIG = "CMA_SEG_SIZE=8m"


def _nixl_api() -> Any:
    # Imported lazily: `disagg` command modules and the operator must not load NIXL at import time.
    from nixl_cu12 import _api

    return _api


class XferState(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"


@dataclass(frozen=True)
class Registration:
    """One registered physical allocation."""

    addr: int
    length: int
    mem_type: str
    device_id: int


@dataclass
class PreppedList:
    """A descriptor list prepared once (local side or one remote agent) and addressed by index."""

    agent: str
    count: int
    handle: Any = field(repr=False)


@dataclass
class Xfer:
    """A posted transfer; poll it with `NixlTransport.state` and release it when done."""

    peer: str
    num_descs: int
    handle: Any = field(repr=False)


def descriptor_array(
    addrs: npt.ArrayLike, lengths: npt.ArrayLike, device_id: int = 0
) -> npt.NDArray[np.uint64]:
    """An Nx3 (addr, len, device) uint64 array, the form NIXL takes without pickling anything."""
    a = np.asarray(addrs, dtype=np.uint64).reshape(-1)
    n = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), a.shape)
    out = np.empty((a.size, 3), dtype=np.uint64)
    out[:, 0] = a
    out[:, 1] = n
    out[:, 2] = device_id
    return out


def merge_runs(
    local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Pairwise descriptors with every run that is contiguous on both sides merged into one descriptor.

    Row i of `local` pairs with row i of `remote` (equal lengths). A run continues while the next pair starts
    where the previous one ends on both sides, on the same devices. NIXL 1.5 also coalesces adjacent
    descriptors of a posted transfer (the bench's one-descriptor-per-block case runs at the merged speed), so
    this is not what reaches memcpy speed; it keeps each posted list as short as the block table allows, which
    saves building, passing and validating one index per block.
    """
    if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3:
        raise ValueError(
            f"descriptor arrays must be Nx3 of equal shape, got {local.shape} and {remote.shape}"
        )
    if not np.array_equal(local[:, 1], remote[:, 1]):
        raise ValueError("paired descriptors must have equal lengths")
    if len(local) < 2:
        return local, remote
    joins = (
        (local[:-1, 0] + local[:-1, 1] == local[1:, 0])
        & (remote[:-1, 0] + remote[:-1, 1] == remote[1:, 0])
        & (local[:-1, 2] == local[1:, 2])
        & (remote[:-1, 2] == remote[1:, 2])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(local[:, 1], starts)
    merged_local, merged_remote = local[starts].copy(), remote[starts].copy()
    merged_local[:, 1] = lengths
    merged_remote[:, 1] = lengths
    return merged_local, merged_remote


def _failed(what: str, exc: Exception) -> TransferFailed:
    return TransferFailed(f"{what}: {type(exc).__name__}: {exc}")


class NixlTransport:
    """One NIXL agent with the UCX backend. Owned by a single thread."""

    def __init__(
        self,
        agent_name: str,
        *,
        progress_thread: bool = False,
        ucx_params: Mapping[str, str] | None = None,
        ucx_log: UcxLog | None = None,
    ) -> None:
        api = _nixl_api()
        conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self.name = agent_name
        self._ucx_log = ucx_log
        self._agent = api.nixl_agent(agent_name, conf)
        try:
            self._agent.create_backend("UCX", {"engine_config": UCX_ENGINE_CONFIG, **(ucx_params or {})})
        except Exception as exc:
            problems = ucx_log.read_new().problems if ucx_log is not None else ()
            why = "; ".join(problems[:3]) or "UCX gave no reason in its log"
            raise KVTransportUnavailable(
                f"NIXL could not start its UCX backend ({type(exc).__name__}): {why}"
            ) from exc
        self._registrations: dict[Registration, Any] = {}
        self._peers: set[str] = set()
        self._lanes: dict[str, tuple[str, ...]] = {}
        if ucx_log is not None:
            ucx_log.read_new()

    # -- memory ---------------------------------------------------------------------------------------------

    def register(self, addr: int, length: int, mem_type: str = "DRAM", device_id: int = 0) -> Registration:
        """Register one physical allocation; registering the same range again is a no-op."""
        if mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        if length <= 0:
            raise ValueError(f"cannot register {length} bytes")
        reg = Registration(addr, length, mem_type, device_id)
        if reg not in self._registrations:
            for other in self._registrations:
                if (
                    other.mem_type == mem_type
                    and other.addr < addr + length
                    and addr < other.addr + other.length
                ):
                    raise ValueError(f"{reg} overlaps the registered allocation {other}")
            arr = descriptor_array([addr], [length], device_id)
            try:
                self._registrations[reg] = self._agent.register_memory(arr, mem_type)
            except Exception as exc:
                raise _failed(f"register {length} B at {addr:#x}", exc) from exc
        return reg

    def metadata(self) -> bytes:
        """The opaque agent blob (connection info and registrations) a peer passes to `add_peer`."""
        md: bytes = self._agent.get_agent_metadata()
        return md

    # -- peers ----------------------------------------------------------------------------------------------

    def add_peer(self, agent_metadata: bytes) -> str:
        """Load a remote agent. Callers validate everything they can *before* this call."""
        try:
            raw = self._agent.add_remote_agent(agent_metadata)
        except Exception as exc:
            raise PeerUnreachable(
                f"NIXL refused the remote agent metadata: {type(exc).__name__}: {exc}"
            ) from exc
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers.add(name)
        self._lanes[name] = self._new_peer_lanes()
        return name

    def _new_peer_lanes(self) -> tuple[str, ...]:
        """The put lanes UCX chose for the peer just loaded, from what it printed while loading it.

        UCX prints a configuration's tables once, when an endpoint first needs it; a peer whose endpoint
        reuses an earlier configuration prints nothing. Then the peer has that configuration's lanes if every
        configuration seen so far has the same ones, and is unknown (no lanes) if they differ."""
        if self._ucx_log is None:
            return ()
        printed = put_lanes(self._ucx_log.read_new().tables, self._worker)
        if printed:
            return tuple(dict.fromkeys(lane for lanes in printed.values() for lane in lanes))
        known = set(put_lanes(self._ucx_log.tables, self._worker).values())
        return known.pop() if len(known) == 1 else ()

    @property
    def _worker(self) -> str:
        # The UCX worker NIXL makes for an agent carries the agent's name.
        return self.name

    def lanes(self, peer: str) -> tuple[str, ...]:
        """The UCX lanes this agent's WRITEs to `peer` go over, as UCX printed them (empty if unknown)."""
        return self._lanes.get(peer, ())

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            self._lanes.pop(name, None)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                raise _failed(f"remove remote agent {name!r}", exc) from exc

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # -- descriptors and transfers --------------------------------------------------------------------------

    def prep(self, agent: str, descs: npt.NDArray[np.uint64], mem_type: str = "DRAM") -> PreppedList:
        """Prepare a descriptor list for `LOCAL_AGENT` or a loaded peer: Nx3 `(addr, len, dev)`, or Nx5
        `(addr, len, dev, stride, count)`, NIXL's strided form, where each row stands for `count`
        descriptors `stride` apart, addressed by index in order as if expanded (one row per region instead
        of one per block: a handshake's list is tens of rows, not hundreds of thousands)."""
        if descs.ndim != 2 or descs.shape[1] not in (3, 5) or descs.dtype != np.uint64:
            raise ValueError(
                f"descriptors must be an Nx3 or Nx5 uint64 array, got {descs.dtype}{descs.shape}"
            )
        if agent != LOCAL_AGENT and agent not in self._peers:
            raise ValueError(f"unknown peer {agent!r}")
        count = int(descs[:, 4].sum()) if descs.shape[1] == 5 else int(descs.shape[0])
        try:
            handle = self._agent.prep_xfer_dlist(agent, np.ascontiguousarray(descs), mem_type)
        except Exception as exc:
            raise _failed(f"prepare {count} descriptors for {agent!r}", exc) from exc
        return PreppedList(agent, count, handle)

    def release_prepped(self, prepped: PreppedList) -> None:
        try:
            self._agent.release_dlist_handle(prepped.handle)
        except Exception as exc:
            raise _failed(f"release descriptors prepared for {prepped.agent!r}", exc) from exc

    def write(
        self,
        local: PreppedList,
        local_ids: npt.NDArray[np.int64],
        remote: PreppedList,
        remote_ids: npt.NDArray[np.int64],
        notif: bytes = b"",
    ) -> Xfer:
        """Post a WRITE of local descriptors into remote ones, pairwise by index, with a notification."""
        if local.agent != LOCAL_AGENT:
            raise ValueError("the local side must be prepared for LOCAL_AGENT")
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local descriptors against {len(remote_ids)} remote ones")
        lids = np.ascontiguousarray(local_ids, dtype=np.int32)
        rids = np.ascontiguousarray(remote_ids, dtype=np.int32)
        try:
            handle = self._agent.make_prepped_xfer("WRITE", local.handle, lids, remote.handle, rids, notif)
        except Exception as exc:
            raise _failed(f"prepare WRITE of {len(lids)} descriptors to {remote.agent!r}", exc) from exc
        return self._post(Xfer(remote.agent, len(lids), handle))

    def write_descs(
        self,
        local: npt.NDArray[np.uint64],
        peer: str,
        remote: npt.NDArray[np.uint64],
        notif: bytes = b"",
        mem_type: str = "DRAM",
    ) -> Xfer:
        """Post a WRITE of explicit (e.g. merged) Nx3 descriptor lists, built here: nothing is unpickled."""
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}")
        try:
            local_list = self._agent.get_xfer_descs(np.ascontiguousarray(local), mem_type)
            remote_list = self._agent.get_xfer_descs(np.ascontiguousarray(remote), mem_type)
            handle = self._agent.initialize_xfer("WRITE", local_list, remote_list, peer, notif)
        except Exception as exc:
            raise _failed(f"prepare WRITE of {len(local)} descriptors to {peer!r}", exc) from exc
        return self._post(Xfer(peer, len(local), handle))

    def _post(self, xfer: Xfer) -> Xfer:
        """Start a prepared transfer; one that cannot start is released here, as no caller holds it yet."""
        try:
            self._agent.transfer(xfer.handle)
        except Exception as exc:
            self.release(xfer)
            raise _failed(f"post WRITE to {xfer.peer!r}", exc) from exc
        return xfer

    def state(self, xfer: Xfer) -> XferState:
        """DONE or PROC; a failed transfer raises TransferFailed (NIXL never returns "ERR" in practice)."""
        try:
            raw = self._agent.check_xfer_state(xfer.handle)
        except Exception as exc:
            raise _failed(f"WRITE to {xfer.peer!r}", exc) from exc
        if raw == "DONE":
            return XferState.DONE
        if raw == "PROC":
            return XferState.PROC
        raise TransferFailed(f"WRITE to {xfer.peer!r} ended in state {raw!r}")

    def release(self, xfer: Xfer) -> None:
        try:
            self._agent.release_xfer_handle(xfer.handle)
        except Exception as exc:
            raise _failed(f"release transfer to {xfer.peer!r}", exc) from exc

    # -- notifications --------------------------------------------------------------------------------------

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name; also drives progress when the progress thread is off."""
        got: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return got

    def send_notif(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise _failed(f"notify {peer!r}", exc) from exc

    def close(self) -> None:
        """Drop every peer and registration; the agent itself goes with the object."""
        for peer in list(self._peers):
            with contextlib.suppress(TransferFailed):
                self.remove_peer(peer)
        for reg_dlist in self._registrations.values():
            # Teardown of a possibly broken agent must not mask the caller's error.
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg_dlist)
        self._registrations.clear()
