"""Issue 15's spec reproducers: no spec crashes `disagg check` or the webhook's verdict, whatever `check` and
the webhook accept the builders build, and engine arguments are judged the way vLLM's parser reads them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from dd_specs import HMA_ON, spec, spec_dict, valid_document

from disagg.operator.cli.main import main
from disagg.operator.control.reconcile import judge
from disagg.operator.control.webhook import refusal
from disagg.operator.naming import Installation

INSTALLED = Installation(worker_image="w:1")


def reasons(spec_patch: dict[str, Any]) -> list[str]:
    return [v.reason for v in judge(valid_document(spec_patch)["spec"], INSTALLED).violations]


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> tuple[int, str]:
    path = tmp_path / "dd.yaml"
    path.write_text(text, encoding="utf-8")
    code = main(["check", str(path)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize(
    "template",
    ["m.{j}.{i}", "{i}{", "{i}{0}", "{i}}", "{i}{i:>10000000}", "{i!r}", "{i.real}", "{i[0]}", "{}{i}"],
)
def test_a_layer_name_template_is_a_format_of_i_alone(
    template: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = valid_document({"model": {"layerNameTemplate": template}})
    assert reasons({"model": {"layerNameTemplate": template}}) == ["InvalidSpec"]
    message = refusal(document["spec"])
    assert message is not None and "layerNameTemplate" in message and "{i}" in message
    code, out = check(tmp_path, capsys, yaml.safe_dump(document))
    assert code == 2 and "layerNameTemplate" in out


@pytest.mark.parametrize("template", ["model.layers.{i}.attn", "{i}", "l{{x}}.{i}", "a{i}b{i}"])
def test_templates_of_i_with_escaped_braces_are_accepted(template: str) -> None:
    assert reasons({"model": {"layerNameTemplate": template}}) == []


def test_a_long_layer_name_template_is_refused() -> None:
    assert reasons({"model": {"layerNameTemplate": "x" * 300 + "{i}"}}) == ["InvalidSpec"]


def test_deeply_nested_yaml_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(tmp_path, capsys, "spec: " + "[" * 5000 + "]" * 5000 + "\n")
    assert code == 2 and "nested" in out


def test_deeply_nested_free_form_fields_are_refused() -> None:
    deep: Any = {}
    for _ in range(200):
        deep = {"a": deep}
    assert reasons({"prefill": {"scheduling": {"affinity": deep}}}) == ["InvalidSpec"]


@pytest.mark.parametrize(
    "resources",
    [
        22,
        {"limits": 22},
        {"limits": {"cpu": "two"}},
        {"limits": {"cpu": -1}},
        {"limits": {"cpu": 0.5}},
        {"limits": {"cpu": True}},
        {"limits": {"not a name!": "1"}},
        {"limit": {"cpu": "1"}},
    ],
)
def test_resources_are_kubernetes_quantities(resources: Any) -> None:
    assert reasons({"prefill": {"resources": resources}}) == ["InvalidSpec"]
    assert reasons({"worker": {"resources": resources}}) == ["InvalidSpec"]


def test_valid_quantities_are_accepted() -> None:
    resources = {"limits": {"cpu": "500m", "memory": "1.5Gi", "nvidia.com/gpu": 2}, "requests": {"cpu": 1}}
    assert reasons({"decode": {"resources": resources}}) == []


@pytest.mark.parametrize("field", ["replicas", "tensorParallelSize", "blockSize"])
def test_sizes_are_bounded(field: str) -> None:
    assert reasons({"prefill": {field: 4294967296}}) == ["InvalidSpec"]


def test_a_spec_the_builders_cannot_fit_in_a_configmap_is_refused() -> None:
    # 4096 layers of 255-character names: a topology document over the 1 MiB a ConfigMap may hold.
    patch = {"model": {"numLayers": 4096, "layerNameTemplate": "x" * 250 + ".{i}"}}
    found = judge(valid_document(patch)["spec"], INSTALLED).violations
    assert [v.reason for v in found] == ["ManifestTooLarge"]
    assert "ConfigMap" in found[0].message


def test_the_chain_runs_the_build() -> None:
    from disagg.operator.policies.chain import REFUSAL_CHAIN

    assert REFUSAL_CHAIN[-1].__name__ == "objects_build"


# ---- engine arguments as vLLM's parser reads them ----------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-parallel", "4"],
        ["--tensor-parallel=4"],
        ["--tensor_parallel", "4"],
        ["--block", "8"],
        ["--pipeline-p", "1"],
        ["-t", "4"],
        ["-n", "3"],
        ["--kv-transfer-config.kv_role", "kv_producer"],
        ["--kv-transfer-config.kv_role=kv_consumer"],
        ["--kv_transfer.kv_connector", "NixlConnector"],
        ["--block-size.x", "1"],
        ["--config", "engine.yaml"],
        ["--config=engine.yaml"],
        ["--conf", "engine.yaml"],
        ["--disable-hybrid"],
        ["--headl"],
        ["--model", "other/model"],
    ],
)
def test_engine_arguments_are_read_as_vllm_reads_them(extra: list[str]) -> None:
    found = judge(valid_document({**HMA_ON, "prefill": {"extraArgs": extra}})["spec"], INSTALLED).violations
    assert [v.reason for v in found] == ["EngineArgumentConflict"], extra


def test_disabling_hma_is_refused_both_ways() -> None:
    disabled = {"engine": {"hybridKvCacheManager": "Disabled"}}
    assert "EngineArgumentConflict" not in reasons(
        {**disabled, "decode": {"extraArgs": ["--disable-hybrid-kv-cache-manager"]}}
    )
    for negation in ("--enable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"):
        assert "EngineArgumentConflict" in reasons({**disabled, "decode": {"extraArgs": [negation]}})
        assert reasons({**HMA_ON, "decode": {"extraArgs": [negation]}}) == []
    assert "EngineArgumentConflict" in reasons({**HMA_ON, "decode": {"extraArgs": ["--disable-hybrid-kv"]}})


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-model-len", "4096"],
        ["--config-format", "hf"],
        ["--tensor-parallel", "2"],
        ["--gpu-memory-utilization=0.9"],
        ["--compilation-config.mode", "3"],
    ],
)
def test_other_and_agreeing_arguments_pass(extra: list[str]) -> None:
    assert reasons({"prefill": {"extraArgs": extra}}) == []


def test_the_messages_name_what_vllm_reads() -> None:
    found = judge(valid_document({"prefill": {"extraArgs": ["--block", "8"]}})["spec"], INSTALLED).violations
    assert "--block-size" in found[0].message and "spec.prefill.blockSize" in found[0].message
    config = judge(valid_document({"decode": {"extraArgs": ["--config", "x.yaml"]}})["spec"], INSTALLED)
    assert "file" in config.violations[0].message


# ---- the webhook's request handling ------------------------------------------------------------------------


def _review(body: bytes) -> tuple[int, dict[str, Any] | None, str]:
    from disagg.operator.control.webhook import review_response

    status, payload, reason = asyncio.run(review_response(_never_called, body))
    return status, payload, reason


async def _never_called(*_: Any, **__: Any) -> Any:
    raise AssertionError("a malformed review must not reach kopf")


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"apiVersion": "admission.k8s.io/v1"}',
        b'{"request": 5}',
        b'{"request": {"uid": "u"}}',
        b"\xff\xfe\x00garbage",
        b"[" * 100000 + b"]" * 100000,
        b"not json",
        b"[]",
        json.dumps({"request": {"uid": "u", "object": {"a": {"b": {"c": {}}}}}}).encode(),
    ],
)
def test_a_malformed_review_is_refused_with_a_reason_never_a_500(body: bytes) -> None:
    status, payload, reason = _review(body)
    assert status in (200, 400)
    assert reason
    if status == 200:
        assert payload is not None and payload["response"]["allowed"] is False
        assert payload["response"]["status"]["message"]


def test_a_spec_the_verdict_cannot_judge_is_denied_not_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf

    from disagg.operator.control import webhook

    def explode(_: Any) -> str | None:
        raise KeyError("j")

    monkeypatch.setattr(webhook, "refusal", explode)
    with pytest.raises(kopf.AdmissionError) as raised:
        webhook.validate(spec=spec_dict(spec()))
    assert raised.value.code == 422 and "VerdictFailed" in str(raised.value)


def test_an_old_autoscaling_mode_is_admitted_with_a_warning() -> None:
    import kopf

    from disagg.operator.control import webhook

    raw = spec_dict(spec())
    raw["decode"]["autoscaling"] = {"mode": "external"}
    warnings: list[str] = []
    webhook.validate(spec=kopf.Spec(kopf.Body({"spec": raw})), warnings=warnings)
    assert warnings == [
        "spec.decode.autoscaling.mode: 'external' is the old spelling of 'External'; both are accepted, "
        "write 'External'"
    ]


@pytest.mark.parametrize("size", ["²", "٣", "9" * 4096])
def test_a_context_parallel_size_that_is_no_ascii_number_does_not_crash_the_verdict(size: str) -> None:
    found = reasons({"prefill": {"extraArgs": ["--prefill-context-parallel-size", size]}})
    # int() reads "٣" as 3; vLLM's parser refuses "²" as no int at all.
    assert "PrefillContextParallel" in found or found == ["UnknownEngineArgument"]
