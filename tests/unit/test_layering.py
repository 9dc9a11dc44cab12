"""The package layering, checked in fresh interpreters, where a clean sys.modules shows what each imports.

The operator runs in a small pod without GPUs, so `disagg.operator` must never pull in torch or NIXL; the KV
worker runs beside the engine, so `disagg.worker` must never pull in kopf.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from types import ModuleType

import disagg.operator
import disagg.worker

_PROBE = """
import importlib, json, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps(sorted(set(sys.argv[1].split(",")) & set(sys.modules))))
"""


def _modules(package: ModuleType) -> list[str]:
    """Every module and sub-package of `package`, found on disk (not only those imported so far)."""
    return sorted(info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."))


def _loaded(forbidden: tuple[str, ...], modules: list[str]) -> list[str]:
    """The forbidden top-level modules present after importing `modules` in a new interpreter."""
    result = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE, ",".join(forbidden), *modules],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout)
    return loaded


def test_every_operator_module_imports_without_torch_or_nixl() -> None:
    modules = _modules(disagg.operator)
    assert "disagg.operator.control.handlers" in modules and "disagg.operator.control.reconcile" in modules
    assert _loaded(("torch", "nixl", "nixl_cu12"), modules) == []


def test_no_worker_module_imports_kopf() -> None:
    modules = _modules(disagg.worker)
    assert "disagg.worker.sidecar.transfer" in modules and "disagg.worker.contracts.pod_contract" in modules
    assert _loaded(("kopf",), modules) == []


def test_the_probe_sees_an_import() -> None:
    # Without this, a probe that never saw any module would pass both checks above.
    assert _loaded(("kopf",), ["disagg.operator.control.handlers"]) == ["kopf"]


def test_the_router_imports_neither_torch_nor_nixl_nor_the_data_path() -> None:
    # The router ships in the light image, which has no torch or NIXL.
    import disagg.worker.router

    modules = _modules(disagg.worker.router)
    assert "disagg.worker.router.app" in modules and "disagg.worker.router.cli" in modules
    forbidden = ("torch", "nixl", "nixl_cu12", "zmq", "kopf")
    assert _loaded(forbidden, [*modules, "disagg.worker.router.discovery"]) == []


def test_the_contracts_import_no_io_stack() -> None:
    # The router and the operator read them, so they stay as light as the core.
    import disagg.worker.contracts

    modules = _modules(disagg.worker.contracts)
    assert (
        "disagg.worker.contracts.kv_transfer_params" in modules
        and "disagg.worker.contracts.pairing" in modules
    )
    forbidden = ("torch", "nixl", "nixl_cu12", "zmq", "kopf", "kubernetes", "aiohttp")
    assert _loaded(forbidden, modules) == []
