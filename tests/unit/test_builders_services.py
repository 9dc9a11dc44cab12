"""`builders.services`: the engines' headless Services."""

from __future__ import annotations

from built import objects
from dd_specs import spec


class TestHeadlessServices:
    def test_service_ports_name_their_protocol(self) -> None:
        # Server-side apply on 1.20 refuses Service ports without protocol (list-map key).
        service = objects(spec())["Service", "gemma-pp2-decode"]
        assert {(p["name"], p["port"], p["protocol"]) for p in service["spec"]["ports"]} == {
            ("http", 8000, "TCP"),
            ("side-channel", 5600, "TCP"),
        }
        assert service["spec"]["publishNotReadyAddresses"] is True
