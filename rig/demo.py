"""The data-path demo: 2 pipeline-parallel prefill stages and 1 decoder, each with its sidecar, on loopback.

Six processes besides this one: three sidecars (`python -m disagg.worker.cli.transfer`, configured only by
the environment and a topology file, as in a pod) and three engine processes (the reference engine: two
prefill stages handing activations over `torch.distributed` gloo, one decoder). Each engine maps its KV pool
from a /dev/shm file and registers it with its sidecar over the local socket. Per request:

1. the decoder allocates its blocks and sends `ExpectRequest`; its sidecar sends `PUSH_REG` to every stage;
2. the stages prefill (stage 0's activations go to stage 1), each writes only its own layers' KV, then sends
   `RequestFinished`; each stage's sidecar pushes those layers by name into the decoder's pool over NIXL;
3. the decoder's sidecar counts one completion per stage and sends `KVReady`; the decoder then decodes
   greedily from the received KV, starting from the first token stage 1 produced.

The same model run monolithically in this process is the reference; the demo reports per request whether
the tokens are identical. Every process it starts is stopped (SIGTERM, then kill) when it ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from disagg.rig.local import LOOPBACK_UCX_ENV, free_port
from disagg.worker.contracts.pod_contract import (
    ENGINE_ID_ENV,
    ENGINE_SOCKET_ENV,
    KV_POOL_ENV,
    LOG_LEVEL_ENV,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    PP_RANK_ENV,
    ROLE_ENV,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    TOPOLOGY_FILE_ENV,
    TP_RANK_ENV,
)
from disagg.worker.contracts.topology import (
    ModelDocument,
    StageDocument,
    TopologyDocument,
    WorkerEndpoint,
    encode_topology,
)
from disagg.worker.engine.config import TinyConfig, encode

HOST = "127.0.0.1"
PREFILL_ENGINE = "demo-prefill"
DECODE_ENGINE = "demo-decode"
STEP_TIMEOUT_S = 120.0
DEFAULT_PROMPTS = (
    "Hello!",
    "Disaggregated serving moves the KV cache from prefill to decode.",
    "Pipeline-parallel prefill stages each hold a slice of the layers; the decoder holds them all, pooled "
    "differently, so the KV moves by layer name.",
    "A sliding window of 32 tokens hides the early tokens from most layers, while every third layer sees "
    "the whole prompt. The decoder must reproduce every token of the monolithic run, bit for bit, from KV "
    "it never computed itself. " * 2,
    "NIXL writes each block with one descriptor per layer; the completion notification tells the decoder. "
    * 4,
)


@dataclass(frozen=True)
class Worker:
    """One sidecar's identity and addresses, and the engine process next to it."""

    role: str
    pp_rank: int
    side_channel_port: int
    metrics_port: int
    socket_path: str
    pool_path: str

    @property
    def name(self) -> str:
        return f"{self.role}-{self.pp_rank}"

    @property
    def engine_id(self) -> str:
        return PREFILL_ENGINE if self.role == "prefill" else DECODE_ENGINE


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process needs (picklable for a spawned process)."""

    config: TinyConfig
    worker: Worker
    pp_size: int
    num_blocks: int
    master_port: int
    prefill_side_channel_port: int


def topology_document(config: TinyConfig, pp_size: int, workers: Sequence[Worker]) -> TopologyDocument:
    """The document the operator's builders would write for this model, built through the same type."""
    geometry = config.geometry
    return TopologyDocument(
        transfer_mode="push",
        block_size=config.block_size,
        packed=False,
        prefill_tensor_parallel_size=1,
        decode_tensor_parallel_size=1,
        stages=tuple(
            StageDocument(stage=rank, start_layer=layers.start, end_layer=layers.stop)
            for rank, layers in enumerate(config.stages(pp_size))
        ),
        model=ModelDocument(
            name=f"disagg-tiny-{config.seed}",
            dtype="float32",
            layer_kinds=geometry.kinds,
            num_kv_heads=geometry.num_kv_heads,
            head_size=geometry.head_size,
            dtype_bytes=geometry.dtype_bytes,
            layer_name_template=geometry.layer_name_template,
            hma=geometry.hma,
        ),
        workers={
            "prefill": tuple(
                WorkerEndpoint(pp_rank=w.pp_rank, tp_rank=0, host=HOST, port=w.side_channel_port)
                for w in workers
                if w.role == "prefill"
            )
        },
        kv_lease_duration_seconds=60,
        push_registration_timeout_seconds=120,
    )


