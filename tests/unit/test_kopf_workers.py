"""kopf runs a worker per watched object, and the worker keeps the object's last event until it exits: with
kopf's 5 s before an idle worker exits, deployments created one after another left hundreds of idle workers
each holding a Pod or a StatefulSet, a third of the operator's peak RSS. The operator's settings (`tune`)
let an idle worker go soon, and with it the event. kopf's own worker runs here, fed as its watcher feeds it.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import kopf
from kopf._core.reactor import queueing

from disagg.operator.control.kopf_tuning import WORKER_IDLE_S, tune


class _Event(dict[str, Any]):
    """A raw watch event that can be weakly referenced (a plain dict cannot)."""


async def _worker_holds(settings: kopf.OperatorSettings) -> tuple[bool, bool]:
    """Whether the last event is still held once the worker has handled it and gone idle, and whether it
    is after the worker has exited."""
    key: Any = ("pods", "uid-1")
    streams: dict[Any, queueing.Stream] = {
        key: queueing.Stream(backlog=asyncio.Queue(), pressure=asyncio.Event())
    }
    event = _Event(type="ADDED", object={"metadata": {"uid": "uid-1", "name": "pod"}})
    held = weakref.ref(event)
    await streams[key].backlog.put(event)
    del event
    handled = asyncio.Event()

    async def processor(**_: Any) -> None:
        handled.set()

    worker = asyncio.create_task(
        queueing.worker(
            signaller=asyncio.Condition(), settings=settings, processor=processor, streams=streams, key=key
        )
    )
    await handled.wait()
    await asyncio.sleep(0)  # the worker is back in its wait for the next event
    gc.collect()
    while_idle = held() is not None
    await worker
    # The worker is gone from the watcher's streams: the object's next event starts a new one.
    assert key not in streams
    gc.collect()
    return while_idle, held() is not None


def test_an_idle_worker_lets_its_objects_last_event_go_soon() -> None:
    settings = kopf.OperatorSettings()
    tune(settings)
    assert settings.queueing.idle_timeout == WORKER_IDLE_S <= 1.0
    while_idle, after_exit = asyncio.run(_worker_holds(settings))
    # kopf's worker holds the event while idle: what the short idle time is for. Should kopf stop
    # doing so, the setting can go.
    assert while_idle
    assert not after_exit
