"""The sidecar's logs: one JSON object per line on stderr, with the structured fields of each event."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra={"fields": {...}}`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
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
