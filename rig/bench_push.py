"""Push throughput and handshake latency, as ratios against baselines measured in the same run.

- Throughput: one request (default 32k tokens, block size 16, a 64-layer 5:1 sliding/full hybrid model with
  HMA pooling) WRITten by this process into a decoder process over NIXL/UCX (CMA on one host), routed by layer
  name exactly like the connector. Baseline: `numpy.copyto` of the same number of bytes in one process (the
  memory-bandwidth limit here). Cases: contiguous block tables (runs contiguous on both sides, which NIXL
  merges into one descriptor per run), the same with merging disabled (one descriptor per block), and
  fragmented block tables (random ids on both sides: nothing to merge). Every case's bytes are verified.
  A second baseline, one `process_vm_writev` of the same bytes into the decoder's pool, is the CMA ceiling
  for that pool's page backing: NIXL's overhead is the gap to it, the pages' cost the gap from it to memcpy.
  Baselines and cases run interleaved, round by round (the machine is shared): best and median per row.
- Pools live on huge pages by default, as a deployment's KV pool should (docs/cluster.md): a mounted hugetlbfs
  with enough free pages, a tmpfs mounted `huge=always`, or else a private tmpfs `huge=always` this process
  mounts for the run (root only). Where none can be had it falls back to /dev/shm and prints why: CMA into
  4 KiB pages runs at about 0.4 of memcpy. `--pool-dir DIR` picks the folder. The backing is printed.
- Handshake: PP2 -> PP1 with the same 64 layers: per stage, fetch and decode the decoder's payload over the
  side channel, validate and align by layer name, add the agent and prepare its descriptors (strided, one row
  per region, as the producer does). Median of runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.rig.local import free_port
from disagg.worker.connector.producer import plan_decode_rank
from disagg.worker.connector.push import LocalKV, PushConfig, agent_name
from disagg.worker.connector.side_channel import SideChannelServer, handshake
from disagg.worker.connector.transport import (
    LOOPBACK_UCX_ENV,
    NixlTransport,
    PreppedList,
    XferState,
    merge_runs,
)
from disagg.worker.kv.layout import ModelGeometry, StageLayout, build_stage_layout
from disagg.worker.kv.routing import DescArray, IdArray, expand_logical_blocks
from disagg.worker.link.kv_pool import ShmPool

HOST = "127.0.0.1"
DECODE_ENGINE = "bench-decode"
PREFILL_ENGINE = "bench-prefill"
COMPAT_HASH = "b" * 64
GOAL = 0.85


@dataclass(frozen=True)
class Shape:
    tokens: int
    layers: int
    block_size: int
    kv_heads: int
    head_size: int

    def model(self) -> ModelGeometry:
        return ModelGeometry.with_full_every(
            self.layers, 6, num_kv_heads=self.kv_heads, head_size=self.head_size, dtype_bytes=2
        )

    def layout(self, *, pp_rank: int = 0, pp_size: int = 1, num_blocks: int) -> StageLayout:
        return build_stage_layout(
            self.model(),
            pp_rank=pp_rank,
            pp_size=pp_size,
            tp_size=1,
            block_size=self.block_size,
            num_blocks=num_blocks,
        )

    @property
    def blocks_per_group(self) -> int:
        return -(-self.tokens // self.block_size)


def _config(shape: Shape, engine_id: str, port: int) -> PushConfig:
    return PushConfig(
        engine_id=engine_id,
        model=shape.model(),
        side_channel_host=HOST,
        side_channel_port=port,
        compat_hash=COMPAT_HASH,
    )


def _decoder(shape: Shape, num_blocks: int, pool_path: str, port: int, conn: Any) -> None:
    """The decoder process: a pool registered with NIXL, served on the side channel until told to stop."""
    layout = shape.layout(num_blocks=num_blocks)
    pool = ShmPool.create(pool_path, layout.total_bytes)
    transport = NixlTransport(agent_name(DECODE_ENGINE, 0, 0))
    local = LocalKV(layout, transport, pool.addr, pool.nbytes, _config(shape, DECODE_ENGINE, port))
    server = SideChannelServer(HOST, port, {(0, 0): local.handshake_payload()}).start()
    conn.send((pool.addr, pool.resident_bytes()))
    while not conn.poll(0.05):
        transport.notifs()
    server.stop()
    transport.close()
    pool.close()


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _process_vm_writev(pid: int, src: int, dst: int, nbytes: int) -> None:
    """Copy nbytes at local `src` to `dst` in process `pid`: the syscall UCX's CMA transport makes."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    while done < nbytes:
        local = _IoVec(src + done, nbytes - done)
        remote = _IoVec(dst + done, nbytes - done)
        n = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_writev: {os.strerror(err)}")
        done += n


