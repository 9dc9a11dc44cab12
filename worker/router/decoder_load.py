"""What a decoder can take now, from its own metrics. Pure: no I/O.

Counting decode legs against a fixed cap (`--max-in-flight-per-decoder`, 256) never engaged where it
mattered: at concurrency 128 against two decoders, 64 legs each, a decoder whose KV cache held far fewer ran
what fit and queued the rest waiting for blocks, while the prefill's lease on their KV ran out (146 of 256
requests failed, `LeaseExpired` after 6 s). What a decoder can take is what it runs: a leg it has no blocks
for waits inside it, where the router cannot see it and its KV expires.

So the router reads each decoder's `/metrics` (every `load_poll_s`) for the gauges vLLM exports and the
reference engine exports under the same names, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`,
and lets a decoder hold at most what it ran at the last sample plus a headroom: `decoder_headroom` legs or
`decoder_headroom_fraction` of what it runs, whichever is more, for the legs whose KV is on its way and for
the decoder to grow into; but never more legs than its free KV blocks hold, at what a running request holds
on average (a fixed headroom alone let 8 legs wait for blocks at a decoder whose cache held 5, and they
expired there). A decoder therefore has few or no legs waiting for blocks inside it, and the rest of a burst
waits in the router's queue, neither leg sent, or is shed there with 503 and Retry-After. A decoder whose
sample is missing or stale (its page failed, or it restarted under a new id) is bounded by the fixed cap
alone.

The cost: legs whose KV is still on its way hold blocks but do not run, and count against the headroom, so a
decoder takes new legs at most at the headroom over the time a leg waits for its KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

RUNNING: Final = "vllm:num_requests_running"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class DecoderLoad:
    """One sample of a decoder's metrics: requests running (summed over its engine cores) and its KV cache
    usage, 0 to 1 (the fullest core's; None when it exports none)."""

    running: int
    kv_usage: float | None


def parse_load(text: str) -> DecoderLoad | None:
    """The load in a Prometheus text page; None without a running gauge or with a value that is not a
    finite number in range (the page is the engine's word, checked like any other answer of it)."""
    running: float | None = None
    usage: float | None = None
    for line in text.splitlines():
        name, value = _sample(line)
        if name == RUNNING and value is not None:
            if value < 0:
                return None
            running = (running or 0.0) + value
        elif name == KV_USAGE and value is not None:
            if not 0.0 <= value <= 1.0:
                return None
            usage = value if usage is None else max(usage, value)
    if running is None:
        return None
    return DecoderLoad(int(running), usage)


def window(load: DecoderLoad, *, headroom: int, headroom_fraction: float) -> int:
    """The decode legs a decoder at `load` may hold: what it runs, plus the headroom, but no more legs than
    its free KV blocks hold at what each running request holds on average (an overestimate while legs
    waiting for their KV hold blocks too, so the bound errs towards sending fewer)."""
    slack = max(headroom, math.ceil(load.running * headroom_fraction))
    usage = load.kv_usage
    if usage is None or usage <= 0.0:
        return load.running + slack
    fits = math.floor((1.0 - usage) * max(load.running, 1) / usage)
    return load.running + min(slack, fits)


def _sample(line: str) -> tuple[str, float | None]:
    """A sample line's name and value (`name{labels} value [timestamp]`); ("", None) for other lines."""
    if not line.startswith("vllm:"):
        return "", None
    if "{" in line:
        name, _, rest = line.partition("{")
        fields = rest.rpartition("}")[2].split()
    else:
        name, *fields = line.split()
    try:
        number = float(fields[0])
    except (IndexError, ValueError):
        return name, None
    return name, number if math.isfinite(number) else None
