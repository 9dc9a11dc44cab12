"""UCX's own log, where it says which lanes it chose for each peer (`contracts.ucx_lanes` reads the text).

`UCX_LOG_FILE` names a file per process (`%p` is the pid, `%h` the host). The transfer sidecar sends its own
agent's UCX log to one (`enable`, before its agent is made: UCX reads the variable once, when NIXL loads it),
and reads what was added after each peer it loads. A watching sidecar reads its vLLM engine's files in the
volume both containers mount (`read_dir`), as vLLM's agent lives in the engine's processes.

A file is read from where the last read stopped, at most `MAX_READ_BYTES` at a time, and only whole lines;
UCX writes the lines, so they are bounded before they are parsed.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Final

from disagg.worker.contracts.ucx_lanes import PROTO_INFO_ENV, LaneTable, Parsed, parse

LOG_FILE_ENV: Final = "UCX_LOG_FILE"
MAX_READ_BYTES: Final = 1 << 20
MAX_FILES: Final = 64
MAX_READS: Final = 16
"""Reads of one file per `read_dir`: the rest waits for the next call."""
MAX_TABLES: Final = 4096
"""Tables kept per file: UCX prints one per endpoint configuration and operation, a handful per peer kind."""
LOG_FILE_PATTERN: Final = "ucx.%h.%p.log"


def enable(env: MutableMapping[str, str], directory: Path | None = None) -> Path | None:
    """Make this process's UCX print its protocol selection into a file, and return that file.

    What the environment already says wins (the operator's builders set both variables); otherwise the file
    goes to `directory`, or a private temporary one. None where no directory can be made (a read-only root
    without the variable): UCX then logs as it would, and pairs' lanes are unknown."""
    for key, value in PROTO_INFO_ENV.items():
        env.setdefault(key, value)
    if LOG_FILE_ENV not in env:
        try:
            where = directory if directory is not None else Path(tempfile.mkdtemp(prefix="disagg-ucx-"))
        except OSError:
            return None
        env[LOG_FILE_ENV] = str(where / LOG_FILE_PATTERN)
    return own_file(env[LOG_FILE_ENV])


def own_file(pattern: str) -> Path:
    """The file UCX writes for this process under `pattern` (UCX expands `%p` and `%h`)."""
    return Path(pattern.replace("%p", str(os.getpid())).replace("%h", socket.gethostname()))


class UcxLog:
    """One UCX log file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._tables: list[LaneTable] = []

    def read_new(self) -> Parsed:
        """What UCX added since the last read (whole lines only; a missing file has added nothing)."""
        try:
            with self.path.open("rb") as handle:
                if os.fstat(handle.fileno()).st_size < self._offset:
                    # UCX started the file again (`UCX_LOG_FILE_SIZE`): read the new one from its start.
                    self._offset = 0
                handle.seek(self._offset)
                chunk = handle.read(MAX_READ_BYTES)
        except OSError:
            return Parsed((), ())
        end = chunk.rfind(b"\n")
        if end < 0:
            # A line longer than a read is no table line: skip it rather than wait for its end forever.
            self._offset += len(chunk) if len(chunk) == MAX_READ_BYTES else 0
            return Parsed((), ())
        self._offset += end + 1
        parsed = parse(chunk[: end + 1].decode("utf-8", errors="replace"))
        self._tables.extend(parsed.tables[: max(0, MAX_TABLES - len(self._tables))])
        return parsed

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def tables(self) -> tuple[LaneTable, ...]:
        """Every table read so far."""
        return tuple(self._tables)


def read_dir(directory: Path, logs: dict[Path, UcxLog]) -> tuple[LaneTable, ...]:
    """Every table in the UCX log files of `directory` (one per process), read on from `logs`' offsets."""
    try:
        names = sorted(directory.glob("ucx.*.log"))[:MAX_FILES]
    except OSError:
        return ()
    for path in names:
        log = logs.setdefault(path, UcxLog(path))
        for _ in range(MAX_READS):
            before = log.offset
            log.read_new()
            if log.offset == before:
                break
    return tuple(table for log in logs.values() for table in log.tables)
