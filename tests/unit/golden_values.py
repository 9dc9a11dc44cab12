"""The golden wire vectors' values as the wire tests compare them (tests/golden and tests/golden/vllm)."""

from __future__ import annotations

import json
from typing import Any

import msgspec


def from_golden(value: Any) -> Any:
    """The golden JSON's values with `{"$bytes_hex": ...}` turned back into bytes."""
    if isinstance(value, dict):
        if "$bytes_hex" in value:
            return bytes.fromhex(str(value["$bytes_hex"]))
        return {k: from_golden(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_golden(v) for v in value]
    return value


def plain(obj: Any) -> Any:
    """A struct as the golden JSON states it: tuples as lists, bytes kept."""
    value = msgspec.to_builtins(obj, builtin_types=(bytes,))
    return json.loads(json.dumps(value, default=lambda b: {"$hex": b.hex()}), object_hook=_unhex)


def _unhex(d: dict[str, Any]) -> Any:
    return bytes.fromhex(d["$hex"]) if set(d) == {"$hex"} else d
