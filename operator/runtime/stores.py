"""What the operator keeps of the objects it watches, by the DisaggDeployment they belong to. Pure.

kopf's indices keep, for every object indexed, a key of three strings copied from its event (namespace,
name, uid), a set of the index keys it is under, and a store per index key: about 7 KiB per
DisaggDeployment with its children and pods, most of the operator's RSS growth per deployment (a
`tracemalloc` diff of 100 and 250 deployments, settled: 11.9 KiB live per deployment, 7.3 KiB of it kopf's
index maps and the strings they hold). A `Store` keeps one flat tuple per owner, `(ident, value, ident,
value, ...)`, and one map from an object's ident to its owner, so an object that changes owner or is deleted
leaves nothing behind.

An object is told apart by its uid, as kopf does: kopf runs each uid's events in a worker of its own, so a
deleted Pod's last event can be handled after its successor's first, under the same name. The ident is the
uid's `hash` (an int, 32 bytes, where the uid's str is 85): for one object to be taken for another, two of
the operator's objects (some 15,000 for a thousand deployments) would have to share a 64-bit hash, salted
per process (`PYTHONHASHSEED`), so no object's author can aim at a collision: odds of about 1 in 10^11.

Writes come from kopf's event loop only; reads from any thread. A write replaces an owner's tuple whole, so a
reader sees an owner's values before a write or after it, never half of one.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

Key = tuple[str, str]
V = TypeVar("V")


class Store(Generic[V]):
    """Values of watched objects, grouped by the key of the deployment each belongs to."""

    __slots__ = ("_by_key", "_key_of")

    def __init__(self) -> None:
        self._by_key: dict[Key, tuple[Any, ...]] = {}
        self._key_of: dict[int, Key] = {}

    def put(self, key: Key | None, uid: str, value: V) -> None:
        """The object `uid` is now `value` under `key` (under no key when None): it leaves the key it was
        under before, if another, and keeps its place among its key's values otherwise."""
        ident = hash(uid)
        was = self._key_of.get(ident)
        if was is not None and was != key:
            self._remove(was, ident)
        if key is None:
            return
        entries = self._by_key.get(key, ())
        for at in range(0, len(entries), 2):
            if entries[at] == ident:
                self._by_key[key] = (*entries[: at + 1], value, *entries[at + 2 :])
                return
        # Every object under a key refers to one tuple of it, the first one put.
        if entries:
            key = self._key_of[entries[0]]
        self._by_key[key] = (*entries, ident, value)
        self._key_of[ident] = key

    def forget(self, uid: str) -> None:
        """The object `uid` is gone (deleted, or no longer watched)."""
        ident = hash(uid)
        key = self._key_of.get(ident)
        if key is not None:
            self._remove(key, ident)

    def get(self, key: Key) -> tuple[V, ...]:
        """The values under `key`, in the order their objects were first put; () for none."""
        return self._by_key.get(key, ())[1::2]

    def values(self) -> list[V]:
        """Every value, of every key."""
        return [value for entries in list(self._by_key.values()) for value in entries[1::2]]

    def owners(self) -> int:
        """How many keys have values."""
        return len(self._by_key)

    def __len__(self) -> int:
        """How many objects are kept."""
        return len(self._key_of)

    def _remove(self, key: Key, ident: int) -> None:
        entries = self._by_key.get(key, ())
        kept = tuple(
            item for at in range(0, len(entries), 2) if entries[at] != ident for item in entries[at : at + 2]
        )
        if kept:
            self._by_key[key] = kept
        else:
            self._by_key.pop(key, None)
        del self._key_of[ident]
