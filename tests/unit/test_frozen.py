"""`runtime.frozen`: what the operator's indices keep thaws back to exactly the JSON it froze, whatever was
frozen before it (tuples are shared), and reads in place as the same Mapping."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.operator.runtime.frozen import FrozenView, freeze, thaw, view

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.sampled_from((0, 1, 0.0, -0.0, 1.0, True, False, "", "a", "1"))
    | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25,
)


def exact(value: Any) -> str:
    """JSON text that tells apart what Python calls equal (True, 1 and 1.0; 0.0 and -0.0; a list and a
    dict never compare equal anyway)."""
    return json.dumps(value, sort_keys=True)


@settings(max_examples=300)
@given(values=st.lists(json_values, min_size=1, max_size=6))
def test_thaw_gives_back_exactly_the_json_frozen_after_any_other(values: list[Any]) -> None:
    # Frozen one after the other, so a tuple frozen earlier that Python calls equal would be shared.
    frozen = [freeze(value) for value in values]
    for value, each in zip(values, frozen, strict=True):
        assert thaw(each) == value
        assert exact(thaw(each)) == exact(value)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ([1, 0], [True, False]),
        ({"a": 1}, {"a": 1.0}),
        ({"a": 1.0}, {"a": True}),
        ([0.0], [-0.0]),
        ([["a"], 0], {"a": 0}),
        ({"a": []}, {"a": {}}),
        ([], {}),
        ({"a": [1]}, {"a": [True]}),
    ],
)
def test_values_python_calls_equal_but_json_does_not_stay_apart(first: Any, second: Any) -> None:
    a, b = freeze(first), freeze(second)
    assert a != b
    assert exact(thaw(a)) == exact(first)
    assert exact(thaw(b)) == exact(second)


def test_equal_parts_are_kept_once_and_each_thaw_is_a_fresh_copy() -> None:
    container = {"name": "kv-worker", "env": [{"name": "DISAGG_PP_RANK", "value": "0"}], "ports": []}
    one = freeze({"metadata": {"name": "pod-a"}, "spec": {"containers": [container]}})
    other = freeze({"metadata": {"name": "pod-b"}, "spec": {"containers": [dict(container)]}})
    assert isinstance(one, tuple) and isinstance(other, tuple)
    assert one[2] is other[2], "the two pods' equal specs are one tuple"
    read = thaw(one)
    read["spec"]["containers"][0]["env"].append({"name": "X"})
    read["metadata"]["name"] = "changed"
    assert thaw(one) == {"metadata": {"name": "pod-a"}, "spec": {"containers": [container]}}
    assert thaw(other)["spec"] == {"containers": [container]}


def test_long_strings_are_kept_whole_and_short_ones_interned() -> None:
    long = "x" * 1000
    name = "".join(["dd-1-prefill", "-0-0"])
    frozen = freeze({"annotation": long, "name": name})
    assert isinstance(frozen, tuple)
    assert frozen[1] == long
    assert frozen[2] is freeze("dd-1-prefill-0-0")


def test_anything_but_json_is_refused() -> None:
    for odd in (object(), {1: "a"}, {"a": {1, 2}}, b"bytes"):
        with pytest.raises(TypeError):
            freeze(odd)


def plain(value: Any) -> Any:
    return {key: plain(item) for key, item in value.items()} if isinstance(value, FrozenView) else value


@settings(max_examples=150)
@given(value=st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_a_view_reads_as_the_thawed_object(value: dict[str, Any]) -> None:
    seen = view(freeze(value))
    assert isinstance(seen, FrozenView)
    assert seen == value
    assert list(seen) == list(value) and len(seen) == len(value)
    assert all(key in seen for key in value)
    assert exact(plain(seen)) == exact(value)
    assert seen.get("\x00missing") is None
    with pytest.raises(KeyError):
        seen["\x00missing"]


def test_a_view_reads_nested_objects_in_place() -> None:
    seen = view(freeze({"spec": {"decode": {"autoscaling": {"mode": "external"}}}, "status": {}}))
    decode = seen["spec"]["decode"]
    assert isinstance(decode, FrozenView)
    assert decode.get("autoscaling", {}).get("mode", "planner") == "external"
    assert not seen["status"] and seen["status"].get("oldRevision") is None
    assert seen.get("missing", 5) == 5 and "missing" not in seen and 1 not in seen
    assert seen.get("spec") == {"decode": {"autoscaling": {"mode": "external"}}}
