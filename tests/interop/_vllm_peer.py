"""The test side of hack/vllm/peer_server.py: one long-lived process running a released vLLM's own code.

The project's tests run in the project venv and never import vLLM; they ask this peer, which runs in
.venv-vllm (built by hack/vllm/venv.sh), to run vLLM's classes and functions and answer in JSON.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVER = ROOT / "hack" / "vllm" / "peer_server.py"
# The release .venv-vllm has installed; the others import from an extracted wheel (hack/vllm/wheels.sh).
INSTALLED_RELEASE = "0.33.0"
RELEASES = ("0.31.0", "0.32.0", "0.33.0", "0.34.0")
# The first VllmConfig of a model architecture makes vLLM inspect the model class in a subprocess (~15 s).
REPLY_TIMEOUT_S = 240.0


def wheel_cache() -> Path:
    """Where hack/vllm/venv.sh and wheels.sh keep the wheels: VLLM_WHEEL_CACHE, else the user's cache."""
    if os.environ.get("VLLM_WHEEL_CACHE"):
        return Path(os.environ["VLLM_WHEEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disagg" / "vllm-wheels"


def extracted_release(version: str) -> Path:
    return wheel_cache() / "x" / version


class PeerError(Exception):
    """vLLM raised: `kind` is the exception's class name, the message is vLLM's."""

    def __init__(self, kind: str, message: str, trace: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.trace = trace


def to_wire(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return value


def from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            return bytes.fromhex(value["$bytes"])
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


class VllmPeer:
    """One peer process for one release; `call(op, **args)` runs one operation of peer_server.py."""

    def __init__(self, version: str, log: Path, hf_home: Path) -> None:
        env = {
            **os.environ,
            "PYTHONSAFEPATH": "1",
            "HF_HOME": str(hf_home),
            "PYTHONHASHSEED": "0",
            # vLLM caches what it learns by inspecting a model class (~15 s per architecture) under one file
            # name per class, keyed by the release's source: one cache per release keeps them from evicting
            # each other, and it outlives the session.
            "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "disagg-vllm-peer" / version),
        }
        env.pop("PYTHONPATH", None)
        if version != INSTALLED_RELEASE:
            env["PYTHONPATH"] = str(extracted_release(version))
        self.version = version
        self._log: IO[bytes] = log.open("wb")
        self.log_path = log
        self._proc = subprocess.Popen(
            [str(VENV_PYTHON), str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=ROOT,
        )
        info = self.call("version")
        self.connector_version: int = info["connector_version"]
        self.metadata_fields: list[str] = info["metadata_fields"]
        if info["vllm_version"] != version:
            self.close()
            raise RuntimeError(
                f"the peer for {version} imported vLLM {info['vllm_version']} from {info['vllm_file']}"
            )

    def call(self, op: str, **args: Any) -> Any:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write((json.dumps({"op": op, "args": to_wire(args)}) + "\n").encode())
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(
                f"the vLLM {self.version} peer gave no reply to {op!r} (exit status {self._proc.poll()}); "
                f"its log is {self.log_path}"
            )
        reply = json.loads(line)
        if not reply["ok"]:
            raise PeerError(reply["type"], reply["error"], reply["traceback"])
        return from_wire(reply["result"])

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


PeerFactory = Callable[[str], VllmPeer]
"""The session fixture `vllm_peers`: a release's peer, started on first use."""
