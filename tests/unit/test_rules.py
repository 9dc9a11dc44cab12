"""Startup gates and handshake-time rules of the push connector (vllm-nixl-push-connector.md §4)."""

from __future__ import annotations

import pytest

from disagg.worker.kv import rules
from disagg.worker.kv.errors import CompatibilityError, Violation
from disagg.worker.kv.rules import RoleTopology, check_topology


def test_decode_pp_must_be_one() -> None:
    assert rules.decode_pipeline_parallel(1) is None
    violation = rules.decode_pipeline_parallel(2)
    assert violation is not None
    assert violation.reason == "DecodePipelineParallel"
    assert "set decode pipelineParallelSize to 1" in violation.message


@pytest.mark.parametrize(
    ("mode", "hma", "pp", "refused"),
    [("pull", True, 2, True), ("push", True, 2, False), ("pull", False, 2, False), ("pull", True, 1, False)],
)
def test_pull_with_hma_and_pp(mode: str, hma: bool, pp: int, refused: bool) -> None:
    violation = rules.pull_connector_with_hma_pp(mode, hma, pp)
    assert (violation is not None) == refused
    if violation is not None:
        assert violation.reason == "PullConnectorWithHybridPP"
        assert "push connector" in violation.message


def test_mamba_under_pp() -> None:
    assert rules.mamba_under_pp(True, 1) is None
    assert rules.mamba_under_pp(False, 4) is None
    violation = rules.mamba_under_pp(True, 2)
    assert violation is not None and violation.reason == "MambaUnderPipelineParallel"


def test_block_sizes_must_match_only_under_routing() -> None:
    assert rules.block_size_mismatch(False, 16, 32) is None
    assert rules.block_size_mismatch(True, 16, 16) is None
    violation = rules.block_size_mismatch(True, 16, 32)
    assert violation is not None and violation.reason == "BlockSizeMismatch"
    assert "16" in violation.message and "32" in violation.message


def test_unequal_block_sizes_only_for_pull_without_hma_when_prefill_divides_decode() -> None:
    for mode in ("push", "pull"):
        assert rules.unequal_block_sizes(mode, True, 16, 16) is None
    assert rules.unequal_block_sizes("pull", False, 16, 32) is None
    refused = [
        ("push", False, 16, 32),  # the push sidecar moves whole blocks, routed or not
        ("push", True, 32, 16),
        ("pull", True, 16, 32),  # no block remapping with a hybrid KV cache
        ("pull", False, 32, 16),  # only smaller prefill blocks are mapped
        ("pull", False, 16, 24),  # ... and only when they divide the decode block
    ]
    for mode, hma, prefill_bs, decode_bs in refused:
        violation = rules.unequal_block_sizes(mode, hma, prefill_bs, decode_bs)
        assert violation is not None and violation.reason == "BlockSizeMismatch", (mode, hma, prefill_bs)
        assert str(prefill_bs) in violation.message and str(decode_bs) in violation.message


def test_decode_tp_above_prefill_tp() -> None:
    assert rules.decode_tp_exceeds_prefill_tp(False, 2, 2, True) is None
    assert rules.decode_tp_exceeds_prefill_tp(True, 1, 2, True) is None  # MLA is replicated
    assert rules.decode_tp_exceeds_prefill_tp(False, 1, 2, False) is None  # region-index path
    violation = rules.decode_tp_exceeds_prefill_tp(False, 1, 4, True)
    assert violation is not None and violation.reason == "DecodeTPExceedsPrefillTP"
    assert "at most 1" in violation.message


@pytest.mark.parametrize(
    ("p", "d", "ok"), [(4, 2, True), (2, 4, True), (3, 2, False), (6, 4, False), (0, 1, False)]
)
def test_tp_divisibility(p: int, d: int, ok: bool) -> None:
    violation = rules.tp_not_divisible(p, d)
    assert (violation is None) == ok
    if violation is not None:
        assert violation.reason == "TensorParallelNotDivisible"


@pytest.mark.parametrize(
    ("partition", "fragment"),
    [((10, 10), "sums to 20"), ((30, 0), "without layers"), ((10, 10, 10), "3 entries")],
)
def test_invalid_layer_partition(partition: tuple[int, ...], fragment: str) -> None:
    violation = rules.invalid_layer_partition(30, 2, partition)
    assert violation is not None and violation.reason == "InvalidLayerPartition"
    assert fragment in violation.message
    assert rules.invalid_layer_partition(30, 2, (12, 18)) is None
    assert rules.invalid_layer_partition(30, 2, None) is None
    assert rules.invalid_layer_partition(3, 4, None) is not None


