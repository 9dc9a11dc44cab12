"""Helpers that drive the real vLLM (the .venv-vllm test peer) on a CPU-only machine.

Everything here calls vLLM's own code; the helpers only supply what a running engine would have supplied
(a Hugging Face cache with a config.json, a minimally initialised worker object, the backend name).

    PYTHONSAFEPATH=1 VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -c 'import sys; sys.path.insert(0, "hack/vllm"); import peer'

Import this module only inside the vLLM venv. It sets HF_HUB_OFFLINE=1 and VLLM_TARGET_DEVICE=cpu (if unset)
before vLLM is imported, and HF_HOME (default $TMPDIR/disagg-vllm-hf) since huggingface_hub reads it at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# huggingface_hub reads HF_HOME once, at import: it must be set before vLLM is imported.
os.environ.setdefault("HF_HOME", os.path.join(os.environ.get("TMPDIR", "/tmp"), "disagg-vllm-hf"))

NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

# Public architecture values (config.json) of three model families the operator deploys. Only the fields that
# vLLM's config code reads matter; no weights are needed for a VllmConfig.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma-3 1B, text-only class (the multimodal class needs torchvision). 5 local (SWA 512) : 1 global.
    "google/gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 262144,
    },
    # Llama-3.1-8B-Instruct: 32 layers, GQA 32 q / 8 kv heads, head 128.
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # DeepSeek-V2-Lite: MLA (kv_lora_rank 512, rope 64), 27 layers, 16 heads, MoE 64 routed + 2 shared.
    "deepseek-ai/DeepSeek-V2-Lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
}


def write_hf_cache(
    repo_id: str, config: dict[str, Any] | None = None, hub_cache: str | os.PathLike | None = None
) -> Path:
    """Write HF_HOME/hub/models--ORG--NAME/{refs/main,snapshots/<rev>/config.json}; return the snapshot dir.
    hub_cache defaults to the one huggingface_hub uses (HF_HOME/hub as it was when it was imported)."""
    if hub_cache is None:
        from huggingface_hub import constants

        hub_cache = constants.HF_HUB_CACHE
    config = MODEL_CONFIGS[repo_id] if config is None else config
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    rev = hashlib.sha1(text.encode()).hexdigest()  # any 40-hex revision will do
    repo_dir = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").write_text(text)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


def parse_serve_argv(argv: list[str] | str):
    """Parse `vllm serve` arguments with vLLM's own parser (vllm.entrypoints.cli.serve)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if isinstance(argv, str):
        argv = shlex.split(argv)
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    sub = cmd.subparser_init(subparsers)
    sub.set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(["serve", *argv])
    cmd.validate(args)
    return args


