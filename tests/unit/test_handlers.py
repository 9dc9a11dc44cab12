"""What the operator registers with kopf, read from kopf's own registry.

Events of Pods, StatefulSets and Deployments arrive by the thousand at scale. A sync handler for them runs on
kopf's executor, queued behind the spec handlers (each a dozen API calls), and every queued event holds its
object's whole body: with sync indexers, 200 deployments created together doubled the operator's memory.
"""

from __future__ import annotations

import inspect

import kopf

import disagg.operator.control.handlers  # noqa: F401  (registers the handlers)

CHILD_PLURALS = {"pods", "statefulsets", "deployments"}


def test_every_handler_of_a_childs_event_runs_on_kopfs_loop_not_its_executor() -> None:
    registry = kopf.get_default_registry()
    handlers = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    children = [h for h in handlers if h.selector is not None and h.selector.any_name in CHILD_PLURALS]
    # Three indices and the refresh request, registered for all three kinds.
    assert {h.selector.any_name for h in children if h.selector is not None} == CHILD_PLURALS
    assert len(children) == 6
    assert [h.id for h in children if not inspect.iscoroutinefunction(h.fn)] == []


def test_the_spec_handlers_stay_sync_and_run_on_the_executor() -> None:
    # They make blocking API calls; on the loop they would stall every watch.
    spec = [h for h in kopf.get_default_registry()._changing.get_all_handlers() if h.id == "reconcile_spec"]
    assert spec and not any(inspect.iscoroutinefunction(h.fn) for h in spec)
