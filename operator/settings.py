"""Everything the operator is configured with, in one typed object read once at start. Pure.

After crate-operator's `config.py`: `Settings.from_environ` is the only place that reads the operator's
environment (the Helm chart sets it, `charts/disagg/templates/deployment.yaml`); everything else is handed
the `Settings`, or the part of it it needs (the builders and policies take its `installation`). A value that
cannot be read is refused at start with the variable's name, where it used to fall back silently or fail
later.

| variable | field | default |
|---|---|---|
| `DISAGG_WORKER_IMAGE` | `installation.worker_image` | none: a spec must name `spec.worker.image` |
| `DISAGG_TRANSFER_IMAGE` | `installation.transfer_image` | none (the worker image stands in) |
| `DISAGG_ROUTER_IMAGE` | `installation.router_image` | none (the sidecar image stands in) |
| `DISAGG_WORKER_CLUSTERROLE` | `installation.worker_cluster_role` | `disagg-worker` |
| `DISAGG_LOG_LEVEL` | `log_level` | `info` (`debug`, `info` or `warning`) |
| `DISAGG_PLANNER_INTERVAL_S` | `planner_interval_s` | 5 seconds |

The rest are fixed here, not read from the environment: how many threads run the spec reconciles and the
status refreshes, and how long a status refresh waits for a burst of events to settle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, cast

from disagg.operator.naming import (
    DEFAULT_WORKER_CLUSTER_ROLE,
    ROUTER_IMAGE_ENV,
    TRANSFER_IMAGE_ENV,
    WORKER_CLUSTER_ROLE_ENV,
    WORKER_IMAGE_ENV,
    Installation,
)

LOG_LEVEL_ENV: Final = "DISAGG_LOG_LEVEL"
PLANNER_INTERVAL_ENV: Final = "DISAGG_PLANNER_INTERVAL_S"
LogLevel = Literal["debug", "info", "warning"]
LOG_LEVELS: Final = ("debug", "info", "warning")


class SettingsError(ValueError):
    """An environment variable the operator cannot read; the message names it and what it takes."""


@dataclass(frozen=True)
class Settings:
    installation: Installation = field(default_factory=Installation)
    """What the chart decides for the children: default images, the worker ClusterRole."""
    log_level: LogLevel = "info"
    planner_interval_s: float = 5.0
    """How often the planner runs per autoscaled deployment."""
    # The threads of the spec reconciles and of the status refreshes. Each thread is another malloc arena and
    # stack, and the API server, not Python, bounds the throughput.
    spec_workers: int = 4
    refresh_workers: int = 4
    settle_s: float = 1.0
    """How long a status refresh waits after the request that queued it: a new child's events (its pods
    created, its status updated two or three times by its controller) come within about a second when the
    API server keeps up, and one refresh after them writes the status once, not once per event (measured: a
    lone deployment's status is written twice, by its reconcile and one refresh). Under a loaded API server
    the pods come seconds apart and each still changes, and is written to, the status."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The operator's settings from its environment; an empty variable is an unset one."""
        return cls(
            installation=installation_from_environ(environ),
            log_level=_log_level(environ.get(LOG_LEVEL_ENV) or "info"),
            planner_interval_s=_seconds(PLANNER_INTERVAL_ENV, environ.get(PLANNER_INTERVAL_ENV) or "5"),
        )


def installation_from_environ(environ: Mapping[str, str]) -> Installation:
    """The installation's part alone, which never fails: what `disagg check` and the webhook's verdict read
    (an operator's environment was read whole, and checked, at its start)."""
    return Installation(
        worker_cluster_role=environ.get(WORKER_CLUSTER_ROLE_ENV) or DEFAULT_WORKER_CLUSTER_ROLE,
        worker_image=environ.get(WORKER_IMAGE_ENV) or None,
        router_image=environ.get(ROUTER_IMAGE_ENV) or None,
        transfer_image=environ.get(TRANSFER_IMAGE_ENV) or None,
    )


def _log_level(value: str) -> LogLevel:
    if value not in LOG_LEVELS:
        raise SettingsError(f"{LOG_LEVEL_ENV} is {value!r}: set it to one of {', '.join(LOG_LEVELS)}")
    return cast(LogLevel, value)


def _seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise SettingsError(f"{name} is {value!r}: set it to a number of seconds above 0")
    return seconds
