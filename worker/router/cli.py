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

from disagg.worker.kv.pod_contract import HTTP_HOST_ENV

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
        "--decode-timeout", type=float, default=600.0, help="seconds for the decode leg's first byte"
    )
    run.add_argument(
        "--stall-timeout", type=float, default=60.0, help="seconds between two reads of a decode answer"
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

    from disagg.worker.kv.pairing import Routing, routing_from_pods
    from disagg.worker.router.app import Router, RouterConfig, start
    from disagg.worker.router.discovery import PodList, PodWatcher

    loop = asyncio.get_running_loop()
    config = RouterConfig(
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        stall_timeout_s=args.stall_timeout,
    )
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
