"""What the planner's tick reads before it scrapes: the ready router pods' addresses; and what a scrape takes
from a pod's answer (a real HTTP server on loopback). Its interval is a setting (`test_settings.py`)."""

from __future__ import annotations

from typing import Any

from disagg.operator.control.scaling import MAX_SCRAPE_BYTES, fetch_page, router_addresses


def router_pod(ip: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": f"x-router-{ip}"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_only_ready_live_router_pods_are_scraped() -> None:
    pods = [
        router_pod("10.0.0.2", True),
        router_pod("10.0.0.1", True),
        router_pod("10.0.0.3", False),
        router_pod("10.0.0.4", True, deleting=True),
        {"metadata": {"name": "pending"}, "spec": {}, "status": {}},
    ]
    assert router_addresses(pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_a_scrape_reads_a_page_whole_and_refuses_one_past_its_size_bound(
    pages: tuple[str, dict[str, bytes]],
) -> None:
    url, served = pages
    served["/metrics"] = b"vllm:num_requests_running 1\n"
    served["/huge"] = b"#" * (MAX_SCRAPE_BYTES + 1)
    assert fetch_page(url + "/metrics") == "vllm:num_requests_running 1\n"
    assert fetch_page(url + "/huge") is None
    assert fetch_page(url.rsplit(":", 1)[0] + ":1/metrics") is None  # nothing listens: missing, not an error
