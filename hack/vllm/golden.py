"""Golden wire vectors for one vLLM release, made by that release's own classes and functions.

Run it with the release importable (the 0.33.0 venv from hack/vllm/venv.sh, or that interpreter with PYTHONPATH
on an extracted wheel of another release); it writes tests/golden/vllm/<version>/:

    bash hack/vllm/venv.sh
    PYTHONSAFEPATH=1 .venv-vllm/bin/python hack/vllm/golden.py                       # 0.33.0 (installed)
    PYTHONSAFEPATH=1 PYTHONPATH=~/.cache/disagg/vllm-wheels/x/0.31.0 .venv-vllm/bin/python hack/vllm/golden.py
    PYTHONSAFEPATH=1 PYTHONPATH=~/.cache/disagg/vllm-wheels/x/0.32.0 .venv-vllm/bin/python hack/vllm/golden.py
    (an extracted wheel: mkdir -p DIR && python3 -m zipfile -e vllm-X-*.whl DIR)

Options: --out DIR (default tests/golden/vllm), --no-configs (skip VllmConfig-based cases: ~15 s each),
--expect-version X (fail unless vllm.__version__ == X).

What comes from vLLM here, and how:
* NixlAgentMetadata / NixlHandshakePayload: the release's dataclasses, encoded with msgspec.msgpack.Encoder()
  exactly as base_worker.register_kv_caches does; the payload bytes are then served by the release's real
  side-channel listener (started by the real NixlBaseConnectorScheduler.set_xfer_handshake_metadata) and the
  .msgpack file holds the bytes as read back from the socket. The release's real client (_nixl_handshake)
  then fetches every payload and must accept it (hash check, typed decode, engine id).
* Side-channel requests: the bytes the release's real _nixl_handshake client sends, captured by a ZMQ ROUTER.
* Compatibility hashes: the release's compute_nixl_compatibility_hash on VllmConfigs built offline from a
  `vllm serve` argv by the release's own parser and AsyncEngineArgs.create_engine_config; the factor dict is
  captured from the call to the release's hash_factors. Cases that need a speculative (EAGLE) config call the
  release's hash_factors on a given dict.
* PUSH_REG: the registration dict built by the release's NixlPushConnectorScheduler.update_state_after_alloc,
  sent by the release's NixlPushConnectorWorker._do_send_reg_notif into a recording send_notif.
  Heartbeat: the release's _send_heartbeats into a recording send_notif. The push completion notif is built
  inline inside the WRITE path (push_worker: notif_id = f"{remote_request_id}:{self.world_size}".encode());
  its vector is that f-string evaluated here, and the json quotes the release's source line.
Only the example values (addresses, ids, names) are made up. Runs are deterministic (the script re-executes
itself with PYTHONHASHSEED=0 so set iteration orders are fixed).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

if os.environ.get("PYTHONHASHSEED") != "0":  # HB joins a set of request ids: fix its order
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import msgspec  # noqa: E402
import peer  # noqa: E402  (sets HF_HUB_OFFLINE, VLLM_TARGET_DEVICE, HF_HOME before vLLM is imported)
import vllm  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as M  # noqa: E402

NIXL_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
SOURCE_FILES = [
    f"{NIXL_DIR}/metadata.py",
    f"{NIXL_DIR}/base_scheduler.py",
    f"{NIXL_DIR}/base_worker.py",
    f"{NIXL_DIR}/push_scheduler.py",
    f"{NIXL_DIR}/push_worker.py",
    f"{NIXL_DIR}/pull_scheduler.py",
    "vllm/config/utils.py",
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
]


# --- helpers ----------------------------------------------------------------------------------------------


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def plain(v: Any, *, bytes_as: str = "hex") -> Any:
    """JSON view: bytes -> {"$bytes_hex", "$len"}, tuples -> lists, dataclasses -> dicts (field order)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes_hex": bytes(v).hex(), "$len": len(v)}
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [plain(x) for x in v]
    return v


def type_name(t: Any) -> str:
    if isinstance(t, type):
        return t.__name__
    return str(t).replace("typing.", "")


def field_table(cls) -> list[dict[str, Any]]:
    rows = []
    for f in dataclasses.fields(cls):
        row: dict[str, Any] = {"name": f.name, "type": type_name(f.type)}
        if f.default is not dataclasses.MISSING:
            row["default"] = plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            row["default"] = plain(f.default_factory())  # type: ignore[misc]
            row["default_factory"] = getattr(f.default_factory, "__name__", str(f.default_factory))
        else:
            row["required"] = True
        rows.append(row)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def provenance() -> dict[str, Any]:
    """Where the imported vllm package lies, and the sha256 of the files used, checked against the RECORD of the
    wheel's dist-info that lies beside it (proves the module is the release's own file)."""
    pkg_dir = Path(vllm.__file__).resolve().parent
    base = pkg_dir.parent
    record: dict[str, str] = {}
    dist = base / f"vllm-{vllm.__version__}.dist-info" / "RECORD"
    if dist.exists():
        for line in dist.read_text().splitlines():
            parts = line.rsplit(",", 2)
            if len(parts) == 3 and parts[1].startswith("sha256="):
                digest = base64.urlsafe_b64decode(parts[1][7:] + "=" * (-len(parts[1][7:]) % 4)).hex()
                record[parts[0]] = digest
    files = {}
    for rel in SOURCE_FILES:
        p = base / rel
        d = sha(p.read_bytes())
        files[rel] = {"sha256": d, "matches_wheel_RECORD": record.get(rel) == d if record else None}
    return {
        "vllm_package_dir_kind": "site-packages (pip-installed wheel)"
        if "site-packages" in str(base)
        else "PYTHONPATH (extracted wheel)",
        "vllm_package_dir": str(pkg_dir),
        "metadata_module_file": M.__file__,
        "dist_info_record": str(dist) if dist.exists() else None,
        "files": files,
    }


def source_line(rel: str, needle: str) -> dict[str, Any] | None:
    p = Path(vllm.__file__).resolve().parent.parent / rel
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if needle in line:
            return {"file": rel, "line": i, "text": line.strip()}
    return None


# --- example values (release independent) -----------------------------------------------------------------


