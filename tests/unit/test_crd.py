"""The generated CRD: committed files match the models, the schema is structural, it accepts the examples."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from dd_specs import EXAMPLES, load, valid_document

from disagg.operator import crd
from disagg.operator.api import (
    Condition,
    ConditionStatus,
    DisaggDeployment,
    DisaggDeploymentStatus,
    RoleHashes,
    RoleStatus,
)
from disagg.operator.policies.compat import evaluate

CRDS = Path(__file__).resolve().parents[2] / "crds"
FORBIDDEN = {"$ref", "$defs", "definitions", "title", "anyOf", "oneOf", "allOf", "discriminator", "const"}


def _schema(with_cel: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = crd.build_crd(with_cel=with_cel)["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"
    ]
    return schema


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_committed_crds_match_the_models() -> None:
    files = crd.rendered_files()
    assert set(files) == {
        Path("disagg.io_disaggdeployments.yaml"),
        Path("cel/disagg.io_disaggdeployments.yaml"),
    }
    for relative, text in files.items():
        committed = (CRDS / relative).read_text(encoding="utf-8")
        assert committed == text, f"crds/{relative} is stale: run `disagg crd generate --output-dir crds`"


def test_names_scope_and_version() -> None:
    document = crd.build_crd(with_cel=False)
    assert document["apiVersion"] == "apiextensions.k8s.io/v1"
    assert document["metadata"]["name"] == "disaggdeployments.disagg.io"
    spec = document["spec"]
    assert spec["group"] == "disagg.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "DisaggDeployment" and spec["names"]["shortNames"] == ["disagg"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    # The scale subresource is decode's (`kubectl scale disagg/x --replicas N` sets spec.decode.replicas).
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.decode.replicas",
            "statusReplicasPath": ".status.decode.replicas",
            "labelSelectorPath": ".status.decode.selector",
        },
    }
    columns = {column["name"]: column for column in version["additionalPrinterColumns"]}
    assert list(columns)[:3] == ["Compatible", "KV", "Ready"] and "Age" in columns
    assert columns["Compatible"]["jsonPath"] == '.status.conditions[?(@.type=="Compatible")].status'
    assert columns["KV"]["jsonPath"] == '.status.conditions[?(@.type=="KVTransferReady")].status'
    assert columns["Pairs"]["jsonPath"] == ".status.routablePairs"
    assert columns["Endpoint"]["jsonPath"] == ".status.endpoint" and columns["Endpoint"]["priority"] == 1


@pytest.mark.parametrize("with_cel", [False, True])
def test_schema_is_structural(with_cel: bool) -> None:
    for path, node in _nodes(_schema(with_cel)):
        # Kubernetes allows one union: int-or-string, spelled anyOf [integer, string] (a resource quantity).
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        if int_or_string:
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        assert not FORBIDDEN & set(node) - ({"anyOf"} if int_or_string else set()), (
            f"{path} has {FORBIDDEN & set(node)}"
        )
        free_form = node.get("x-kubernetes-preserve-unknown-fields") is True
        assert "type" in node or free_form or int_or_string, f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert node.get("default", 0) is not None, f"{path} defaults to null"
        # the 1.20 API server reads an empty-string default as null and refuses the CRD
        assert node.get("default") != "", f"{path} defaults to the empty string"


def test_free_form_only_where_the_core_api_owns_the_shape() -> None:
    free = {path for path, node in _nodes(_schema()) if node.get("x-kubernetes-preserve-unknown-fields")}
    assert free == {
        ".spec.prefill.scheduling.tolerations[]",
        ".spec.decode.scheduling.tolerations[]",
        ".spec.prefill.scheduling.affinity",
        ".spec.decode.scheduling.affinity",
        ".spec.router.scheduling.tolerations[]",
        ".spec.router.scheduling.affinity",
    }


def test_every_field_is_described_for_kubectl_explain() -> None:
    undescribed = [
        path
        for path, node in _nodes(_schema())
        if path.count(".") >= 2 and not path.endswith(("[]", "{}")) and not node.get("description")
    ]
    assert undescribed == []


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "phase" not in _schema()["properties"]["status"]["properties"]


def _closed(node: Any) -> Any:
    """The schema as strict JSON Schema: objects with declared properties refuse unknown fields, as
    `kubectl apply --validate=strict` does (the API server would silently prune them)."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _closed(value) for key, value in node.items()}
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _validator() -> jsonschema.Draft7Validator:
    schema = _closed(_schema())
    # metadata is typed by Kubernetes itself, not by this schema
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_validates_against_the_crd_schema(path: Path) -> None:
    errors = list(_validator().iter_errors(load(path)))
    assert errors == []


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        ({"prefill": {"tensorParallelsize": 2}}, "tensorParallelsize"),
        ({"kvTransfer": {"connector": "push"}}, "'push' is not one of"),
        ({"decode": {"blockSize": 0}}, "0 is less than the minimum of 1"),
        ({"kvTransfer": {"sideChannelPort": 70000}}, "70000 is greater than the maximum"),
        ({"model": {"numLayers": "62"}}, "'62' is not of type 'integer'"),
    ],
)
def test_schema_rejects_bad_documents(patch: dict[str, Any], where: str) -> None:
    errors = [error.message for error in _validator().iter_errors(valid_document(patch))]
    assert any(where in message for message in errors), errors


def test_defaults_are_the_models_defaults_and_valid() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["kvTransfer"]["default"] == {}
    transfer = spec["kvTransfer"]["properties"]
    assert transfer["sideChannelPort"]["default"] == 5600
    assert transfer["connector"]["default"] == "Push"
    assert transfer["backends"]["default"] == ["UCX"]
    defaults = [(path, node) for path, node in _nodes(_schema()) if "default" in node]
    assert len(defaults) > 10
    for _, node in defaults:
        jsonschema.validate(node["default"], {k: v for k, v in node.items() if k != "default"})


def test_a_status_written_by_the_operator_validates() -> None:
    dd = DisaggDeployment.model_validate(load(EXAMPLES / "pp2-hma.yaml"))
    report = evaluate(dd.spec)
    assert report.plan is not None
    status = DisaggDeploymentStatus(
        observed_generation=3,
        conditions=[
            Condition(
                type="Compatible",
                status=ConditionStatus.TRUE,
                reason="Compatible",
                message="",
                observed_generation=3,
                last_transition_time=datetime(2026, 11, 30, 9, 0, tzinfo=UTC),
            )
        ],
        prefill=RoleStatus(replicas=2, ready_replicas=1),
        decode=RoleStatus(replicas=2, ready_replicas=2),
        topology=report.plan.to_status(),
        compatibility_hashes=RoleHashes(prefill=report.hashes["prefill"], decode=report.hashes["decode"]),
    )
    document = dd.model_copy(update={"status": status}).to_dict()
    assert document["status"]["conditions"][0]["lastTransitionTime"] == "2026-11-30T09:00:00Z"
    assert list(_validator().iter_errors(document)) == []
    assert DisaggDeployment.model_validate(document) == dd.model_copy(update={"status": status})


def test_rendered_yaml_has_the_generated_header_and_parses() -> None:
    text = crd.render(crd.build_crd(with_cel=True))
    assert text.startswith("# Generated from disagg/operator/api/")
    assert yaml.safe_load(text) == crd.build_crd(with_cel=True)
