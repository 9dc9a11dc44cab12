"""`make vllm-release VERSION=X` (hack/vllm/release.py) on vLLM 0.34's own facts: it names what 0.34 changed
against 0.33 and reports nothing missing for a release the project supports throughout; the same facts as a
release the project has never seen (a connector version and a field more) are reported missing everywhere the
project would have to change, so the command exits non-zero until they are handled."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
from _vllm_peer import PeerFactory

from disagg.worker.contracts import releases
from disagg.worker.contracts.attention_backends import KERNEL_BLOCK_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "vllm"))
import release


@pytest.fixture(scope="module")
def facts(vllm_peers: PeerFactory) -> dict[str, Any]:
    got: dict[str, Any] = vllm_peers("0.34.0").call("release_facts", backends=sorted(KERNEL_BLOCK_SIZES))
    return got


def test_what_034_changed_and_that_nothing_is_missing(facts: dict[str, Any]) -> None:
    assert facts["problems"] == []
    base = release.newest_before((0, 34, 0))
    assert base is not None and base.tested == "0.33.0"
    told = release.changes(facts, base)
    assert "connector version 15 -> 16" in told
    assert "NixlAgentMetadata: 21 -> 22 fields; added layer_group_ids after region_members" in told
    assert "hashed speculative_config keys: removed ['parallel_drafting'], added []" in told
    assert any(line.startswith("push protocol files byte-identical: push_scheduler.py") for line in told)
    assert release.missing(facts, "0.34.0") == []


def test_a_release_the_project_does_not_know_is_reported_missing(facts: dict[str, Any]) -> None:
    unknown = copy.deepcopy(facts)
    unknown["connector_version"] = 17
    unknown["metadata_fields"].append({"name": "kv_offload_tier", "type": "str | None"})
    unknown["kernel_block_sizes"]["FLASHMLA"] = [128]
    gaps = release.missing(unknown, "0.35.0")
    assert releases.release_of("0.35.0") is None
    expected = [
        'add ConnectorVersion(17, "0.35.0")',
        "vllm serve option table",
        "tests/golden/vllm/0.35.0",
        "add 0.35.0 to tests/interop/_vllm_peer.py RELEASES",
        "add 0.35.0 to RELEASES in hack/vllm/wheels.sh",
        "kernel block sizes of FLASHMLA are [128]",
    ]
    for text in expected:
        assert sum(text in gap for gap in gaps) == 1, (text, gaps)
    assert len(gaps) == len(expected)
