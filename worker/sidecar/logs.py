"""The sidecar's logs: one JSON object per line on stderr, with the structured fields of each event."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from disagg.worker.kv.wire import clip, quote

MAX_FIELD_CHARS = 2048
"""A logged text is cut to this: a value a peer or the engine sent (a 16 MiB request id) must not become a
line of tens of megabytes."""


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return clip(value, MAX_FIELD_CHARS)
    if isinstance(value, bytes):
        return quote(value, MAX_FIELD_CHARS)
    if isinstance(value, list | tuple) and len(value) > 64:
        return [*value[:64], f"... ({len(value)} items)"]
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra={"fields": {...}}`, every text
    cut to `MAX_FIELD_CHARS`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": clip(record.getMessage(), MAX_FIELD_CHARS),
        }
        line.update({key: _bounded(value) for key, value in getattr(record, "fields", {}).items()})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log `msg` with `fields` as top-level keys of its JSON line."""
    logger.log(level, msg, extra={"fields": fields})
