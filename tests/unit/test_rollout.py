"""`rollout.assess` over recorded states of a deployment's workloads and pods: no cluster, no clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from disagg.operator.api import RolloutSpec
from disagg.operator.rollout import COMPLETE, DRAINING_OLD, IDLE_GRACE_S, STUCK, WAITING, assess
from disagg.operator.status import Workload
from disagg.worker.contracts.pairing import routing_from_pods
from disagg.worker.contracts.peer_report import (
    PEER_REPORT_VERSION,
    InFlight,
    PeerReport,
    PeerVerdict,
    decode_peer_report,
    encode_peer_report,
)
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    DRAINING_ANNOTATION,
    PEER_REPORT_ANNOTATION,
    ROLE_LABEL,
)

NOW = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
OLD, NEW = "1111111111", "2222222222"
HASHES = {OLD: "a" * 64, NEW: "b" * 64}
SETTINGS = RolloutSpec(drain_seconds=30, progress_deadline_seconds=120)


def workloads(*slots: tuple[str, str], since: datetime = NOW) -> list[Workload]:
    out = []
    for slot, revision in slots:
        stem = "d" if slot == "a" else "d-b"
        for kind, role, name in (
            ("StatefulSet", "prefill", f"{stem}-prefill-0"),
            ("Deployment", "decode", f"{stem}-decode"),
        ):
            out.append(Workload(kind, name, role, 1, 1, 1, 1, True, 1, slot, revision, since))
    return out


def pod(
    name: str, role: str, slot: str, revision: str, peers: list[tuple[str, bool, str]], **extra: Any
) -> dict[str, Any]:
    """A ready PP1 pod whose report vouches for (or refuses) `peers` (name, ok, the hash it saw)."""
    verdicts = tuple(
        PeerVerdict(
            pod=peer,
            engine_id=peer.rsplit("-", 1)[0] if "prefill" in peer else peer,
            ok=ok,
            reason="HandshakesSucceeded" if ok else "CompatibilityHashMismatch",
            kv_hash=seen,
        )
        for peer, ok, seen in peers
    )
    engine_id = name.rsplit("-", 1)[0] if role == "prefill" else name
    report = PeerReport(
        version=PEER_REPORT_VERSION, engine_id=engine_id, kv_hash=HASHES[revision], peers=verdicts
    )
    annotations = {PEER_REPORT_ANNOTATION: encode_peer_report(report), **extra}
    return {
        "metadata": {
            "name": name,
            "labels": {
                DEPLOYMENT_LABEL: "d",
                ROLE_LABEL: role,
                "disagg.io/revision": revision,
                "disagg.io/slot": slot,
            },
            "annotations": annotations,
        },
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def pair(slot: str, revision: str, *, decode_hash: str | None = None) -> list[dict[str, Any]]:
    """One prefill engine and one decoder of `revision` in `slot`, vouching for each other (or, with
    `decode_hash`, a decoder whose live hash differs: each side refuses the other)."""
    stem = "d" if slot == "a" else "d-b"
    prefill, decode = f"{stem}-prefill-0-0", f"{stem}-decode-x{slot}"
    ok = decode_hash is None
    theirs = HASHES[revision] if ok else decode_hash
    pods = [
        pod(prefill, "prefill", slot, revision, [(decode, ok, theirs or "")]),
        pod(decode, "decode", slot, revision, [(prefill, ok, HASHES[revision])]),
    ]
    if decode_hash is not None:
        report = PeerReport(
            version=PEER_REPORT_VERSION,
            engine_id=decode,
            kv_hash=decode_hash,
            peers=(
                PeerVerdict(
                    pod=prefill,
                    engine_id=prefill.rsplit("-", 1)[0],
                    ok=False,
                    reason="CompatibilityHashMismatch",
                    kv_hash=HASHES[revision],
                ),
            ),
        )
        pods[1]["metadata"]["annotations"][PEER_REPORT_ANNOTATION] = encode_peer_report(report)
    return pods


def judge(
    revision: str,
    slots: list[tuple[str, str]],
    pods: list[dict[str, Any]],
    now: datetime = NOW,
    since: datetime = NOW,
) -> Any:
    return assess(
        revision=revision,
        workloads=workloads(*slots, since=since),
        pods=pods,
        routing=routing_from_pods(pods),
        now=now,
        settings=SETTINGS,
        sizes=(1, 1),
    )


def test_a_revision_that_is_all_there_is_stays_in_its_slot_with_no_rollout() -> None:
    found = judge(OLD, [("a", OLD)], pair("a", OLD))
    assert (found.slot, found.phase, found.keep_old, found.old_slot) == ("a", None, False, None)
    assert found.pairs == {OLD: 1}
    # Workloads from before revisions existed are the spec's: changed in place, as they always were.
    found = judge(NEW, [("a", "")], [])
    assert (found.slot, found.phase) == ("a", None)


def test_a_new_revision_comes_up_in_the_other_slot_and_the_old_keeps_serving_until_it_pairs() -> None:
    found = judge(NEW, [("a", OLD)], pair("a", OLD))
    assert (found.slot, found.old_slot, found.old_revision) == ("b", "a", OLD)
    assert (found.phase, found.keep_old, found.drain) == (WAITING, True, ())
    assert "step 1 of 1: 0/1 prefill engines and 0/1 decoders" in found.message

    both = [("a", OLD), ("b", NEW)]
    found = judge(NEW, both, pair("a", OLD))
    assert (found.slot, found.phase, found.keep_old) == ("b", WAITING, True)


def test_once_the_new_revision_pairs_the_old_pods_that_served_are_drained_then_let_go() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    found = judge(NEW, both, pods)
    assert found.phase == DRAINING_OLD and found.keep_old
    assert found.drain == ("d-decode-xa", "d-prefill-0-0")
    assert found.pairs == {OLD: 1, NEW: 1}

    # Marked: the router stops sending them requests; until drainSeconds pass the old slot stays.
    marked = (NOW - timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    for each in pods[:2]:
        each["metadata"]["annotations"][DRAINING_ANNOTATION] = marked
    found = judge(NEW, both, pods)
    assert (found.phase, found.keep_old, found.drain) == (DRAINING_OLD, True, ())
    assert "0 of 2 old pods idle" in found.message and "in 20s (drainSeconds 30)" in found.message
    # Without a word from the pods' sidecars, drainSeconds bounds the drain.
    found = judge(NEW, both, pods, now=NOW + timedelta(seconds=25))
    assert (found.phase, found.keep_old) == (DRAINING_OLD, False)
    assert f"revision {OLD} is drained" in found.message and not found.keep_old


def mark(pods: list[dict[str, Any]], at: datetime) -> None:
    for each in pods:
        each["metadata"]["annotations"][DRAINING_ANNOTATION] = at.strftime("%Y-%m-%dT%H:%M:%SZ")


def in_flight(each: dict[str, Any], requests: int, at: datetime) -> None:
    """What a draining pod's sidecar adds to its report: its engine's requests in flight, measured `at`."""
    annotations = each["metadata"]["annotations"]
    report = decode_peer_report(annotations[PEER_REPORT_ANNOTATION])
    report = PeerReport(
        version=report.version,
        engine_id=report.engine_id,
        kv_hash=report.kv_hash,
        peers=report.peers,
        in_flight=InFlight(requests=requests, at=at),
    )
    annotations[PEER_REPORT_ANNOTATION] = encode_peer_report(report)


def test_a_drain_ends_once_every_drained_pod_reports_nothing_in_flight_a_grace_after_its_mark() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    marked = NOW - timedelta(seconds=10)
    mark(pods[:2], marked)
    # One old pod idle, the other still finishing a request: the old slot stays.
    in_flight(pods[0], 0, NOW)
    in_flight(pods[1], 1, NOW)
    found = judge(NEW, both, pods)
    assert (found.phase, found.keep_old) == (DRAINING_OLD, True)
    assert "1 of 2 old pods idle" in found.message
    # Both idle: the old slot goes long before drainSeconds (30 s) would have let it.
    in_flight(pods[1], 0, NOW)
    found = judge(NEW, both, pods)
    assert (found.phase, found.keep_old) == (DRAINING_OLD, False)
    assert f"revision {OLD} is drained" in found.message and not found.keep_old


def test_an_idle_report_counts_only_when_measured_a_grace_after_the_mark() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    mark(pods[:2], NOW - timedelta(seconds=10))
    # Measured before the mark, or within the grace a router may still send a request in: not idle yet.
    in_flight(pods[0], 0, NOW - timedelta(seconds=11))
    in_flight(pods[1], 0, NOW - timedelta(seconds=10 - IDLE_GRACE_S + 1))
    found = judge(NEW, both, pods)
    assert found.keep_old and "0 of 2 old pods idle" in found.message
    in_flight(pods[0], 0, NOW - timedelta(seconds=10 - IDLE_GRACE_S))
    found = judge(NEW, both, pods)
    assert found.keep_old and "1 of 2 old pods idle" in found.message


def test_pods_being_marked_now_are_not_idle_whatever_they_reported_before() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    for each in pods[:2]:
        in_flight(each, 0, NOW)
    found = judge(NEW, both, pods)
    assert found.keep_old and found.drain == ("d-decode-xa", "d-prefill-0-0")
    assert "0 of 2 old pods idle" in found.message


def test_a_new_revision_that_cannot_pair_with_itself_is_stuck_at_once_and_the_old_keeps_serving() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW, decode_hash="c" * 64)
    found = judge(NEW, both, pods)
    assert (found.phase, found.keep_old, found.drain) == (STUCK, True, ())
    assert "reports CompatibilityHashMismatch from pod d-b-" in found.message
    assert f"revision {OLD} keeps serving (1 pairs)" in found.message


def test_a_new_revision_without_a_routable_pair_past_its_deadline_is_stuck() -> None:
    both = [("a", OLD), ("b", NEW)]
    early = NOW - timedelta(seconds=60)
    assert judge(NEW, both, pair("a", OLD), since=early).phase == WAITING
    late = NOW - timedelta(seconds=121)
    found = judge(NEW, both, pair("a", OLD), since=late)
    assert found.phase == STUCK and found.keep_old
    assert "progressDeadlineSeconds 120" in found.message


def test_rolling_back_to_the_old_spec_lets_the_failed_slot_go_at_once() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW, decode_hash="c" * 64)
    found = judge(OLD, both, pods)
    # Slot a holds the spec's revision again; slot b's pods never served, so there is nothing to drain.
    assert (found.slot, found.old_slot, found.old_revision) == ("a", "b", NEW)
    assert (found.phase, found.keep_old, found.drain) == (DRAINING_OLD, False, ())


def test_a_third_revision_during_a_rollout_replaces_the_slot_that_serves_less() -> None:
    both = [("a", OLD), ("b", NEW)]
    third = "3333333333"
    found = judge(third, both, pair("a", OLD))
    assert (found.slot, found.old_slot, found.old_revision) == ("b", "a", OLD)
    assert found.phase == WAITING and COMPLETE == "RolloutComplete"


def test_a_handshake_that_failed_while_a_peer_started_is_waited_for_not_stuck() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    report = PeerReport(
        version=PEER_REPORT_VERSION,
        engine_id="d-b-decode-xb",
        kv_hash=HASHES[NEW],
        peers=(
            PeerVerdict(
                pod="d-b-prefill-0-0",
                engine_id="d-b-prefill-0",
                ok=False,
                reason="HandshakeFailed",
                kv_hash="",
            ),
        ),
    )
    pods[3]["metadata"]["annotations"][PEER_REPORT_ANNOTATION] = encode_peer_report(report)
    found = judge(NEW, both, pods)
    assert (found.phase, found.keep_old) == (WAITING, True)


def decoders(slot: str, revision: str, count: int, *, settings: RolloutSpec = SETTINGS) -> Any:
    """One prefill engine and `count` decoders of `revision` in `slot`, all vouching for each other."""
    stem = "d" if slot == "a" else "d-b"
    prefill = f"{stem}-prefill-0-0"
    names = [f"{stem}-decode-{k}" for k in range(count)]
    pods = [pod(prefill, "prefill", slot, revision, [(n, True, HASHES[revision]) for n in names])]
    pods += [pod(n, "decode", slot, revision, [(prefill, True, HASHES[revision])]) for n in names]
    return pods


def test_a_step_drains_one_old_decoder_per_new_one_then_deletes_exactly_it_and_scales_down() -> None:
    settings = RolloutSpec(drain_seconds=30, max_surge=1)
    old = [
        Workload("StatefulSet", "d-prefill-0", "prefill", 1, 1, 1, 1, True, 1, "a", OLD, NOW),
        Workload("Deployment", "d-decode", "decode", 3, 3, 3, 3, True, 1, "a", OLD, NOW),
    ]
    new = [
        Workload("StatefulSet", "d-b-prefill-0", "prefill", 1, 1, 1, 1, True, 1, "b", NEW, NOW),
        Workload("Deployment", "d-b-decode", "decode", 1, 1, 1, 1, True, 1, "b", NEW, NOW),
    ]
    pods = decoders("a", OLD, 3) + decoders("b", NEW, 1)

    def at(now: datetime) -> Any:
        return assess(
            revision=NEW,
            workloads=old + new,
            pods=pods,
            routing=routing_from_pods(pods),
            now=now,
            settings=settings,
            sizes=(1, 3),
        )

    found = at(NOW)
    # The new pair serves: one old decoder (the highest) drains; the old prefill engine stays, the old
    # decoders' pair; the new revision may not grow yet (3 old decoders + 1 new = desired + maxSurge).
    assert found.drain == ("d-decode-2",)
    assert found.replicas[NEW] == (1, 1) and found.phase == DRAINING_OLD
    assert found.message.startswith("step 1 of 3: 1/1 prefill engines and 1/3 decoders")
    assert (found.delete_pods, found.scale, found.remove) == ((), None, ())
    marked = (NOW - timedelta(seconds=31)).strftime("%Y-%m-%dT%H:%M:%SZ")
    for each in pods:
        if each["metadata"]["name"] in found.drain:
            each["metadata"]["annotations"][DRAINING_ANNOTATION] = marked
    found = at(NOW)
    # Drained: exactly that decoder goes, its Deployment one replica lower.
    assert found.delete_pods == ("d-decode-2",) and found.scale == ("d-decode", 2)
    assert found.replicas == {NEW: (1, 1), OLD: (1, 2)} and found.keep_old and not found.remove


def test_a_rollback_midway_unmarks_the_spec_slots_draining_pods() -> None:
    pods = pair("a", OLD) + pair("b", NEW)
    marked = NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    pods[1]["metadata"]["annotations"][DRAINING_ANNOTATION] = marked
    found = judge(OLD, [("a", OLD), ("b", NEW)], pods)
    assert found.slot == "a" and found.undrain == ("d-decode-xa",)


def test_a_steps_pod_not_routable_past_the_deadline_since_it_was_made_stops_the_rollout() -> None:
    from disagg.worker.contracts.engine_pods import essentials

    settings = RolloutSpec(progress_deadline_seconds=120, max_surge=1)
    old = [
        Workload("StatefulSet", "d-prefill-0", "prefill", 1, 1, 1, 1, True, 1, "a", OLD, NOW),
        Workload("Deployment", "d-decode", "decode", 1, 1, 1, 1, True, 1, "a", OLD, NOW),
    ]
    # The new revision began long ago (an earlier step paired); its second decoder was made later.
    began = NOW - timedelta(seconds=600)
    new = [
        Workload("StatefulSet", "d-b-prefill-0", "prefill", 1, 1, 1, 1, True, 1, "b", NEW, began),
        Workload("Deployment", "d-b-decode", "decode", 2, 2, 1, 2, True, 1, "b", NEW, began),
    ]
    late = pod("d-b-decode-9", "decode", "b", NEW, [])
    pods = decoders("a", OLD, 1) + decoders("b", NEW, 1) + [late]

    def at(made: datetime) -> Any:
        late["metadata"]["creationTimestamp"] = made.strftime("%Y-%m-%dT%H:%M:%SZ")
        seen = [essentials(each) for each in pods]
        return assess(
            revision=NEW,
            workloads=old + new,
            pods=seen,
            routing=routing_from_pods(seen),
            now=NOW,
            settings=settings,
            sizes=(1, 2),
        )

    assert at(NOW - timedelta(seconds=60)).phase == WAITING
    found = at(NOW - timedelta(seconds=121))
    assert found.phase == STUCK and "progressDeadlineSeconds 120" in found.message
    assert found.drain == () and found.replicas[NEW] == (1, 2)


def test_a_pp_engines_later_stages_are_idle_when_their_head_is() -> None:
    both = [("a", OLD), ("b", NEW)]
    pods = pair("a", OLD) + pair("b", NEW)
    # Stage 1 of the old prefill engine: headless, its engine schedules nothing and reports no count.
    stage = pod("d-prefill-0-1", "prefill", "a", OLD, [("d-decode-xa", True, HASHES[OLD])])
    pods.append(stage)
    mark([pods[0], pods[1], stage], NOW - timedelta(seconds=10))
    in_flight(pods[1], 0, NOW)
    in_flight(pods[0], 1, NOW)
    found = judge(NEW, both, pods)
    assert found.keep_old and "1 of 3 old pods idle" in found.message
    in_flight(pods[0], 0, NOW)
    found = judge(NEW, both, pods)
    assert not found.keep_old and f"revision {OLD} is drained" in found.message
