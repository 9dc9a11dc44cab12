"""`runtime.stores.Store`: the values of watched objects by the deployment they belong to, told apart by uid.

kopf runs each uid's events in a worker of its own, so the events of a deleted object and of its successor
under the same name can be handled in either order: the store must keep the successor whatever the order."""

from __future__ import annotations

import itertools

import pytest

from disagg.operator.runtime.stores import Store

A, B = ("ns", "a"), ("ns", "b")


def test_values_read_back_by_key_in_the_order_first_put_and_replaced_in_place() -> None:
    store: Store[str] = Store()
    store.put(A, "u1", "one")
    store.put(A, "u2", "two")
    store.put(B, "u3", "three")
    store.put(A, "u1", "one again")
    assert store.get(A) == ("one again", "two")
    assert store.get(B) == ("three",)
    assert store.get(("ns", "none")) == ()
    assert store.values() == ["one again", "two", "three"]
    assert store.owners() == 2 and len(store) == 3


def test_an_object_that_changes_owner_or_loses_it_leaves_the_old_one() -> None:
    store: Store[str] = Store()
    store.put(A, "u1", "one")
    store.put(A, "u2", "two")
    store.put(B, "u1", "one, moved")
    assert store.get(A) == ("two",) and store.get(B) == ("one, moved",)
    store.put(None, "u2", "two, unowned")
    assert store.get(A) == () and store.owners() == 1 and len(store) == 1


def test_forgetting_removes_one_object_and_an_emptied_key() -> None:
    store: Store[str] = Store()
    store.put(A, "u1", "one")
    store.put(A, "u2", "two")
    store.forget("u1")
    assert store.get(A) == ("two",)
    store.forget("u1")  # again, and an object never seen: nothing to do
    store.forget("never")
    store.forget("u2")
    assert store.get(A) == () and store.values() == [] and store.owners() == 0 and len(store) == 0


# Each object's own events stay in order: its deletion comes after its last sighting.
ORDERS = [
    order
    for order in itertools.permutations(["old seen", "old gone", "new seen"])
    if order.index("old seen") < order.index("old gone")
]


@pytest.mark.parametrize("order", ORDERS)
def test_a_successor_under_the_same_name_is_kept_whatever_order_the_events_are_handled_in(
    order: tuple[str, ...],
) -> None:
    store: Store[str] = Store()
    steps = {
        "old seen": lambda: store.put(A, "old-uid", "old pod"),
        "old gone": lambda: store.forget("old-uid"),
        "new seen": lambda: store.put(A, "new-uid", "new pod"),
    }
    for step in order:
        steps[step]()
    assert store.get(A) == ("new pod",)
