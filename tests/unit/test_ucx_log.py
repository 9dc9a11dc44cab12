"""Reading UCX's log file on from where the last read stopped, when UCX starts the file again at its size
bound (`UCX_LOG_FILE_SIZE`, which the pods set: the file lives in the pod's shared memory)."""

from __future__ import annotations

from pathlib import Path

from disagg.worker.connector.ucx_log import UcxLog
from disagg.worker.contracts.ucx_lanes import PROTO_INFO_ENV, put_lanes
from disagg.worker.reporting.engine_lanes import EngineLanes
from disagg.worker.sidecar.pairs import PairStats

PREFIX = "[1796644107.534430] [vm:24743:0]   "


def table(worker: str, cfg: int, lane: str) -> str:
    rows = [
        "+----------------------------------------------------------+",
        f"| {worker} intra-node cfg#{cfg} |",
        "| remote memory write by ucp_put* from host memory to host |",
        "+---------+-------------+----------------------------------+",
        "| Range   | Config      | Lanes                            |",
        "+---------+-------------+----------------------------------+",
        f"| 0..inf  | zero-copy   | {lane} |",
        "+---------+-------------+----------------------------------+",
    ]
    return "".join(PREFIX + row + "\n" for row in rows)


def test_a_log_started_again_is_read_from_its_start_and_earlier_tables_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "ucx.vm.1.log"
    path.write_text(table("agent-a", 1, "cma/memory") + "filler line\n" * 50)
    log = UcxLog(path)
    log.read_new()
    assert put_lanes(log.tables) == {("agent-a", 1): ("cma/memory",)}
    # UCX truncates the file at its bound and goes on writing from the start: shorter than what was read.
    path.write_text(table("agent-a", 2, "tcp/lo"))
    log.read_new()
    assert put_lanes(log.tables) == {("agent-a", 1): ("cma/memory",), ("agent-a", 2): ("tcp/lo",)}


def test_the_log_is_bounded_wherever_proto_info_is_on() -> None:
    assert PROTO_INFO_ENV["UCX_LOG_FILE_SIZE"] == "4m" and PROTO_INFO_ENV["UCX_LOG_FILE_ROTATE"] == "1"


def test_a_vllm_prefill_engines_put_lanes_are_every_pairs_transport(tmp_path: Path) -> None:
    # Two processes of the engine (two files), one with a put table to a peer and its own endpoint's table.
    (tmp_path / "ucx.pod.11.log").write_text(
        table("engine-a_0", 1, "tcp/lo") + table("engine-a_0", 2, "tcp/eth0")
    )
    (tmp_path / "ucx.pod.12.log").write_text("no tables yet\n")
    (tmp_path / "other.log").write_text(table("not-ucx", 1, "rc_mlx5/mlx5_0:1"))
    lanes = EngineLanes(tmp_path)
    pairs = lanes.snapshot()
    assert pairs["any decode engine"] == pairs["another"] == PairStats(lanes=("tcp/lo", "tcp/eth0"))
    assert pairs["x"].transport == "tcp"
    # Read on: a table written later joins the lanes.
    with (tmp_path / "ucx.pod.12.log").open("a") as out:
        out.write(table("engine-a_1", 1, "cma/memory"))
    assert lanes.snapshot()["x"].transport == "shm+tcp"


def test_an_engine_with_no_put_table_yet_reports_no_transport(tmp_path: Path) -> None:
    assert EngineLanes(tmp_path).snapshot() == {}
    assert EngineLanes(tmp_path / "missing").snapshot() == {}
