"""`disagg engine serve`: the reference engine's OpenAI-compatible server (`disagg.worker.engine.serve`).

    disagg engine serve --port 8000 [--master-addr HOST --master-port 29500] [--num-blocks N] [--host ADDR]

It binds `--host`, else `DISAGG_HTTP_HOST` (the local rig's per-pod address), else every address.

Everything else comes from the pod's environment, read as the transfer sidecar next to it reads it
(`disagg.worker.sidecar.config.from_env`): role, engine id, PP rank (a prefill pod's StatefulSet ordinal),
the topology file (model geometry, block size, lease and registration timeout; the served model name is its
model's name), the engine socket and the KV pool path it shares with its sidecar. A PP prefill engine's
stage 0 serves the API and drives the others, which join it at `--master-addr:--master-port` (the head
pod's stable DNS name) and serve only `/healthz`, `/readyz` and `/metrics`.

Exit codes: 0 on SIGTERM, 1 when the engine fails (its sidecar refused it or went away, a stage is gone), 2
on a bad configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from disagg.worker.contracts.pod_contract import HTTP_HOST_ENV, LOG_LEVEL_ENV
from disagg.worker.kv.errors import DisaggError

if TYPE_CHECKING:
    from disagg.worker.engine.settings import ServeSettings

DEFAULT_PORT = 8000
DEFAULT_MASTER_PORT = 29500
DEFAULT_NUM_BLOCKS = 1024
DEFAULT_KV_POOL = "/dev/shm/disagg-kv.pool"


def register(subparsers: Any) -> None:
    engine = subparsers.add_parser("engine", help="the project's reference engine")
    commands = engine.add_subparsers(dest="engine_command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the reference engine's OpenAI-compatible API (configured by DISAGG_* variables)",
        description=(
            "Serve the reference engine behind /v1/completions, /v1/chat/completions, /v1/models, /healthz, "
            "/readyz and /metrics, with vLLM's push kv_transfer_params; its transfer sidecar moves the KV. "
            "Exits 0 on SIGTERM."
        ),
    )
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    serve.add_argument(
        "--host", default=None, help=f"HTTP bind address (default ${HTTP_HOST_ENV}, else every address)"
    )
    serve.add_argument(
        "--master-addr", default="127.0.0.1", help="PP prefill: the head stage's address (gloo rendezvous)"
    )
    serve.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"PP prefill: the rendezvous port on the head (default {DEFAULT_MASTER_PORT})",
    )
    serve.add_argument(
        "--num-blocks",
        type=int,
        default=DEFAULT_NUM_BLOCKS,
        help=f"KV blocks in this worker's pool (default {DEFAULT_NUM_BLOCKS})",
    )
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    return main(args.port, args.host, args.master_addr, args.master_port, args.num_blocks)


def settings_from_env(
    env: Mapping[str, str], *, port: int, host: str, master_addr: str, master_port: int, num_blocks: int
) -> ServeSettings:
    """The server's settings from the sidecar's configuration of this pod and the flags."""
    from disagg.worker.engine.settings import ServeSettings
    from disagg.worker.kv.errors import WorkerConfigError
    from disagg.worker.sidecar.config import from_env

    config = from_env(env)
    for name, value, low in (
        ("--port", port, 1),
        ("--master-port", master_port, 1),
        ("--num-blocks", num_blocks, 2),
    ):
        if not low <= value <= (65535 if "port" in name else 1 << 20):
            raise WorkerConfigError(f"{name} {value} is out of range")
    return ServeSettings(
        role=config.role,
        engine_id=config.engine_id,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        tp_size=config.tp_size,
        advertised_host=config.engine_host,
        advertised_port=config.side_channel_port,
        engine_socket=config.engine_socket,
        kv_pool=config.kv_pool or DEFAULT_KV_POOL,
        topology=config.topology,
        model_name=config.topology.model_name or "disagg-tiny",
        host=host,
        port=port,
        master_addr=master_addr,
        master_port=master_port,
        num_blocks=num_blocks,
    )


def main(
    port: int = DEFAULT_PORT,
    host: str | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_MASTER_PORT,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    env: Mapping[str, str] | None = None,
) -> int:
    from disagg.worker.sidecar.logs import configure_logging, event

    env = os.environ if env is None else env
    log = logging.getLogger("disagg.worker.engine")
    host = host or env.get(HTTP_HOST_ENV) or "0.0.0.0"
    try:
        settings = settings_from_env(
            env, port=port, host=host, master_addr=master_addr, master_port=master_port, num_blocks=num_blocks
        )
        from disagg.worker.engine.settings import model_config

        model_config(settings.topology, settings.role)
    except DisaggError as exc:
        configure_logging("info")
        event(log, logging.ERROR, "invalid engine configuration", reason=exc.reason, error=exc.message)
        return 2
    configure_logging(env.get(LOG_LEVEL_ENV, "info").lower())
    from disagg.worker.engine.serve import run

    code = run(settings)
    if settings.headless:
        # A headless stage's gloo receive cannot be interrupted; leave without waiting for its thread.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code
