"""`Kube.latest_status`: a status is judged against the newest one, the operator's own last write included,
even while the watch that feeds the refreshes still shows an older one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.operator.control.k8s_apply import Kube


class _Response:
    def __init__(self, body: dict[str, Any]) -> None:
        self.status = 200
        self._data = json.dumps(body).encode()

    def read(self) -> bytes:
        return self._data


class _Server:
    """The two calls `Kube` makes of its `ApiClient`, answering a status patch with the stored object."""

    def __init__(self, uid: str, version: int) -> None:
        self.uid = uid
        self.version = version

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        return method, path, kwargs["header_params"], kwargs["body"], None

    def call_api(self, method: str, url: str, headers: Any, body: Any) -> _Response:
        assert method == "PATCH" and url.endswith("/status")
        self.version += 1
        metadata = {"uid": self.uid, "resourceVersion": str(self.version)}
        return _Response({"metadata": metadata, "status": body["status"]})


def _body(uid: str, version: int, status: dict[str, Any]) -> dict[str, Any]:
    metadata = {"namespace": "ns", "name": "dd", "uid": uid, "resourceVersion": str(version)}
    return {"metadata": metadata, "status": status}


def test_the_operators_own_write_wins_over_an_older_watched_body() -> None:
    kube = Kube(_Server("u1", 10))  # type: ignore[arg-type]
    kube.patch_status("ns", "dd", {"observedGeneration": 2})
    assert kube.latest_status(_body("u1", 10, {"observedGeneration": 1})) == {"observedGeneration": 2}


def test_a_body_as_new_as_the_write_or_newer_wins_and_the_write_is_forgotten() -> None:
    kube = Kube(_Server("u1", 10))  # type: ignore[arg-type]
    kube.patch_status("ns", "dd", {"observedGeneration": 2})
    assert kube.latest_status(_body("u1", 12, {"observedGeneration": 3})) == {"observedGeneration": 3}
    # Forgotten: an older body no longer meets the write.
    assert kube.latest_status(_body("u1", 10, {"observedGeneration": 1})) == {"observedGeneration": 1}


def test_a_new_object_of_the_same_name_never_sees_the_old_ones_status() -> None:
    kube = Kube(_Server("u1", 10))  # type: ignore[arg-type]
    kube.patch_status("ns", "dd", {"observedGeneration": 2})
    assert kube.latest_status(_body("u2", 5, {})) == {}


def test_the_watch_showing_the_write_drops_it_before_any_status_is_asked_for() -> None:
    # A deployment that stays as it is never asks `latest_status` again: the watch's sighting must drop it.
    kube = Kube(_Server("u1", 10))  # type: ignore[arg-type]
    kube.patch_status("ns", "dd", {"observedGeneration": 2})
    kube.saw(_body("u1", 10, {})["metadata"])  # older than the write: still kept
    assert kube.latest_status(_body("u1", 10, {"observedGeneration": 1})) == {"observedGeneration": 2}
    kube.saw(_body("u1", 11, {})["metadata"])  # the write itself, as the watch shows it
    assert kube.latest_status(_body("u1", 10, {"observedGeneration": 1})) == {"observedGeneration": 1}


class _WatchedServer(_Server):
    """The watch (here `kube.saw`) shows each status write before `Kube` has read the response, as it did
    for one write in six at 300 deployments: the API server sends the event and the response together."""

    kube: Kube

    def call_api(self, method: str, url: str, headers: Any, body: Any) -> _Response:
        response = super().call_api(method, url, headers, body)
        self.kube.saw(_body(self.uid, self.version, {})["metadata"])
        return response


def test_a_write_the_watch_showed_before_its_response_was_read_is_not_kept() -> None:
    server = _WatchedServer("u1", 10)
    kube = server.kube = Kube(server)  # type: ignore[arg-type]
    kube.patch_status("ns", "dd", {"observedGeneration": 2})
    assert kube.latest_status(_body("u1", 10, {"observedGeneration": 1})) == {"observedGeneration": 1}
    assert not kube._statuses and not kube._writing


def test_a_failed_write_leaves_nothing_behind() -> None:
    class Refusing(_Server):
        def call_api(self, method: str, url: str, headers: Any, body: Any) -> _Response:
            raise ConnectionError("the API server is away")

    kube = Kube(Refusing("u1", 10))  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        kube.patch_status("ns", "dd", {"observedGeneration": 2})
    assert not kube._statuses and not kube._writing