def sidecar_env(worker: Worker, topology_file: Path) -> dict[str, str]:
    return {
        **os.environ,
        **LOOPBACK_UCX_ENV,
        "PYTHONSAFEPATH": "1",
        ROLE_ENV: worker.role,
        ENGINE_ID_ENV: worker.engine_id,
        PP_RANK_ENV: str(worker.pp_rank),
        TP_RANK_ENV: "0",
        TOPOLOGY_FILE_ENV: str(topology_file),
        SIDE_CHANNEL_HOST_ENV: HOST,
        SIDE_CHANNEL_PORT_ENV: str(worker.side_channel_port),
        ENGINE_SOCKET_ENV: worker.socket_path,
        KV_POOL_ENV: worker.pool_path,
        METRICS_HOST_ENV: HOST,
        METRICS_PORT_ENV: str(worker.metrics_port),
        LOG_LEVEL_ENV: "info",
    }


# ---- engine processes (spawned) ---------------------------------------------------------------------------


def _engine_main(spec: EngineSpec, conn: Connection) -> None:
    """Entry point of an engine process: report any failure to the parent instead of dying silently."""
    try:
        if spec.worker.role == "prefill":
            _prefill_stage(spec, conn)
        else:
            _decoder(spec, conn)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _register(spec: EngineSpec, model: Any) -> tuple[Any, Any]:
    from disagg.worker.engine.pp import map_kv_cache
    from disagg.worker.link.engine_link import EngineLink, register_layout_message

    w = spec.worker
    pp_size = spec.pp_size if w.role == "prefill" else 1
    kv = map_kv_cache(model, spec.num_blocks, w.pool_path, pp_rank=w.pp_rank, pp_size=pp_size, create=True)
    link = EngineLink(w.socket_path, reply_timeout_s=STEP_TIMEOUT_S)
    stage = spec.config.stage_layout(spec.num_blocks, pp_rank=w.pp_rank, pp_size=pp_size)
    link.register_layout(
        register_layout_message(
            engine_id=w.engine_id,
            role=w.role,
            geometry=spec.config.geometry,
            stage=stage,
            tp_rank=0,
            num_blocks=spec.num_blocks,
            pool_path=w.pool_path,
            pool_bytes=int(kv.buffer.numel()),
        )
    )
    return kv, link


def _prefill_stage(spec: EngineSpec, conn: Connection) -> None:
    import torch

    from disagg.worker.engine.model import TinyModel
    from disagg.worker.engine.stages import join, leave, prefill_step, prompt_block_ids

    torch.set_num_threads(1)
    model = TinyModel(spec.config)
    kv, link = _register(spec, model)
    rank, world = spec.worker.pp_rank, spec.pp_size
    join(HOST, spec.master_port, rank, world, timeout_s=STEP_TIMEOUT_S)
    conn.send(("ready",))
    try:
        while True:
            command = conn.recv()
            if command[0] == "quit":
                break
            _, request_id, token_ids, tables = command
            first_token = prefill_step(model, kv, rank, world, token_ids, tables)
            done = time.monotonic()
            link.request_finished(
                request_id, prompt_block_ids(tables, len(token_ids), spec.config.block_size)
            )
            sent = link.wait(request_id, STEP_TIMEOUT_S)
            conn.send(("sent", first_token, done, sent.bytes, sent.seconds))
    finally:
        leave()
        link.close()


def _decoder(spec: EngineSpec, conn: Connection) -> None:
    import torch

    from disagg.worker.engine.model import TinyModel
    from disagg.worker.engine.stages import prompt_block_ids
    from disagg.worker.link.engine_link import PrefillEngine

    torch.set_num_threads(1)
    model = TinyModel(spec.config)
    kv, link = _register(spec, model)
    prefill = PrefillEngine(
        PREFILL_ENGINE, HOST, spec.prefill_side_channel_port, tp_size=1, pp_size=spec.pp_size
    )
    requests: dict[str, tuple[dict[int, list[int]], int, int]] = {}
    conn.send(("ready",))
    try:
        while True:
            command = conn.recv()
            if command[0] == "quit":
                break
            if command[0] == "expect":
                _, request_id, num_prompt, max_new = command
                tables = kv.allocate(num_prompt + max_new - 1)
                blocks = prompt_block_ids(tables, num_prompt, spec.config.block_size)
                link.expect_request(request_id, blocks, prefill)
                requests[request_id] = (tables, num_prompt, max_new)
                conn.send(("expected", sum(len(ids) for ids in blocks)))
            elif command[0] == "decode":
                _, request_id, first_token = command
                tables, num_prompt, max_new = requests.pop(request_id)
                ready = link.wait(request_id, STEP_TIMEOUT_S)
                ready_at = time.monotonic()
                tokens = model.decode_greedy(first_token, num_prompt, kv, tables, max_new)
                kv.free(tables)
                conn.send(("tokens", tokens, ready_at, ready.seconds))
    finally:
        link.close()


