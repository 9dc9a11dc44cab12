"""Push needs equal (kernel block size, kernel blocks per logical block) on both roles (vLLM 0.34's
`_validate_remote_parallel_config`, and the push sidecar): decided before pods exist where both roles pin a
backend whose kernel block sizes are fixed, said in the verdict where not, and refused at handshake by the
decode checks either way. The table is checked against vLLM 0.34's own backends in
tests/interop/test_kernel_blocks_interop.py."""

from __future__ import annotations

import dataclasses

from dd_specs import spec

from disagg.operator.naming import Installation
from disagg.operator.policies.chain import REFUSAL_CHAIN
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.attention_backends import kernel_blocks
from disagg.worker.kv.decode_checks import LocalRegion, PrefillRank, check_decode_rank
from disagg.worker.kv.errors import HandshakeError
from disagg.worker.kv.routing import RegionGeometry

V034 = {"version": "0.34.0", "image": "vllm/vllm-openai:v0.34.0"}


def test_a_fixed_backend_gives_its_kernel_block_size_and_an_auto_sized_one_none() -> None:
    assert kernel_blocks("TRITON_ATTN", 32) == (32, 1)
    assert kernel_blocks("CPU_MLA", 64) == (16, 4)
    assert kernel_blocks("FLASHMLA", 128) == (64, 2)
    assert kernel_blocks("FLASHMLA", 32) is None  # no size of FLASHMLA divides 32: vLLM does not start
    assert kernel_blocks("FLASH_ATTN", 32) is None  # by the GPU and KV spec


def test_a_push_pair_whose_pinned_backends_give_other_kernel_blocks_is_refused_before_any_pod() -> None:
    patch = {
        "engine": {**V034, "attentionBackend": "TRITON_ATTN"},
        "decode": {"overrides": {"attentionBackend": "CPU_MLA"}},
    }
    report = evaluate(spec(patch), REFUSAL_CHAIN, Installation(worker_image="w:1"))
    (violation,) = [v for v in report.violations if v.reason == "KernelBlockSizeMismatch"]
    block = spec(patch).prefill.block_size
    assert f"prefill has ({block}, 1) and decode (16, {block // 16})" in violation.message
    assert report.notes == ()


def test_equal_fixed_kernel_blocks_pass_and_an_undecided_pair_is_left_to_the_handshake() -> None:
    fixed = evaluate(spec({"engine": {**V034, "attentionBackend": "TRITON_ATTN"}}))
    assert fixed.compatible and fixed.notes == ()
    auto = evaluate(spec({"engine": {**V034, "attentionBackend": "FLASH_ATTN"}}))
    assert auto.compatible
    (note,) = auto.notes
    assert "FLASH_ATTN picks its kernel block size by the GPU" in note and "KernelBlockSizeMismatch" in note


def test_the_handshake_refuses_other_kernel_blocks_per_logical_block() -> None:
    name = "model.layers.0.self_attn.attn"
    rank = PrefillRank(
        block_size=16,
        routed_layers=((name, 0),),
        pp_size=1,
        stage_layers=range(1),
        regions=(LocalRegion(name, 4096, False),),
        mem_types=None,
        tp_rank=0,
        tp_size=1,
        num_kv_heads=8,
        is_mla=False,
        blocks_per_logical=2,
        whole_model=True,
    )
    remote = RegionGeometry(
        kv_caches_base_addr=[1 << 44],
        device_id=0,
        num_blocks=32,
        block_lens=[4096],
        block_strides=[4096],
        block_size=16,
        physical_blocks_per_logical_kv_block=1,
        region_names=[name],
        region_members=[[name]],
    )
    try:
        check_decode_rank(rank, remote, 1)
    except HandshakeError as error:
        assert error.reason == "KernelBlockSizeMismatch"
        assert "prefill has (16, 2) and decode (16, 1)" in error.message
    else:
        raise AssertionError("a decoder with other kernel blocks per logical block was accepted")
    check_decode_rank(rank, dataclasses.replace(remote, physical_blocks_per_logical_kv_block=2), 1)
