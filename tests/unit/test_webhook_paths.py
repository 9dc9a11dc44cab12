"""The operator's webhook server answers only the paths that name a handler (issue 22, finding 9).

The real server (`SelfSignedWebhookServer`, HTTPS on 127.0.0.1) runs kopf's own admission function, bound as
kopf's operator binds it, with kopf's default registry, where importing `control.webhook` registered
the `validate` handler. kopf routes `/{id:.*}` and runs only the handlers whose id equals the path, so on
`/` or `/x` it ran none and allowed every review."""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
from typing import Any

import aiohttp
import kopf
import pytest
from dd_specs import EXAMPLES, load
from kopf._cogs.structs import ephemera, references
from kopf._core.engines import admission, indexing
from kopf._core.intents import registries
from kopf._core.reactor import inventory

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.control.webhook import HANDLER_ID, SelfSignedWebhookServer


def review(document: dict[str, Any], uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": GROUP, "version": VERSION, "kind": "DisaggDeployment"},
            "resource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
            "operation": "CREATE",
            "userInfo": {"username": "tester"},
            "object": document,
        },
    }


def kopf_webhook_fn() -> Any:
    """kopf's `serve_admission_request`, bound as `kopf._core.reactor.running.spawn_tasks` binds it."""
    insights = references.Insights()
    insights.webhook_resources.add(references.Resource(GROUP, VERSION, PLURAL, namespaced=True))
    return functools.partial(
        admission.serve_admission_request,
        settings=kopf.OperatorSettings(),
        registry=registries.get_default_registry(),
        insights=insights,
        memories=inventory.ResourceMemories(),
        memobase=ephemera.AnyMemo(ephemera.Memo()),
        indices=indexing.OperatorIndexers().indices,
    )


async def post_reviews(paths: list[str], body: dict[str, Any]) -> dict[str, tuple[int, str]]:
    server = SelfSignedWebhookServer(addr="127.0.0.1", port=0, host="127.0.0.1")
    server.port = server._allocate_free_port()
    configs = server(kopf_webhook_fn())
    config = await anext(configs)  # the server listens once it yields its client configuration
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the server's self-signed certificate; the answers are checked
    base = config["url"].rstrip("/")
    answers: dict[str, tuple[int, str]] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for path in paths:
                async with session.post(base + path, json=body, ssl=context) as response:
                    answers[path] = (response.status, await response.text())
    finally:
        await configs.aclose()
    return answers


def test_only_the_handlers_ids_are_served() -> None:
    # A new handler registered without a path the server answers would be unreachable: this says so.
    from disagg.operator.control.webhook import SERVED_HANDLER_IDS

    registered = {handler.id for handler in registries.get_default_registry()._webhooks.get_all_handlers()}
    assert registered == SERVED_HANDLER_IDS == {HANDLER_ID}


@pytest.mark.parametrize("path", ["/", "/x", "/validate", f"/{HANDLER_ID}/x", f"/{HANDLER_ID}x"])
def test_a_path_that_names_no_handler_is_404_not_allowed(path: str) -> None:
    incompatible = load(EXAMPLES / "bad-block-size.yaml")
    answers = asyncio.run(post_reviews([path, f"/{HANDLER_ID}"], review(incompatible, "u1")))
    status, text = answers[path]
    assert status == 404, (status, text)
    assert "NoSuchWebhook" in text and "allowed" not in text
    # The handler's own path, in the same server, judges the same review: denied with the operator's reason.
    status, text = answers[f"/{HANDLER_ID}"]
    assert status == 200
    response = json.loads(text)["response"]
    assert response["uid"] == "u1" and response["allowed"] is False
    assert response["status"]["message"].startswith("BlockSizeMismatch")


def test_the_handlers_path_admits_a_compatible_spec() -> None:
    answers = asyncio.run(post_reviews([f"/{HANDLER_ID}"], review(load(EXAMPLES / "pp2-hma.yaml"), "u2")))
    status, text = answers[f"/{HANDLER_ID}"]
    assert status == 200 and json.loads(text)["response"] == {"uid": "u2", "allowed": True}