# ---- the orchestrator --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    prompt_tokens: int
    blocks: int
    """Logical blocks per side (every KV cache group) the decoder received."""
    bytes_moved: int
    transfer_s: float
    ttft_s: float
    tokens: list[int]
    reference: list[int]

    @property
    def identical(self) -> bool:
        return self.tokens == self.reference

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.transfer_s / 1e9 if self.transfer_s > 0 else float("nan")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes] | None = None
    process: Any = None
    conn: Connection | None = None
    log_path: Path | None = None


class DemoError(RuntimeError):
    pass


@dataclass
class DemoCluster:
    """The six processes of the demo; `close()` (or the context manager) stops every one of them."""

    config: TinyConfig = field(default_factory=TinyConfig)
    pp_size: int = 2
    num_blocks: int = 160
    progress: Callable[[str], None] = lambda line: None
    workdir: Path = field(init=False)
    workers: list[Worker] = field(init=False, default_factory=list)
    sidecars: list[_Proc] = field(init=False, default_factory=list)
    engines: list[_Proc] = field(init=False, default_factory=list)
    sidecar_exit_codes: dict[str, int | None] = field(init=False, default_factory=dict)

    def __enter__(self) -> DemoCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        shm = Path("/dev/shm")
        self.workdir = Path(tempfile.mkdtemp(prefix="disagg-demo-", dir=shm if shm.is_dir() else None))
        roles = [("prefill", rank) for rank in range(self.pp_size)] + [("decode", 0)]
        self.workers = [
            Worker(
                role,
                rank,
                free_port(),
                free_port(),
                str(self.workdir / f"{role}-{rank}.sock"),
                str(self.workdir / f"{role}-{rank}.kv"),
            )
            for role, rank in roles
        ]
        topology = self.workdir / "topology.json"
        topology.write_text(encode_topology(topology_document(self.config, self.pp_size, self.workers)))
        self.progress(f"starting {len(self.workers)} sidecars (NIXL agents, side channels, metrics) ...")
        for worker in self.workers:
            log_path = self.workdir / f"sidecar-{worker.name}.log"
            with open(log_path, "wb") as log_file:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "disagg.worker.cli.transfer"],
                    env=sidecar_env(worker, topology),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            self.sidecars.append(_Proc(f"sidecar {worker.name}", popen=popen, log_path=log_path))
        self.progress(f"starting {len(self.workers)} engine processes (torch, gloo rendezvous) ...")
        ctx = multiprocessing.get_context("spawn")
        master_port = free_port()
        for worker in self.workers:
            parent, child = ctx.Pipe()
            spec = EngineSpec(
                self.config,
                worker,
                self.pp_size,
                self.num_blocks,
                master_port,
                self.workers[0].side_channel_port,
            )
            process = ctx.Process(
                target=_engine_main, args=(spec, child), name=f"engine-{worker.name}", daemon=True
            )
            process.start()
            child.close()
            self.engines.append(_Proc(f"engine {worker.name}", process=process, conn=parent))
        for engine in self.engines:
            self._expect(engine, "ready")
            self.progress(f"  {engine.name} registered its KV pool")
        self.progress("waiting for every sidecar to be ready (stage 0 republishes stage 1's handshake) ...")
        for worker in self.workers:
            self._wait_ready(worker)
        self.progress("  all sidecars ready")

    def _check_sidecars(self) -> None:
        for proc in self.sidecars:
            assert proc.popen is not None
            if proc.popen.poll() is not None:
                raise DemoError(f"{proc.name} exited with {proc.popen.returncode}:\n{self.log_tail(proc)}")

    def log_tail(self, proc: _Proc, chars: int = 3000) -> str:
        if proc.log_path is None or not proc.log_path.exists():
            return ""
        return proc.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self, worker: Worker) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            code, _ = self.http_get(worker, "/readyz")
            if code == 200:
                return
            self._check_sidecars()
            if time.monotonic() > deadline:
                raise DemoError(f"sidecar {worker.name} not ready after {STEP_TIMEOUT_S} s")
            time.sleep(0.1)

    def http_get(self, worker: Worker, path: str) -> tuple[int, str]:
        url = f"http://{HOST}:{worker.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def _expect(self, engine: _Proc, kind: str) -> tuple[Any, ...]:
        assert engine.conn is not None
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not engine.conn.poll(0.2):
            self._check_sidecars()
            if not engine.process.is_alive():
                raise DemoError(f"{engine.name} exited with {engine.process.exitcode}")
            if time.monotonic() > deadline:
                raise DemoError(f"{engine.name}: no {kind!r} within {STEP_TIMEOUT_S} s")
        message: tuple[Any, ...] = engine.conn.recv()
        if message[0] == "error":
            time.sleep(0.5)
            self._check_sidecars()
            raise DemoError(f"{engine.name} failed: {message[1]}")
        if message[0] != kind:
            raise DemoError(f"{engine.name}: expected {kind!r}, got {message!r}")
        return message

    def run_request(
        self, request_id: str, token_ids: list[int], max_new_tokens: int, reference: list[int]
    ) -> RequestResult:
        from disagg.worker.engine.kv_cache import BlockPool, allocate_block_tables

        stages, decoder = self.engines[: self.pp_size], self.engines[self.pp_size]
        assert decoder.conn is not None
        groups = len(self.config.stage_layout(self.num_blocks).groups)
        # Prefill's scheduler decides one set of per-group block ids for every stage.
        p_pool = BlockPool(self.num_blocks)
        started = time.monotonic()
        decoder.conn.send(("expect", request_id, len(token_ids), max_new_tokens))
        (_, blocks) = self._expect(decoder, "expected")
        tables = allocate_block_tables(p_pool, groups, self.config.block_size, len(token_ids))
        for stage in stages:
            assert stage.conn is not None
            stage.conn.send(("prefill", request_id, token_ids, tables))
        sent = [self._expect(stage, "sent") for stage in stages]
        first_token = sent[-1][1]
        decoder.conn.send(("decode", request_id, first_token))
        _, tokens, ready_at, _ = self._expect(decoder, "tokens")
        return RequestResult(
            request_id=request_id,
            prompt_tokens=len(token_ids),
            blocks=blocks,
            bytes_moved=sum(s[3] for s in sent),
            transfer_s=max(s[4] for s in sent),
            ttft_s=max(ready_at, max(s[2] for s in sent)) - started,
            tokens=tokens,
            reference=reference,
        )

    def close(self) -> None:
        for engine in self.engines:
            if engine.conn is not None and engine.process.is_alive():
                with contextlib.suppress(OSError):
                    engine.conn.send(("quit",))
        for engine in self.engines:
            engine.process.join(timeout=10)
            if engine.process.is_alive():
                engine.process.kill()
                engine.process.join(timeout=10)
            if engine.conn is not None:
                engine.conn.close()
        for proc in self.sidecars:
            assert proc.popen is not None
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.sidecars:
            assert proc.popen is not None
            try:
                proc.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
            self.sidecar_exit_codes[proc.name] = proc.popen.returncode
        self.engines.clear()
        self.sidecars.clear()
        if hasattr(self, "workdir"):
            shutil.rmtree(self.workdir, ignore_errors=True)


