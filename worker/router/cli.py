"""`disagg router run`: the router process the operator deploys per DisaggDeployment.

It watches the deployment's engine pods through the API server (in-cluster service account, else
`--kubeconfig` or `KUBECONFIG`), recomputes the routable pairs on every change (`pairing.routing_from_pods`,
the function the operator's status uses too) and serves the OpenAI-compatible API on `--host:--port`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from disagg.worker.contracts.pod_contract import HTTP_HOST_ENV
from disagg.worker.router.config import RouterConfig

log = logging.getLogger("disagg.worker.router")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("router", help="the OpenAI-compatible router of a DisaggDeployment")
    commands = parser.add_subparsers(dest="router_command", metavar="COMMAND", required=True)
    run = commands.add_parser("run", help="route requests over the deployment's verified KV pairs")
    run.add_argument("--deployment", required=True, help="the DisaggDeployment whose pods to route to")
    run.add_argument("--namespace", required=True)
    run.add_argument("--port", type=int, default=8000)
    run.add_argument(
        "--host",
        default=os.environ.get(HTTP_HOST_ENV) or "0.0.0.0",
        help=f"bind address (default ${HTTP_HOST_ENV}, else every address)",
    )
    run.add_argument("--kubeconfig", default=None, help="outside a pod (default: KUBECONFIG, ~/.kube/config)")
    run.add_argument(
        "--prefill-timeout", type=float, default=300.0, help="seconds for the prefill leg's answer"
    )
    run.add_argument(
        "--decode-timeout",
        type=float,
        default=600.0,
        help="seconds for the decode leg's first byte, and for a stream's first data event",
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streamed decode answer may go without a data event before it fails as stalled "
        "(SSE comments such as keep-alives do not count)",
    )
    defaults = RouterConfig()
    clients = run.add_argument_group("client bounds (what one client may hold, and for how long)")
    clients.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="client connections held at once; one past it is answered 503 with Retry-After and closed "
        "(0: no cap; default %(default)s)",
    )
    clients.add_argument(
        "--header-timeout-s",
        type=float,
        default=defaults.header_timeout_s,
        help="seconds a client has, from connecting or from its previous response, to send a request's "
        "complete headers; a slower or idle keep-alive connection is closed (default %(default)s)",
    )
    clients.add_argument(
        "--body-timeout-s",
        type=float,
        default=defaults.body_timeout_s,
        help="seconds a client has, once its headers are in, to send its whole body; a slower one gets "
        "408 and is disconnected (default %(default)s)",
    )
    clients.add_argument(
        "--min-body-rate-bytes-s",
        type=int,
        default=defaults.min_body_rate_bytes_s,
        help="the least average rate, from its headers on, at which a body must arrive once the grace has "
        "passed; a slower one gets 408 and is disconnected (0: no floor; default %(default)s)",
    )
    clients.add_argument(
        "--body-rate-grace-s",
        type=float,
        default=defaults.body_rate_grace_s,
        help="seconds a body may take before the rate floor applies (default %(default)s)",
    )
    clients.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="largest request body: refused with 413 by its content-length, or as soon as it streams past "
        "(default %(default)s)",
    )
    clients.add_argument(
        "--max-body-buffer-bytes",
        type=int,
        default=defaults.max_body_buffer_bytes,
        help="request body bytes the router holds while reading bodies, summed over every client and shared "
        "fairly: when it is full, a body over its share (the budget over the bodies being read) gets 503 "
        "with Retry-After, and a body within its share cuts those over theirs (default %(default)s)",
    )
    clients.add_argument(
        "--request-timeout-s",
        type=float,
        default=defaults.request_timeout_s,
        help="seconds a request may take from its headers to its answer's end, queueing included; past it "
        "the client gets 504 (or an SSE error event once streaming), and both legs are closed "
        "(0: none; default %(default)s)",
    )
    load = run.add_argument_group("backpressure (work is queued or shed, never sent to expire)")
    load.add_argument(
        "--max-in-flight-per-decoder",
        type=int,
        default=defaults.max_in_flight_per_decoder,
        help="requests one decoder may hold at once (set it to the decoder's --max-num-seqs); a request "
        "finding no decoder with room waits, neither leg sent (0: no bound; default %(default)s)",
    )
    load.add_argument(
        "--load-poll-s",
        type=float,
        default=defaults.load_poll_s,
        help="seconds between two reads of each decoder's /metrics (vllm:num_requests_running, "
        "vllm:kv_cache_usage_perc), by which a decoder holds at most what it runs plus the headroom, "
        "within what its free KV blocks hold (0: never read; the fixed bound alone; default %(default)s)",
    )
    load.add_argument(
        "--decoder-headroom",
        type=int,
        default=defaults.decoder_headroom,
        help="decode legs a decoder may hold beyond what it ran at the last read (default %(default)s)",
    )
    load.add_argument(
        "--decoder-headroom-fraction",
        type=float,
        default=defaults.decoder_headroom_fraction,
        help="the headroom as a fraction of what the decoder runs, where that is more (default %(default)s)",
    )
    load.add_argument(
        "--max-queued",
        type=int,
        default=defaults.max_queued,
        help="requests that may wait for room; one more gets 503 with Retry-After (default %(default)s)",
    )
    load.add_argument(
        "--queue-timeout-s",
        type=float,
        default=defaults.queue_timeout_s,
        help="seconds a request waits for room before it gets 503 with Retry-After (default %(default)s)",
    )
    load.add_argument(
        "--retry-after-s",
        type=int,
        default=defaults.retry_after_s,
        help="the Retry-After, in seconds, of every 503 the router sheds load with (default %(default)s)",
    )
    eject = run.add_argument_group("outlier ejection (an engine whose legs keep failing leaves the routing)")
    eject.add_argument(
        "--eject-after-failures",
        type=int,
        default=defaults.eject_after_failures,
        help="failed legs in a row after which an engine's pairs leave the routing; they come back through "
        "the KV canary when the hold ends (0: never eject; default %(default)s)",
    )
    eject.add_argument(
        "--eject-s",
        type=float,
        default=defaults.eject_s,
        help="seconds an engine is ejected for, doubled for each ejection since it last served a leg "
        "(default %(default)s)",
    )
    eject.add_argument(
        "--max-eject-s",
        type=float,
        default=defaults.max_eject_s,
        help="the longest an ejection lasts, however often the engine failed (default %(default)s)",
    )
    canary = run.add_argument_group("the KV canary (a pair is routed to only once KV has crossed it)")
    canary.add_argument(
        "--no-kv-canary",
        dest="kv_canary",
        action="store_false",
        help="route to a pair as soon as its sidecars vouch for it, without a canary request first "
        "(default: every new pair, and every pair of a restarted engine, first carries one one-token "
        "request of the router's own through both legs)",
    )
    canary.add_argument(
        "--canary-timeout-s",
        type=float,
        default=defaults.canary_timeout_s,
        help="seconds a canary request may take before it counts as failed (default %(default)s)",
    )
    canary.add_argument(
        "--canary-retry-s",
        type=float,
        default=defaults.canary_retry_s,
        help="seconds between canaries of a pair whose last one failed; the pair is excluded meanwhile, "
        "with the failure as its reason (default %(default)s)",
    )
    run.add_argument(
        "--recompute-window-edge",
        dest="window_edges",
        action="append",
        type=window_edge,
        default=[],
        metavar="WINDOW:BLOCK",
        help="a sliding window and block size (tokens) of engines that load a prompt's KV without its "
        "window's first key when (prompt tokens - WINDOW + 1) is a whole number of BLOCKs (vLLM with the "
        "hybrid KV cache manager, docs/vllm-sliding-window-load.md): such a prompt is served again by the "
        "decoder alone, its transferred answer discarded; repeatable (the operator sets it)",
    )
    run.add_argument("--log-level", default="INFO")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from disagg.worker.contracts.pairing import Routing, routing_from_pods
    from disagg.worker.router.app import Router, start
    from disagg.worker.router.discovery import PodList, PodWatcher

    loop = asyncio.get_running_loop()
    config = config_from(args)
    raise_open_files_limit(config)
    watcher: PodWatcher | None = None
    router = Router(config, watch_alive=lambda: watcher is not None and watcher.alive())

    def on_change(pods: PodList) -> None:
        try:
            routing = routing_from_pods(pods)
        except Exception:
            # A pod the pairing cannot read must not leave the router sending to what it knew before.
            log.exception(
                "cannot compute the routing from %d pods; routing nothing until the next change", len(pods)
            )
            routing = Routing((), (), (), ())
        loop.call_soon_threadsafe(router.set_routing, routing)
        log.info("%d routable pairs, %d excluded", len(routing.pairs), len(routing.exclusions))

    watcher = PodWatcher(kube_client(args.kubeconfig), args.namespace, args.deployment, on_change)
    runner = await start(router, args.host, args.port)
    watcher.start()
    log.info("routing %s/%s on %s:%d", args.namespace, args.deployment, args.host, args.port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watcher.stop()
    await runner.cleanup()
    return 0


def window_edge(text: str) -> tuple[int, int]:
    """`--recompute-window-edge`'s value, WINDOW:BLOCK."""
    window, sep, block = text.partition(":")
    if not sep or not window.isdigit() or not block.isdigit() or int(window) < 1 or int(block) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not WINDOW:BLOCK (two positive whole numbers of tokens)"
        )
    return int(window), int(block)


