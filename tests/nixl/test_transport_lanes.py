"""The transport a pair's KV really used, read from UCX's own protocol selection during a real WRITE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _procs import UCX_ENV

from disagg.worker.contracts.ucx_lanes import families, ucx_env

PEER = Path(__file__).with_name("_lanes_peer.py")


def _pair(tmp_path: Path, env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    full = {**base, **UCX_ENV, **env}
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(PEER), role, str(tmp_path)], env=full, stdout=subprocess.PIPE, text=True
        )
        for role in ("dst", "src")
    }
    out = {}
    for role, proc in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=90)
        finally:
            proc.kill()
        out[role] = json.loads(stdout.strip().splitlines()[-1])
    return out["src"], out["dst"]


def test_default_ucx_moves_loopback_kv_over_cma_and_the_writer_says_so(tmp_path: Path) -> None:
    src, dst = _pair(tmp_path, {})
    assert dst["arrived"] is True
    assert src["peer"] == "lanes-dst"
    assert src["lanes"] == ["cma/memory"]
    assert families(src["lanes"]) == ("shm",)


def test_a_tcp_demand_moves_the_kv_over_tcp_and_the_report_follows(tmp_path: Path) -> None:
    src, dst = _pair(tmp_path, ucx_env("tcp"))
    assert dst["arrived"] is True
    assert src["lanes"] == ["tcp/lo"]
    assert families(src["lanes"]) == ("tcp",)


def test_an_rdma_demand_on_a_node_without_rdma_fails_with_ucxs_reason(tmp_path: Path) -> None:
    for report in _pair(tmp_path, ucx_env("rdma")):
        assert report["reason"] == "KVTransportUnavailable"
        assert "'ib'" in report["message"] and "not available" in report["message"], report["message"]
