"""values.yaml against values.schema.json, in Python only (no helm): the defaults are valid, bad values are
refused with the offending key named, and every value is documented as Helm's guide asks."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "disagg"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
DEFAULTS: dict[str, Any] = yaml.safe_load(VALUES_TEXT)


def errors_for(values: dict[str, Any]) -> list[jsonschema.ValidationError]:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    return list(jsonschema.Draft7Validator(SCHEMA).iter_errors(values))


def with_value(path: str, value: object) -> dict[str, Any]:
    values = copy.deepcopy(DEFAULTS)
    *parents, last = path.split(".")
    node = values
    for key in parents:
        node = node[key]
    node[last] = value
    return values


def test_default_values_satisfy_the_schema() -> None:
    assert errors_for(DEFAULTS) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("replicas", -1),
        ("replicas", 2),
        ("replicas", "1"),
        ("replicass", 1),
        ("webhook.prt", 9443),
        ("webhook.port", 70000),
        ("webhook.failurePolicy", "Maybe"),
        ("webhook.timeoutSeconds", 31),
        ("logLevel", "verbose"),
        ("logLevel", "error"),
        ("image.pullPolicy", "Sometimes"),
        ("image.tag", "has space"),
        ("watchNamespaces", ["Team_A"]),
        ("watchNamespaces", ["a", "a"]),
        ("worker.image.registry", "x"),
        ("healthPort", 0),
    ],
)
def test_schema_refuses_bad_values_naming_the_key(path: str, value: object) -> None:
    errors = errors_for(with_value(path, value))
    assert errors, f"{path}={value!r} was accepted"
    leaf = path.rsplit(".", 1)[-1]
    described = " ".join(f"{'.'.join(map(str, e.absolute_path))} {e.message}" for e in errors)
    assert leaf in described


def test_every_value_is_documented_by_a_comment_naming_it() -> None:
    """Helm's guide: each value has a comment that starts with its (dotted) name."""
    lines = VALUES_TEXT.splitlines()
    comments = "\n".join(line.strip() for line in lines if line.strip().startswith("#"))

    def leaves(node: dict[str, Any], prefix: str) -> list[str]:
        found = []
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            # A group of values (a map of named settings) is documented leaf by leaf; a free-form map
            # (resources, nodeSelector, ...) is one value.
            if (
                isinstance(value, dict)
                and value
                and dotted
                in {
                    "image",
                    "worker",
                    "worker.image",
                    "worker.transferImage",
                    "webhook",
                    "serviceAccount",
                    "rbac",
                    "metrics",
                    "metrics.podMonitor",
                    "metrics.serviceMonitor",
                    "metrics.dashboard",
                }
            ):
                found += leaves(value, f"{dotted}.")
            else:
                found.append(dotted)
        return found

    undocumented = [
        name
        for name in leaves(DEFAULTS, "")
        if not re.search(rf"^# {re.escape(name)} ", comments, re.MULTILINE)
    ]
    assert undocumented == []
