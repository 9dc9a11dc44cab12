"""A deployment's start, against real side channels: a peer whose engine is not up yet is pending (the
condition Unknown, naming it and the grace left), not a failure, until it answers or its startup grace has
passed; a peer that answered once and then fails is reported at once (issue 22, finding 11b).

The rounds are the sidecar's own (`check_round` for a transfer sidecar, `watch_round` for a watching one),
kept from round to round by one `StartupGrace`, whose clock the test moves instead of waiting 600 s.
"""

from __future__ import annotations

from pathlib import Path

from test_peer_check import DECODE_POD, HEAD_POD, HOST, PREFILL_POD, config, engine, topology, worker
from test_watch import pod_of

from disagg.rig.local import free_port
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.reporting.peer_check import Outcome, check_round
from disagg.worker.reporting.startup import StartupGrace
from disagg.worker.reporting.watch import watch_round

TIMEOUT_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prefill_engine_still_loading_is_awaited_then_ready_then_reported_at_once_when_it_goes(
    tmp_path: Path,
) -> None:
    decode = config(tmp_path, "decode", DECODE_POD, topology())
    head = config(tmp_path, "prefill", HEAD_POD, topology())
    stage = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_PP_RANK="1")
    pods = [pod_of(head, HEAD_POD), pod_of(stage, PREFILL_POD)]
    clock = Clock()
    grace = StartupGrace(600.0, clock)

    def round_() -> Outcome:
        return check_round(decode, None, pods, timeout_s=TIMEOUT_S, grace=grace)

    loading = round_()
    assert (loading.status, loading.reason) == ("Unknown", "AwaitingPeers"), loading
    assert (
        f"prefill stage 0 (pod {HEAD_POD}) at {HOST}:{head.side_channel_port} to answer (PeerUnreachable"
        in (loading.message)
    )
    assert "600 s of its startup grace left" in loading.message
    assert loading.refusals == ()  # no Warning Event for an engine that is still loading
    assert loading.report is not None and loading.report.peers == ()  # not yet checked, not refused
    clock.now = 120.0
    with engine(head, stage):
        up = round_()
    assert (up.status, up.reason) == ("True", "HandshakesSucceeded"), up
    # It answered before, so its going away is news at once, well inside the grace.
    clock.now = 130.0
    gone = round_()
    assert (gone.status, gone.reason) == ("False", "PeerUnreachable"), gone
    assert [refusal.peer.pod for refusal in gone.refusals] == [HEAD_POD, PREFILL_POD]


def test_a_peer_serving_no_payload_yet_is_awaited_and_one_that_never_answers_fails_after_the_grace(
    tmp_path: Path,
) -> None:
    decode = config(tmp_path, "decode", DECODE_POD, topology())
    head = config(tmp_path, "prefill", HEAD_POD, topology())
    clock = Clock()
    grace = StartupGrace(600.0, clock)
    # A transfer sidecar whose engine has not registered its KV: its side channel answers, with no payload.
    with SideChannelServer(head.side_channel_host, head.side_channel_port):
        empty = check_round(decode, None, [pod_of(head, HEAD_POD)], timeout_s=TIMEOUT_S, grace=grace)
        assert (empty.status, empty.reason) == ("Unknown", "AwaitingPeers"), empty
        assert "(HandshakeFailed: " in empty.message
        clock.now = 600.0
        late = check_round(decode, None, [pod_of(head, HEAD_POD)], timeout_s=TIMEOUT_S, grace=grace)
    assert (late.status, late.reason) == ("False", "HandshakeFailed"), late
    assert late.report is not None and [v.reason for v in late.report.peers] == ["HandshakeFailed"]


def test_a_refusal_is_reported_at_once_even_at_startup(tmp_path: Path) -> None:
    prefill = config(tmp_path, "prefill", PREFILL_POD, topology())
    other = config(tmp_path, "decode", DECODE_POD, topology(compatibilityHashes={"decode": "0" * 64}))
    grace = StartupGrace(600.0, Clock())
    with worker(prefill) as (local, _), worker(other):
        outcome = check_round(prefill, local, [pod_of(other, DECODE_POD)], timeout_s=2.0, grace=grace)
    assert (outcome.status, outcome.reason) == ("False", "CompatibilityHashMismatch"), outcome


def test_a_watching_sidecar_awaits_its_own_engine_until_it_answers_or_the_grace_passes(
    tmp_path: Path,
) -> None:
    port = str(free_port())
    own = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    head = config(tmp_path, "prefill", HEAD_POD, topology())
    pods = [pod_of(head, HEAD_POD)]
    clock = Clock()
    grace = StartupGrace(300.0, clock)

    def round_() -> Outcome:
        return watch_round(watcher, DECODE_POD, pods, timeout_s=TIMEOUT_S, grace=grace)

    loading = round_()
    assert (loading.status, loading.reason) == ("Unknown", "AwaitingEngine"), loading
    assert (
        f"this pod's own engine {DECODE_POD} at {HOST}:{port} to answer its first handshake"
        in loading.message
    )
    assert loading.refusals == ()
    with worker(own), engine(head):
        clock.now = 60.0
        assert round_().status == "True"
    clock.now = 61.0
    gone = round_()  # the engine answered before: its going away is reported at once
    assert (gone.status, gone.reason) == ("False", "PeerUnreachable"), gone
    assert f"this pod's own engine {DECODE_POD}" in gone.message

    late_start = StartupGrace(300.0, clock)
    assert watch_round(watcher, DECODE_POD, pods, timeout_s=TIMEOUT_S, grace=late_start).status == "Unknown"
    clock.now = 361.0
    never = watch_round(watcher, DECODE_POD, pods, timeout_s=TIMEOUT_S, grace=late_start)
    assert (never.status, never.reason) == ("False", "PeerUnreachable"), never