def serve_parser():
    """The `serve` subparser exactly as parse_serve_argv builds it (under vLLM's top-level parser)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    return ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))


def _takes_an_object(parser, action) -> bool:
    """Whether the action accepts a JSON object as its value (what vLLM makes of dotted keys): its type,
    its choices and the action itself take '{}'."""
    import argparse
    import io

    if action.nargs == 0:
        return False
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            values = parser._get_values(action, ["{}"])
            action(parser, argparse.Namespace(), values, action.option_strings[0])
    except (Exception, SystemExit):
        return False
    return True


def _nargs_code(parser, action) -> str:
    import argparse

    if isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return "exit"
    code = {None: "1", argparse.OPTIONAL: "?", argparse.ZERO_OR_MORE: "*", argparse.ONE_OR_MORE: "+"}.get(
        action.nargs, action.nargs
    )
    if not (isinstance(code, str) or (isinstance(code, int) and code >= 0)):
        raise ValueError(
            f"nargs {action.nargs!r} of {action.option_strings} is not in the table's vocabulary"
        )
    return f"{code}{'o' if _takes_an_object(parser, action) else ''}"


# The value types the option table names (`vllm_serve_argv` converts a value as each does); any other type is
# left out of the table, and its values are not judged.
_VALUE_TYPES = {"int": int, "float": float, "str": str, "json": json.loads}


def _closure(function: Any, name: str) -> Any:
    """The variable `name` a closure (vLLM's optional_type and parse_type wrappers) captured."""
    cells = (cell.cell_contents for cell in function.__closure__ or ())
    return dict(zip(function.__code__.co_freevars, cells, strict=True))[name]


def _value_code(action) -> str:
    """How the parser judges the action's value: "=" then its type ("int", "float", "str", "json", "hint" and
    "hint-auto" for vLLM's human-readable integers, "lower_" for its lower-cased choices), "?" first when
    "" and "None" read as None (vLLM's optional_type), and ":" with the choices as compact JSON; "" when the
    action takes no value or its type is none of these (its values are not judged)."""
    import argparse

    from vllm.utils import argparse_utils

    if action.nargs == 0 or isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return ""
    kind = action.type
    optional = getattr(kind, "__qualname__", "").endswith("optional_type.<locals>._optional_type")
    if optional:
        kind = _closure(kind, "return_type")
    if getattr(kind, "__qualname__", "").endswith("parse_type.<locals>._parse_type"):
        kind = _closure(kind, "return_type")
    names = {id(f): name for name, f in _VALUE_TYPES.items()}
    names[id(argparse_utils.human_readable_int)] = "hint"
    names[id(argparse_utils.human_readable_int_or_auto)] = "hint-auto"
    name = "str" if kind is None else names.get(id(kind))
    if name is None and getattr(kind, "__name__", "") == "<lambda>":
        probes = ("Ab-c_D", "x", "A-B-C", "é-Ü")
        if all(kind(p) == p.lower().replace("-", "_") for p in probes):
            name = "lower_"
    # A plain string without choices is every value: nothing to judge.
    if name is None or (name == "str" and action.choices is None):
        return ""
    code = f"={'?' if optional else ''}{name}"
    if action.choices is not None:
        choices = json.dumps(list(action.choices), separators=(",", ":"))
        assert " " not in choices, f"{action.option_strings}: a choice with a space: {choices}"
        code += f":{choices}"
    return code


def serve_option_table() -> dict[str, Any]:
    """The release's `vllm serve` option table as disagg.worker.contracts.vllm_serve_options ships it:
    whether argparse abbreviations are on, the positionals' nargs, and one line per action: its nargs code
    ("0", "1", "?", "*", "+", N, or "exit" for help; an "o" suffix when it takes a JSON object, so dotted keys)
    and every option string the parser registered (negations and vLLM's --enable/--disable pairs included)."""
    parser = serve_parser()
    # What the table does not describe must be absent, so that the emulation need not know it.
    assert parser.prefix_chars == "-" and parser.fromfile_prefix_chars is None
    assert not parser._mutually_exclusive_groups and not parser._has_negative_number_optionals
    assert not [a.dest for a in parser._actions if a.required]
    grouped: dict[int, tuple[Any, list[str]]] = {}
    for option, action in parser._option_string_actions.items():
        grouped.setdefault(id(action), (action, []))[1].append(option)
    rows = []
    for action, options in grouped.values():
        names = sorted(options, key=lambda o: (not o.startswith("--"), o))
        value = _value_code(action)
        rows.append((names[0], " ".join([_nargs_code(parser, action), *([value] if value else []), *names])))
    return {
        "allow_abbrev": parser.allow_abbrev,
        "positionals": [_nargs_code(parser, a).rstrip("o") for a in parser._get_positional_actions()],
        "actions": [line for _, line in sorted(rows)],
    }


def serve_option_samples(model: str, config_file: str) -> dict[str, Any]:
    """For every option string of the serve parser: a value with which `vllm serve MODEL OPTION VALUE` parses
    and validates ("" for a switch that does alone), or None when none of a few candidates does; and for each
    option that takes a JSON object, a dotted key and value that parse (`OPTION.KEY VALUE`), or None."""
    import argparse
    import io

    parser = serve_parser()

    def accepted(argv: list[str]) -> bool:
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                parse_serve_argv(argv)
        except (Exception, SystemExit):
            return False
        return True

    values: dict[str, str | None] = {}
    dotted: dict[str, list[str] | None] = {}
    for option, action in sorted(parser._option_string_actions.items()):
        if isinstance(action, argparse._HelpAction):
            values[option] = None
            continue
        if action.nargs == 0:
            values[option] = "" if accepted([model, option]) else None
            continue
        candidates = [
            *(str(c) for c in (action.choices or ())),
            "1",
            "2",
            "0.5",
            "auto",
            "x",
            "true",
            "{}",
            "a=b",
        ]
        if option == "--config":
            candidates = [config_file]
        values[option] = next((c for c in candidates if accepted([model, option, c])), None)
        if not _takes_an_object(parser, action):
            continue
        cls = (getattr(action.type, "__defaults__", None) or (None,))[0]
        keys = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else ["x"]
        dotted[option] = next(
            (
                [key, value]
                for key in keys[:40]
                for value in ("1", "true", "x")
                if accepted([model, f"{option}.{key}", value])
            ),
            None,
        )
    return {"values": values, "dotted": dotted}


@contextlib.contextmanager
def _triton_gate_open() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses to build any VllmConfig on x86 without triton-cpu ("vLLM on x86 CPUs
    requires Triton (triton-cpu)", platforms/cpu.py check_and_update_config): a serving requirement, since its
    CPU kernels are Triton's. Nothing here runs a kernel and PyPI has no triton-cpu, so the config is built as
    on a machine that has it: `vllm.triton_utils.HAS_TRITON`, which that check reads when it runs, is True for
    the build and restored after. Releases without the check (0.31-0.33) never read it; every hashed factor
    still comes from the release's own config code."""
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had


def build_vllm_config(argv: list[str] | str, *, restore_repo_id: bool = True):
    """VllmConfig from a `vllm serve` argv, offline. Writes the model's config.json into the HF cache if it is
    one of MODEL_CONFIGS (write_hf_cache first for others). With restore_repo_id, model_config.model is set back to the repo id (what a pod
    that downloads the model hashes) instead of the local snapshot path vLLM substitutes offline."""
    args = parse_serve_argv(argv)
    repo_id = args.model_tag or args.model
    if repo_id in MODEL_CONFIGS:
        write_hf_cache(repo_id)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs.from_cli_args(args)
    with _triton_gate_open():
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if restore_repo_id and config.model_config.model != repo_id:
        config.model_config.model = repo_id
    return config


@contextlib.contextmanager
def captured_hash_factors() -> Iterator[list[dict[str, Any]]]:
    """Capture the factor dicts vLLM passes to vllm.config.utils.hash_factors (the real function still runs)."""
    import vllm.config.utils as cu

    seen: list[dict[str, Any]] = []
    real = cu.hash_factors

    def spy(items):
        seen.append(json.loads(json.dumps(items)))  # the JSON view vLLM hashes (tuples become lists)
        return real(items)

    cu.hash_factors = spy
    try:
        yield seen
    finally:
        cu.hash_factors = real


def compat_hash(
    vllm_config, attn_backend_name: str = "FLASH_ATTN", transfer_mode: str = "push"
) -> tuple[str, dict]:
    """vLLM's compute_nixl_compatibility_hash plus the factor dict it hashed.

    The worker calls it in register_kv_caches as
      compute_nixl_compatibility_hash(vllm_config, backend_name, transfer_mode=self._TRANSFER_MODE)
    with backend_name = get_current_attn_backends(vllm_config)[0].get_name() (the first attention layer's
    backend; needs a loaded model on the GPU, so it is passed in here), or for push + packed (block-outermost)
    caches ",".join(sorted({b.get_name() for b in attn_backends})) (v13+). _TRANSFER_MODE is "push" for
    NixlPushConnector and "pull" for NixlConnector / NixlPullConnector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import compute_nixl_compatibility_hash

    with captured_hash_factors() as seen:
        digest = compute_nixl_compatibility_hash(vllm_config, attn_backend_name, transfer_mode=transfer_mode)
    return digest, seen[-1]


def hash_factors(factors: dict[str, Any]) -> str:
    """vLLM's own hash_factors (sha256 of json.dumps(factors, sort_keys=True))."""
    from vllm.config.utils import hash_factors as hf

    return hf(factors)


# --- the side channel -------------------------------------------------------------------------------------


def start_listener(encoded_payloads: dict[tuple[int, int], bytes], host: str = "127.0.0.1", port: int = 5600):
    """Run vLLM's real side-channel server (NixlBaseConnectorScheduler._nixl_handshake_listener) in a thread.

    encoded_payloads: {(pp_rank, tp_rank): msgspec.msgpack.encode(NixlHandshakePayload(...))}. The dict is read
    at every request, so it may be changed while the listener runs. A request for a key that is not in it raises
    KeyError inside the loop and ENDS the listener thread (as in vLLM). Returns (thread, stop_event); stop with
    stop_event.set(); thread.join() (the loop notices within its 1 s receive timeout)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(encoded_payloads, ready, stop, host, port),
        daemon=True,
        name="nixl_handshake_listener",
    )
    t.start()
    ready.wait()
    return t, stop


class RecordingNixlWrapper:
    """Stands in for nixl._api.nixl_agent where _nixl_handshake calls it (add_remote_agent on the notif-only
    path); records the agent blobs and returns a made-up agent name."""

    def __init__(self):
        self.added: list[bytes] = []

    def add_remote_agent(self, agent_metadata: bytes) -> str:
        self.added.append(agent_metadata)
        return f"remote-agent-{len(self.added) - 1}"


def handshake_worker(
    compat_hash_value: str,
    *,
    local_engine_id: str = "local-decode",
    tp_rank: int = 0,
    tp_size: int = 1,
    enforce_compat_hash: bool = True,
    worker_cls=None,
    record_full_add: bool = True,
    block_size: int = 16,
    physical_blocks_per_logical: int = 1,
):
    """A NixlPushConnectorWorker (or worker_cls) made with object.__new__ and only the attributes that
    _nixl_handshake reads. Calling w._nixl_handshake(host, port, remote_tp_size, expected_engine_id,
    remote_dcp_size=1, remote_pp_size=1, notif_agents_only=False) then runs vLLM's real client: REQ socket,
    (GET_META_MSG, pp, tp) per target rank, 2-part reply, two-step typed decode, hash check, engine-id check.
    With notif_agents_only=False the full add_remote_agent (NIXL descriptors) is replaced on the instance by a
    recorder (w.added_full: list of (NixlAgentMetadata, remote_tp_rank, remote_tp_size, remote_dcp_size))."""
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    if worker_cls is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

        worker_cls = NixlPushConnectorWorker
    w = object.__new__(worker_cls)
    w._is_csa_linear = False  # True would call _validate_csa_linear_tp_layout
    w.use_host_buffer = True  # False calls current_platform.set_device(self.device_id) first
    w.device_id = 0
    w.compat_hash = compat_hash_value
    w.enforce_compat_hash = enforce_compat_hash
    w.pcp_size = 1  # _validate_remote_parallel_config
    w.dcp_size = 1
    # 0.34's push _validate_remote_parallel_config: (kernel block size, kernel blocks per logical block) equal.
    w.block_size = block_size
    w._physical_blocks_per_logical_kv_block = physical_blocks_per_logical
    w.transfer_topo = TransferTopology(  # handshake_target_ranks, register_remote_engine
        tp_rank=tp_rank,
        tp_size=tp_size,
        block_size=block_size,
        engine_id=local_engine_id,
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=8,
        attn_backends=[],
    )
    w.nixl_wrapper = RecordingNixlWrapper()  # _add_notif_only_remote_agent
    if record_full_add:
        w.added_full = []

        def add_remote_agent(meta, remote_tp_rank, remote_tp_size, remote_dcp_size=1):
            w.added_full.append((meta, remote_tp_rank, remote_tp_size, remote_dcp_size))
            return f"full-agent-{len(w.added_full) - 1}"

        w.add_remote_agent = add_remote_agent
    return w


# The release's files that make the NIXL push protocol, whose digests `release_facts` reports.
PROTOCOL_FILES = (
    "metadata.py",
    "base_scheduler.py",
    "base_worker.py",
    "push_scheduler.py",
    "push_worker.py",
    "pull_scheduler.py",
    "pull_worker.py",
    "stats.py",
)


def _stub_config(speculative: Any = None) -> Any:
    """The attributes of a VllmConfig that vLLM's compatibility-hash code reads, with made-up values: so that
    a release's own compute_nixl_compatibility_hash runs without a model, and the factors it hashes are
    captured. A release that reads more fails here, which `release_facts` reports."""
    import types

    model = types.SimpleNamespace(
        model="example/model",
        dtype="torch.bfloat16",
        get_total_num_kv_heads=lambda: 8,
        get_head_size=lambda: 128,
        get_total_num_hidden_layers=lambda: 32,
    )
    return types.SimpleNamespace(
        model_config=model,
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=speculative,
    )


def _eagle3() -> Any:
    import types

    draft = types.SimpleNamespace(
        model="example/eagle3",
        revision=None,
        code_revision=None,
        hf_config=types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2]),
    )
    return types.SimpleNamespace(
        method="eagle3",
        draft_model_config=draft,
        kv_cache_dtype=None,
        parallel_drafting=False,
        uses_target_hidden_states=True,
        use_eagle=lambda: True,
    )


def release_facts(backends: list[str]) -> dict[str, Any]:
    """What a release says about NIXL P/D interoperability, from its own code: connector version, metadata
    fields in order (with type and default), the compatibility-hash factor keys and the speculative sub-dict
    keys (its own compute_nixl_compatibility_hash on a stub config, factors captured), the sha256 of each
    push protocol file, the `vllm serve` option table, and each of `backends`' declared kernel block sizes."""
    import importlib

    import vllm

    meta = importlib.import_module(f"{NIXL_PKG}.metadata")
    facts: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "connector_version": meta.NIXL_CONNECTOR_VERSION,
        "metadata_fields": [
            {"name": f.name, "type": str(f.type).replace("typing.", "")}
            for f in dataclasses.fields(meta.NixlAgentMetadata)
        ],
    }
    problems: list[str] = []
    try:
        with captured_hash_factors() as seen:
            meta.compute_nixl_compatibility_hash(_stub_config(_eagle3()), "FLASH_ATTN", transfer_mode="push")
        facts["hash_factor_keys"] = list(seen[-1])
        speculative = seen[-1].get("speculative_config")
        facts["speculative_keys"] = sorted(speculative) if isinstance(speculative, dict) else None
    except Exception as exc:  # a release that reads more of the config: say what, do not stop
        problems.append(f"compute_nixl_compatibility_hash on the stub config: {type(exc).__name__}: {exc}")
        facts["hash_factor_keys"] = facts["speculative_keys"] = None
    nixl_dir = Path(meta.__file__).resolve().parent
    facts["protocol_files"] = {
        name: hashlib.sha256((nixl_dir / name).read_bytes()).hexdigest()
        if (nixl_dir / name).exists()
        else None
        for name in PROTOCOL_FILES
    }
    facts["serve_options"] = serve_option_table()
    kernel: dict[str, Any] = {}
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        for name in backends:
            try:
                sizes = AttentionBackendEnum[name].get_class().get_supported_kernel_block_sizes()
                kernel[name] = [
                    size if isinstance(size, int) else {"multiple_of": size.base} for size in sizes
                ]
            except Exception as exc:
                kernel[name] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        problems.append(f"attention backend registry: {type(exc).__name__}: {exc}")
    facts["kernel_block_sizes"] = kernel
    facts["problems"] = problems
    return facts


def known_env_names() -> set[str]:
    """The VLLM_* (and other) environment names vllm.envs knows."""
    import vllm.envs as envs

    return set(envs.environment_variables)


# --- the connector's scheduler side (P request_finished, D update_state_after_alloc) -----------------------


def gemma_kv_cache_config(num_blocks: int = 1000, layers: range = range(26), block_size: int = 16):
    """A KVCacheConfig like vLLM's for a Gemma-3-1B-like model: group 0 = full-attention layers (every 6th),
    group 1 = sliding-window (512) layers. No tensors (the scheduler side never touches memory)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    name = "model.layers.{}.self_attn.attn".format
    full = [name(i) for i in layers if (i + 1) % 6 == 0]
    swa = [name(i) for i in layers if (i + 1) % 6 != 0]
    fs = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    ss = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=256, dtype=torch.bfloat16, sliding_window=512
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(full, fs), KVCacheGroupSpec(swa, ss)],
    )


def push_scheduler(
    vllm_config,
    engine_id: str | None = None,
    kv_cache_config=None,
    *,
    host: str | None = None,
    port: int | None = None,
):
    """vLLM's real NixlPushConnectorScheduler (what NixlPushConnector(role=SCHEDULER) delegates to). host/port
    override what it read from VLLM_NIXL_SIDE_CHANNEL_HOST/PORT (+ data_parallel_index)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

    engine_id = engine_id or vllm_config.kv_transfer_config.engine_id
    s = NixlPushConnectorScheduler(vllm_config, engine_id, kv_cache_config or gemma_kv_cache_config())
    if host is not None:
        s.side_channel_host = host
    if port is not None:
        s.side_channel_port = port
    return s


def make_request(
    request_id: str, num_prompt_tokens: int, kv_transfer_params: dict[str, Any], max_tokens: int = 1
):
    """A vllm.v1.request.Request with prompt token ids 0..n-1 and the given kv_transfer_params."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    r = Request(request_id, list(range(num_prompt_tokens)), SamplingParams(max_tokens=max_tokens), None)
    r.kv_transfer_params = dict(kv_transfer_params)
    return r


def make_blocks(*groups: list[int]):
    """KVCacheBlocks (one list of fresh, unhashed blocks per KV-cache group) as the KV cache manager returns."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in g] for g in groups))