@pytest.mark.parametrize(
    ("mode", "hma", "packed", "mamba", "pp", "expected"),
    [
        ("push", True, False, False, 2, True),
        ("push", False, True, False, 2, True),
        ("push", True, False, False, 1, False),
        ("push", False, False, False, 2, False),
        ("push", True, False, True, 2, False),
        ("pull", True, False, False, 2, False),
    ],
)
def test_layer_name_routing_gate(
    mode: str, hma: bool, packed: bool, mamba: bool, pp: int, expected: bool
) -> None:
    assert rules.requires_layer_name_routing(mode, hma, packed, mamba, pp, connector_version=15) is expected
    assert rules.layer_routed_pp_push(mode, hma, packed, mamba, pp) is expected
    # From vLLM 0.34 (connector version 16) every peer pairs by layer name.
    assert rules.requires_layer_name_routing(mode, hma, packed, mamba, pp, connector_version=16)


def test_check_topology_reports_every_violation() -> None:
    found = check_topology(
        transfer_mode="push",
        hma=True,
        has_mamba=False,
        is_mla=False,
        num_layers=30,
        prefill=RoleTopology(pp_size=2, tp_size=1, block_size=16, layer_partition=(10, 10)),
        decode=RoleTopology(pp_size=2, tp_size=2, block_size=32),
    )
    assert [v.reason for v in found] == [
        "DecodePipelineParallel",
        "BlockSizeMismatch",
        "DecodeTPExceedsPrefillTP",
        "InvalidLayerPartition",
    ]


def test_check_topology_accepts_the_supported_topology() -> None:
    assert (
        check_topology(
            transfer_mode="push",
            hma=True,
            has_mamba=False,
            is_mla=False,
            num_layers=30,
            prefill=RoleTopology(pp_size=2, tp_size=2, block_size=16),
            decode=RoleTopology(pp_size=1, tp_size=1, block_size=16),
        )
        == []
    )


def test_a_typed_error_raised_for_a_rule_gives_back_its_violation() -> None:
    # How the worker raises a rule (decode_checks) and how the operator's policies read it back.
    violation = rules.mamba_under_pp(True, 2)
    assert isinstance(violation, Violation)
    with pytest.raises(CompatibilityError) as info:
        raise CompatibilityError(violation.message, reason=violation.reason)
    assert info.value.violation == violation


def test_a_pp1_push_peer_advertises_layers_but_keeps_region_routing() -> None:
    assert rules.tracks_region_layers("push", True, False, False, connector_version=15)
    assert not rules.requires_layer_name_routing("push", True, False, False, 1, connector_version=15)
    assert not rules.tracks_region_layers("push", True, False, True, connector_version=15)
    assert not rules.tracks_region_layers("pull", True, False, False, connector_version=15)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("hma", "mamba"), [(False, False), (True, False), (True, True)])
def test_from_connector_version_16_every_worker_advertises_and_pairs_by_layer(
    mode: str, hma: bool, mamba: bool
) -> None:
    """vLLM 0.34's register_kv_caches fills region_members for every worker, and `_pair_regions` is its only
    pairing; 0.33 (15) kept both to PP + HMA/packed push."""
    assert rules.tracks_region_layers(mode, hma, False, mamba, connector_version=16)
    assert rules.requires_layer_name_routing(mode, hma, False, mamba, 1, connector_version=16)
    assert not rules.requires_layer_name_routing(mode, hma, False, mamba, 1, connector_version=15)


def test_mamba_state_is_not_moved_by_the_push_sidecar() -> None:
    assert rules.mamba_state_not_transferred("pull", True) is None
    assert rules.mamba_state_not_transferred("push", False) is None
    violation = rules.mamba_state_not_transferred("push", True)
    assert violation is not None and violation.reason == "MambaStateNotSupported"
    assert "Pull" in violation.message


def test_prefill_context_parallel() -> None:
    assert rules.prefill_context_parallel(1) is None
    violation = rules.prefill_context_parallel(2)
    assert violation is not None and violation.reason == "PrefillContextParallel"
    assert "--prefill-context-parallel-size" in violation.message


def test_decode_context_parallel() -> None:
    assert rules.decode_context_parallel(1) is None
    violation = rules.decode_context_parallel(2)
    assert violation is not None and violation.reason == "DecodeContextParallel"
    assert "--decode-context-parallel-size" in violation.message


@pytest.mark.parametrize(
    ("prefill", "decode", "mla", "refused"),
    [
        ("LBHNC", "LBHNC", False, False),
        ("LBHNC", "HND", False, False),
        ("LBHNC", "NHD", False, True),
        ("HND", "LBNHC", False, True),
        ("LBHNC", "BLHNC", False, True),
        ("LBHNC", "NHD", True, False),
    ],
)
def test_kv_cache_layouts_must_match(prefill: str, decode: str, mla: bool, refused: bool) -> None:
    violation = rules.kv_cache_layout_mismatch(prefill, decode, mla)
    assert (violation is not None) is refused
    if violation is not None:
        assert violation.reason == "KVCacheLayoutMismatch"
        assert "enable_permute_local_kv" in violation.message
