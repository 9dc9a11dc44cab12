"""Generate the `DisaggDeployment` CustomResourceDefinition from the pydantic models in `disagg.operator.api`.

The pydantic JSON schema is rewritten into a Kubernetes *structural* schema: `$ref`s inlined, `title` and
`additionalProperties: false` dropped, `Optional` unions collapsed to the plain type (optional fields are
omitted, never null), integers given an explicit format.

Two variants are written, because Kubernetes 1.20 does not know `x-kubernetes-validations`: its kubectl
refuses the CRD client-side (`unknown field "x-kubernetes-validations"`), and with `--validate=false` the API
server silently prunes the rules (`kubernetes-integration-on-1.20.md` §6). So:

- `crds/disagg.io_disaggdeployments.yaml` has no CEL rules and applies cleanly on every cluster from 1.20; the
  operator's admission webhook and reconciler enforce the same rules in Python (`policies.compat`).
- `crds/cel/disagg.io_disaggdeployments.yaml` adds the cross-field rules as CEL for clusters that enforce them
  (1.25 and later), so a bad object is refused even while the operator is down.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from disagg.operator import api

CRD_NAME: Final = f"{api.PLURAL}.{api.GROUP}"
CRD_FILENAME: Final = f"{api.GROUP}_{api.PLURAL}.yaml"
CEL_SUBDIR: Final = "cel"
HEADER: Final = (
    "# Generated from disagg/operator/api/ by `disagg crd generate --output-dir crds`. Do not edit.\n"
)

# Keys pydantic emits that a structural schema forbids or that carry no meaning for Kubernetes.
_DROPPED_KEYS: Final = frozenset({"title", "discriminator", "$defs", "readOnly", "writeOnly", "deprecated"})


# --- CEL rules ----------------------------------------------------------------------------------------------
# Evaluated with `self` bound to the spec. The API server applies schema defaults before validating, so
# fields with a default are always present; only truly optional fields need has().


def _all_kinds(predicate: str) -> str:
    """CEL that is true iff every layer's attention kind satisfies `predicate` (with `{k}` for the kind)."""
    model = "self.model"
    pattern = f"{model}.layerPattern"
    each = predicate.format(k="k")
    full = predicate.format(k="'Full'")
    other = predicate.format(k=f"{pattern}.otherKind")
    return (
        f"(has({model}.attentionKinds) ? {model}.attentionKinds.all(k, {each}) : "
        f"has({pattern}) ? (({full}) || {pattern}.fullEvery > {model}.numLayers) && "
        f"(({other}) || {pattern}.fullEvery == 1) : "
        f"({predicate.format(k=f'{model}.attentionKind')}))"
    )


_ALL_FULL: Final = _all_kinds("{k} == 'Full'")
_NO_MAMBA: Final = _all_kinds("{k} != 'Mamba'")
_HMA: Final = f"(self.engine.hybridKvCacheManager == 'Enabled' && !{_ALL_FULL})"
_MAMBA: Final = f"!{_NO_MAMBA}"
_MLA: Final = _all_kinds("{k} in ['MLA', 'Mamba']")
_ROUTING: Final = (
    f"(self.kvTransfer.connector == 'Push' && ({_HMA} || self.engine.kvCacheLayout == 'BlockOutermost') && "
    f"!({_MAMBA}) && self.prefill.pipelineParallelSize > 1)"
)


def _effective(role: str, field: str, shared: str, *, optional_shared: bool = False) -> str:
    override = f"self.{role}.overrides"
    base = f"(has({shared}) ? {shared} : '')" if optional_shared else shared
    return f"(has({override}) && has({override}.{field}) ? {override}.{field} : {base})"


def _same_for_roles(field: str, shared: str, *, optional_shared: bool = False) -> str:
    return (
        f"{_effective('prefill', field, shared, optional_shared=optional_shared)} == "
        f"{_effective('decode', field, shared, optional_shared=optional_shared)}"
    )


def _partition_ok(role: str) -> str:
    """`sum()` is from the Kubernetes CEL lists library, present wherever CRD validation rules are."""
    partition = f"self.{role}.layerPartition"
    return (
        f"self.{role}.pipelineParallelSize <= self.model.numLayers && (!has({partition}) || "
        f"(size({partition}) == self.{role}.pipelineParallelSize && {partition}.all(n, n >= 1) && "
        f"{partition}.sum() == self.model.numLayers))"
    )


def _heads_split(tp: str) -> str:
    return f"(self.model.numKvHeads % {tp} == 0 || {tp} % self.model.numKvHeads == 0)"


@dataclass(frozen=True)
class CelRule:
    """One cross-field rule on the spec: the same CamelCase reason as the Python pre-flight check."""

    reason: str
    rule: str
    message: str

    def as_schema(self) -> dict[str, str]:
        return {"rule": self.rule, "message": f"{self.reason}: {self.message}"}


