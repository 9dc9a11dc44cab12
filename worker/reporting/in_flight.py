"""How many requests the pod's engine has in flight, read from the engine's own Prometheus endpoint.

vLLM and the reference engine both export vLLM's scheduler gauges, `vllm:num_requests_running` and
`vllm:num_requests_waiting` (a decode request waiting for its prompt's KV is waiting), so one reading serves
both sidecar modes: a watching sidecar moves no KV and sees none of the engine's requests itself. The
engine is asked where its side channel is (`SidecarConfig.engine_host`: a vLLM PP engine's head for every
stage). A PP prefill engine's stages past the head schedule nothing and export no scheduler gauge (a
reference engine's headless stage), so their count is None; the operator reads the head's report for them
(`operator.rollout`'s drain rule). What the router has sent but the engine has not yet received is not
counted: the operator waits a grace after a drain mark for that.
"""

from __future__ import annotations

import logging
import math
import urllib.error
import urllib.request
from typing import Final

from disagg.worker.contracts.pod_contract import DEFAULT_ENGINE_HTTP_PORT
from disagg.worker.sidecar.config import SidecarConfig

log = logging.getLogger(__name__)
GAUGES: Final = ("vllm:num_requests_running", "vllm:num_requests_waiting")
TIMEOUT_S: Final = 2.0
# An exposition larger than this is not an engine's: read no further.
MAX_METRICS_BYTES: Final = 4 * 1024 * 1024


def parse_in_flight(text: str) -> int | None:
    """The sum of every sample of `GAUGES` in a Prometheus exposition, or None when it has none (an engine
    whose scheduler is not up yet exports no sample)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in GAUGES:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(value) or value < 0:
            return None  # not a count: the engine's word is unknown, not idle
        total, seen = total + value, True
    return round(total) if seen else None


def metrics_url(config: SidecarConfig, port: int = DEFAULT_ENGINE_HTTP_PORT) -> str:
    return f"http://{config.engine_host}:{port}/metrics"


def engine_in_flight(url: str, timeout_s: float = TIMEOUT_S) -> int | None:
    """The engine's requests in flight now, or None when its metrics cannot be read (not idle: unknown)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(MAX_METRICS_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.debug("the engine's metrics at %s could not be read: %s", url, exc)
        return None
    if len(body) > MAX_METRICS_BYTES:
        return None  # not an engine's page; a cut one could miss a gauge and read as idle
    return parse_in_flight(body.decode("utf-8", errors="replace"))
