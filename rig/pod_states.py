"""Every state one deployment's pods pass through, in the API server's order: a list, then a watch from its
resourceVersion, each change applied in turn and the whole set handed to a callback.

A poller sees the pods only when its list returns, and on a loaded machine one list can take seconds: a
moment with no routable pair could pass between two lists unseen. The watch replays every change from where
it left off (each watch request resumes at the last resourceVersion an event or bookmark carried; a dropped
connection or a server error is retried from there), so a slow machine delays the states, never thins them.
The changes of one namespace's pods are totally ordered by resourceVersion, so each state handed on is the
set of pods as it was at that version. Only a watch the server ends as too old (410: its resourceVersion no
longer in the watch cache) loses states; that stretch is listed again and reported (`unseen_s`), never
hidden.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL

WATCH_S = 60
"""How long one watch request lasts before the server ends it and the next resumes from the last
resourceVersion seen (`stop` shuts the stream at once, not at its end)."""
READ_S = WATCH_S + 30
"""The client's read timeout: a stream silent this long (no event, no end) is retried."""
LIST_READ_S = 60
CONNECT_S = 10
RETRY_S = 1.0
RETRIES = 10
"""Failed requests in a row (a dropped connection, a 5xx, an error event other than 410) before the stream
gives up and `stop` raises: each is retried from the last resourceVersion seen, so none loses a state."""
GONE = 410
TRANSIENT = (urllib3.exceptions.HTTPError, OSError)
"""What a dropped or timed-out connection raises (urllib3's errors; `ConnectionError` is an `OSError`)."""


class _Retry(Exception):
    """A watch request that failed without losing its place: retried from the same resourceVersion."""


class _CallbackFailed(RuntimeError):
    """`on_state` raised: the stream ends."""


class _Gone(Exception):
    """The server no longer has the resourceVersion to resume from: only a new list goes on."""


@dataclass
class PodStates:
    """Calls `on_state(at, pods)` for the listed pods and after every change to them (`at` from
    `time.monotonic()` when the state arrived, `pods` as the API server's JSON, what `routing_from_pods`
    reads), one call at a time from its own thread, until `stop`. `states` and `unseen_s` are written by
    that thread: read them after `stop` (which joins it)."""

    core: client.CoreV1Api
    namespace: str
    name: str
    on_state: Callable[[float, list[dict[str, Any]]], None]
    unseen_s: list[float] = field(default_factory=list)
    """Each stretch whose states may be lost, in seconds: from the last state handed on before a watch the
    server refused as too old to the state the list after it showed."""
    states: int = 0
    """The states handed to `on_state`."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None
    _response: Any = None
    _last_at: float = 0.0
    _version: str = ""
    """The resourceVersion the pods handed on last are at: where the next watch request resumes."""

    def start(self) -> PodStates:
        self._thread = threading.Thread(target=self._run, name=f"pod-states-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the stream and raises what ended it early, if anything did (a callback's error included)."""
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks the thread's read now rather than at the watch's end.
            with contextlib.suppress(Exception):
                response.shutdown()
        assert self._thread is not None, "stop before start"
        self._thread.join(timeout=LIST_READ_S + CONNECT_S + 30)
        if self._thread.is_alive():
            raise RuntimeError(f"the watch of {self.name}'s pods did not end")
        if self._error is not None:
            raise RuntimeError(
                f"the watch of {self.name}'s pods failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def _run(self) -> None:
        try:
            relisting = False
            while not self._stop.is_set():
                listed = self._list()
                if listed is None:
                    return
                pods, self._version = listed
                if relisting:
                    self.unseen_s.append(time.monotonic() - self._last_at)
                self._emit(pods)
                self._follow(pods)
                relisting = True
        except Exception as error:
            self._error = error

    def _selector(self) -> str:
        return f"{DEPLOYMENT_LABEL}={self.name}"

    def _list(self) -> tuple[dict[str, dict[str, Any]], str] | None:
        """The pods now and the resourceVersion of the list; None once stopped."""
        failures = 0
        while not self._stop.is_set():
            try:
                response: Any = self.core.list_namespaced_pod(
                    self.namespace,
                    label_selector=self._selector(),
                    _request_timeout=(CONNECT_S, LIST_READ_S),
                    _preload_content=False,
                )
                listed = json.loads(response.data)
            except (client.ApiException, *TRANSIENT) as error:
                failures = self._failed(error, failures)
                continue
            pods = {pod["metadata"]["uid"]: pod for pod in listed.get("items") or ()}
            return pods, str(listed["metadata"]["resourceVersion"])
        return None

    def _follow(self, pods: dict[str, dict[str, Any]]) -> None:
        """Applies every change after `_version` to `pods` and hands each state on, until `stop`; returns
        early when the server says `_version` is too old to resume from (the caller lists again)."""
        failures = 0
        while not self._stop.is_set():
            try:
                self._watch(pods)
                failures = 0
            except _Gone:
                return
            except (_Retry, client.ApiException, *TRANSIENT) as error:
                if self._stop.is_set():
                    return  # `stop` shut the stream
                if isinstance(error, client.ApiException) and error.status == GONE:
                    return
                failures = self._failed(error, failures)

    def _watch(self, pods: dict[str, dict[str, Any]]) -> None:
        """One watch request from `_version`: every change applied to `pods` and handed on, `_version`
        moved to each event's (a bookmark's too), until the server ends the request or `stop` shuts it. A
        retry after a failure resumes from there: an event applied twice would hand on a state that never
        was (one pod older than the others)."""
        response: Any = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=self._selector(),
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_S,
            _request_timeout=(CONNECT_S, READ_S),
            _preload_content=False,
        )
        self._response = response
        try:
            # `stop` sets the event before it reads `_response`: either it shuts this stream or this sees it.
            if self._stop.is_set():
                return
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if pod.get("code") == GONE:
                        raise _Gone(pod.get("message"))
                    raise _Retry(f"the watch answered an error: {pod}")
                self._version = str((pod.get("metadata") or {}).get("resourceVersion") or self._version)
                if kind == "BOOKMARK":
                    continue
                uid = pod["metadata"]["uid"]
                if kind == "DELETED":
                    pods.pop(uid, None)
                elif kind in ("ADDED", "MODIFIED"):
                    pods[uid] = pod
                else:
                    raise RuntimeError(f"a watch event of unknown type {kind!r}")
                self._emit(pods)
                if self._stop.is_set():
                    return
        finally:
            self._response = None
            response.close()
            response.release_conn()

    def _failed(self, error: Exception, failures: int) -> int:
        """One more failed request in a row: waits RETRY_S, or raises once there were RETRIES, or at once
        for an answer a retry would only repeat (a 4xx other than 429: forbidden, not found, bad request)."""
        status = error.status if isinstance(error, client.ApiException) else None
        if status is not None and status < 500 and status != 429:
            raise error
        failures += 1
        if failures > RETRIES:
            raise RuntimeError(f"{failures} requests in a row failed, the last: {error!r}") from error
        self._stop.wait(RETRY_S)
        return failures

    def _emit(self, pods: dict[str, dict[str, Any]]) -> None:
        self.states += 1
        self._last_at = time.monotonic()
        try:
            self.on_state(self._last_at, list(pods.values()))
        except Exception as error:
            # Never taken for a failed request (retried): it ends the stream, and `stop` raises it.
            raise _CallbackFailed(f"on_state raised {error!r}") from error