def reference_tokens(
    config: TinyConfig, prompts: Sequence[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The monolithic run: the whole model, prefill and decode, in this process, one kernel thread (as the
    engine processes use)."""
    import torch

    from disagg.worker.engine.model import TinyModel

    model = TinyModel(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [model.generate(prompt, max_new_tokens) for prompt in prompts]
    finally:
        torch.set_num_threads(threads)


def format_table(results: Sequence[RequestResult]) -> str:
    header = ("request", "prompt tokens", "blocks", "bytes moved", "transfer GB/s", "TTFT ms", "identical")
    rows = [
        (
            r.request_id,
            str(r.prompt_tokens),
            str(r.blocks),
            f"{r.bytes_moved:,}",
            f"{r.gb_per_s:.2f}",
            f"{r.ttft_s * 1e3:.1f}",
            "yes" if r.identical else "NO",
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: Sequence[RequestResult]) -> str:
    differing = [r.request_id for r in results if not r.identical]
    if not differing:
        return f"all {len(results)} requests identical to the monolithic run"
    return (
        f"{len(differing)} of {len(results)} requests differ from the monolithic run: {', '.join(differing)}"
    )


def run_demo(
    prompts: Sequence[str] = DEFAULT_PROMPTS, max_new_tokens: int = 16, out: Callable[[str], None] = print
) -> int:
    """The demo: returns 0 only when every request's tokens equal the monolithic run's."""
    config = TinyConfig()
    token_ids = [encode(prompt) for prompt in prompts]
    out(
        f"model: {config.num_layers} layers (sliding window {config.sliding_window}, full attention every "
        f"{config.full_every}), float32; 2 prefill stages + 1 decoder, each with its sidecar, on {HOST}"
    )
    out(f"monolithic reference run of {len(prompts)} prompts ...")
    references = reference_tokens(config, token_ids, max_new_tokens)
    results = []
    with DemoCluster(config, progress=out) as cluster:
        for index, (ids, reference) in enumerate(zip(token_ids, references, strict=True)):
            out(f"request req-{index}: {len(ids)} prompt tokens ...")
            results.append(cluster.run_request(f"req-{index}", ids, max_new_tokens, reference))
        out("stopping the engines and sending SIGTERM to the sidecars ...")
    codes = sorted(set(cluster.sidecar_exit_codes.values()), key=str)
    out(f"  {len(cluster.sidecar_exit_codes)} sidecars exited with {', '.join(map(str, codes))}")
    out("")
    out(format_table(results))
    out("")
    out(summary(results))
    return 0 if all(r.identical for r in results) else 1
