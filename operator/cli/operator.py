"""`disagg operator run`: the kopf operator (and optionally its admission webhook) in this process.

In a cluster (the Helm chart): `--namespace-all --webhook-port 9443 --webhook-cert-dir /etc/disagg/webhook
--health-port 8080`. In development and tests: `--namespace NS --webhook-port P --webhook-dev` serves kopf's
self-signed webhook on 127.0.0.1 and lets kopf write the webhook configuration. kopf is imported only when the
command runs, so the rest of the CLI starts fast.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEV_WEBHOOK_CONFIGURATION = "dev.validate.disagg.io"
# glibc's mallopt parameter number for the arena limit (malloc.h).
M_ARENA_MAX = -8


def register(subparsers: Any) -> None:
    from disagg.operator.settings import LOG_LEVEL_ENV, LOG_LEVELS

    operator = subparsers.add_parser("operator", help="Run the DisaggDeployment operator.")
    commands = operator.add_subparsers(dest="operator_command", metavar="COMMAND", required=True)
    run = commands.add_parser("run", help="Reconcile DisaggDeployments until stopped (SIGTERM, SIGINT).")
    scope = run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="Watch this namespace (repeatable; a glob such as 'team-*' works).",
    )
    scope.add_argument("--namespace-all", action="store_true", help="Watch every namespace.")
    run.add_argument("--webhook-port", type=int, help="Serve the validating admission webhook on this port.")
    run.add_argument(
        "--webhook-cert-dir",
        type=Path,
        help="Folder with tls.crt and tls.key for the webhook (the configuration is the chart's).",
    )
    run.add_argument(
        "--webhook-dev",
        action="store_true",
        help="Serve the webhook on 127.0.0.1 with a self-signed certificate and let kopf manage the "
        f"ValidatingWebhookConfiguration (--webhook-configuration, default {DEV_WEBHOOK_CONFIGURATION}).",
    )
    run.add_argument("--webhook-configuration", default=DEV_WEBHOOK_CONFIGURATION, help=argparse.SUPPRESS)
    run.add_argument("--health-port", type=int, help="Serve kopf's liveness endpoint at GET /healthz.")
    run.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help=f"Log verbosity (default: ${LOG_LEVEL_ENV} or info).",
    )
    run.set_defaults(func=_run)


def _cap_malloc_arenas() -> None:
    """At most two glibc malloc arenas (what MALLOC_ARENA_MAX=2 sets), before any thread starts.

    glibc gives each thread that allocates its own arena, up to eight per core, and keeps what each frees: the
    executor and status threads each hold megabytes of freed JSON that no other thread can reuse. The
    operator's threads mostly wait on the API server, so sharing two arenas costs no throughput."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)  # glibc only; musl has no arenas to cap
    if mallopt is not None:
        mallopt(M_ARENA_MAX, 2)


def _run(args: argparse.Namespace) -> int:
    _cap_malloc_arenas()
    import kopf

    import disagg.operator.control.handlers  # noqa: F401  (registers the handlers)
    from disagg.operator.control import access
    from disagg.operator.control.k8s_apply import Kube, api_client
    from disagg.operator.control.kopf_tuning import ChildrenForgotten
    from disagg.operator.settings import Settings, SettingsError

    try:
        settings = Settings.from_environ(os.environ)
    except SettingsError as error:
        raise SystemExit(f"disagg operator run: {error}") from None
    role = settings.installation.worker_cluster_role
    try:
        access.check_when_reachable(Kube(api_client()), role, args.namespace, clusterwide=args.namespace_all)
    except access.AccessDenied as denied:
        raise SystemExit(f"disagg operator run: {denied}") from None

    memo = kopf.Memo()
    memo.settings = settings
    if args.webhook_port is not None:
        from disagg.operator.control import webhook

        if args.webhook_dev:
            memo.webhook = webhook.dev_webhook(args.webhook_port, args.webhook_configuration)
        elif args.webhook_cert_dir is not None:
            memo.webhook = webhook.cluster_webhook(args.webhook_port, args.webhook_cert_dir)
        else:
            raise SystemExit("disagg operator run: --webhook-port needs --webhook-cert-dir or --webhook-dev")
    level = args.log_level or settings.log_level
    kopf.configure(verbose=level == "debug", quiet=level == "warning")
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    kopf.run(
        standalone=True,
        clusterwide=args.namespace_all,
        namespaces=tuple(args.namespace),
        liveness_endpoint=liveness,
        memo=memo,
        memories=ChildrenForgotten(),
    )
    return 0
