"""Which routable pair takes a request: by load. Pure: no I/O, no clock.

The policy (the README cites it):

1. Only routable pairs are candidates (`pairing.routing_from_pods`: both sides ready, each side's sidecar
   handshook the other, equal hashes). No candidate: no route (503).
2. The prefill engine: the one with the least outstanding prefill work, counted as the summed prompt weight
   (characters, or tokens where the client sent token ids) of the prefill legs it is running now. Prefill
   cost grows with the prompt, so one long prompt weighs as much as many short ones.
3. The decoder: among that engine's routable decoders, the one with the fewest outstanding decode legs (a
   decode leg lasts for the whole generation whatever the prompt, so it is counted, not weighed).
4. Ties (equal load, e.g. an idle deployment) go round robin: a counter advances on every choice, so equal
   pairs take turns instead of the first listed taking everything.

A prefill engine's load is released when its leg ends (it answers in one step), a decoder's when the decode
leg ends; the two are released separately for that reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from disagg.worker.contracts.pairing import Pair


@dataclass
class Ticket:
    """The load one request put on its pair; release each side once, when that leg ends."""

    pair: Pair
    weight: int
    prefill_open: bool = True
    decode_open: bool = True


@dataclass
class Balancer:
    """Outstanding work per prefill engine (prompt weight) and per decoder (legs); the choice by it."""

    prefill_weight: Counter[str] = field(default_factory=Counter)
    prefill_legs: Counter[str] = field(default_factory=Counter)
    decode_legs: Counter[str] = field(default_factory=Counter)
    _turn: int = 0

    def choose(self, pairs: Sequence[Pair]) -> Pair | None:
        if not pairs:
            return None
        self._turn += 1
        engines = sorted({p.prefill.engine_id for p in pairs})
        engine = _least(engines, lambda e: self.prefill_weight[e], self._turn)
        decoders = sorted({p.decode.pod for p in pairs if p.prefill.engine_id == engine})
        decoder = _least(decoders, lambda d: self.decode_legs[d], self._turn)
        return next(p for p in pairs if p.prefill.engine_id == engine and p.decode.pod == decoder)

    def start(self, pair: Pair, weight: int) -> Ticket:
        self.prefill_weight[pair.prefill.engine_id] += weight
        self.prefill_legs[pair.prefill.engine_id] += 1
        self.decode_legs[pair.decode.pod] += 1
        return Ticket(pair, weight)

    def prefill_done(self, ticket: Ticket) -> None:
        if ticket.prefill_open:
            ticket.prefill_open = False
            engine = ticket.pair.prefill.engine_id
            _decrement(self.prefill_weight, engine, ticket.weight)
            _decrement(self.prefill_legs, engine, 1)

    def decode_done(self, ticket: Ticket) -> None:
        if ticket.decode_open:
            ticket.decode_open = False
            _decrement(self.decode_legs, ticket.pair.decode.pod, 1)

    def done(self, ticket: Ticket) -> None:
        self.prefill_done(ticket)
        self.decode_done(ticket)


def _least(names: list[str], load: Callable[[str], int], turn: int) -> str:
    lowest = min(load(n) for n in names)
    tied = [n for n in names if load(n) == lowest]
    return tied[turn % len(tied)]


def _decrement(counter: Counter[str], key: str, amount: int) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
