"""What a prefill worker's unmatched registrations count against their byte cap, and when their expiry
hands the heap's free pages back (the flood itself, against a real sidecar:
tests/sidecar/test_sidecar_flood.py)."""

from __future__ import annotations

import pytest

from disagg.worker.connector.heap import HeapTrimmer, libc_malloc_trim
from disagg.worker.connector.registrations import Registrations
from disagg.worker.kv import wire
from disagg.worker.kv.errors import InvalidRegistration
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout

MODEL = ModelGeometry.with_full_every(4, 1, num_kv_heads=2, head_size=8, dtype_bytes=2, hma=False)
LAYOUT = build_stage_layout(MODEL, pp_rank=0, pp_size=1, tp_size=1, block_size=16, num_blocks=1024)


def registration(request_id: str, blocks: int) -> wire.PushRegistration:
    return wire.PushRegistration(
        request_id, "d", "127.0.0.1", 5600, 1, [[1] * blocks], "p", "127.0.0.1", 5601, 1, 1
    )  # fmt: skip


class Trims:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_a_registration_counts_its_block_id_arrays_against_the_byte_cap() -> None:
    store = Registrations(LAYOUT, 1, max_bytes=20_000)
    store.add(registration("r0", 1000), 1100, deadline=10.0, now=0.0)
    assert store.nbytes == 1100 + 8 * 1000  # an id a byte on the wire, 8 in its array
    store.add(registration("r1", 1000), 1100, deadline=10.0, now=0.0)
    with pytest.raises(InvalidRegistration, match="held unmatched already"):
        # 3 notifs of 1,100 bytes, 27,300 held
        store.add(registration("r2", 1000), 1100, deadline=10.0, now=0.0)


def test_expiry_trims_the_heap_once_enough_was_dropped_and_at_most_once_an_interval() -> None:
    trims = Trims()
    store = Registrations(LAYOUT, 1, trimmer=HeapTrimmer(after_bytes=20_000, interval_s=2.0, trim=trims))
    for i in range(4):
        store.add(registration(f"r{i}", 1000), 1000, deadline=float(i), now=0.0)
    store.expire(now=1.0, silence_s=100.0)  # r0, r1: 18,000 bytes dropped, under the threshold
    assert trims.count == 0
    store.expire(now=2.0, silence_s=100.0)  # r2 too: 27,000
    assert trims.count == 1
    store.add(registration("r4", 1000), 1000, deadline=2.5, now=0.0)
    store.expire(now=3.0, silence_s=100.0)  # r3 and r4: 18,000 again
    store.add(registration("r5", 1000), 1000, deadline=3.0, now=0.0)
    store.expire(now=3.5, silence_s=100.0)  # r5: 27,000, but the last trim was 1.5 s ago
    assert trims.count == 1
    # Nothing dropped, the interval has passed: the pending bytes are trimmed.
    store.expire(now=4.0, silence_s=100.0)
    assert (trims.count, list(store), store.nbytes) == (2, [], 0)
    store.expire(now=9.0, silence_s=100.0)
    assert trims.count == 2


def test_the_c_library_trim_is_found_on_glibc() -> None:
    trim = libc_malloc_trim()
    assert trim is not None
    trim()


def test_a_registration_whose_decoder_falls_silent_is_dropped_and_a_heartbeat_keeps_one() -> None:
    """A decoder heartbeats what it waits for; one silent for a lease gave the request up (or died), and the
    prefill must not write its blocks afterwards: the decoder may have given them to another request."""
    store = Registrations(LAYOUT, 1)
    store.add(registration("kept-0123abcd", 1000), 1000, deadline=100.0, now=0.0)
    store.add(registration("silent", 1000), 1000, deadline=100.0, now=0.0)
    store.hear("kept", 8.0)  # a heartbeat names the request up to the engine's random suffix
    store.expire(now=9.0, silence_s=10.0)
    assert [kept.registration.request_id for kept in store] == ["kept-0123abcd", "silent"]
    store.expire(now=11.0, silence_s=10.0)
    assert [kept.registration.request_id for kept in store] == ["kept-0123abcd"]
    store.expire(now=18.5, silence_s=10.0)
    assert list(store) == []


def test_refused_registrations_count_towards_the_next_trim_as_expired_ones_do() -> None:
    """A flood naming more blocks than this worker has is refused before it is stored; what its decoding
    allocated is freed in the heap all the same, and stayed resident (96 MB grew to some 300, held) while
    only expiries counted towards a trim."""
    trims = Trims()
    store = Registrations(LAYOUT, 1, trimmer=HeapTrimmer(after_bytes=20_000, interval_s=2.0, trim=trims))
    for i in range(3):
        with pytest.raises(InvalidRegistration, match="a request here has at most 1024"):
            store.add(registration(f"r{i}", 1025), 1100, deadline=10.0, now=0.0)
    store.expire(now=1.0, silence_s=100.0)
    assert (trims.count, list(store), store.refused) == (1, [], 3)
    # Refused by a cap, and refused at decoding (the producer's path for a notif it cannot read), too.
    small = Registrations(LAYOUT, 1, max_count=1, trimmer=HeapTrimmer(after_bytes=20_000, trim=trims))
    small.add(registration("kept", 10), 100, deadline=10.0, now=0.0)
    with pytest.raises(InvalidRegistration, match="held unmatched already"):
        small.add(registration("over", 1000), 1100, deadline=10.0, now=0.0)
    small.refuse(20_000)
    small.expire(now=1.0, silence_s=100.0)
    assert (trims.count, small.refused) == (2, 2)
