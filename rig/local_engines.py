"""Reference engines as real processes on loopback: per worker a transfer sidecar and `disagg engine serve`.

A PP prefill engine (one sidecar and one engine process per stage; stage 0 serves HTTP and drives the others
over gloo) and any number of decoders (one sidecar and one engine process each), configured as pods are: by
the environment and one topology file. The tests of the engine server, the router's tests, the demo and the
bench start them from here:

    with LocalEngines(pp_size=2, decoders=1) as engines:
        engines.prefill_url, engines.decode_urls[0], engines.decode_leg_params()

`close()` (or leaving the context) stops every process: the engines first (the head ends its stages), then
the sidecars with SIGTERM, then anything still running with SIGKILL.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from disagg.rig.demo import Worker, sidecar_env, topology_document
from disagg.rig.local import HOST, free_port
from disagg.worker.contracts.pod_contract import ENGINE_ID_ENV
from disagg.worker.contracts.topology import encode_topology
from disagg.worker.engine.config import TinyConfig

START_TIMEOUT_S = 180.0
PREFILL_ENGINE = "ref-prefill"


@dataclass(frozen=True)
class EngineWorker:
    """One worker: its sidecar's identity and ports, and its engine server's HTTP port."""

    worker: Worker
    engine_id: str
    http_port: int

    @property
    def name(self) -> str:
        return f"{self.engine_id}-{self.worker.pp_rank}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path


class EnginesError(RuntimeError):
    pass


@dataclass
class LocalEngines:
    config: TinyConfig = field(default_factory=TinyConfig)
    pp_size: int = 2
    decoders: int = 1
    num_blocks: int = 256
    kv_lease_s: float = 60.0
    registration_timeout_s: float = 120.0
    progress: Callable[[str], None] = lambda line: None
    workdir: Path = field(init=False)
    prefill: list[EngineWorker] = field(init=False, default_factory=list)
    decode: list[EngineWorker] = field(init=False, default_factory=list)
    _sidecars: list[_Proc] = field(init=False, default_factory=list)
    _engines: list[_Proc] = field(init=False, default_factory=list)
    exit_codes: dict[str, int | None] = field(init=False, default_factory=dict)

    def __enter__(self) -> LocalEngines:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def prefill_url(self) -> str:
        return self.prefill[0].url

    @property
    def decode_urls(self) -> list[str]:
        return [w.url for w in self.decode]

    @property
    def model_name(self) -> str:
        return f"disagg-tiny-{self.config.seed}"

    def decode_leg_params(self) -> dict[str, Any]:
        """A decode leg's `kv_transfer_params` for this prefill engine, as a concurrent router sends them."""
        head = self.prefill[0].worker
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": PREFILL_ENGINE,
            "remote_host": HOST,
            "remote_port": head.side_channel_port,
            "tp_size": 1,
            "pp_size": self.pp_size,
            "remote_block_ids": None,
        }

    def _worker(self, role: str, rank: int, engine_id: str) -> EngineWorker:
        prefix = f"{role}-{engine_id}-{rank}"
        worker = Worker(
            role,
            rank,
            free_port(),
            free_port(),
            str(self.workdir / f"{prefix}.sock"),
            str(self.workdir / f"{prefix}.kv"),
        )
        return EngineWorker(worker, engine_id, free_port())

    def start(self) -> None:
        shm = Path("/dev/shm")
        self.workdir = Path(tempfile.mkdtemp(prefix="disagg-eng-", dir=shm if shm.is_dir() else None))
        self.prefill = [self._worker("prefill", r, PREFILL_ENGINE) for r in range(self.pp_size)]
        self.decode = [self._worker("decode", 0, f"ref-decode-{i}") for i in range(self.decoders)]
        everyone = self.prefill + self.decode
        document = topology_document(self.config, self.pp_size, [w.worker for w in everyone])
        document = msgspec.structs.replace(
            document,
            kv_lease_duration_seconds=self.kv_lease_s,
            push_registration_timeout_seconds=self.registration_timeout_s,
        )
        topology = self.workdir / "topology.json"
        topology.write_text(encode_topology(document))
        master_port = free_port()
        self.progress(f"starting {len(everyone)} sidecars and {len(everyone)} engine servers ...")
        for w in everyone:
            env = {**sidecar_env(w.worker, topology), ENGINE_ID_ENV: w.engine_id}
            self._sidecars.append(
                self._spawn(f"sidecar {w.name}", [sys.executable, "-m", "disagg.worker.cli.transfer"], env)
            )
            argv = [
                sys.executable,
                "-m",
                "disagg.operator.cli.main",
                "engine",
                "serve",
                "--host",
                HOST,
                "--port",
                str(w.http_port),
                "--num-blocks",
                str(self.num_blocks),
            ]
            if w.worker.role == "prefill" and self.pp_size > 1:
                argv += ["--master-addr", HOST, "--master-port", str(master_port)]
            self._engines.append(self._spawn(f"engine {w.name}", argv, env))
        for w in everyone:
            self._wait_ready(w.name, f"http://{HOST}:{w.worker.metrics_port}/readyz")
            self._wait_ready(w.name, f"{w.url}/readyz")
        self.progress("  every sidecar and engine is ready")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> _Proc:
        log_path = self.workdir / f"{name.replace(' ', '-')}.log"
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        return _Proc(name, popen, log_path)

    def check_alive(self) -> None:
        for proc in self._sidecars + self._engines:
            if proc.popen.poll() is not None:
                raise EnginesError(
                    f"{proc.name} exited with {proc.popen.returncode}:\n{self.log_tail(proc.name)}"
                )

    def log_tail(self, name: str, chars: int = 4000) -> str:
        for proc in self._sidecars + self._engines:
            if proc.name == name and proc.log_path.exists():
                return proc.log_path.read_text(errors="replace")[-chars:]
        return ""

    def _wait_ready(self, name: str, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while get(url)[0] != 200:
            self.check_alive()
            if time.monotonic() > deadline:
                raise EnginesError(f"{name}: {url} not ready after {START_TIMEOUT_S} s")
            time.sleep(0.2)

    def close(self) -> None:
        # The head first: it tells its stages to leave the group; then the rest, then the sidecars.
        for group in (self._engines[:1], self._engines[1:], self._sidecars):
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait(timeout=10)
                self.exit_codes[proc.name] = proc.popen.returncode
        self._engines.clear()
        self._sidecars.clear()
        if hasattr(self, "workdir"):
            shutil.rmtree(self.workdir, ignore_errors=True)


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def vllm_labels(engines: LocalEngines) -> str:
    """The labels of an engine's vLLM-named samples, as `metric` takes them."""
    return f'engine="0",model_name="{engines.model_name}"'


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (`labels` as written, e.g. `state="decoding"`)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    raise KeyError(f"no sample {wanted}")
