"""An engine container restarted beside a running sidecar keeps the pool file the sidecar registered.

A real kubelet restarts one container of a pod (the engine) and leaves the other (the sidecar, with its NIXL
registration of the pool's pages) running. Seen on the node (hack/node.sh): after a PP stage's engine
restarted, a new pool file made every request's text differ from the monolithic run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from disagg.worker.engine.config import TinyConfig
from disagg.worker.engine.model import TinyModel
from disagg.worker.engine.pool_registration import new_pool
from disagg.worker.link.kv_pool import ShmPool

NUM_BLOCKS = 8


def settings(path: Path, pp_rank: int = 0, pp_size: int = 1) -> Any:
    return SimpleNamespace(kv_pool=str(path), num_blocks=NUM_BLOCKS, pp_rank=pp_rank, pp_size=pp_size)


def test_a_restarted_engine_writes_into_the_pages_its_sidecar_maps(tmp_path: Path) -> None:
    model = TinyModel(TinyConfig())
    path = tmp_path / "disagg-kv.pool"
    first = new_pool(model, settings(path))
    nbytes = int(first.buffer.numel())
    sidecar = ShmPool(path, nbytes)  # what the sidecar maps and registers, once
    try:
        first.buffer.fill_(3)
        del first
        restarted = new_pool(model, settings(path))  # the engine container's next run
        assert not restarted.buffer.any(), "a restart starts from a zeroed pool"
        restarted.buffer[:16] = 7
        assert np.array_equal(sidecar.array[:16], np.full(16, 7, dtype=np.uint8))
    finally:
        sidecar.close()


def test_a_pool_of_another_size_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "disagg-kv.pool"
    path.write_bytes(b"\xff" * 4096)  # a file some other layout left
    kv = new_pool(TinyModel(TinyConfig()), settings(path))
    assert int(kv.buffer.numel()) != 4096
    assert path.stat().st_size >= int(kv.buffer.numel())
    assert not kv.buffer.any()