SPEC_RULES: Final[tuple[CelRule, ...]] = (
    CelRule(
        "InvalidModelLayers",
        "!has(self.model.layerPattern) || !has(self.model.attentionKinds)",
        "give model.layerPattern or model.attentionKinds, not both",
    ),
    CelRule(
        "InvalidModelLayers",
        "!has(self.model.attentionKinds) || size(self.model.attentionKinds) == self.model.numLayers",
        "model.attentionKinds needs one entry per layer (model.numLayers)",
    ),
    CelRule(
        "DecodePipelineParallel",
        "self.decode.pipelineParallelSize == 1",
        "decode.pipelineParallelSize must be 1: the push connector counts completions per decode rank",
    ),
    CelRule(
        "PullConnectorWithHybridPP",
        f"self.kvTransfer.connector == 'Push' || self.prefill.pipelineParallelSize == 1 || !{_HMA}",
        "a hybrid KV cache (HMA) under prefill pipeline parallelism needs kvTransfer.connector Push",
    ),
    CelRule(
        "MambaUnderPipelineParallel",
        f"self.prefill.pipelineParallelSize == 1 || !({_MAMBA})",
        "models with Mamba layers need prefill.pipelineParallelSize 1",
    ),
    CelRule(
        "MambaStateNotSupported",
        f"self.kvTransfer.connector == 'Pull' || !({_MAMBA})",
        "models with Mamba layers need kvTransfer.connector Pull: the push transfer sidecar moves "
        "attention KV only",
    ),
    CelRule(
        "BlockSizeMismatch",
        "self.prefill.blockSize == self.decode.blockSize || (self.kvTransfer.connector == 'Pull' && "
        f"!{_HMA} && self.prefill.blockSize < self.decode.blockSize && "
        "self.decode.blockSize % self.prefill.blockSize == 0)",
        "prefill.blockSize must equal decode.blockSize (the pull connector without HMA also accepts a "
        "prefill blockSize that divides decode's)",
    ),
    CelRule(
        "DecodeTPExceedsPrefillTP",
        f"!{_ROUTING} || {_MLA} || self.decode.tensorParallelSize <= self.prefill.tensorParallelSize",
        "layer-name routing of a non-MLA model needs decode.tensorParallelSize <= prefill.tensorParallelSize",
    ),
    CelRule(
        "TensorParallelNotDivisible",
        "self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0 || "
        "self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0",
        "one of prefill.tensorParallelSize and decode.tensorParallelSize must divide the other",
    ),
    CelRule(
        "KVHeadsNotDivisible",
        f"{_MLA} || ({_heads_split('self.prefill.tensorParallelSize')} && "
        f"{_heads_split('self.decode.tensorParallelSize')})",
        "model.numKvHeads and each role's tensorParallelSize must divide one another",
    ),
    CelRule(
        "InvalidLayerPartition",
        f"({_partition_ok('prefill')}) && ({_partition_ok('decode')})",
        "layerPartition needs one count of at least 1 per pipeline stage, adding up to model.numLayers, and "
        "pipelineParallelSize may not exceed model.numLayers",
    ),
    CelRule(
        "CompatibilityHashMismatch",
        " && ".join(
            (
                _same_for_roles("version", "self.engine.version"),
                _same_for_roles("image", "self.engine.image"),
                _same_for_roles("attentionBackend", "self.engine.attentionBackend"),
                _same_for_roles("dtype", "self.model.dtype"),
                _same_for_roles("kvCacheDtype", "self.model.kvCacheDtype"),
                _same_for_roles("revision", "self.model.revision", optional_shared=True),
            )
        ),
        "prefill and decode overrides must agree on image, version, attentionBackend, revision, dtype and "
        "kvCacheDtype",
    ),
    # Whole pages cannot be checked here: CEL's quantity library is newer than the clusters this targets.
    CelRule(
        "KVPoolSizeInvalid",
        "!has(self.kvTransfer.kvPool) || self.kvTransfer.kvPool.medium == 'Memory' || "
        "has(self.kvTransfer.kvPool.sizeLimit)",
        "kvTransfer.kvPool.sizeLimit is required for the HugePages media",
    ),
)


# --- schema rewriting ---------------------------------------------------------------------------------------


def _resolve(node: Any, defs: Mapping[str, Any]) -> Any:
    """Inline `$ref`s (sibling keys such as a field description win over the referenced schema's)."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    any_of = node.get("anyOf")
    # int-or-string (a quantity) is the one non-Optional union a structural schema allows, spelled so.
    if isinstance(any_of, list) and not node.get("x-kubernetes-int-or-string"):
        non_null = [option for option in any_of if option != {"type": "null"}]
        if len(non_null) != 1:
            raise ValueError(f"only Optional[T] unions map to a structural schema, got anyOf {any_of}")
        del node["anyOf"]
        node = {**non_null[0], **node}
    if node.get("default", 0) is None:
        del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS or (key == "additionalProperties" and value is False):
            continue
        if key == "properties":
            out[key] = {name: _structural(prop) for name, prop in value.items()}
        elif key in {"items", "additionalProperties"}:
            out[key] = _structural(value)
        else:
            out[key] = value
    if out.get("type") == "integer":
        out.setdefault("format", "int32")
    # JSON Schema's numeric exclusive bounds are OpenAPI v3's bound plus a boolean.
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(exclusive), int | float) and not isinstance(out[exclusive], bool):
            out[bound], out[exclusive] = out[exclusive], True
    # type and description first, so the YAML reads like kubectl explain
    leading = {key: out.pop(key) for key in ("type", "format", "description") if key in out}
    return {**leading, **out}


def structural_schema(model: type[api.ApiModel]) -> dict[str, Any]:
    """The structural openAPIV3 schema of one model, as Kubernetes accepts it."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    resolved: dict[str, Any] = _structural(_resolve(raw, defs))
    return resolved


