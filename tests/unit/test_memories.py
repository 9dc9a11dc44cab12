"""`ChildrenForgotten` keeps kopf's memory of a DisaggDeployment, and of any kind it does not name, from event
to event as kopf does, and makes a child's afresh for each event, keeping none."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from disagg.operator.api import GROUP, VERSION
from disagg.operator.control.kopf_tuning import ChildrenForgotten


def _body(api_version: str, kind: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": "ns", "name": uid, "uid": uid}}


def test_a_deployments_memory_is_kept_and_a_childs_is_not() -> None:
    async def recalled_twice(body: dict[str, Any], memories: ChildrenForgotten) -> bool:
        memo = kopf.Memo(shared=object())
        first = await memories.recall(body, memobase=memo)  # type: ignore[arg-type]
        second = await memories.recall(body, memobase=memo)  # type: ignore[arg-type]
        # Each memory's memo is kopf's copy of the operator's: the shared objects, not the dict.
        assert first.memo is not memo and first.memo.shared is memo.shared
        return first is second

    memories = ChildrenForgotten()
    owner = _body(f"{GROUP}/{VERSION}", "DisaggDeployment", "dd")
    assert asyncio.run(recalled_twice(owner, memories))
    for api_version, kind in (("v1", "Pod"), ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment")):
        assert not asyncio.run(recalled_twice(_body(api_version, kind, kind), memories))
    # A kind named nowhere (a Deployment of another group) is kept as kopf keeps it.
    assert asyncio.run(recalled_twice(_body("example.com/v1", "Deployment", "other"), memories))
    assert len(list(memories.iter_all_memories())) == 2
