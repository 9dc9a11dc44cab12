"""Check, on CPU, that the parts of the real vLLM the peer tests use import and work; time each step.

    bash hack/vllm/venv.sh
    PYTHONSAFEPATH=1 .venv-vllm/bin/python hack/vllm/check.py [--json OUT.json]

Works for another release too (PYTHONPATH=<extracted wheel>). Prints one line per step: ok/FAIL, seconds, detail.
Exit status 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
T0 = time.perf_counter()
import peer  # noqa: E402

results: list[dict] = []


def step(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except Exception as e:
            detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
            ok = False
        dt = time.perf_counter() - t
        results.append({"step": name, "ok": ok, "seconds": round(dt, 2), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {dt:6.2f}s  {name}: {str(detail)[:300]}", flush=True)
        return fn

    return deco


@step("import vllm")
def _():
    import vllm

    return f"{vllm.__version__} from {vllm.__file__}"


@step("import nixl.metadata")
def _():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as M

    return {
        "NIXL_CONNECTOR_VERSION": M.NIXL_CONNECTOR_VERSION,
        "NixlAgentMetadata": list(M.NixlAgentMetadata.__dataclass_fields__),
        "NixlHandshakePayload": list(M.NixlHandshakePayload.__dataclass_fields__),
        "compute_nixl_compatibility_hash": callable(M.compute_nixl_compatibility_hash),
    }


@step("import nixl.base_scheduler / base_worker / push_* / pull_*")
def _():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: F401
        base_scheduler,
        base_worker,
        pull_scheduler,
        pull_worker,
        push_scheduler,
        push_worker,
    )

    return "ok"


@step("listener thread + _nixl_handshake client (TP2 x PP2 remote)")
def _():
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    enc = msgspec.msgpack.Encoder()
    payloads = {}
    for pp in range(2):
        for tp in range(2):
            meta = NixlAgentMetadata(
                engine_id="prefill-0",
                agent_metadata=b"blob-%d-%d" % (pp, tp),
                kv_caches_base_addr=[4096],
                device_id=0,
                num_blocks=8,
                block_lens=[4096],
                block_strides=[4096],
                kv_cache_layout="LBHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
            )
            payloads[(pp, tp)] = enc.encode(NixlHandshakePayload("ab" * 32, enc.encode(meta)))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    thread, stop = peer.start_listener(payloads, "127.0.0.1", port)
    try:
        w = peer.handshake_worker("ab" * 32)
        agents, offset = w._nixl_handshake(
            "127.0.0.1", port, 2, "prefill-0", remote_pp_size=2, notif_agents_only=True
        )
        w2 = peer.handshake_worker("ab" * 32)
        _agents2, _ = w2._nixl_handshake("127.0.0.1", port, 2, "prefill-0", remote_pp_size=2)
    finally:
        stop.set()
        thread.join()
    return {
        "notif_only": {str(k): v for k, v in agents.items()},
        "blobs": w.nixl_wrapper.added,
        "full_add_calls": [(m.engine_id, r, t) for m, r, t, _ in w2.added_full],
        "clock_offset": offset,
    }


@step("import vllm.engine.arg_utils")
def _():
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: F401

    return "ok"


@step("vllm serve parser (vllm.entrypoints.cli.serve)")
def _():
    args = peer.parse_serve_argv(
        [
            "google/gemma-3-1b-it",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--block-size",
            "16",
            "--dtype",
            "bfloat16",
            "--kv-cache-dtype",
            "auto",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29500",
            "--headless",
            "--attention-backend",
            "FLASH_ATTN",
            "--kv-transfer-config",
            '{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}',
        ]
    )
    return {
        k: getattr(args, k)
        for k in (
            "model_tag",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "block_size",
            "nnodes",
            "node_rank",
            "master_addr",
            "headless",
        )
    }


@step("vllm.config.KVTransferConfig")
def _():
    from vllm.config import KVTransferConfig

    c = KVTransferConfig(
        kv_connector="NixlPushConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"backends": ["UCX"], "kv_lease_duration": 60},
    )
    return {
        "engine_id(default uuid4)": c.engine_id,
        "kv_buffer_device": c.kv_buffer_device,
        "lease": c.get_from_extra_config("kv_lease_duration", 30),
    }


@step("KVConnectorFactory registry")
def _():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    names = sorted(KVConnectorFactory._registry)
    cls = KVConnectorFactory.get_connector_class_by_name("NixlPushConnector")
    hma = KVConnectorFactory.supports_hma_config(
        KVTransferConfig(kv_connector="NixlPushConnector", kv_role="kv_producer")
    )
    return {
        "NixlPushConnector_registered": "NixlPushConnector" in names,
        "class": f"{cls.__module__}.{cls.__name__}",
        "supports_hma": hma,
        "registry": names,
    }


@step("vllm.envs known names")
def _():
    names = sorted(peer.known_env_names())
    wanted = [
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_PP_LAYER_PARTITION",
        "VLLM_ATTENTION_BACKEND",
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
    ]
    import vllm.envs as envs

    return {
        "count": len(names),
        "present": {w: w in names for w in wanted},
        "defaults": {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": envs.VLLM_NIXL_SIDE_CHANNEL_PORT,
        },
    }


@step("get_pp_indices")
def _():
    from vllm.distributed.utils import get_pp_indices

    return {n: [get_pp_indices(n, r, p) for r in range(p)] for n, p in ((26, 2), (27, 2), (32, 4), (61, 4))}


for repo_id, backend in (
    ("google/gemma-3-1b-it", "FLASH_ATTN"),
    ("meta-llama/Llama-3.1-8B-Instruct", "FLASH_ATTN"),
    ("deepseek-ai/DeepSeek-V2-Lite", "FLASHMLA"),
):

    @step(f"VllmConfig offline + compat hash: {repo_id}")
    def _(repo_id=repo_id, backend=backend):
        argv = [
            "--model",
            repo_id,
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "NixlPushConnector",
                    "kv_role": "kv_producer",
                    "engine_id": "p0",
                    "kv_connector_extra_config": {"backends": ["UCX"], "kv_lease_duration": 60},
                }
            ),
        ]
        t = time.perf_counter()
        cfg = peer.build_vllm_config(argv)
        built = time.perf_counter() - t
        digest, factors = peer.compat_hash(cfg, backend, "push")
        return {
            "config_s": round(built, 2),
            "hash": digest,
            "factors": factors,
            "pp": cfg.parallel_config.pipeline_parallel_size,
            "tp": cfg.parallel_config.tensor_parallel_size,
            "use_mla": cfg.model_config.use_mla,
            "hma_disabled": cfg.scheduler_config.disable_hybrid_kv_cache_manager,
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    total = time.perf_counter() - T0
    print(f"total {total:.1f}s, {sum(not r['ok'] for r in results)} failed")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"total_s": round(total, 1), "steps": results}, indent=2, default=str)
        )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