def huge_page_dir(mounts: str, hugetlb_free_bytes: int, need_bytes: int) -> str | None:
    """A folder in `mounts` (the text of /proc/mounts) whose files get huge pages with `need_bytes` in them: a
    read-write tmpfs mounted `huge=always`, or a hugetlbfs with that many bytes of free huge pages."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        _, target, fstype, options = fields[:4]
        opts = options.split(",")
        if "rw" not in opts:
            continue
        if fstype == "tmpfs" and "huge=always" in opts:
            return target.replace("\\040", " ")
        if fstype == "hugetlbfs" and hugetlb_free_bytes >= need_bytes:
            return target.replace("\\040", " ")
    return None


def _hugetlb_free_bytes() -> int:
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) if value.split() else 0
    return fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0) * 1024


@contextlib.contextmanager
def huge_pool_dir(need_bytes: int) -> Iterator[tuple[str, str]]:
    """(folder, how it was chosen) for the pools: huge pages where this machine gives them (`huge_page_dir`,
    else a private tmpfs `huge=always` mounted for the run and unmounted after), /dev/shm with the reason
    otherwise."""
    with open("/proc/mounts") as mounts:
        found = huge_page_dir(mounts.read(), _hugetlb_free_bytes(), need_bytes)
    if found is not None:
        yield found, f"huge pages: {found} (mounted)"
        return
    target = tempfile.mkdtemp(prefix="disagg-bench-huge-")
    size_mib = -(-need_bytes // 2**20) + 64
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"huge=always,size={size_mib}m,mode=0700", "disagg-bench", target],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        os.rmdir(target)
        why = (mounted.stderr or mounted.stdout).strip() or f"mount exited {mounted.returncode}"
        yield (
            "/dev/shm",
            f"4 KiB pages: /dev/shm, since no huge-page mount is here and mounting one failed: {why}",
        )
        return
    try:
        yield target, f"huge pages: a tmpfs mounted huge=always for this run at {target}"
    finally:
        subprocess.run(["umount", target], check=False, capture_output=True)
        os.rmdir(target)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def _backing(resident: tuple[int, int], nbytes: int) -> str:
    rss, huge = resident
    return f"{rss / nbytes:.0%} resident, {huge / nbytes:.0%} in huge pages"


def _block_tables(groups: int, per_group: int, rng: np.random.Generator | None) -> list[IdArray]:
    """Distinct ids across groups (HMA allocates every group from one pool), id 0 left as the null block."""
    ids = np.arange(1, groups * per_group + 1, dtype=np.int64)
    if rng is not None:
        ids = rng.permutation(ids)
    return [ids[g * per_group : (g + 1) * per_group] for g in range(groups)]


def _timed_write(
    transport: NixlTransport,
    local: LocalKV,
    local_ids: IdArray,
    peer: str,
    remote: PreppedList,
    remote_descs: DescArray,
    remote_ids: IdArray,
    *,
    merge: bool,
) -> tuple[float, int]:
    """Seconds for one WRITE (post to DONE, descriptor merging included) and the descriptors posted."""
    start = time.perf_counter()
    if merge:
        local_rows, remote_rows = merge_runs(local.descs[local_ids], remote_descs[remote_ids])
        posted = len(local_rows)
        xfer = transport.write_descs(local_rows, peer, remote_rows, b"bench")
    else:
        posted = len(local_ids)
        xfer = transport.write(local.prepped, local_ids, remote, remote_ids, b"bench")
    while transport.state(xfer) is not XferState.DONE:
        pass
    elapsed = time.perf_counter() - start
    transport.release(xfer)
    return elapsed, posted


def _verify(
    src: ShmPool,
    src_layout: StageLayout,
    dst: npt.NDArray[np.uint8],
    dst_layout: StageLayout,
    src_blocks: Sequence[IdArray],
    dst_blocks: Sequence[IdArray],
) -> bool:
    block_len = src_layout.regions[0].block_len
    src_region = {n: r for r in src_layout.regions for n in r.members}
    dst_region = {n: r for r in dst_layout.regions for n in r.members}
    for name, group in src_layout.group_index_by_layer.items():
        s, d = src_region[name], dst_region[name]
        s_view = src.array[s.offset : s.offset + s.num_blocks * block_len].reshape(s.num_blocks, block_len)
        d_view = dst[d.offset : d.offset + d.num_blocks * block_len].reshape(d.num_blocks, block_len)
        if not np.array_equal(s_view[src_blocks[group]], d_view[dst_blocks[group]]):
            return False
    return True


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class _Row:
    label: str
    times: list[float]
    posted: int = 0
    verified: bool | None = None


def run(shape: Shape, repeats: int, handshakes: int, pool_dir: str, chosen: str = "") -> int:
    model = shape.model()
    groups = len(shape.layout(num_blocks=1).groups)
    per_group = shape.blocks_per_group
    capacity = groups * per_group + 1
    src_layout = shape.layout(num_blocks=capacity)
    tmp = tempfile.mkdtemp(prefix="disagg-bench-", dir=pool_dir)
    dst_path, src_path = os.path.join(tmp, "decode"), os.path.join(tmp, "prefill")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_decoder, args=(shape, capacity, dst_path, port, child_conn), daemon=True)
    child.start()
    try:
        if not parent_conn.poll(120):
            print("decoder process did not start", file=sys.stderr)
            return 1
        dst_addr, dst_resident = parent_conn.recv()
        src = ShmPool.create(src_path, src_layout.total_bytes)
        src.array[:] = np.random.default_rng(0).integers(0, 256, size=src.nbytes, dtype=np.uint8)
        transport = NixlTransport(agent_name(PREFILL_ENGINE, 0, 0))
        # The connector's own path: layer-name routing as a PP producer does it, over the PP1 layout.
        local = LocalKV(
            src_layout, transport, src.addr, src.nbytes, _config(shape, PREFILL_ENGINE, 0), layer_routing=True
        )
        [peer] = handshake(HOST, port, [(0, 0)], expected_hash=COMPAT_HASH, expected_engine_id=DECODE_ENGINE)
        write = plan_decode_rank(local, peer.metadata, 1, peer.tp_rank)
        plan, descs = write.plan, write.remote_descs
        peer_name = transport.add_peer(peer.metadata.agent_metadata)
        remote = transport.prep(peer_name, descs)
        dst = ShmPool(dst_path)
        dst_layout = shape.layout(num_blocks=capacity)
        block_len = src_layout.regions[0].block_len

        rng = np.random.default_rng(7)
        cases = []
        for label, src_rng, dst_rng, merge in [
            ("contiguous, runs merged", None, None, True),
            ("contiguous, one descriptor per block", None, None, False),
            ("fragmented, runs merged", rng, np.random.default_rng(8), True),
        ]:
            src_blocks = _block_tables(groups, per_group, src_rng)
            dst_blocks = _block_tables(groups, per_group, dst_rng)
            local_ids, remote_ids = plan.desc_ids(
                expand_logical_blocks(src_blocks, plan.local.physical_blocks_per_logical_kv_block),
                expand_logical_blocks(dst_blocks, plan.remote.physical_blocks_per_logical_kv_block),
            )
            cases.append((_Row(label, []), src_blocks, dst_blocks, local_ids, remote_ids, merge))
        nbytes = len(cases[0][3]) * block_len
        copy_src = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
        copy_dst = np.empty_like(copy_src)
        memcpy = _Row("numpy.copyto, one process", [])
        cma = _Row("process_vm_writev into the pool", [], posted=1)

        load_before = os.getloadavg()
        faults = 0
        # Round 0 warms up (UCX wire-up, first touch of the copy buffers) and verifies; it is not timed.
        for round_ in range(repeats + 1):
            timed = round_ > 0
            faults_before = _minor_faults(child.pid) if child.pid else 0
            elapsed = _timed(lambda: np.copyto(copy_dst, copy_src))
            if timed:
                memcpy.times.append(elapsed)
            if not timed:
                dst.array[:] = 0
            elapsed = _timed(lambda: _process_vm_writev(child.pid or 0, src.addr, dst_addr, nbytes))
            if timed:
                cma.times.append(elapsed)
            else:
                cma.verified = bool(np.array_equal(src.array[:nbytes], dst.array[:nbytes]))
            for row, src_blocks, dst_blocks, local_ids, remote_ids, merge in cases:
                if not timed:
                    dst.array[:] = 0
                elapsed, row.posted = _timed_write(
                    transport, local, local_ids, peer_name, remote, descs, remote_ids, merge=merge
                )
                if timed:
                    row.times.append(elapsed)
                else:
                    row.verified = _verify(src, src_layout, dst.array, dst_layout, src_blocks, dst_blocks)
            if timed and child.pid:
                faults += _minor_faults(child.pid) - faults_before
        load_after = os.getloadavg()

        def rate(row: _Row) -> tuple[float, float]:
            return nbytes / min(row.times) / 1e9, nbytes / statistics.median(row.times) / 1e9

        print(
            f"push: {shape.tokens} tokens, block size {shape.block_size}, {model.num_layers} layers "
            f"({groups} KV cache groups, {len(src_layout.regions)} pooled regions), {block_len} B blocks, "
            f"{nbytes / 2**20:.0f} MiB, {len(cases[0][3])} block descriptors; best / median of {repeats} "
            "interleaved rounds"
        )
        print(
            f"  pools on {chosen or pool_dir}: decoder {_backing(dst_resident, dst.nbytes)}, "
            f"prefill {_backing(src.resident_bytes(), src.nbytes)}; load average {load_before[0]:.1f} -> "
            f"{load_after[0]:.1f} on {os.cpu_count()} CPUs; decoder minor faults while timed: {faults}"
        )
        if 2 * dst_resident[1] < dst.nbytes:
            print(
                "  the decoder's pool is mostly in 4 KiB pages: CMA pins the target's pages one by one, so "
                "no push beats the process_vm_writev row; put --pool-dir on hugetlbfs or a tmpfs mounted "
                "huge=always (/sys/kernel/mm/transparent_hugepage/shmem_enabled must not be deny)"
            )
        copy_best, copy_median = rate(memcpy)
        print(f"  {memcpy.label + ' (baseline)':44s} {copy_best:7.2f} / {copy_median:7.2f} GB/s")
        for row in [cma] + [case[0] for case in cases]:
            best, median = rate(row)
            print(
                f"  {row.label:44s} {best:7.2f} / {median:7.2f} GB/s   ratio {best / copy_best:5.2f} / "
                f"{median / copy_median:5.2f}   {row.posted:7d} descriptors   bytes verified: {row.verified}"
            )
        merged_ratio = rate(cases[0][0])[0] / copy_best
        verdict = "met" if merged_ratio >= GOAL else "NOT met"
        print(
            f"  contiguous push vs memcpy (best): {merged_ratio:.2f}, goal {GOAL}: {verdict}; "
            f"vs process_vm_writev: {rate(cases[0][0])[0] / rate(cma)[0]:.2f}"
        )
        transport.release_prepped(remote)

        latencies = _handshake_latencies(shape, port, handshakes)
        median_ms, min_ms = statistics.median(latencies) * 1e3, min(latencies) * 1e3
        print(
            f"handshake PP2 -> PP1, {model.num_layers} layers: median {median_ms:.2f} ms, "
            f"min {min_ms:.2f} ms over {len(latencies)} runs (per stage: fetch, decode, align by layer name, "
            "add agent, prepare descriptors)"
        )
        dst.close()
        src.close()
        return 0 if cma.verified and all(case[0].verified for case in cases) else 1
    finally:
        parent_conn.send("stop")
        child.join(30)
        if child.is_alive():
            child.kill()
        for path in (dst_path, src_path):
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(tmp)


def _handshake_latencies(shape: Shape, port: int, runs: int) -> list[float]:
    stages = []
    pools = []
    for pp_rank in range(2):
        layout = shape.layout(pp_rank=pp_rank, pp_size=2, num_blocks=8)
        pool = ShmPool.create(
            os.path.join(tempfile.gettempdir(), f"disagg-bench-hs-{os.getpid()}-{pp_rank}"),
            layout.total_bytes,
        )
        pools.append(pool)
        transport = NixlTransport(agent_name(PREFILL_ENGINE, pp_rank, 0) + "-hs")
        stages.append(LocalKV(layout, transport, pool.addr, pool.nbytes, _config(shape, PREFILL_ENGINE, 0)))
    latencies = []
    try:
        for _ in range(runs):
            start = time.perf_counter()
            added = []
            for local in stages:
                [peer] = handshake(
                    HOST, port, [(0, 0)], expected_hash=COMPAT_HASH, expected_engine_id=DECODE_ENGINE
                )
                # What PushProducer._connect prepares: one strided row per region.
                descs = plan_decode_rank(local, peer.metadata, 1, peer.tp_rank).remote_strided
                name = local.transport.add_peer(peer.metadata.agent_metadata)
                added.append((local.transport, name, local.transport.prep(name, descs)))
            latencies.append(time.perf_counter() - start)
            for transport, name, prepped in added:
                transport.release_prepped(prepped)
                transport.remove_peer(name)
    finally:
        for local in stages:
            local.transport.close()
        for pool in pools:
            pool.close()
            pool.unlink()
    return latencies


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg bench push", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=1, help="KV heads on this rank")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--handshakes", type=int, default=20)
    parser.add_argument(
        "--pool-dir",
        help="where both pools' files live (tmpfs or hugetlbfs); default: huge pages where this machine "
        "gives them, else /dev/shm",
    )
    args = parser.parse_args(argv)
    for key, value in LOOPBACK_UCX_ENV.items():
        os.environ.setdefault(key, value)
    shape = Shape(args.tokens, args.layers, args.block_size, args.kv_heads, args.head_size)
    if args.pool_dir is not None:
        return run(shape, args.repeats, args.handshakes, args.pool_dir)
    # Both pools, each a little over one request's bytes (the null block and rounding to huge pages).
    groups = len(shape.layout(num_blocks=1).groups)
    need = 2 * shape.layout(num_blocks=groups * shape.blocks_per_group + 1).total_bytes + 2 * 2**21
    with huge_pool_dir(need) as (pool_dir, chosen):
        return run(shape, args.repeats, args.handshakes, pool_dir, chosen)


if __name__ == "__main__":
    sys.exit(main())
