"""Spawning connector worker processes for the NIXL tests, and what parent and child share.

Each worker runs `_peer.py` in its own OS process with its own NIXL agent and a KV pool in a /dev/shm file.
The parent drives it with JSON lines on stdin and reads JSON-line events from its stdout; it reads the pools
directly (same files) to check bytes. Every process has a deadline and is killed in teardown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from disagg.rig.local import LOOPBACK_UCX_ENV as UCX_ENV
from disagg.worker.kv.layout import AttentionKind, ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.link.kv_pool import ShmPool

PEER_SCRIPT = Path(__file__).with_name("_peer.py")
EVENT_TIMEOUT_S = 120.0
HOST = "127.0.0.1"


def model_of(spec: dict[str, Any]) -> ModelGeometry:
    m = spec["model"]
    return ModelGeometry.with_full_every(
        m["num_layers"],
        m["period"],
        other=AttentionKind(m.get("other", "sliding_window")),
        num_kv_heads=m["num_kv_heads"],
        head_size=m["head_size"],
        dtype_bytes=m["dtype_bytes"],
        hma=m["hma"],
    )


def layout_of(spec: dict[str, Any]) -> StageLayout:
    """The worker's layout; `capacities` (per region, kernel blocks) reshapes it into one allocation."""
    layout = build_stage_layout(
        model_of(spec),
        pp_rank=spec["pp_rank"],
        pp_size=spec["pp_size"],
        tp_size=spec["tp_size"],
        block_size=spec["block_size"],
        num_blocks=spec["num_blocks"],
    )
    caps = spec.get("capacities")
    if caps is None:
        return layout
    if len(caps) != len(layout.regions):
        raise ValueError(f"{len(caps)} capacities for {len(layout.regions)} regions")
    regions, offset = [], 0
    for region, cap in zip(layout.regions, caps, strict=True):
        regions.append(dataclasses.replace(region, offset=offset, num_blocks=cap))
        offset += cap * region.block_stride
    return dataclasses.replace(layout, regions=tuple(regions), total_bytes=offset)


def initial_pool(spec: dict[str, Any], nbytes: int) -> np.ndarray:
    return np.random.default_rng(spec["seed"]).integers(0, 256, size=nbytes, dtype=np.uint8)


def read_pool(spec: dict[str, Any]) -> np.ndarray:
    pool = ShmPool(spec["pool_path"])
    try:
        return pool.array.copy()
    finally:
        pool.close()


