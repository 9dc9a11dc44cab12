"""A vLLM prefill engine's KV transport, for its watching sidecar's peer report.

vLLM's NIXL agent lives in the engine's processes, so the sidecar cannot ask it. The operator gives the engine
container UCX's protocol-selection log (`UCX_PROTO_INFO`, `UCX_LOG_FILE` in the pod's `/dev/shm`, which both
containers mount), and this reads the engine's put tables there (`connector.ucx_log.read_dir`). UCX prints a
table per endpoint configuration, not per peer, and vLLM's agent names say nothing of the decode engine, so
every pair of the engine reports the lanes of all its put tables: one transport per engine, which is what a
node without working RDMA changes. Bytes and GB/s stay unknown here (vLLM counts them inside the engine).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from disagg.worker.connector.ucx_log import UcxLog, read_dir
from disagg.worker.contracts.pod_contract import UCX_LOG_DIR
from disagg.worker.contracts.ucx_lanes import MAX_LANES, put_lanes
from disagg.worker.sidecar.pairs import PairStats


class EveryPair(Mapping[str, PairStats]):
    """The same stats for every decode engine the report asks about."""

    def __init__(self, stats: PairStats) -> None:
        self._stats = stats

    def __getitem__(self, key: str) -> PairStats:
        return self._stats

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 1


class EngineLanes:
    """The put lanes in the UCX logs of `directory`, read on at each `snapshot` (the reporter's rounds)."""

    def __init__(self, directory: Path = Path(UCX_LOG_DIR)) -> None:
        self.directory = directory
        self._logs: dict[Path, UcxLog] = {}

    def snapshot(self) -> Mapping[str, PairStats]:
        lanes: list[str] = []
        for found in put_lanes(read_dir(self.directory, self._logs)).values():
            lanes.extend(lane for lane in found if lane not in lanes)
        return EveryPair(PairStats(lanes=tuple(lanes[:MAX_LANES]))) if lanes else {}
