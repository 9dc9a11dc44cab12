"""The router's bounds and timeouts, apart from the server so that `disagg router run`'s flags can show their
defaults without importing aiohttp."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """Bounds and timeouts. A timeout that expires fails the request with 504 and closes both legs.
    `disagg router run` has a flag for each client-facing bound (its help says what the bound does)."""

    # --- clients: what one may hold, and for how long
    max_request_bytes: int = 8 * 1024 * 1024
    # The request bodies being read at once, summed: what slow uploads can make the router hold. Shared
    # fairly (`client_body`): a body within its share is never refused for bytes others hold.
    max_body_buffer_bytes: int = 128 * 1024 * 1024
    max_connections: int = 4096
    # From a connection's start (or its previous response) to its request's last header byte; an idle
    # keep-alive connection is closed after it too.
    header_timeout_s: float = 10.0
    # From the request's headers to its body's last byte.
    body_timeout_s: float = 60.0
    # The rate floor: a body must arrive at this average from its headers on (0: no floor), once the grace
    # has passed; a slower one gets 408.
    min_body_rate_bytes_s: int = 32 * 1024
    body_rate_grace_s: float = 5.0
    # From the request's headers to its answer's end, queueing included (0: none).
    request_timeout_s: float = 3600.0
    # --- backpressure (`admission`): decode legs one decoder may hold (0: no bound), and the wait for room
    max_in_flight_per_decoder: int = 256
    # What a decoder can take now, from its metrics (`decoder_load`): read every load_poll_s (0: never);
    # what it runs plus the headroom, within what its free KV blocks hold.
    load_poll_s: float = 0.5
    decoder_headroom: int = 8
    decoder_headroom_fraction: float = 0.25
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    # --- engines
    # A non-streamed completion; the prefill's answer (its block ids grow with the prompt); one SSE event.
    max_response_bytes: int = 64 * 1024 * 1024
    max_prefill_response_bytes: int = 8 * 1024 * 1024
    max_sse_event_bytes: int = 4 * 1024 * 1024
    max_error_bytes: int = 64 * 1024
    connect_timeout_s: float = 10.0
    # The prefill leg's whole answer; the decode leg's first byte (it waits for the prefill and the KV).
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 600.0
    # Between two data events of a streamed decode answer once it has started (SSE comments, such as
    # keep-alives, do not count: a decoder sending only those is stalled).
    stall_timeout_s: float = 60.0
    models_timeout_s: float = 10.0
    # --- prompts whose transferred KV the engines are known to get wrong: (sliding window, block size) of a
    # vLLM deployment with HMA on a release with the sliding-window load defect. A prompt whose length loses
    # a window's first key (`releases.loses_window_edge`) is served again by the decoder alone, without the
    # transfer, and its first answer discarded (`--recompute-window-edge`).
    window_edges: tuple[tuple[int, int], ...] = ()
    # --- outlier ejection (`outliers`): an engine whose legs fail this many times in a row (0: never) leaves
    # the routing for eject_s, doubled for each ejection since it last served a leg, up to max_eject_s
    eject_after_failures: int = 3
    eject_s: float = 5.0
    max_eject_s: float = 300.0
    # --- the KV canary (`canary`): a pair is routed to only after a request of the router's own crossed it
    kv_canary: bool = True
    canary_timeout_s: float = 60.0
    canary_retry_s: float = 5.0