def L(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gemma_hma_regions(layers: range) -> tuple[list[list[str]], list[int]]:
    """Gemma-3-1B-like HMA pooling: groups = [full layers] + sliding layers in chunks of 4; KV tensor r is shared
    by the r-th layer of every group. Restricted to the layers this stage holds."""
    full = [i for i in range(26) if (i + 1) % 6 == 0]
    swa = [i for i in range(26) if (i + 1) % 6 != 0]
    groups = [full] + [swa[k : k + 4] for k in range(0, len(swa), 4)]
    regions, gids = [], []
    for r in range(4):
        members = [g[r] for g in groups if len(g) > r and g[r] in layers]
        if not members:
            continue
        members.sort()
        regions.append([L(i) for i in members])
        owner = [gi for gi, g in enumerate(groups) if len(g) > r and g[r] in members]
        gids.append(-1 if len(owner) > 1 else owner[0])
    return regions, gids


def gemma_layer_groups(regions: list[list[str]]) -> dict[str, int]:
    """The cache group of each listed layer (v16 `layer_group_ids`): group 0 holds the full-attention layers,
    group 1 + k the k-th chunk of 4 sliding-window layers, as `gemma_hma_regions` pools them."""
    full = [i for i in range(26) if (i + 1) % 6 == 0]
    swa = [i for i in range(26) if (i + 1) % 6 != 0]
    group = {L(i): 0 for i in full} | {L(i): 1 + k // 4 for k, i in enumerate(swa)}
    return {name: group[name] for members in regions for name in members}


def metadata_cases(pp_stage1_layers: range) -> list[dict[str, Any]]:
    base_addr = 0x7F3A40000000
    cases = []

    # (i) PP2 stage 1 prefill, Gemma-3-1B-like HMA (push), TP rank 1 of 2.
    regions, gids = gemma_hma_regions(pp_stage1_layers)
    n = len(regions)
    page = 2 * 16 * 1 * 256 * 2  # K+V, block 16, 1 KV head, head 256, bf16
    cases.append(
        dict(
            id="pp2_stage1_prefill_hma",
            note=f"PP2 stage 1 prefill worker (pp_rank 1, tp_rank 1 of 2), Gemma-3-1B-like hybrid (SWA + full), HMA"
            f" pooled regions: layers {pp_stage1_layers.start}..{pp_stage1_layers.stop - 1} (vLLM get_pp_indices), {n}"
            f" regions shared by several layers (region_group_ids -1 = shared); 300-byte agent blob",
            pp_rank=1,
            tp_rank=1,
            compat_case="gemma3_1b_push_pp2_tp2",
            values=dict(
                engine_id="prefill-7f3c2a",
                agent_metadata=bytes(range(256)) + b"NIXL-UCX-opaque-agent-metadata-blob" + b"\x00" * 9,
                kv_caches_base_addr=[base_addr + k * 0x8000000 for k in range(n)],
                device_id=1,
                num_blocks=40960,
                block_lens=[page] * n,
                block_strides=[page] * n,
                kv_cache_layout="LBHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=[40960] * n,
                region_group_ids=gids,
                region_names=[r[0] for r in regions],
                region_mem_types=["VRAM"] * n,
                dcp_size=1,
                pcp_size=1,
                region_members=regions,
                layer_group_ids=gemma_layer_groups(regions),
            ),
        )
    )

    # (ii) PP1 decode, all 26 layers, HMA pooled.
    regions, gids = gemma_hma_regions(range(26))
    n = len(regions)
    cases.append(
        dict(
            id="pp1_decode_hma",
            note="PP1 decode worker (tp_rank 0 of 2), Gemma-3-1B-like HMA: 4 pooled regions over all 26 layers,"
            " region_members lists every layer aliasing each region",
            pp_rank=0,
            tp_rank=0,
            compat_case="gemma3_1b_push_pp1_tp2_decode",
            values=dict(
                engine_id="decode-1b9e44",
                agent_metadata=b"\x00NIXL-opaque",
                kv_caches_base_addr=[base_addr + k * 0x10000000 for k in range(n)],
                device_id=0,
                num_blocks=81920,
                block_lens=[page] * n,
                block_strides=[page] * n,
                kv_cache_layout="LBHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=[81920] * n,
                region_group_ids=gids,
                region_names=[r[0] for r in regions],
                region_mem_types=["VRAM"] * n,
                dcp_size=1,
                pcp_size=1,
                region_members=regions,
                layer_group_ids=gemma_layer_groups(regions),
            ),
        )
    )

    # (iii) legacy non-HMA: only the 12 required fields given; every default still goes on the wire.
    cases.append(
        dict(
            id="legacy_nonhma",
            note="Dense Llama-8B-like TP2 prefill, built from the 12 required fields only: region_* nil, dcp/pcp 1,"
            " ple_block_len nil (v14+), region_members [], packed_member_layouts {} (v13+): all still encoded",
            pp_rank=0,
            tp_rank=0,
            compat_case="llama8b_pull_tp2",
            values=dict(
                engine_id="llama-prefill-0",
                agent_metadata=b"agent-blob-llama",
                kv_caches_base_addr=[base_addr + k * 0x4000000 for k in range(4)],
                device_id=0,
                num_blocks=2048,
                block_lens=[2 * 16 * 4 * 128 * 2] * 4,
                block_strides=[2 * 16 * 4 * 128 * 2] * 4,
                kv_cache_layout="LBHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
            ),
        )
    )

    # (iii b) v16: a dense model's worker lists its layers too, each region one layer of group 0.
    cases.append(
        dict(
            id="dense_pp1_layers",
            note="Dense Llama-8B-like TP2 decode (non-HMA), as a v16 worker advertises it: region_members names the"
            " layer of each of its 4 regions and layer_group_ids its cache group (0), which 0.34 requires of every"
            " peer before it pairs regions by layer name",
            pp_rank=0,
            tp_rank=0,
            requires=["layer_group_ids"],
            compat_case="llama8b_pull_tp2_push",
            values=dict(
                engine_id="llama-decode-0",
                agent_metadata=b"agent-blob-llama-decode",
                kv_caches_base_addr=[base_addr + k * 0x4000000 for k in range(4)],
                device_id=0,
                num_blocks=2048,
                block_lens=[2 * 16 * 4 * 128 * 2] * 4,
                block_strides=[2 * 16 * 4 * 128 * 2] * 4,
                kv_cache_layout="LBHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=[2048] * 4,
                region_group_ids=[0] * 4,
                region_names=[L(i) for i in range(4)],
                region_mem_types=["VRAM"] * 4,
                region_members=[[L(i)] for i in range(4)],
                layer_group_ids={L(i): 0 for i in range(4)},
            ),
        )
    )

    # (iv) packed MLA (block-outermost BLHNC): one region whose block row holds every layer's page (v13+).
    mla_page = 16 * 576 * 2
    cases.append(
        dict(
            id="packed_mla",
            note="DeepSeek-V2-Lite-like MLA, PP1 push decode, block-outermost BLHNC layout: 1 region whose block"
            " holds all 27 layers' pages; packed_member_layouts gives (byte offset in the block, page bytes) per"
            " layer (v13+)",
            pp_rank=0,
            tp_rank=0,
            requires=["packed_member_layouts"],
            compat_case="dsv2lite_push_pp1_tp2_decode",
            values=dict(
                engine_id="dsv2-decode-0",
                agent_metadata=b"\x01\x02mla-agent",
                kv_caches_base_addr=[base_addr],
                device_id=0,
                num_blocks=12000,
                block_lens=[27 * mla_page],
                block_strides=[27 * mla_page],
                kv_cache_layout="BLHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASHMLA",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=[12000],
                region_group_ids=[0],
                region_names=[L(0)],
                region_mem_types=["VRAM"],
                region_members=[[L(i) for i in range(27)]],
                packed_member_layouts={L(i): (i * mla_page, mla_page) for i in range(27)},
            ),
        )
    )

    # (v) non-default ple_block_len (v14+) together with packed_member_layouts (v13+).
    attn_page = 16 * 2 * 2 * 128 * 2
    cases.append(
        dict(
            id="ple_packed",
            note="Block-outermost packed model with a PLE short-conv state region (v14 #59997): ple_block_len"
            " (24576) is larger than that region's block_len, since the PLE page shares the region with smaller"
            " pages; packed_member_layouts filled",
            pp_rank=0,
            tp_rank=0,
            requires=["ple_block_len", "packed_member_layouts"],
            compat_case="ple_push_synthetic",
            values=dict(
                engine_id="ple-decode-0",
                agent_metadata=b"ple-agent",
                kv_caches_base_addr=[base_addr, base_addr + 0x20000000],
                device_id=0,
                num_blocks=4096,
                block_lens=[4 * attn_page, attn_page],
                block_strides=[4 * attn_page, 4 * attn_page],
                kv_cache_layout="BLHNC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=[4096, 4096],
                region_group_ids=[0, 1],
                region_names=[L(0), "model.ple.conv"],
                region_mem_types=["VRAM", "VRAM"],
                ple_block_len=24576,
                region_members=[[L(0), L(1), L(2), L(3)], ["model.ple.conv"]],
                packed_member_layouts={L(i): (i * attn_page, attn_page) for i in range(4)},
            ),
        )
    )
    return cases


# --- compatibility hashes ---------------------------------------------------------------------------------


def backend_name(enum_name: str) -> tuple[str, str]:
    """The backend class's own get_name() where it imports on CPU, else the enum name."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum[
            enum_name
        ].get_class().get_name(), "AttentionBackendEnum[...].get_class().get_name()"
    except Exception as e:
        return enum_name, f"literal ({type(e).__name__} importing the backend on CPU)"


def kvt(role: str, engine: str, **extra: Any) -> str:
    d: dict[str, Any] = {"kv_connector": "NixlPushConnector", "kv_role": role, "engine_id": engine}
    d.update(extra)
    return json.dumps(d)


CONFIG_CASES = [
    dict(
        id="gemma3_1b_push_pp2_tp2",
        argv=[
            "--model",
            "google/gemma-3-1b-it",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt(
                "kv_producer",
                "prefill-7f3c2a",
                kv_connector_extra_config={"backends": ["UCX"], "kv_lease_duration": 60},
            ),
        ],
        backend="FLASH_ATTN",
        modes=["push", "pull"],
    ),
    dict(
        id="gemma3_1b_push_pp1_tp2_decode",
        argv=[
            "--model",
            "google/gemma-3-1b-it",
            "--tensor-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt("kv_consumer", "decode-1b9e44"),
        ],
        backend="FLASH_ATTN",
        modes=["push"],
    ),
    dict(
        id="llama8b_pull_tp2",
        argv=[
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--tensor-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            json.dumps(
                {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "llama-prefill-0"}
            ),
        ],
        backend="FLASH_ATTN",
        modes=["pull", "push"],
    ),
    dict(
        id="llama8b_fp8_nohma",
        argv=[
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--tensor-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-cache-dtype",
            "fp8",
            "--disable-hybrid-kv-cache-manager",
            "--kv-transfer-config",
            kvt("kv_consumer", "llama-decode-0"),
        ],
        backend="FLASHINFER",
        modes=["push"],
    ),
    dict(
        id="dsv2lite_push_pp2_tp2",
        argv=[
            "--model",
            "deepseek-ai/DeepSeek-V2-Lite",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt("kv_producer", "dsv2-prefill-0"),
        ],
        backend="FLASHMLA",
        modes=["push"],
        packed_backends=["FLASHMLA", "TRITON_MLA"],
    ),
    dict(
        id="dsv2lite_push_pp1_tp2_decode",
        argv=[
            "--model",
            "deepseek-ai/DeepSeek-V2-Lite",
            "--tensor-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt("kv_consumer", "dsv2-decode-0"),
        ],
        backend="FLASHMLA",
        modes=["push"],
    ),
]


def packed_backend_expr() -> str:
    """The release's expression for the hashed backend name of push + packed caches (the line after
    'backend_name = ",".join(' in base_worker.register_kv_caches), e.g. sorted({b.get_name() for b in ...})."""
    p = Path(vllm.__file__).resolve().parent.parent / NIXL_DIR / "base_worker.py"
    lines = p.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if 'backend_name = ",".join(' in line)
    return '",".join(' + lines[i + 1].strip() + ")"


def hash_case(cid: str, factors: dict[str, Any], digest: str, how: dict[str, Any]) -> dict[str, Any]:
    canon = json.dumps(factors, sort_keys=True)
    assert sha(canon.encode()) == digest, (cid, "hash_factors is not sha256(json.dumps(sort_keys=True))")
    return {
        "id": cid,
        **how,
        "factors": factors,
        "canonical_json": canon,
        "canonical_json_utf8_hex": canon.encode().hex(),
        "sha256": digest,
    }


SPECULATIVE_INPUT = (
    "method eagle3, draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, revisions None, no draft kv_cache_dtype, cache"
    " dtype auto, eagle_aux_hidden_state_layer_ids [1, 15, 28], parallel_drafting False"
)


def release_speculative_factors() -> dict[str, Any]:
    """The release's own `_get_speculative_compatibility_factors` on the attributes it reads (SPECULATIVE_INPUT):
    0.34 hashes every speculator that uses the target's hidden states and drops parallel_drafting, 0.33 asked
    use_eagle() and kept it, so the sub-dict comes from each release's function, never a copy of it."""
    draft = types.SimpleNamespace(
        model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        revision=None,
        code_revision=None,
        hf_config=types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 15, 28]),
    )
    speculative = types.SimpleNamespace(
        method="eagle3",
        draft_model_config=draft,
        kv_cache_dtype=None,
        parallel_drafting=False,
        uses_target_hidden_states=True,
        use_eagle=lambda: True,
    )
    config = types.SimpleNamespace(
        speculative_config=speculative, cache_config=types.SimpleNamespace(cache_dtype="auto")
    )
    factors: dict[str, Any] = M._get_speculative_compatibility_factors(config)
    return factors


