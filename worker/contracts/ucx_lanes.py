"""Which UCX lanes a NIXL agent's KV really moves over, read from UCX's own protocol selection. Pure.

UCX chooses a transport per endpoint configuration, in silence: a node whose RDMA does not work moves KV over
TCP at a fraction of the speed, and nothing in NIXL's API says so. With `UCX_PROTO_INFO=y` UCX prints, for
every endpoint configuration it creates (when NIXL loads a peer's metadata), one table per operation with the
lanes it selected, titled with its worker's name, which is the NIXL agent's name:

    [1796644107.534430] [vm:24743:0]   | src intra-node cfg#1                                     |
    [1796644107.534430] [vm:24743:0]   | remote memory write by ucp_put* from host memory to host |
    ...
    [1796644107.534430] [vm:24743:0]   | 0..inf | zero-copy   | cma/memory                        |

NIXL moves KV with `ucp_put` (a WRITE), so the lanes of the put tables are the KV's transport; the other
tables (active messages: notifications, wireup) are not KV. `UCX_LOG_FILE` sends these lines to a file, which
the transfer sidecar reads for its own agent and a watching sidecar for its engine's (`connector.ucx_log`).

This module parses that text (bounded, untrusted: a line is at most `MAX_LINE_CHARS`), names each lane's
family (`rdma`, `tcp`, `shm`, `cuda_ipc`, ...), and holds the UCX settings that make a spec's
`kvTransfer.transport` the only one UCX may choose, so a node without it fails at the agent or the handshake
with UCX's own reason instead of falling back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

Transport = Literal["any", "rdma", "tcp", "shm", "cuda_ipc"]
TRANSPORTS: Final[tuple[Transport, ...]] = ("any", "rdma", "tcp", "shm", "cuda_ipc")
"""What `spec.kvTransfer.transport` may demand; `any` lets UCX choose."""

MAX_LINE_CHARS: Final = 512
MAX_LANES: Final = 16
"""Lanes kept per table (UCX stripes a put over a few at most)."""

# UCX transport name (before the "/device") -> family. Names from UCX 1.23's uct components.
_FAMILY: Final[Mapping[str, str]] = {
    **{name: "rdma" for name in ("rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5", "srd", "gga_mlx5")},
    **{name: "shm" for name in ("cma", "posix", "sysv", "xpmem", "knem")},
    "tcp": "tcp",
    "cuda_ipc": "cuda_ipc",
    "self": "self",
}

# What each demand lets UCX use. `self` keeps an agent's own loopback endpoint (NIXL connects an agent to
# itself at start); `cuda_copy` lets UCX stage GPU memory (NIXL refuses a UCX_TLS without it on a GPU node)
# and is no network lane. Active messages (notifications) need a lane with peer failure handling: under
# NIXL's `peer` error mode no shared-memory transport has one, so `shm` and `cuda_ipc` keep `tcp` for them,
# and the put lanes the report reads tell whether the KV itself took the demanded transport.
_UCX_TLS: Final[Mapping[str, str]] = {
    "rdma": "ib,self,cuda_copy",
    "tcp": "tcp,self,cuda_copy",
    "shm": "sm,tcp,self,cuda_copy",
    "cuda_ipc": "cuda_ipc,cuda_copy,tcp,self",
}

PROTO_INFO_ENV: Final = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE_SIZE": "4m", "UCX_LOG_FILE_ROTATE": "1"}
"""What makes UCX print its protocol selection (into `UCX_LOG_FILE` when that is set), and the bound on that
file: it lives in the pod's shared memory, so a process that logs without end (a peer refused over and over)
must not fill it; past 4 MiB UCX starts the file again and keeps one older one (`connector.ucx_log` reads
the new file from its start)."""

_PREFIX = re.compile(r"^\[[0-9.]+\] \[[^\]]*\]\s+")
_TITLE = re.compile(r"^\| (\S+) (self|intra-node|inter-node) cfg#(\d+)\s*\|$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")
_PROBLEM = re.compile(r"\bUCX\s+(ERROR|WARN)\s+(.*)$")


@dataclass(frozen=True)
class LaneTable:
    """One protocol-selection table: a worker (NIXL agent), one endpoint configuration, one operation."""

    worker: str
    scope: str
    """`self` (the agent's endpoint to itself), `intra-node` or `inter-node`."""
    cfg: int
    operation: str
    lanes: tuple[str, ...]
    """Each selected lane once, in the order UCX printed them: `cma/memory`, `rc_mlx5/mlx5_0:1`."""

    @property
    def is_put(self) -> bool:
        return "ucp_put" in self.operation


@dataclass(frozen=True)
class Parsed:
    tables: tuple[LaneTable, ...]
    problems: tuple[str, ...]
    """UCX's own ERROR and WARN lines (its reason when an agent or endpoint cannot be made)."""


def ucx_tls(transport: str) -> str | None:
    """The `UCX_TLS` that leaves UCX only `transport` (None for `any`, UCX's choice, or an unknown name)."""
    return _UCX_TLS.get(transport)


def ucx_env(transport: str) -> dict[str, str]:
    """The UCX environment of a process whose NIXL agent moves KV under `spec.kvTransfer.transport`."""
    tls = ucx_tls(transport)
    return {**PROTO_INFO_ENV, **({"UCX_TLS": tls} if tls else {})}


def family(lane: str) -> str:
    """A lane's family: `rdma`, `tcp`, `shm`, `cuda_ipc`, `self`, or the UCX transport's own name."""
    name = lane.split("/", 1)[0]
    return _FAMILY.get(name, name)


def families(lanes: Iterable[str]) -> tuple[str, ...]:
    """The families of `lanes`, each once, sorted: what a pair's KV moved over."""
    return tuple(sorted({family(lane) for lane in lanes}))


def transport_name(lanes: Iterable[str]) -> str:
    """One word for a pair: its family (`shm`), or several joined (`rdma+tcp`, a put striped over both)."""
    return "+".join(families(lanes))


def satisfies(demanded: str, lanes: Iterable[str]) -> bool:
    """Whether KV moved over `lanes` is what `demanded` asks for (`any` takes every lane)."""
    found = families(lanes)
    return demanded == "any" or (bool(found) and set(found) == {demanded})


def parse(text: str) -> Parsed:
    """The protocol tables and problem lines in a stretch of UCX's log; unreadable lines are skipped."""
    tables: list[LaneTable] = []
    problems: list[str] = []
    title: tuple[str, str, int] | None = None
    operation: str | None = None
    in_rows = False
    lanes: list[str] = []

    def close() -> None:
        nonlocal title, operation, in_rows, lanes
        if title is not None and operation is not None and lanes:
            tables.append(LaneTable(title[0], title[1], title[2], operation, tuple(lanes)))
        title, operation, in_rows, lanes = None, None, False, []

    for raw in text.splitlines():
        if len(raw) > MAX_LINE_CHARS:
            continue
        if (problem := _PROBLEM.search(raw)) is not None:
            problems.append(problem.group(2).strip())
            continue
        line = _PREFIX.sub("", raw).strip()
        if (match := _TITLE.match(line)) is not None:
            close()
            title = (match.group(1), match.group(2), int(match.group(3)))
            continue
        if title is None:
            continue
        if line.startswith("+"):
            if in_rows and lanes:
                close()
            continue
        if not (line.startswith("|") and line.endswith("|")):
            close()
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if operation is None:
            operation = cells[0]
        elif "Range" in cells and "Config" in cells:
            in_rows = True
        elif in_rows:
            for name, device in _LANE.findall(cells[-1]):
                lane = f"{name}/{device}"
                if lane not in lanes and len(lanes) < MAX_LANES:
                    lanes.append(lane)
    close()
    return Parsed(tuple(tables), tuple(problems))


def put_lanes(
    tables: Iterable[LaneTable], worker: str | None = None
) -> dict[tuple[str, int], tuple[str, ...]]:
    """The KV lanes per (worker, endpoint configuration) of peers (not an agent's endpoint to itself)."""
    out: dict[tuple[str, int], list[str]] = {}
    for table in tables:
        if not table.is_put or table.scope == "self" or (worker is not None and table.worker != worker):
            continue
        lanes = out.setdefault((table.worker, table.cfg), [])
        lanes.extend(lane for lane in table.lanes if lane not in lanes)
    return {key: tuple(value) for key, value in out.items()}
