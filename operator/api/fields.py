"""The API's shared pieces: its group and kind, the bounds every field is held to, the Kubernetes types
it passes through (quantities, resource lists, free-form objects) and `ApiModel`, the base of every model.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    StrictInt,
    StringConstraints,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

GROUP: Final = "disagg.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DisaggDeployment"
PLURAL: Final = "disaggdeployments"
SINGULAR: Final = "disaggdeployment"
SHORT_NAMES: Final = ("disagg",)
Role = Literal["prefill", "decode"]
ROLES: Final[tuple[Role, Role]] = ("prefill", "decode")
# Bounds on lists that CEL rules iterate and strings they compare: without maxItems/maxLength the API
# server's CEL cost estimate assumes the largest possible request and can refuse the CRD.
MAX_LAYERS: Final = 4096
MAX_STAGES: Final = 256
# A Kubernetes resource quantity in the forms a pool size takes (no exponent notation, no milli).
QUANTITY_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"

# The builders write one StatefulSet and one Service per prefill replica, and reconcile applies each: the
# bound keeps what one spec asks of the API server bounded (and a build of 2**32 replicas from hanging).
MAX_REPLICAS: Final = 256
MAX_TENSOR_PARALLEL: Final = 1024
MAX_BLOCK_SIZE: Final = 4096
MAX_EXTRA_ARGS: Final = 256
MAX_ARG_LENGTH: Final = 4096
# Real Affinity and Toleration objects are under ten levels deep; a bound keeps a hostile one from recursing.
MAX_FREE_FORM_DEPTH: Final = 32

# metav1.Condition's reason: CamelCase, for machines.
REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

# A resource quantity as Kubernetes parses it (resource.Quantity), unsigned because a container's request or
# limit is never negative, with a bounded exponent; and a resource name (a qualified name, `nvidia.com/gpu`).
KUBE_QUANTITY_PATTERN: Final = (
    r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]{1,2})?$"
)
RESOURCE_NAME_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_INT64_MAX: Final = 2**63 - 1


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON-like `value` nests more than `limit` levels (iteratively: a deep one must not recurse)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        pending.extend((child, depth + 1) for child in children)
    return False


def _bounded_depth(value: Any) -> Any:
    if nested_deeper_than(value, MAX_FREE_FORM_DEPTH):
        raise ValueError(f"is nested more than {MAX_FREE_FORM_DEPTH} levels deep")
    return value


# Kubernetes objects the operator passes through untouched (Affinity, Toleration): typing them here would copy
# the core API into this CRD and drift from it.
FreeForm = Annotated[
    dict[str, Any],
    AfterValidator(_bounded_depth),
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


def _quantity(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{value} is not a quantity: a whole number must be between 0 and 2**63 - 1")
    if isinstance(value, str) and (len(value) > 64 or not re.fullmatch(KUBE_QUANTITY_PATTERN, value)):
        raise ValueError(f"{value[:64]!r} is not a Kubernetes quantity such as 2, 500m or 16Gi")
    return value


_QUANTITY_SCHEMA: Final = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": KUBE_QUANTITY_PATTERN,
}
Quantity = Annotated[StrictInt | str, AfterValidator(_quantity)]


PERCENT_PATTERN: Final = r"^(100|[1-9]?[0-9])%$"


def _int_or_percent(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= MAX_REPLICAS:
        raise ValueError(f"{value} must be between 0 and {MAX_REPLICAS}")
    if isinstance(value, str) and not re.fullmatch(PERCENT_PATTERN, value):
        raise ValueError(f"{value[:64]!r} is neither a whole number nor a percentage from 0% to 100%")
    return value


# A count of engines or a percentage of a role's replicas, as a Deployment's maxSurge is spelled.
IntOrPercent = Annotated[
    StrictInt | str,
    AfterValidator(_int_or_percent),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]
ResourceName = Annotated[str, StringConstraints(max_length=253, pattern=RESOURCE_NAME_PATTERN)]
# A structural schema cannot constrain map keys (no patternProperties): the names are checked in Python.
ResourceList = Annotated[
    dict[ResourceName, Quantity],
    WithJsonSchema({"type": "object", "additionalProperties": _QUANTITY_SCHEMA, "maxProperties": 64}),
]
ExtraArg = Annotated[str, StringConstraints(max_length=MAX_ARG_LENGTH)]


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )
