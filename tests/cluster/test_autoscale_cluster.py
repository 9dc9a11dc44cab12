"""A load step (concurrency 1 -> 16 -> 1) on the real API server with the reference engine as processes: the
planner scales decode (the role whose target the step breaks) up within its bounds and back down after its
scale-down window, prefill stays, and no request fails (the decoders going away are drained first), though
the operator is killed (SIGKILL) while the decoder it scaled away drains.

The scenario is `disagg bench autoscale`'s (`rig.bench_autoscale.AutoscaleRun`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Cluster, OperatorProcess

from disagg.rig.bench_autoscale import DOWN_WINDOW_S, MAX_DECODERS, AutoscaleRun

# Engine pods start in seconds on an idle machine and in minutes on a CI runner whose cores every process
# shares: the step waits for each one, so it may take longer than the suite's default timeout.
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_a_load_step_scales_decode_up_and_back_down_with_no_failed_request(
    cluster: Cluster, ns: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    def apply(document: dict[str, Any]) -> None:
        result = cluster.kubectl_apply(document)
        assert result.returncode == 0, result.stderr

    killed: list[float] = []

    def restart_operator() -> None:
        # SIGKILL mid-scale-down, a decoder draining: the new operator (which remembers no sample and no
        # recommendation) finishes the drain from what the cluster shows.
        operator.kill()
        operator.start()
        killed.append(time.monotonic())

    result = AutoscaleRun(
        cluster.cp.api_client, cluster.cp.kubeconfig, ns, apply, tmp_path, during_scale_down=restart_operator
    ).run()

    assert result["failed"] == 0, "\n".join([*result["failures"], "events:", *result["events"]])
    assert 1 < result["peak_decoders"] <= MAX_DECODERS
    assert result["max_decoders_seen"] <= MAX_DECODERS
    assert result["max_prefill_seen"] == 1, "prefill's target held: it must not scale"
    assert result["reasons"][0] in ("ScaledUp", "AtMaxReplicas")
    assert result["reasons"][1] == "ScaledDown"
    # The planner's step (the operator's clock) posted the deletion of the drained decoder on the deployment.
    deletions = [e for e in result["events"] if "DisaggDeployment/" in e and " ScaledDown: Deleted " in e]
    assert deletions, result["events"]
    # Down only after the window: the load fell, and the count held at least that long.
    assert result["decide_down_s"] >= DOWN_WINDOW_S - 1
    # Killed while a decoder drained, and converged: one of the decoders there before went and the other
    # stayed (none lost), prefill's engines are untouched, and no decode pod was added but the ReplicaSet's
    # brief replacement for the deleted one, which the scale-down removes (none duplicated).
    assert killed, "the scale-down's drain was never seen"
    before, after = result["pods_before_down"], result["pods_after_down"]
    assert len(after["decode"]) == 1 and set(after["decode"]) < set(before["decode"]), (before, after)
    assert after["prefill"] == before["prefill"]
    assert len(result["decode_pods_added_down"]) <= 1, result["decode_pods_added_down"]
