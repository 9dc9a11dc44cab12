"""`disagg check`, `disagg plan` and `disagg crd generate`: exit codes and what they print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dd_specs import EXAMPLES, VALID_EXAMPLE, valid_document

from disagg.operator import crd
from disagg.operator.api import DisaggDeployment
from disagg.operator.builders.children import build
from disagg.operator.cli.main import main
from disagg.operator.naming import Installation, Owner
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.pod_contract import POD_CONDITION

REPO = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _write(tmp_path: Path, document: Any, name: str = "dd.yaml") -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document), encoding="utf-8")
    return path


def test_check_a_compatible_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(VALID_EXAMPLE))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{VALID_EXAMPLE}: DisaggDeployment default/gemma-pp2 is compatible"
    assert lines[1] == "  prefill: 1 replica x 2 stages x TP 2, block size 32"
    assert lines[2] == "  decode:  2 replicas x TP 2, block size 32"
    assert "push connector, uniform KV cache, region-index routing, 2 completion notifications" in lines[3]
    # The example's sliding-window model on vLLM 0.33: the operator turns HMA off, and says why.
    assert lines[4].startswith("  hybrid KV cache manager off: Auto: the model has sliding-window layers")
    assert lines[5] == "  engine: vLLM 0.33.0 (NIXL connector version 15) (prefill and decode)"
    assert lines[6].startswith("  compatibility hash vLLM computes: ") and lines[6].endswith(
        "(prefill and decode)"
    )
    # FLASH_ATTN picks its kernel block size by the GPU: the verdict says the handshake decides it.
    assert lines[-1].startswith("  note: kernel block sizes undecided before pods exist (prefill: FLASH_ATTN")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("bad-decode-pp.yaml", "DecodePipelineParallel"),
        ("bad-pull-hma-pp.yaml", "PullConnectorWithHybridPP"),
        ("bad-block-size.yaml", "BlockSizeMismatch"),
        ("bad-tp-not-divisible.yaml", "TensorParallelNotDivisible"),
        ("bad-mamba-pp.yaml", "MambaUnderPipelineParallel"),
        ("bad-layer-partition.yaml", "InvalidLayerPartition"),
        ("bad-version-mismatch.yaml", "CompatibilityHashMismatch"),
    ],
)
def test_check_an_incompatible_file_exits_1_with_the_reason(
    capsys: pytest.CaptureFixture[str], name: str, reason: str
) -> None:
    code, out, _ = run(capsys, "check", str(EXAMPLES / name))
    assert code == 1
    first, second = out.splitlines()[:2]
    assert " is incompatible (" in first
    assert second.startswith(f"  {reason}: ")


def test_check_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", "-o", "json", str(EXAMPLES / "bad-block-size.yaml"))
    assert code == 1
    result = json.loads(out)
    assert result["valid"] is True and result["compatible"] is False
    assert [v["reason"] for v in result["violations"]] == ["BlockSizeMismatch"]
    assert "prefill blockSize 32 and decode blockSize 16" in result["violations"][0]["message"]
    assert result["topology"]["routingMode"] == "region-index" and result["topology"]["hma"] is False
    assert [s["startLayer"] for s in result["topology"]["stages"]] == [0, 31]
    assert set(result["compatibilityHashes"]) == {"prefill", "decode"}


def test_check_schema_error_exits_2_with_the_field_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _write(
        tmp_path, valid_document({"prefill": {"tensorParallelSize": 0}, "decode": {"blockSize": "x"}})
    )
    code, out, _ = run(capsys, "check", str(path))
    assert code == 2
    assert out.splitlines() == [
        f"{path} is not a valid DisaggDeployment",
        "  spec.prefill.tensorParallelSize: Input should be greater than or equal to 1",
        "  spec.decode.blockSize: Input should be a valid integer, unable to parse string as an integer",
    ]


def test_check_refuses_unknown_fields_as_the_api_server_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `kubectl apply` refuses a snake_case spelling as an unknown field: so does the check, naming it.
    path = _write(
        tmp_path,
        valid_document(
            {"rollout": {"max_surge": 1}, "decode": {"block_size": 32}, "router": {"colour": "blue"}}
        ),
    )
    code, out, _ = run(capsys, "check", str(path))
    assert code == 2
    assert out.splitlines() == [
        f"{path} is not a valid DisaggDeployment",
        "  spec.decode.block_size: unknown field 'block_size' (did you mean blockSize?)",
        "  spec.router.colour: unknown field 'colour'",
        "  spec.rollout.max_surge: unknown field 'max_surge' (did you mean maxSurge?)",
    ]


def test_check_schema_error_as_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _write(tmp_path, valid_document({"kvTransfer": {"connector": "RDMA"}}))
    code, out, _ = run(capsys, "check", "-o", "json", str(path))
    assert code == 2
    result = json.loads(out)
    assert result["valid"] is False
    assert result["errors"] == [
        {"path": "spec.kvTransfer.connector", "message": "Input should be 'Push' or 'Pull'"}
    ]


def test_check_cross_field_model_error_names_the_object(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _write(tmp_path, valid_document({"model": {"attentionKinds": ["Full"]}}))
    code, out, _ = run(capsys, "check", str(path))
    assert code == 2
    assert "  spec.model: give either layerPattern or attentionKinds, not both" in out.splitlines()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("spec: [unclosed", "is not valid YAML"),
        ("- a\n- b\n", "must hold a YAML mapping, found list"),
        ("a: 1\n---\nb: 2\n", "exactly one DisaggDeployment document, found 2"),
    ],
)
def test_check_unreadable_documents_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    code, out, _ = run(capsys, "check", str(_write(tmp_path, content)))
    assert code == 2 and message in out


def test_check_a_missing_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "check", str(tmp_path / "absent.yaml"))
    assert code == 2 and "cannot read" in out


def test_plan_prints_stages_with_layer_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", str(VALID_EXAMPLE))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "# DisaggDeployment default/gemma-pp2 (compatible)"
    assert "# prefill stage 0: layers 0-30 (31 layers), region-index routing" in lines
    assert "# prefill stage 1: layers 31-61 (31 layers), region-index routing" in lines
    assert "# decode: every layer (0-61), region-index routing" in lines
    stage1 = lines.index("# prefill stage 1: layers 31-61 (31 layers), region-index routing")
    assert lines[stage1 + 1].startswith(
        "#     model.layers.31.self_attn.attn, model.layers.32.self_attn.attn"
    )
    named = {name.strip(" #,") for line in lines if line.startswith("#     ") for name in line.split(", ")}
    assert named == {f"model.layers.{i}.self_attn.attn" for i in range(62)}
    assert err == ""


def _operator_objects(path: Path) -> list[dict[str, Any]]:
    """What the operator builds for the file, owner reference aside (the operator path, called directly)."""
    dd = DisaggDeployment.model_validate(yaml.safe_load(path.read_text()))
    report = evaluate(dd.spec)
    assert report.plan is not None and dd.metadata.name and dd.metadata.namespace
    owner = Owner(dd.metadata.name, dd.metadata.namespace, "uid-from-the-api-server", 1)
    built = build(dd.spec, owner, report.plan, report.hashes, Installation(), report.factors)
    for obj in built:
        assert obj["metadata"].pop("ownerReferences")[0]["uid"] == "uid-from-the-api-server"
    return built


def _by_kind(documents: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for document in documents:
        found.setdefault(document["kind"], []).append(document)
    return found


def test_plan_prints_the_manifests_the_operator_applies(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(VALID_EXAMPLE))
    assert code == 0
    assert "# The operator also sets each object's metadata.ownerReferences to the DisaggDeployment" in out
    documents = [doc for doc in yaml.safe_load_all(out) if doc is not None]
    assert documents == _operator_objects(VALID_EXAMPLE)
    kinds = _by_kind(documents)
    [statefulset] = kinds["StatefulSet"]
    pod = statefulset["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine", "kv-worker"]
    assert pod["readinessGates"] == [{"conditionType": POD_CONDITION}]
    assert pod["serviceAccountName"] == "gemma-pp2-kv-worker"
    assert [d["metadata"]["name"] for d in kinds["Deployment"]] == ["gemma-pp2-decode", "gemma-pp2-router"]
    assert {s["metadata"]["name"] for s in kinds["Service"]} == {
        "gemma-pp2-prefill-0",
        "gemma-pp2-decode",
        "gemma-pp2-router",
    }
    [topology] = kinds["ConfigMap"]
    assert json.loads(topology["data"]["topology.json"])["deployment"] == "gemma-pp2"
    assert [a["metadata"]["name"] for a in kinds["ServiceAccount"]] == [
        "gemma-pp2-kv-worker",
        "gemma-pp2-router",
    ]
    assert kinds["RoleBinding"][0]["roleRef"]["name"] == "disagg-worker"
    assert all("ownerReferences" not in d["metadata"] for d in documents)
    header = [line for line in out.splitlines() if line.startswith("#   - ")]
    assert header == [f"#   - {d['kind']} {d['metadata']['name']}" for d in documents]


@pytest.mark.parametrize("output", ["text", "yaml"])
def test_plan_yaml_has_no_anchors_or_aliases(capsys: pytest.CaptureFixture[str], output: str) -> None:
    # The builders share one env list and one mounts list between a pod's two containers; people read and
    # diff the manifests, so each object is written out in full.
    code, out, _ = run(capsys, "plan", "-o", output, str(VALID_EXAMPLE))
    assert code == 0
    # An anchor (`&id001`) or an alias (`*id001`) is a node event with an anchor name.
    anchored = [
        event.anchor for event in yaml.parse(out) if isinstance(event, yaml.NodeEvent) and event.anchor
    ]
    assert anchored == []


def test_plan_names_the_installations_worker_cluster_role(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_WORKER_CLUSTERROLE", "ops-disagg-worker")
    _, out, _ = run(capsys, "plan", str(VALID_EXAMPLE))
    bindings = _by_kind([doc for doc in yaml.safe_load_all(out) if doc is not None])["RoleBinding"]
    [binding] = [b for b in bindings if b["roleRef"]["kind"] == "ClusterRole"]
    assert binding["roleRef"]["name"] == "ops-disagg-worker"


def test_plan_without_a_namespace_says_which_one_it_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    document = yaml.safe_load(VALID_EXAMPLE.read_text())
    del document["metadata"]["namespace"]
    code, out, _ = run(capsys, "plan", str(_write(tmp_path, document)))
    assert code == 0
    assert "# namespace: the file names none, so default is shown" in out
    documents = [doc for doc in yaml.safe_load_all(out) if doc is not None]
    assert {d["metadata"]["namespace"] for d in documents} == {"default"}


def test_plan_without_a_worker_image_uses_the_operators_default_or_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = yaml.safe_load(VALID_EXAMPLE.read_text())
    del document["spec"]["worker"]
    path = _write(tmp_path, document)
    monkeypatch.delenv("DISAGG_WORKER_IMAGE", raising=False)
    code, out, _ = run(capsys, "plan", str(path))
    assert code == 1
    assert "#   WorkerImageMissing: spec.worker.image is not set" in out
    assert [doc for doc in yaml.safe_load_all(out) if doc is not None] == []
    monkeypatch.setenv("DISAGG_WORKER_IMAGE", "registry.example/worker:2.0")
    code, out, _ = run(capsys, "plan", str(path))
    assert code == 0
    [statefulset] = _by_kind([doc for doc in yaml.safe_load_all(out) if doc is not None])["StatefulSet"]
    images = {c["name"]: c["image"] for c in statefulset["spec"]["template"]["spec"]["containers"]}
    assert images["kv-worker"] == "registry.example/worker:2.0"


def test_plan_of_an_engine_argument_conflict_exits_1_and_prints_no_manifests(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The operator refuses contradicting engine arguments, so the plan must not show objects for them.
    path = _write(tmp_path, valid_document({"engine": {"extraArgs": ["--block-size", "16"]}}))
    code, out, _ = run(capsys, "plan", str(path))
    assert code == 1
    assert "EngineArgumentConflict" in out
    assert [doc for doc in yaml.safe_load_all(out) if doc is not None] == []
    assert run(capsys, "check", str(path))[0] == 1


def test_plan_of_an_incompatible_file_exits_1_and_prints_no_manifests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "plan", str(EXAMPLES / "bad-layer-partition.yaml"))
    assert code == 1
    assert "#   InvalidLayerPartition: layerPartition [30, 30] sums to 60" in out
    assert "# no topology: the prefill layers cannot be split into stages" in out
    assert [doc for doc in yaml.safe_load_all(out) if doc is not None] == []
    assert err == ""


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-o", "json", str(VALID_EXAMPLE))
    assert code == 0
    result = json.loads(out)
    assert result["topology"]["stages"][1]["layers"][0] == "model.layers.31.self_attn.attn"
    assert result["manifests"] == _operator_objects(VALID_EXAMPLE)
    assert result["ownerReferencesOmitted"] is True


def test_plan_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-o", "yaml", str(VALID_EXAMPLE))
    assert code == 0
    result = yaml.safe_load(out)
    assert result["manifests"] == _operator_objects(VALID_EXAMPLE)
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap"} <= set(_by_kind(result["manifests"]))


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_plan_of_an_incompatible_file_has_no_manifests_in_either_format(
    capsys: pytest.CaptureFixture[str], output: str
) -> None:
    code, out, _ = run(capsys, "plan", "-o", output, str(EXAMPLES / "bad-layer-partition.yaml"))
    assert code == 1
    result = yaml.safe_load(out)
    assert result["compatible"] is False and result["manifests"] is None


def test_crd_generate_prints_either_variant(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "crd", "generate")
    assert code == 0 and out == crd.render(crd.build_crd(with_cel=False))
    code, out, _ = run(capsys, "crd", "generate", "--cel")
    assert code == 0 and out == crd.render(crd.build_crd(with_cel=True))
    assert "x-kubernetes-validations" in out


def test_crd_generate_writes_and_checks_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(capsys, "crd", "generate", "--output-dir", str(tmp_path), "--check")[0] == 1
    code, out, _ = run(capsys, "crd", "generate", "--output-dir", str(tmp_path))
    assert code == 0 and out.count("wrote ") == 2
    assert run(capsys, "crd", "generate", "--output-dir", str(tmp_path), "--check")[0] == 0
    stale = tmp_path / "cel" / crd.CRD_FILENAME
    stale.write_text(stale.read_text().replace("decode.pipelineParallelSize must be 1", "anything"))
    code, out, _ = run(capsys, "crd", "generate", "--output-dir", str(tmp_path), "--check")
    assert code == 1 and str(stale) in out


def test_the_installed_command_returns_the_exit_codes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-m", "disagg.operator.cli.main", "check"]
    invalid = _write(tmp_path, valid_document({"decode": {"replicas": -1}}))
    results = {
        name: subprocess.run(
            [*command, str(path)], cwd=REPO, env=env, capture_output=True, text=True, check=False
        )
        for name, path in {
            "ok": VALID_EXAMPLE,
            "incompatible": EXAMPLES / "bad-decode-pp.yaml",
            "invalid": invalid,
        }.items()
    }
    assert {name: r.returncode for name, r in results.items()} == {"ok": 0, "incompatible": 1, "invalid": 2}
    assert "spec.decode.replicas: Input should be greater than or equal to 0" in results["invalid"].stdout


def test_completion_counts_are_shown_only_for_the_push_connector(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "check", str(EXAMPLES / "bad-pull-hma-pp.yaml"))
    assert "  transfer: pull connector, hybrid KV cache (HMA), region-index routing\n" in out


# The project's reference engine, whose policy split the layers itself (issue 22, finding 7).
REFERENCE_IMAGE = "ghcr.io/disagg/disagg-transfer:0.1.0"


@pytest.mark.parametrize("command", ["check", "plan"])
def test_more_stages_than_layers_on_the_reference_engine_is_a_violation_not_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    document = valid_document(
        {
            "model": {"numLayers": 9},
            "prefill": {"pipelineParallelSize": 64},
            "engine": {"image": REFERENCE_IMAGE},
        }
    )
    code, out, _ = run(capsys, command, "-o", "json", str(_write(tmp_path, document)))
    assert code == 1
    violations = json.loads(out)["violations"]
    assert violations[0] == {
        "reason": "InvalidLayerPartition",
        "message": "9 layers cannot fill 64 pipeline stages: lower pipelineParallelSize to at most 9",
    }
    assert "PolicyFailed" not in [violation["reason"] for violation in violations]