def compat_hash_cases(with_configs: bool) -> tuple[list[dict[str, Any]], list[str]]:
    from vllm.config.utils import hash_factors

    cases: list[dict[str, Any]] = []
    problems: list[str] = []
    if with_configs:
        for c in CONFIG_CASES:
            t0 = time.perf_counter()
            try:
                cfg = peer.build_vllm_config(c["argv"], restore_repo_id=False)
            except Exception as e:
                problems.append(f"{c['id']}: VllmConfig failed: {type(e).__name__}: {e}")
                continue
            print(f"  VllmConfig {c['id']}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            offline_model = cfg.model_config.model
            hf_home = os.environ["HF_HOME"].rstrip("/")
            offline_model_shown = offline_model.replace(hf_home, "$HF_HOME")
            repo_id = c["argv"][c["argv"].index("--model") + 1]
            cfg.model_config.model = repo_id  # what a pod that downloads the model hashes
            bname, bhow = backend_name(c["backend"])
            variants = [(m, bname, bhow) for m in c["modes"]]
            if c.get("packed_backends"):
                names = [backend_name(b)[0] for b in c["packed_backends"]]
                # base_worker.register_kv_caches, push + packed (block-outermost) caches, v13+:
                expr = packed_backend_expr()
                # the release's own expression, evaluated on the backend classes' names
                joined = eval(
                    expr,
                    {"sorted": sorted},
                    {
                        "self": types.SimpleNamespace(
                            attn_backends=[types.SimpleNamespace(get_name=(lambda n=n: n)) for n in names]
                        )
                    },
                )
                variants.append(
                    ("push", joined, f"packed push (base_worker.register_kv_caches): {expr} over {names}")
                )
            for mode, bn, bh in variants:
                with peer.captured_hash_factors() as seen:
                    digest = M.compute_nixl_compatibility_hash(cfg, bn, transfer_mode=mode)
                suffix = (
                    ""
                    if (mode, bn) == (c["modes"][0], bname)
                    else (f"_{mode}" if bn == bname else "_packed_backends")
                )
                cases.append(
                    hash_case(
                        c["id"] + suffix,
                        seen[-1],
                        digest,
                        {
                            "how": "compute_nixl_compatibility_hash(vllm_config, attn_backend_name, transfer_mode=...)"
                            " on a VllmConfig from vLLM's serve parser + AsyncEngineArgs.from_cli_args(args)"
                            ".create_engine_config(); factors captured from its call to hash_factors",
                            "argv": ["vllm", "serve", *c["argv"]],
                            "attn_backend_name": bn,
                            "attn_backend_name_from": bh,
                            "transfer_mode": mode,
                            "model_config_model_offline": offline_model_shown,
                            "model_config_model_hashed": repo_id,
                        },
                    )
                )
    # Cases needing configs this machine cannot build offline (a draft model): the release's hash_factors on a
    # factor dict with the same 12 keys.
    base = {
        "vllm_version": vllm.__version__,
        "nixl_connector_version": M.NIXL_CONNECTOR_VERSION,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "dtype": "torch.bfloat16",
        "num_kv_heads": 8,
        "head_size": 128,
        "num_hidden_layers": 32,
        "attn_backend_name": "FLASH_ATTN",
        "cache_dtype": "auto",
        "is_hma_enabled": True,
        "speculative_config": release_speculative_factors(),
        "transfer_mode": "push",
    }
    factors = json.loads(json.dumps(base))
    cases.append(
        hash_case(
            "llama8b_eagle3_push_factors",
            factors,
            hash_factors(base),
            {
                "how": "vllm.config.utils.hash_factors(factors) (no offline draft model config); speculative_config is"
                " what the release's _get_speculative_compatibility_factors returns for an EAGLE3 draft"
                f" ({SPECULATIVE_INPUT}) (auxiliary_layer_ids a tuple -> JSON array)",
            },
        )
    )
    ple = dict(
        base, speculative_config=None, model="example/ple-packed-model", num_hidden_layers=4, num_kv_heads=2
    )
    cases.append(
        hash_case(
            "ple_push_synthetic",
            json.loads(json.dumps(ple)),
            hash_factors(ple),
            {
                "how": "vllm.config.utils.hash_factors(factors) on a made-up model (for the ple_packed payload)",
            },
        )
    )
    return cases, problems


# --- the side channel, with the release's listener and client ----------------------------------------------


def serve_payloads(payloads: dict[tuple[int, int], Any]):
    """The release's NixlPushConnectorScheduler.set_xfer_handshake_metadata (encodes every payload with
    msgspec.msgpack.Encoder() and starts the real listener thread) on an object with only what it reads."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

    s = object.__new__(NixlPushConnectorScheduler)
    s.side_channel_host = "127.0.0.1"
    s.side_channel_port = free_port()
    s._stop_event = threading.Event()
    s._nixl_handshake_listener_t = None
    s._handshake_data = {}  # v15 keeps the served dict here; older releases use a local dict
    s._registration_generation = 0
    s.set_xfer_handshake_metadata(payloads)
    return s


def req_rep(port: int, frames: list[bytes], timeout_ms: int = 3000) -> list[bytes] | None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None
    finally:
        ctx.destroy(linger=0)


def capture_client_requests(
    targets: list[tuple[int, int, int, int]], payload: bytes, engine_id: str
) -> list[dict[str, Any]]:
    """Run the release's real _nixl_handshake against a recording ROUTER; return what it sent.
    targets: (remote_tp_size, remote_pp_size, local_tp_rank, local_tp_size) combos."""
    out = []
    for remote_tp, remote_pp, local_rank, local_tp in targets:
        port = free_port()
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{port}")
        seen: list[list[bytes]] = []
        stop = threading.Event()

        def serve(router=router, stop=stop, seen=seen):
            router.setsockopt(zmq.RCVTIMEO, 200)
            while not stop.is_set():
                try:
                    frames = router.recv_multipart()
                except zmq.Again:
                    continue
                seen.append(frames)
                router.send_multipart([frames[0], b"", payload, msgspec.msgpack.encode(1.5)])

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        w = peer.handshake_worker("0" * 64, tp_rank=local_rank, tp_size=local_tp, enforce_compat_hash=False)
        err = None
        try:
            w._nixl_handshake(
                "127.0.0.1", port, remote_tp, engine_id, remote_pp_size=remote_pp, notif_agents_only=True
            )
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        stop.set()
        t.join()
        ctx.destroy(linger=0)
        out.append(
            {
                "local_tp_rank": local_rank,
                "local_tp_size": local_tp,
                "remote_tp_size": remote_tp,
                "remote_pp_size": remote_pp,
                "error": err,
                "requests": [
                    {"frames_at_router": len(f), "delimiter": f[1].hex(), "body": f[2]} for f in seen
                ],
            }
        )
    return out


# --- writing ----------------------------------------------------------------------------------------------


class Writer:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        for p in out.iterdir():  # a rerun replaces the whole set
            if p.is_file():
                p.unlink()
        self.entries: list[dict[str, Any]] = []
        self.extra: list[str] = []

    def vector(self, name: str, data: bytes, kind: str, desc: dict[str, Any]) -> None:
        (self.out / name).write_bytes(data)
        jname = name.rsplit(".", 1)[0] + ".json"
        d = {"file": name, "length": len(data), "sha256": sha(data), "hex": data.hex(), "kind": kind, **desc}
        self.write_json(jname, d, extra=False)
        self.entries.append(
            {"file": name, "description_file": jname, "kind": kind, "length": len(data), "sha256": sha(data)}
        )

    def write_json(self, name: str, obj: Any, extra: bool = True) -> None:
        (self.out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        if extra:
            self.extra.append(name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "golden" / "vllm"))
    ap.add_argument("--no-configs", action="store_true")
    ap.add_argument("--expect-version")
    a = ap.parse_args()
    version = vllm.__version__
    if a.expect_version and a.expect_version != version:
        print(f"golden.py: vllm {version} imported, expected {a.expect_version}", file=sys.stderr)
        return 1
    from vllm.distributed.utils import get_pp_indices

    t_start = time.perf_counter()
    out = Path(a.out) / version
    w = Writer(out)
    prov = provenance()
    fields = field_table(M.NixlAgentMetadata)
    field_names = [f["name"] for f in fields]
    enc = msgspec.msgpack.Encoder()  # as in base_worker.register_kv_caches / set_xfer_handshake_metadata
    problems: list[str] = []

    # 1. compatibility hashes
    hcases, hp = compat_hash_cases(not a.no_configs)
    problems += hp
    hash_by_id = {c["id"]: c["sha256"] for c in hcases}
    w.write_json(
        "compat_hash_cases.json",
        {
            "kind": "compat_hash_cases",
            "vllm_version": version,
            "nixl_connector_version": M.NIXL_CONNECTOR_VERSION,
            "rule": "hash_factors(d) = sha256(json.dumps(d, sort_keys=True).encode()).hexdigest() (vllm/config/utils.py)",
            "factor_keys": list(hcases[-1]["factors"].keys()),
            "worker_call": source_line(
                f"{NIXL_DIR}/base_worker.py", "self.compat_hash = compute_nixl_compatibility_hash("
            ),
            "packed_backend_name_expr": packed_backend_expr(),
            "cases": hcases,
        },
    )

    # 2. agent metadata + handshake payloads, served by the real listener and fetched by the real client
    stage1 = range(*get_pp_indices(26, 1, 2))
    made: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for case in metadata_cases(stage1):
        missing = [f for f in case.get("requires", []) if f not in field_names]
        if missing:
            skipped.append(
                {"id": case["id"], "reason": f"NixlAgentMetadata has no field(s) {missing} in {version}"}
            )
            continue
        values = {k: v for k, v in case["values"].items() if k in field_names}
        meta = M.NixlAgentMetadata(**values)
        meta_bytes = enc.encode(meta)
        back = msgspec.msgpack.Decoder(M.NixlAgentMetadata).decode(meta_bytes)
        assert back == meta, case["id"]
        assert enc.encode(back) == meta_bytes
        hcase = case["compat_case"] if case["compat_case"] in hash_by_id else "ple_push_synthetic"
        payload = M.NixlHandshakePayload(
            compatibility_hash=hash_by_id[hcase], agent_metadata_bytes=meta_bytes
        )
        made.append(dict(case=case, meta=meta, meta_bytes=meta_bytes, payload=payload, hash_case=hcase))

    listener_checks: list[dict[str, Any]] = []
    for m in made:
        c = m["case"]
        pp, tp = c["pp_rank"], c["tp_rank"]
        # served under every key the client below asks for: (0..pp, tp)
        served = serve_payloads({(p, tp): m["payload"] for p in range(pp + 1)})
        try:
            frames = req_rep(served.side_channel_port, [msgspec.msgpack.encode((M.GET_META_MSG, pp, tp))])
            assert frames is not None and len(frames) == 2, c["id"]
            wire_payload, ts = frames
            assert wire_payload == enc.encode(m["payload"]), c["id"]
            listener_checks.append(
                {
                    "case": c["id"],
                    "served_keys": [[p, tp] for p in range(pp + 1)],
                    "reply_frames_at_REQ": len(frames),
                    "frame0_len": len(wire_payload),
                    "frame1_first_byte": ts[:1].hex(),
                    "frame1_len": len(ts),
                    "frame1_decodes_to": type(msgspec.msgpack.decode(ts)).__name__,
                }
            )
            # the release's real client (TP tp+1, rank tp -> target remote rank tp) fetches and accepts it
            cw = peer.handshake_worker(m["payload"].compatibility_hash, tp_rank=tp, tp_size=tp + 1)
            agents, _ = cw._nixl_handshake(
                "127.0.0.1", served.side_channel_port, tp + 1, c["values"]["engine_id"], remote_pp_size=pp + 1
            )
            assert sorted(agents) == [(p, tp) for p in range(pp + 1)], agents
            assert all(x[0] == m["meta"] for x in cw.added_full), c["id"]
            m["client_ok"] = {"remote_ranks": [list(k) for k in sorted(agents)], "decoded_equals_value": True}
            m["wire_payload"] = wire_payload
        finally:
            served.shutdown()

    for m in made:
        c, meta, mb = m["case"], m["meta"], m["meta_bytes"]
        w.vector(
            f"agent_metadata_{c['id']}.msgpack",
            mb,
            "NixlAgentMetadata",
            {
                "note": c["note"],
                "encoding": f"msgpack map, {len(field_names)} entries (header {mb[:3].hex() if mb[0] == 0xDE else mb[:1].hex()}),"
                " keys = field names in declaration order, every default written; bytes as bin, tuples as"
                " arrays, None as nil",
                "fields_given": [k for k in m["case"]["values"] if k in field_names],
                "decoded": plain(meta),
                "source": {
                    "vllm_version": version,
                    "class": "NixlAgentMetadata",
                    "module": M.__name__,
                    "encoder": "msgspec.msgpack.Encoder().encode(NixlAgentMetadata(...))",
                    "check": "msgspec.msgpack.Decoder(NixlAgentMetadata).decode(bytes) == value; re-encode identical",
                },
            },
        )
        pb = m["wire_payload"]
        w.vector(
            f"handshake_payload_{c['id']}.msgpack",
            pb,
            "NixlHandshakePayload",
            {
                "note": f"Wraps agent_metadata_{c['id']}.msgpack; compatibility_hash is compat_hash_cases.json case"
                f" '{m['hash_case']}'. Reply frame 0 of the side channel, as read back from the release's real"
                " listener.",
                "encoding": "msgpack map, 2 entries: 'compatibility_hash' (str8, 64 hex chars) then"
                " 'agent_metadata_bytes' (bin holding the encoded NixlAgentMetadata)",
                "decoded": {
                    "compatibility_hash": m["payload"].compatibility_hash,
                    "compat_case": m["hash_case"],
                    "agent_metadata_bytes": {
                        "$bytes_hex": mb.hex(),
                        "$len": len(mb),
                        "$is": f"agent_metadata_{c['id']}.msgpack",
                    },
                },
                "source": {
                    "vllm_version": version,
                    "served_by": "NixlPushConnectorScheduler.set_xfer_handshake_metadata -> "
                    "NixlBaseConnectorScheduler._nixl_handshake_listener (real thread, real ZMQ)",
                    "accepted_by_real_client": m.get("client_ok"),
                },
            },
        )

    # 3. side-channel requests from the real client
    caps = capture_client_requests(
        [(1, 1, 0, 1), (2, 2, 0, 1), (4, 1, 1, 2), (1, 2, 1, 2), (256, 1, 200, 256)],
        made[0]["wire_payload"],
        made[0]["case"]["values"]["engine_id"],
    )
    seen_req: dict[bytes, tuple[int, int]] = {}
    for cap in caps:
        for r in cap["requests"]:
            body = r["body"]
            msg, pp, tp = msgspec.msgpack.decode(body)
            seen_req.setdefault(body, (pp, tp))
            r["body"] = {"hex": body.hex(), "decoded": [plain(msg), pp, tp]}
    for body, (pp, tp) in sorted(seen_req.items(), key=lambda kv: kv[1]):
        w.vector(
            f"side_channel_request_pp{pp}_tp{tp}.msgpack",
            body,
            "side_channel_request",
            {
                "note": "The single message part the release's real _nixl_handshake client sends (REQ socket;"
                " a ROUTER sees [identity, b'', body]).",
                "encoding": "fixarray(3): bin8 'get_meta_msg' (c4 0c ...), pp_rank int, tp_rank int",
                "decoded": {
                    "msg": {"$bytes_hex": M.GET_META_MSG.hex(), "$ascii": M.GET_META_MSG.decode()},
                    "pp_rank": pp,
                    "tp_rank": tp,
                },
                "source": {"vllm_version": version, "sent_by": "NixlBaseConnectorWorker._nixl_handshake"},
            },
        )

    # 4. listener / client behaviour
    behaviour = side_channel_behaviour(made, enc)
    behaviour["reply_checks"] = listener_checks
    behaviour["client_request_captures"] = caps
    w.write_json("side_channel_behavior.json", behaviour)

    # 5. notifications
    notif_problems = notifications(w, version)
    problems += notif_problems

    # 6. manifest
    manifest = {
        "generator": "hack/vllm/golden.py",
        "vllm_version": version,
        "nixl_connector_version": M.NIXL_CONNECTOR_VERSION,
        "how_generated": {
            "command": " ".join(
                [
                    "PYTHONSAFEPATH=1",
                    *(["PYTHONPATH=" + os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []),
                    ".venv-vllm/bin/python",
                    "hack/vllm/golden.py",
                    *sys.argv[1:],
                ]
            ),
            "python": sys.version.split()[0],
            "msgspec": msgspec.__version__,
            "pyzmq": zmq.__version__,
            "torch": __import__("torch").__version__,
            "env": {k: os.environ.get(k) for k in ("VLLM_TARGET_DEVICE", "HF_HUB_OFFLINE", "PYTHONHASHSEED")},
            "provenance": prov,
        },
        "NixlAgentMetadata_fields": fields,
        "NixlAgentMetadata_field_order": field_names,
        "NixlHandshakePayload_fields": field_table(M.NixlHandshakePayload),
        "constants": {
            "GET_META_MSG": M.GET_META_MSG.decode(),
            "PUSH_REG_NOTIF_PREFIX": M.PUSH_REG_NOTIF_PREFIX.decode(),
        },
        "pp_indices_26_layers_pp2": [list(get_pp_indices(26, r, 2)) for r in range(2)],
        "skipped_cases": skipped,
        "problems": problems,
        "files": w.entries,
        "extra_files": [*sorted(w.extra), "manifest.json"],
        "extra_sha256": {n: sha((out / n).read_bytes()) for n in sorted(w.extra)},
    }
    w.write_json("manifest.json", manifest, extra=False)
    print(
        f"golden.py: vllm {version} (connector v{M.NIXL_CONNECTOR_VERSION}) -> {out}: {len(w.entries)} vectors,"
        f" {len(hcases)} hash cases, {len(problems)} problems, {time.perf_counter() - t_start:.1f}s"
    )
    for p in problems:
        print("  problem:", p)
    return 0


def side_channel_behaviour(made: list[dict[str, Any]], enc) -> dict[str, Any]:
    """What the release's listener and client do with odd input (each check runs the real code)."""
    res: dict[str, Any] = {"kind": "side_channel_behavior", "vllm_version": vllm.__version__}
    m = made[0]
    eng = m["case"]["values"]["engine_id"]
    s = serve_payloads(
        {(0, 0): m["payload"], (1, 0): m["payload"], (0, 1): m["payload"], (1, 1): m["payload"]}
    )
    port = s.side_channel_port
    try:
        # str instead of bin for the tag: only a warning, still answered
        r = req_rep(port, [msgspec.msgpack.encode(("get_meta_msg", 0, 0))])
        res["str_tag_request"] = {"answered": r is not None and len(r) == 2}
        # a list instead of a tuple: identical bytes
        res["list_vs_tuple_request_identical"] = msgspec.msgpack.encode(
            [M.GET_META_MSG, 1, 1]
        ) == msgspec.msgpack.encode((M.GET_META_MSG, 1, 1))

        # client: hash mismatch, disabled check, engine id mismatch, TP/PP sweep
        def client(**kw):
            w = peer.handshake_worker(
                kw.pop("hash_", m["payload"].compatibility_hash),
                enforce_compat_hash=kw.pop("enforce", True),
                tp_rank=kw.pop("tp_rank", 0),
                tp_size=kw.pop("tp_size", 1),
            )
            try:
                agents, _off = w._nixl_handshake(
                    "127.0.0.1",
                    port,
                    kw.pop("remote_tp", 1),
                    kw.pop("engine", eng),
                    remote_pp_size=kw.pop("remote_pp", 1),
                    notif_agents_only=kw.pop("notif", False),
                )
                return {
                    "ok": True,
                    "agents": {f"{k[0]},{k[1]}": v for k, v in agents.items()},
                    "full_add_calls": [[x[1], x[2], x[3]] for x in getattr(w, "added_full", [])],
                    "notif_only_adds": len(w.nixl_wrapper.added),
                }
            except Exception as e:
                return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}

        res["client_hash_mismatch"] = client(hash_=("f" * 64))
        res["client_hash_mismatch_enforce_false"] = client(hash_=("f" * 64), enforce=False)
        res["client_engine_id_mismatch"] = client(engine="someone-else")
        res["client_pp2_tp2_from_tp1"] = client(remote_tp=2, remote_pp=2)
        res["client_pp2_tp2_from_tp1_notif_only"] = client(remote_tp=2, remote_pp=2, notif=True)
        res["client_tp1_remote_from_local_rank1_of_2"] = client(
            tp_rank=1, tp_size=2, remote_tp=1, remote_pp=2
        )
        # garbage payload
    finally:
        s.shutdown()
    g = serve_payloads({(0, 0): M.NixlHandshakePayload("0" * 64, b"\x01not-metadata")})
    try:
        w = peer.handshake_worker("0" * 64)
        try:
            w._nixl_handshake("127.0.0.1", g.side_channel_port, 1, eng)
            res["client_bad_agent_metadata"] = {"ok": True}
        except Exception as e:
            res["client_bad_agent_metadata"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        # unknown (pp, tp): KeyError in the listener thread, which then ends
        thread_errors: list[str] = []
        old_hook = threading.excepthook
        threading.excepthook = lambda a: thread_errors.append(f"{a.exc_type.__name__}: {a.exc_value}")
        r = req_rep(g.side_channel_port, [msgspec.msgpack.encode((M.GET_META_MSG, 3, 7))], timeout_ms=1500)
        time.sleep(0.2)
        alive = g._nixl_handshake_listener_t.is_alive()
        r2 = req_rep(g.side_channel_port, [msgspec.msgpack.encode((M.GET_META_MSG, 0, 0))], timeout_ms=1500)
        threading.excepthook = old_hook
        res["unknown_rank_request"] = {
            "request": "(b'get_meta_msg', 3, 7) to a listener serving only (0, 0)",
            "answered": r is not None,
            "listener_thread_exception": thread_errors,
            "listener_thread_alive_after": alive,
            "later_valid_request_answered": r2 is not None,
        }
    finally:
        g._stop_event.set()
        g._nixl_handshake_listener_t.join(timeout=3)
    return res


def notifications(w: Writer, version: str) -> list[str]:
    """PUSH_REG (scheduler registration dict + worker send path), heartbeat, push completion notif."""
    problems: list[str] = []
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    class Rec:
        def __init__(self):
            self.sent: list[tuple[str, bytes]] = []

        def send_notif(self, agent_name, notif_msg):
            self.sent.append((agent_name, notif_msg))

    def push_worker(remote_engine: str, agents: dict[tuple[int, int], str]):
        pw = object.__new__(NixlPushConnectorWorker)
        pw._handshake_lock = threading.RLock()
        pw._remote_agents = {remote_engine: dict(agents)}
        pw._engine_last_active = {}
        pw._engine_ttl = 0.0
        pw._hb_handshake_notif_only = False
        pw._handshake_futures = {}
        pw.nixl_wrapper = Rec()
        return pw

    # registration dict from the real D scheduler
    reg = None
    try:
        reg = registration_from_scheduler()
    except Exception as e:
        problems.append(
            f"PUSH_REG registration from NixlPushConnectorScheduler failed: {type(e).__name__}: {e}"
        )
    if reg is not None:
        rid, reg_data, params_after, matched, prefill = reg
        w.write_json(
            "kv_transfer_params_push.json",
            {
                "kind": "kv_transfer_params",
                "vllm_version": version,
                "note": "From the release's NixlPushConnectorScheduler: the prefill (kv_producer, PP2 TP2, Gemma-3-1B-like"
                " 2 KV groups) request_finished(request FINISHED_LENGTH_CAPPED, per-group block ids) return value"
                " (delay_free_blocks, kv_transfer_params for the response), the decode request's params built"
                " from it, and what the decoder's update_state_after_alloc leaves in them.",
                "prefill_request_kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
                "prefill_request_finished": plain(prefill["request_finished_returned"]),
                "decode_request_kv_transfer_params": prefill["decode_request_kv_transfer_params"],
                "decode_get_num_new_matched_tokens": list(matched),
                "decode_kv_transfer_params_after_update_state_after_alloc": plain(params_after),
                "decode_registration": plain(reg_data),
                "decode_blocks_per_sw": prefill["blocks_per_sw"],
            },
        )
        pw = push_worker(reg_data["remote_engine_id"], {(0, 0): "p-agent-pp0-tp0", (1, 0): "p-agent-pp1-tp0"})
        pw._do_send_reg_notif(rid, reg_data)
        sent = pw.nixl_wrapper.sent
        assert len(sent) == 2 and sent[0][1] == sent[1][1]
        body = sent[0][1]
        pre = M.PUSH_REG_NOTIF_PREFIX
        assert body.startswith(pre)
        w.vector(
            "push_reg_notif.bin",
            body,
            "push_reg_notif",
            {
                "note": "D worker -> every handshaken P worker agent ((pp_rank, tp_rank) of the prefill) via NIXL"
                " send_notif: PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration dict). The dict is the"
                " one the release's NixlPushConnectorScheduler.update_state_after_alloc built for a decode"
                " request (Gemma-3-1B-like, 2 KV groups, SWA clipping); bytes from the release's"
                " NixlPushConnectorWorker._do_send_reg_notif into a recording send_notif.",
                "encoding": f"{len(pre)} ASCII bytes {pre.decode()!r} then one msgpack map (untyped dict, insertion order)",
                "prefix_hex": pre.hex(),
                "sent_to_agents": [a for a, _ in sent],
                "decoded": plain(msgspec.msgpack.decode(body[len(pre) :])),
                "kv_transfer_params_after_update_state_after_alloc": plain(params_after),
                "get_num_new_matched_tokens": list(matched),
                "source": {
                    "vllm_version": version,
                    "files": [
                        f"{NIXL_DIR}/push_scheduler.py (update_state_after_alloc)",
                        f"{NIXL_DIR}/push_worker.py (_do_send_reg_notif)",
                    ],
                },
            },
        )

    # heartbeat from the real _send_heartbeats
    try:
        pw = push_worker("prefill-7f3c2a", {(0, 0): "p-agent-pp0-tp0", (1, 0): "p-agent-pp1-tp0"})
        meta = M.NixlConnectorMetadata()
        meta.heartbeat_by_engine = {
            "prefill-7f3c2a": M.HeartbeatInfo(
                req_ids={"cmpl-hb-1-0-1a2b3c4d", "chatcmpl-hb-2-0-5e6f7a8b"},
                host="10.0.0.5",
                port=5600,
                tp_size=2,
                pp_size=2,
            )
        }
        pw._send_heartbeats(meta)
        sent = pw.nixl_wrapper.sent
        body = sent[0][1]
        w.vector(
            "heartbeat_notif.bin",
            body,
            "heartbeat_notif",
            {
                "note": "D worker -> every P agent of the engine: b'HB:' + ','.join(P request ids) (a set: order is"
                " Python's set order, fixed here by PYTHONHASHSEED=0). Made by the release's"
                " NixlBaseConnectorWorker._send_heartbeats into a recording send_notif.",
                "encoding": "UTF-8 text",
                "sent_to_agents": [a for a, _ in sent],
                "decoded": {"req_ids": body[3:].decode().split(",")},
                "source": {"vllm_version": version, "file": f"{NIXL_DIR}/base_worker.py (_send_heartbeats)"},
            },
        )
    except Exception as e:
        problems.append(f"heartbeat: {type(e).__name__}: {e}")

    # push completion notif: inline f-string inside the WRITE path
    line = source_line(
        f"{NIXL_DIR}/push_worker.py", 'notif_id = f"{remote_request_id}:{self.world_size}".encode()'
    )
    if line is None:
        problems.append("push completion notif line not found in push_worker.py")
    else:
        remote_request_id, world_size = "chatcmpl-d41d8cd98f00-0-5b7e9a1c", 4
        body = f"{remote_request_id}:{world_size}".encode()
        w.vector(
            "completion_notif_push.bin",
            body,
            "completion_notif",
            {
                "note": "Push mode, attached by each P worker to its WRITE (make_prepped_xfer notif_msg): "
                "'<D request id>:<P TP world size>'. D parses msg.rsplit(':', 1) and finishes the request"
                " after pp_size * max(1, P_tp // D_tp) of them. The f-string below is the release's own line,"
                " evaluated here (it sits inside the WRITE path, which needs NIXL).",
                "encoding": "UTF-8 text",
                "source_line": line,
                "parse_line": source_line(
                    f"{NIXL_DIR}/push_worker.py", 'req_id, tp_size = msg.rsplit(":", 1)'
                ),
                "expected_notifs_line": source_line(
                    f"{NIXL_DIR}/push_worker.py", "expected_notifs = meta.pp_size *"
                ),
                "decoded": {"request_id": remote_request_id, "tp_size": world_size},
            },
        )
    return problems


def registration_from_scheduler():
    """Run the release's NixlPushConnectorScheduler on VllmConfigs built from argvs: the P side's
    request_finished (what the prefill's response carries) and the D side's get_num_new_matched_tokens +
    update_state_after_alloc (the PUSH_REG registration dict)."""
    from vllm.v1.request import RequestStatus

    pcfg = peer.build_vllm_config(
        [
            "--model",
            "google/gemma-3-1b-it",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt("kv_producer", "prefill-7f3c2a"),
        ]
    )
    psched = peer.push_scheduler(pcfg, host="10.0.0.5", port=5600)
    prid = "chatcmpl-d41d8cd98f00-0-9c0d1e2f"
    preq = peer.make_request(prid, 600, {"do_remote_decode": True, "do_remote_prefill": False})
    preq.num_computed_tokens = 600
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    nb = -(-600 // 16)
    delay, p_params = psched.request_finished(preq, (list(range(1, nb + 1)), list(range(201, 201 + nb))))

    cfg = peer.build_vllm_config(
        [
            "--model",
            "google/gemma-3-1b-it",
            "--tensor-parallel-size",
            "2",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kvt("kv_consumer", "decode-1b9e44"),
        ]
    )
    sched = peer.push_scheduler(cfg, host="10.0.1.23", port=5600)
    rid = "chatcmpl-d41d8cd98f00-0-5b7e9a1c"
    decode_params = {
        k: p_params[k]
        for k in (
            "do_remote_prefill",
            "do_remote_decode",
            "remote_engine_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "pp_size",
            "remote_request_id",
        )
    }
    req = peer.make_request(rid, 600, decode_params, max_tokens=16)
    matched = sched.get_num_new_matched_tokens(req, 0)
    blocks = peer.make_blocks(list(range(100, 100 + nb)), list(range(500, 500 + nb)))
    sched.update_state_after_alloc(req, blocks, matched[0])
    reg = sched._push_pending_registrations[rid]
    prefill = {
        "request_finished_returned": [delay, p_params],
        "decode_request_kv_transfer_params": decode_params,
        "blocks_per_sw": sched.blocks_per_sw,
    }
    return rid, reg, dict(req.kv_transfer_params), matched, prefill


if __name__ == "__main__":
    sys.exit(main())