def config_from(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        window_edges=tuple(args.window_edges),
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        stall_timeout_s=args.stall_timeout,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        min_body_rate_bytes_s=args.min_body_rate_bytes_s,
        body_rate_grace_s=args.body_rate_grace_s,
        max_request_bytes=args.max_request_bytes,
        max_body_buffer_bytes=args.max_body_buffer_bytes,
        request_timeout_s=args.request_timeout_s,
        max_in_flight_per_decoder=args.max_in_flight_per_decoder,
        load_poll_s=args.load_poll_s,
        decoder_headroom=args.decoder_headroom,
        decoder_headroom_fraction=args.decoder_headroom_fraction,
        max_queued=args.max_queued,
        queue_timeout_s=args.queue_timeout_s,
        retry_after_s=args.retry_after_s,
        eject_after_failures=args.eject_after_failures,
        eject_s=args.eject_s,
        max_eject_s=args.max_eject_s,
        kv_canary=args.kv_canary,
        canary_timeout_s=args.canary_timeout_s,
        canary_retry_s=args.canary_retry_s,
    )


def raise_open_files_limit(config: RouterConfig) -> None:
    """Every client connection and every leg is a file descriptor: the connection cap is only the bound if
    the process may open that many (a container's soft limit is often 1024, its hard one far higher)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # A connection, and at most two legs for the request on it; a margin for the API server watch, the
    # listener and logging. No cap: as many as the hard limit allows.
    wanted = 3 * config.max_connections + 256 if config.max_connections > 0 else hard
    if soft == resource.RLIM_INFINITY or (wanted != resource.RLIM_INFINITY and soft >= wanted):
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
        return
    if target < wanted:
        log.warning(
            "the open-files limit is %d, under the %d that --max-connections %d needs",
            target,
            wanted,
            config.max_connections,
        )


def kube_client(kubeconfig: str | None) -> Any:
    """In a pod, the service account; elsewhere `kubeconfig`, else KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    if kubeconfig is not None:
        return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()
