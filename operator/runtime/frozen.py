"""What the operator's long-lived stores keep of an object: its JSON frozen into shared tuples, thawed back
into the dicts and lists a reader wants when it reads. Pure.

The JSON decoder makes a fresh dict for every object, and a fresh str for every key and value, of every
event's body; a store that keeps parts of them keeps all of that, per pod and per deployment: about 3.7 MiB
per 100 DisaggDeployments (`disagg bench operator`), where the same values repeat from pod to pod and from one
deployment to the next (containers, labels, the spec of a template). `freeze` keeps an object as a tuple of
its values after one shared tuple of its keys, an array as a tuple, short strings interned, and every tuple
that equals one of the last `SHARED_TUPLES` frozen as that one: the pods of a deployment share their
containers, deployments stamped from one template their spec. `thaw` rebuilds the JSON exactly (a reader
gets fresh dicts, never another reader's); `view` reads a frozen object in place, for a reader that looks at
a field or two of every object often (the operator's clock).

Equality must not blur JSON values that Python calls equal (`True == 1 == 1.0`): a shared tuple stands for
every tuple equal to it, so `true`, `false` and numbers with a fraction are frozen as values equal only to
themselves.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

# Strings up to this long are interned (names, label values, timestamps, hashes); longer ones (messages, a
# sidecar's peer report) are mostly one of a kind.
INTERNED_CHARS: Final = 64
# Frozen tuples remembered for sharing (and kept alive: ~0.2 MiB): a pod's frozen parts are ~20 tuples, a
# deployment's ~80, and what recurs (containers, conditions, a spec) is met again within a few events; at 300
# deployments 256 shared as much as 4,096.
SHARED_TUPLES: Final = 1024


class Keys(tuple[str, ...]):
    """The keys of a frozen JSON object, in order; equal only to another `Keys` (never to an array)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is Keys and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


class _Bool:
    __slots__ = ("value",)

    def __init__(self, value: bool) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"frozen({self.value})"


_TRUE: Final = _Bool(True)
_FALSE: Final = _Bool(False)


class _Float(float):
    """A JSON number with a fraction: equal only to the same float (0.0 and -0.0 apart)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is _Float and float.__repr__(self) == float.__repr__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = float.__hash__


@functools.lru_cache(maxsize=SHARED_TUPLES)
def _shared(value: tuple[Any, ...]) -> tuple[Any, ...]:
    return value


@functools.lru_cache(maxsize=SHARED_TUPLES)
def _keys(names: tuple[object, ...]) -> Keys:
    return Keys(sys.intern(_key(name)) for name in names)


def _key(name: object) -> str:
    if type(name) is not str:
        raise TypeError(f"a JSON object's keys are str, not {type(name).__name__}")
    return name


def freeze(value: Any) -> object:
    """`value` (JSON: dicts or Mappings with str keys, lists or tuples, str, int, float, bool, None) frozen.
    Raises TypeError on anything else."""
    # The exact types JSON decodes to first: this runs for every field of every event's kept parts.
    kind = type(value)
    if kind is str:
        return sys.intern(value) if len(value) <= INTERNED_CHARS else value
    if kind is dict:
        return _shared((_keys(tuple(value)), *[freeze(item) for item in value.values()]))
    if kind is list:
        return _shared(tuple([freeze(item) for item in value])) if value else ()
    if kind is int or value is None:
        return value
    if kind is bool:
        return _TRUE if value else _FALSE
    if kind is float:
        return _Float(value)
    if isinstance(value, Mapping):
        return freeze(dict(value))
    if isinstance(value, tuple):
        return freeze(list(value))
    # Subclasses (a str enum, an IntEnum) as the plain value they serialize to; bool before int (it is one).
    if isinstance(value, bool):
        return freeze(bool(value))
    if isinstance(value, float):
        return freeze(float(value))
    if isinstance(value, str):
        return freeze(str.__str__(value))
    if isinstance(value, int):
        return freeze(int(value))
    raise TypeError(f"not a JSON value: {kind.__name__}")


def thaw(frozen: Any) -> Any:
    """The JSON value `frozen` was frozen from: fresh dicts and lists, equal to it and of the same types."""
    kind = type(frozen)
    if kind is tuple:
        if frozen and type(frozen[0]) is Keys:
            items = iter(frozen)
            return {name: thaw(item) for name, item in zip(next(items), items, strict=True)}
        return [thaw(item) for item in frozen]
    if kind is _Bool:
        return frozen.value
    if kind is _Float:
        return float(frozen)
    return frozen


def view(frozen: Any) -> Any:
    """`frozen` to read without thawing all of it: an object as a read-only `FrozenView`, anything else
    thawed."""
    if type(frozen) is tuple and frozen and type(frozen[0]) is Keys:
        return FrozenView(frozen)
    return thaw(frozen)


class FrozenView(Mapping[str, Any]):
    """A frozen JSON object read in place: its objects read as views, its other values thawed."""

    __slots__ = ("_node",)

    def __init__(self, node: tuple[Any, ...]) -> None:
        self._node = node

    def __getitem__(self, key: str) -> Any:
        node = self._node
        if key not in node[0]:
            raise KeyError(key)
        return view(node[node[0].index(key) + 1])

    # Mapping's own `get` and `in` go through a KeyError for every absent key: the clock asks for absent
    # fields (a deletionTimestamp, an oldRevision) of every deployment, twice a second.
    def get(self, key: str, default: Any = None) -> Any:
        node = self._node
        return view(node[node[0].index(key) + 1]) if key in node[0] else default

    def __contains__(self, key: object) -> bool:
        return key in self._node[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._node[0])

    def __len__(self) -> int:
        return len(self._node[0])

    def __repr__(self) -> str:
        return f"FrozenView({thaw(self._node)!r})"