def open_api_schema(*, with_cel: bool) -> dict[str, Any]:
    spec = structural_schema(api.DisaggDeploymentSpec)
    if with_cel:
        spec["x-kubernetes-validations"] = [rule.as_schema() for rule in SPEC_RULES]
    status = structural_schema(api.DisaggDeploymentStatus)
    return {
        "type": "object",
        "description": (
            "DisaggDeployment serves one model with disaggregated prefill and decode: prefill pods (one per "
            "pipeline stage) push KV blocks to decode pods over NIXL, routed by layer name. Its scale "
            "subresource is decode's: `kubectl scale disagg/<name> --replicas N` (or an autoscaler aimed "
            "at it) sets spec.decode.replicas."
        ),
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "APIVersion of this object (disagg.io/v1alpha1).",
            },
            "kind": {"type": "string", "description": "Kind of this object (DisaggDeployment)."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
    }


def _condition_column(
    name: str, condition: str, description: str, *, field: str = "status", priority: int = 0
) -> dict[str, Any]:
    column: dict[str, Any] = {
        "name": name,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{condition}")].{field}',
        "description": description,
    }
    if priority:
        column["priority"] = priority
    return column


PRINTER_COLUMNS: Final[tuple[dict[str, Any], ...]] = (
    _condition_column("Compatible", "Compatible", "Whether prefill and decode can exchange KV."),
    _condition_column("KV", "KVTransferReady", "Whether every prefill stage handshook every decode pod."),
    _condition_column("Ready", "Available", "Whether the deployment serves requests."),
    {
        "name": "Pairs",
        "type": "string",
        "jsonPath": ".status.routablePairs",
        "description": "Routable prefill/decode pairs of all pairs (the Routable condition names the rest).",
    },
    {
        "name": "Transport",
        "type": "string",
        "jsonPath": ".status.kvTransport",
        "description": "The transports the pairs' KV took, as UCX chose them (status.kvTransports per pair).",
    },
    {
        "name": "Revision",
        "type": "string",
        "jsonPath": ".status.revision",
        "description": "The spec's engine revision (what pairs depend on).",
    },
    {
        "name": "Old",
        "type": "string",
        "jsonPath": ".status.oldRevision",
        "description": "The revision being replaced while a rollout is under way.",
    },
    _condition_column(
        "Rollout",
        "Progressing",
        "Where a rollout is (RolloutWaitingForRoutablePairs, ...).",
        field="reason",
    ),
    {
        "name": "Stages",
        "type": "integer",
        "jsonPath": ".spec.prefill.pipelineParallelSize",
        "description": "Prefill pipeline stages.",
        "priority": 1,
    },
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".status.prefill.readyReplicas",
        "description": "Ready prefill pods.",
        "priority": 1,
    },
    {
        "name": "Decode",
        "type": "integer",
        "jsonPath": ".status.decode.readyReplicas",
        "description": "Ready decode pods.",
        "priority": 1,
    },
    {
        "name": "Want",
        "type": "integer",
        "jsonPath": ".status.decode.desiredReplicas",
        "description": "Decode pods the role is to have (the spec's, or the planner's).",
        "priority": 1,
    },
    _condition_column(
        "Scaling", "Scaling", "Why the planner last changed a count.", field="reason", priority=1
    ),
    _condition_column("Reason", "Compatible", "Why the pair is (in)compatible.", field="reason", priority=1),
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.endpoint",
        "description": "The router's URL: the deployment's OpenAI-compatible API.",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


# The scale subresource is decode's: its pods are one Deployment, so a count maps to pods one to one (a
# prefill replica is a StatefulSet of pipeline stages, which no autoscaler's pod metrics describe).
SCALE_SUBRESOURCE: Final = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.replicas",
    "labelSelectorPath": ".status.decode.selector",
}


def build_crd(*, with_cel: bool) -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/part-of": "disagg"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": copy.deepcopy(list(PRINTER_COLUMNS)),
                    "schema": {"openAPIV3Schema": open_api_schema(with_cel=with_cel)},
                }
            ],
        },
    }


def render(crd: Mapping[str, Any]) -> str:
    return HEADER + yaml.safe_dump(dict(crd), sort_keys=False, width=110, allow_unicode=True)


def rendered_files() -> dict[Path, str]:
    """Relative path under `crds/` → YAML text, for both variants."""
    return {
        Path(CRD_FILENAME): render(build_crd(with_cel=False)),
        Path(CEL_SUBDIR) / CRD_FILENAME: render(build_crd(with_cel=True)),
    }


def write_all(output_dir: Path) -> list[Path]:
    written = []
    for relative, text in rendered_files().items():
        path = output_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