class Peer:
    """One worker process; `events` are its JSON-line outputs in order."""

    def __init__(self, spec: dict[str, Any], log_dir: Path) -> None:
        self.spec = spec
        self.name = f"{spec['engine_id']}-pp{spec['pp_rank']}-tp{spec['tp_rank']}"
        env = {**os.environ, **UCX_ENV, "PYTHONSAFEPATH": "1"}
        self._stderr = open(log_dir / f"{self.name}.stderr", "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._events.put(json.loads(line))
        self._events.put({"event": "exited"})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def wait(self, event: str, req: str | None = None, timeout: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next event of this kind (and request); fails with the process's stderr tail if none comes."""
        for seen in self.seen:
            if seen["event"] == event and (req is None or seen.get("req") == req):
                self.seen.remove(seen)
                return seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = self._events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if got["event"] == event and (req is None or got.get("req") == req):
                return got
            if got["event"] == "exited":
                break
            self.seen.append(got)
        raise AssertionError(
            f"{self.name}: no {event!r} for {req!r}; seen {self.seen}; stderr:\n{self.stderr()}"
        )

    def stderr(self) -> str:
        self._stderr.flush()
        text = (Path(self._stderr.name)).read_text(errors="replace")
        return text[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._stderr.close()


class Cluster:
    """Every worker a test started; all are killed and their pools removed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.peers: list[Peer] = []

    def spec(self, engine_id: str, *, role: str, serve_port: int, **fields: Any) -> dict[str, Any]:
        pp_rank, tp_rank = fields.get("pp_rank", 0), fields.get("tp_rank", 0)
        spec: dict[str, Any] = {
            "engine_id": engine_id,
            "role": role,
            "pp_rank": pp_rank,
            "pp_size": 1,
            "tp_rank": tp_rank,
            "tp_size": 1,
            "block_size": 16,
            "num_blocks": 64,
            "seed": zlib.crc32(f"{engine_id}/{pp_rank}/{tp_rank}".encode()),
            "host": HOST,
            "port": serve_port,
            "payload_dir": str(self.tmp / f"payloads-{engine_id}"),
            "pool_path": f"/dev/shm/disagg-test-{os.getpid()}-{engine_id}-pp{pp_rank}-tp{tp_rank}",
            "compat_hash": "0" * 64,
            "lease_s": 60.0,
            "registration_timeout_s": 120.0,
        }
        spec.update(fields)
        spec["serve"] = spec["pp_rank"] == 0 and spec["tp_rank"] == 0
        spec["serve_ranks"] = [[p, t] for p in range(spec["pp_size"]) for t in range(spec["tp_size"])]
        return spec

    def start(self, spec: dict[str, Any]) -> Peer:
        Path(spec["payload_dir"]).mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spec["pool_path"])
        peer = Peer(spec, self.tmp)
        self.peers.append(peer)
        return peer

    def start_all(self, specs: list[dict[str, Any]]) -> list[Peer]:
        peers = [self.start(spec) for spec in specs]
        for peer in peers:
            peer.wait("ready")
        return peers

    def close(self) -> None:
        for peer in self.peers:
            peer.kill()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(peer.spec["pool_path"])


@contextlib.contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.close()


def _heads(spec: dict[str, Any]) -> range:
    """The KV heads a worker's TP rank holds: its share, or one replicated head above the head count."""
    total, tp = spec["model"]["num_kv_heads"], spec["tp_size"]
    first = spec["tp_rank"] * total // tp
    return range(first, first + max(1, total // tp))


def written_bytes(
    producer: dict[str, Any], decoder: dict[str, Any], p_blocks: list[list[int]], d_blocks: list[list[int]]
) -> list[tuple[int, int, int]]:
    """(decoder offset, producer offset, length) of every byte range a push must copy, per layer and block.

    Independent of the connector's routing: it walks layer names through both layouts, and heads through
    both ranks (heads are outermost in a block, so the heads two ranks share are one run on each side).
    """
    p_layout, d_layout = layout_of(producer), layout_of(decoder)
    p_region = {name: r for r, reg in enumerate(p_layout.regions) for name in reg.members}
    d_region = {name: r for r, reg in enumerate(d_layout.regions) for name in reg.members}
    p_heads, d_heads = _heads(producer), _heads(decoder)
    shared = range(max(p_heads.start, d_heads.start), min(p_heads.stop, d_heads.stop))
    out: list[tuple[int, int, int]] = []
    for name, g in p_layout.group_index_by_layer.items():
        pr, dr = p_layout.regions[p_region[name]], d_layout.regions[d_region[name]]
        if pr.replicated:
            # A replicated (MLA) block is the same bytes on every TP rank: written whole, never head-sliced.
            assert dr.block_len == pr.block_len
            p_start, d_start, length = 0, 0, pr.block_len
        else:
            head_bytes = pr.block_len // len(p_heads)
            assert dr.block_len == head_bytes * len(d_heads)
            if not shared:
                continue  # this prefill rank holds none of the decode rank's heads: it writes nothing there
            p_start = (shared.start - p_heads.start) * head_bytes
            d_start = (shared.start - d_heads.start) * head_bytes
            length = len(shared) * head_bytes
        for pb, db in zip(p_blocks[g], d_blocks[g], strict=True):
            out.append(
                (
                    dr.offset + db * dr.block_stride + d_start,
                    pr.offset + pb * pr.block_stride + p_start,
                    length,
                )
            )
    return out


def check_push(
    decoder: dict[str, Any],
    decoder_pool: np.ndarray,
    pushes: list[tuple[dict[str, Any], list[list[int]], list[list[int]]]],
) -> int:
    """Every pushed range equals the producer's bytes; every other decoder byte is its initial value.

    Returns the number of bytes checked as transferred.
    """
    expected = initial_pool(decoder, decoder_pool.size)
    written = np.zeros(decoder_pool.size, dtype=bool)
    for producer, p_blocks, d_blocks in pushes:
        source = read_pool(producer)
        for d_off, p_off, length in written_bytes(producer, decoder, p_blocks, d_blocks):
            assert not written[d_off : d_off + length].any(), "two pushes name the same decoder bytes"
            expected[d_off : d_off + length] = source[p_off : p_off + length]
            written[d_off : d_off + length] = True
    mismatch = np.flatnonzero(decoder_pool != expected)
    assert mismatch.size == 0, (
        f"{mismatch.size} decoder bytes differ, first at {mismatch[:8].tolist()} "
        f"({int(written[mismatch].sum())} of them in transferred blocks)"
    )
    return int(written.sum())


def expect_failure(peer: Peer, req: str, reason: str) -> dict[str, Any]:
    event = peer.wait("failed", req)
    assert event["reason"] == reason, event
    return event
