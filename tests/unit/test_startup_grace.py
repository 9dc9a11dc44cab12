"""The startup grace, pure parts: which failed peers are held back, for how long, and what a round with
peers still starting says (the rounds against real side channels: tests/nixl/test_peer_startup.py)."""

from __future__ import annotations

from pathlib import Path

from test_kv_report import sidecar_config

from disagg.worker.kv.errors import PeerUnreachable
from disagg.worker.reporting.peer_check import Peer, PeerResult, hold_back, summarize
from disagg.worker.reporting.startup import StartupGrace
from disagg.worker.sidecar.config import DEFAULT_PEER_STARTUP_GRACE_S


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decoder(name: str, ip: str = "10.0.0.9") -> Peer:
    return Peer(name, "decode", 0, name, ip, 5600)


def silent(peer: Peer) -> PeerResult:
    return PeerResult(peer, PeerUnreachable("did not answer within 5 s"), answered=False)


def test_a_never_answered_peer_is_held_back_for_its_grace_from_when_it_was_first_seen() -> None:
    clock = Clock()
    grace = StartupGrace(100.0, clock)
    assert grace.left(decoder("d-1").key, answered=False) == 100.0
    clock.now = 60.0
    assert grace.left(decoder("d-1").key, answered=False) == 40.0
    assert grace.left(decoder("d-2").key, answered=False) == 100.0  # seen only now
    clock.now = 100.0
    assert grace.left(decoder("d-1").key, answered=False) is None
    # Recreated at another address, it is another peer, with a grace of its own.
    assert grace.left(decoder("d-1", "10.0.0.10").key, answered=False) == 100.0


def test_a_peer_that_answered_once_is_reported_at_once_ever_after() -> None:
    clock = Clock()
    grace = StartupGrace(100.0, clock)
    grace.answered(decoder("d-1").key)
    assert grace.left(decoder("d-1").key, answered=False) is None
    # One whose reply was refused (another hash, say) answered too.
    assert grace.left(decoder("d-2").key, answered=True) is None
    assert grace.left(decoder("d-2").key, answered=False) is None
    # Forgotten once gone from the deployment: if it comes back, it is starting again.
    grace.keep_only([decoder("d-2").key])
    assert grace.left(decoder("d-1").key, answered=False) == 100.0
    assert grace.left(decoder("d-2").key, answered=False) is None


def test_a_round_with_peers_still_starting_is_unknown_or_true_never_false(tmp_path: Path) -> None:
    prefill = sidecar_config(tmp_path, "prefill", "gemma-prefill-0-1")
    assert prefill.peer_startup_grace_s == DEFAULT_PEER_STARTUP_GRACE_S
    grace = StartupGrace(600.0, Clock())
    reported, starting = hold_back([silent(decoder("d-1")), silent(decoder("d-2"))], grace)
    outcome = summarize(prefill, reported, [], starting)
    assert (outcome.status, outcome.reason, outcome.refusals) == ("Unknown", "AwaitingPeers", ())
    assert "waiting for decode pod d-1 at 10.0.0.9:5600 to answer (PeerUnreachable: did not answer" in (
        outcome.message
    )
    reported, starting = hold_back([PeerResult(decoder("d-1"), None), silent(decoder("d-3"))], grace)
    outcome = summarize(prefill, reported, [], starting)
    assert (outcome.status, outcome.reason) == ("True", "HandshakesSucceeded")
    assert "waiting for decode pod d-3" in outcome.message
    # Without a grace (and past it), the same round is a failure, as before.
    reported, starting = hold_back([silent(decoder("d-1"))], None)
    assert (summarize(prefill, reported, [], starting).status, starting) == ("False", [])
