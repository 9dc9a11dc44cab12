"""What `disagg check` says when the spec leaves an engine container without the resources its scheduling
needs: the operator generates none of its own and says so, and on CPU what to request instead."""

from __future__ import annotations

from typing import Any

from dd_specs import DELETE, spec

from disagg.operator.policies.compat import evaluate

CPU_ENGINE: dict[str, Any] = {"engine": {"attentionBackend": "CPU_ATTN"}}
NO_RESOURCES: dict[str, Any] = {"prefill": {"resources": DELETE}, "decode": {"resources": DELETE}}


def _resource_notes(patch: dict[str, Any]) -> list[str]:
    return [note for note in evaluate(spec(patch)).notes if "request no cpu and memory" in note]


def test_roles_without_resources_get_a_note_naming_them_and_that_the_operator_guessed_none() -> None:
    (note,) = _resource_notes(NO_RESOURCES)
    assert "spec.prefill.resources and spec.decode.resources" in note
    assert "guesses nothing" in note and "BestEffort" in note
    assert "NUMA" not in note  # the CPU advice is for engines on CPU only


def test_a_gpu_role_with_its_gpus_given_needs_no_note() -> None:
    # The example's roles limit their GPUs: what the scheduler must count for a GPU engine is there.
    assert _resource_notes({}) == []


def test_on_cpu_a_role_without_cpu_and_memory_requests_is_told_what_to_request_and_where() -> None:
    (note,) = _resource_notes(
        {**CPU_ENGINE, "decode": {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}}
    )
    assert "spec.prefill.resources request" in note and "spec.decode" not in note
    assert "cpu: 2" in note and "VLLM_CPU_KVCACHE_SPACE" in note and "one engine per NUMA node" in note
    both = {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "3"}}}
    assert _resource_notes({**CPU_ENGINE, "prefill": both, "decode": both}) == []
