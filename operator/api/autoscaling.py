"""`spec.prefill.autoscaling` and `spec.decode.autoscaling`: each role's bounds, its one target and how the
operator's planner (or the user's own autoscaler) sets its replica count."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Any, Final, Self

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from disagg.operator.api.fields import MAX_REPLICAS, ApiModel

DEFAULT_SCALE_UP_WINDOW_S: Final = 0
# HorizontalPodAutoscaler's default for scaling down (`--horizontal-pod-autoscaler-downscale-stabilization`).
DEFAULT_SCALE_DOWN_WINDOW_S: Final = 300
DEFAULT_METRIC_WINDOW_S: Final = 30
DEFAULT_TOLERANCE: Final = 0.1
MAX_WINDOW_S: Final = 3600


class ScalingMode(enum.StrEnum):
    """Who sets the role's replica count. CamelCase, as every enum of the API is; the lowercase spellings of
    the first releases (`OLD_SCALING_MODES`) are still accepted, and the admission webhook warns of them."""

    PLANNER = "Planner"
    EXTERNAL = "External"


OLD_SCALING_MODES: Final = {"planner": ScalingMode.PLANNER, "external": ScalingMode.EXTERNAL}


def scaling_mode(value: object) -> ScalingMode | None:
    """The mode a stored spec's `mode` names, in either spelling; None for one that names none."""
    if not isinstance(value, str):
        return None
    if value in OLD_SCALING_MODES:
        return OLD_SCALING_MODES[value]
    return ScalingMode(value) if value in tuple(ScalingMode) else None


def old_spellings(raw_spec: Mapping[str, Any]) -> list[str]:
    """A warning for each autoscaling mode a raw spec gives in its old lowercase spelling."""
    found = []
    for role in ("prefill", "decode"):
        section = raw_spec.get(role)
        scaling = section.get("autoscaling") if isinstance(section, Mapping) else None
        mode = scaling.get("mode") if isinstance(scaling, Mapping) else None
        if isinstance(mode, str) and mode in OLD_SCALING_MODES:
            new = OLD_SCALING_MODES[mode].value
            found.append(
                f"spec.{role}.autoscaling.mode: {mode!r} is the old spelling of {new!r}; both are accepted, "
                f"write {new!r}"
            )
    return found


# The CRD lists both spellings, so objects stored before the rename still pass the API server's schema.
_MODE_SCHEMA: Final = {"type": "string", "enum": [*(m.value for m in ScalingMode), *OLD_SCALING_MODES]}


class _Autoscaling(ApiModel):
    mode: Annotated[ScalingMode, WithJsonSchema(_MODE_SCHEMA)] = Field(
        default=ScalingMode.PLANNER,
        description="Planner (the default): the operator reads the router's and engines' metrics and sets "
        "the replica count within [minReplicas, maxReplicas]. External (decode only): your own "
        "HorizontalPodAutoscaler or KEDA ScaledObject scales the decode Deployment; the operator leaves its "
        "replicas out of what it applies, and minReplicas, maxReplicas and target are not given. The "
        "lowercase planner and external of earlier releases are still accepted.",
    )
    min_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="Fewest replicas the planner keeps (planner mode; default 1).",
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="Most replicas the planner runs (required in planner mode; at least minReplicas).",
    )
    scale_up_stabilization_window_seconds: int = Field(
        default=DEFAULT_SCALE_UP_WINDOW_S,
        ge=0,
        le=MAX_WINDOW_S,
        description="The planner scales up to the lowest count it wanted over this window (default 0: at "
        "once, as a HorizontalPodAutoscaler does).",
    )
    scale_down_stabilization_window_seconds: int = Field(
        default=DEFAULT_SCALE_DOWN_WINDOW_S,
        ge=0,
        le=MAX_WINDOW_S,
        description="The planner scales down only to the highest count it wanted over this window (default "
        "300, a HorizontalPodAutoscaler's), so a dip in load does not remove a replica; the replicas going "
        "away are drained first (no new request, their in-flight requests finish).",
    )
    metric_window_seconds: int = Field(
        default=DEFAULT_METRIC_WINDOW_S,
        ge=1,
        le=MAX_WINDOW_S,
        description="How far back the planner reads the metrics: a histogram's p90 from its bucket "
        "increases over this window, a gauge's mean, a counter's rate (default 30).",
    )
    tolerance: float = Field(
        default=DEFAULT_TOLERANCE,
        ge=0,
        le=1,
        description="The planner keeps the count while the metric is within this fraction of its target "
        "(default 0.1, as a HorizontalPodAutoscaler).",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _old_spelling(cls, value: object) -> object:
        return OLD_SCALING_MODES.get(value, value) if isinstance(value, str) else value

    def _checked(self, targets: int) -> Self:
        if self.mode == ScalingMode.EXTERNAL:
            if targets or self.min_replicas is not None or self.max_replicas is not None:
                raise ValueError(
                    "mode External leaves the replica count to your own autoscaler: give no target, "
                    "minReplicas or maxReplicas (set them on the HorizontalPodAutoscaler)"
                )
            return self
        if self.max_replicas is None:
            raise ValueError("mode Planner needs maxReplicas")
        if self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas ({self.max_replicas})"
            )
        if targets != 1:
            raise ValueError(f"mode planner needs exactly one target, {targets} given")
        return self

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) of planner mode."""
        assert self.max_replicas is not None
        return self.min_replicas or 1, self.max_replicas


class PrefillTarget(ApiModel):
    """What the planner holds a prefill engine to; give one."""

    ttft_p90_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="The router's time to first token, p90 over the metric window (streamed requests).",
    )
    prompt_tokens_per_second: float | None = Field(
        default=None,
        gt=0,
        description="Prompt tokens per second per prefill engine (the engines' vllm:prompt_tokens).",
    )


class DecodeTarget(ApiModel):
    """What the planner holds a decoder to; give one."""

    inter_token_latency_p90_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="The router's inter-token latency, p90 over the metric window (streamed requests).",
    )
    kv_cache_usage: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Mean KV-cache usage of the decoders, a fraction (vllm:kv_cache_usage_perc).",
    )
    running_requests: float | None = Field(
        default=None,
        gt=0,
        description="Requests per decoder: the router's decode legs in flight and the requests it queues "
        "for a decoder with room (disagg_router_in_flight_requests, disagg_router_queued_requests).",
    )


def _given(target: ApiModel | None) -> int:
    return 0 if target is None else len(target.model_dump(exclude_none=True))


class PrefillAutoscaling(_Autoscaling):
    """How prefill's replica count (its engines) is set."""

    target: PrefillTarget | None = Field(
        default=None, description="One of ttftP90Seconds, promptTokensPerSecond (planner mode)."
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if self.mode == ScalingMode.EXTERNAL:
            raise ValueError(
                "mode External is for decode only: prefill's engines are StatefulSets an autoscaler cannot "
                "add; use mode Planner, or scale spec.prefill.replicas yourself"
            )
        return self._checked(_given(self.target))


class DecodeAutoscaling(_Autoscaling):
    """How decode's replica count (its pods) is set."""

    target: DecodeTarget | None = Field(
        default=None,
        description="One of interTokenLatencyP90Seconds, kvCacheUsage, runningRequests (planner mode).",
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        return self._checked(_given(self.target))
