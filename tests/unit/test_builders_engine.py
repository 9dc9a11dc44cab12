"""`builders.engine`: the vLLM engine's command, arguments and environment."""

from __future__ import annotations

import json

import pytest
from built import container, env, flag, objects
from dd_specs import HMA_ON, spec
from pydantic import ValidationError

from disagg.operator.api import EngineKind
from disagg.operator.builders.engine import ENGINE_LAUNCHER_NAME, arg_violations, engine_container
from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.operator.engine_kind import engine_kind, kind_of_image
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.pod_contract import SIDECAR_CONTAINER


class TestVllmEngine:
    def test_prefill_is_push_producer_with_its_stage_layout(self) -> None:
        engine = container(objects(spec())["StatefulSet", "gemma-pp2-prefill-0"], ENGINE_CONTAINER)
        args = engine["args"]
        assert args[0] == "google/gemma-3-27b-it"
        assert json.loads(flag(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_producer",
            "engine_id": "@DISAGG_ENGINE_ID@",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"backends": ["UCX"], "kv_lease_duration": 120},
        }
        assert (flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")) == ("2", "2")
        assert flag(args, "--block-size") == "32"
        assert flag(args, "--nnodes") == "2"
        assert flag(args, "--master-addr") == "gemma-pp2-prefill-0-0.gemma-pp2-prefill-0.ns1.svc"
        # The pipeline rank is the pod ordinal, read from the pod name at start.
        assert engine["command"][:2] == ["/bin/sh", "-c"]
        assert "${POD_NAME##*-}" in engine["command"][2]
        variables = env(engine)
        assert variables["VLLM_PP_LAYER_PARTITION"] == "31,31"
        assert variables["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        names = [item["name"] for item in engine["env"]]
        # $(POD_IP) expands only from a variable defined earlier in the list.
        assert variables["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
        # The address stage 0 publishes its scheduler queue at, for the other stages: the pod's own, not
        # what a route to the internet would give (0.0.0.0 in a pod without a default route).
        assert variables["VLLM_HOST_IP"] == "$(POD_IP)"
        assert names.index("POD_IP") < names.index("VLLM_HOST_IP")

    def test_decode_is_consumer_without_pipeline_launcher(self) -> None:
        engine = container(objects(spec())["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert engine["command"][:2] == ["/bin/sh", "-c"]
        assert (
            engine["command"][2].endswith('exec vllm serve "$@"') and "--headless" not in engine["command"][2]
        )
        config = json.loads(flag(engine["args"], "--kv-transfer-config"))
        assert (config["kv_connector"], config["kv_role"]) == ("NixlPushConnector", "kv_consumer")
        assert "--nnodes" not in engine["args"]
        assert "VLLM_PP_LAYER_PARTITION" not in env(engine)

    def test_pull_connector(self) -> None:
        model = spec({"kvTransfer": {"connector": "Pull"}, "prefill": {"pipelineParallelSize": 1}})
        engine = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert json.loads(flag(engine["args"], "--kv-transfer-config"))["kv_connector"] == "NixlConnector"

    def test_user_args_are_kept_and_redundant_owned_ones_dropped(self) -> None:
        model = spec(
            {
                "engine": {"extraArgs": ["--enforce-eager", "--block-size=32"]},
                "decode": {"extraArgs": ["-tp", "2"]},
            }
        )
        assert arg_violations(model) == []
        args = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)["args"]
        assert args[-1] == "--enforce-eager"
        assert args.count("--block-size") == 1 and "-tp" not in args

    @pytest.mark.parametrize(
        ("extra", "field"),
        [
            (["--block-size", "16"], "spec.prefill.blockSize"),
            (["--tensor_parallel_size=4"], "spec.prefill.tensorParallelSize"),
            (["--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], "spec.kvTransfer"),
            (["--disable-hybrid-kv-cache-manager"], "spec.engine.hybridKvCacheManager"),
            (["--node-rank", "1"], "the pod's StatefulSet ordinal"),
        ],
    )
    def test_contradicting_args_are_refused_with_the_field_to_use(self, extra: list[str], field: str) -> None:
        model = spec({**HMA_ON, "prefill": {"extraArgs": extra}})
        (violation,) = arg_violations(model)
        assert violation.reason == "EngineArgumentConflict"
        assert field in violation.message and "spec.prefill.extraArgs" in violation.message
        report = evaluate(model)
        assert report.plan is not None
        with pytest.raises(ValueError, match="EngineArgumentConflict"):
            engine_container(model, "prefill", report.plan, stage_service="s", identity_env=[])

    @pytest.mark.parametrize(
        ("extra", "field"),
        [
            # Issue 22 (finding 8): each exits vLLM 0.33's parser with status 2, so the engine crash-loops.
            (["-tp4"], "spec.prefill.tensorParallelSize"),
            (["-pp2"], "spec.prefill.pipelineParallelSize"),
            (["--no-enable-hybrid-kv-cache-manager"], "spec.engine.hybridKvCacheManager"),
            (["-tp2=2"], "spec.prefill.tensorParallelSize"),
            (["-t4"], "spec.prefill.tensorParallelSize"),
            (["--no-block-size"], "spec.prefill.blockSize"),
            (["--block-size32"], "spec.prefill.blockSize"),
            (["--attention-backendFLASH_ATTN"], "spec.engine.attentionBackend"),
            (["--no_tensor_parallel_size"], "spec.prefill.tensorParallelSize"),
            (["--no-headless"], "the pod's StatefulSet ordinal"),
            (["-pp2.x", "1"], "spec.prefill.pipelineParallelSize"),
            # argparse splits a value off a one-letter option: `-n3` is `--nnodes 3`, `-r1` `--node-rank 1`.
            (["-n3"], "spec.prefill.pipelineParallelSize"),
            (["-r1"], "the pod's StatefulSet ordinal"),
        ],
    )
    def test_args_vllms_parser_refuses_or_reads_as_owned_are_refused(
        self, extra: list[str], field: str
    ) -> None:
        model = spec({"prefill": {"extraArgs": extra}})
        (violation,) = arg_violations(model)
        assert violation.reason == "EngineArgumentConflict"
        assert field in violation.message and f"sets '{extra[0]}" in violation.message

    def test_an_agreeing_attached_value_is_dropped_and_vllm_options_near_owned_ones_kept(self) -> None:
        # `-n2` is the PP2 prefill's own `--nnodes 2`; `--kv-cache-dtype-skip-layers` and
        # `--no-enable-prefix-caching` are vLLM options that only look like owned ones.
        kept = ["--kv-cache-dtype-skip-layers", "sliding_window", "--no-enable-prefix-caching"]
        model = spec({"prefill": {"extraArgs": ["-n2", *kept]}})
        assert arg_violations(model) == []
        report = evaluate(model)
        assert report.plan is not None
        built = engine_container(model, "prefill", report.plan, stage_service="s", identity_env=[])
        assert list(built.args[-3:]) == kept and "-n2" not in built.args

    def test_other_engines_get_user_args_verbatim(self) -> None:
        model = spec(
            {"engine": {"image": "ghcr.io/disagg/reference-engine:0.1.0", "extraArgs": ["--block-size", "8"]}}
        )
        assert arg_violations(model) == []
        engine = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert engine["args"] == ["--block-size", "8"] and "command" not in engine

    @pytest.mark.parametrize(
        ("image", "expected"),
        [
            ("vllm/vllm-openai:v0.33.0", EngineKind.VLLM),
            ("registry.local:5000/team/vllm-tpu@sha256:abc", EngineKind.VLLM),
            ("ghcr.io/vllm-like/engine:1", EngineKind.CUSTOM),
            ("sglang/sglang:latest", EngineKind.CUSTOM),
            ("registry.corp/ml/inference:0.33", EngineKind.CUSTOM),
        ],
    )
    def test_an_unset_kind_defaults_to_what_the_repository_name_says(
        self, image: str, expected: EngineKind
    ) -> None:
        assert kind_of_image(image) is expected


class TestEngineKind:
    """`spec.engine.kind` decides what the engine runs; the image's name only gives the default."""

    MIRRORED = "registry.corp/ml/inference:0.33"

    def test_a_mirrored_image_of_kind_vllm_runs_vllm_with_a_watching_sidecar(self) -> None:
        model = spec({"engine": {"image": self.MIRRORED, "kind": "VLLM"}})
        built = objects(model)
        for key in (("StatefulSet", "gemma-pp2-prefill-0"), ("Deployment", "gemma-pp2-decode")):
            engine, sidecar = (
                container(built[key], ENGINE_CONTAINER),
                container(built[key], SIDECAR_CONTAINER),
            )
            assert engine["image"] == self.MIRRORED
            assert engine["command"][-1] == ENGINE_LAUNCHER_NAME
            assert engine["args"][0] == "google/gemma-3-27b-it" and "--kv-transfer-config" in engine["args"]
            # vLLM moves the KV itself: the side channel and IPC_LOCK are the engine's, the sidecar watches.
            assert "IPC_LOCK" in engine["securityContext"]["capabilities"].get("add", [])
            assert sidecar["args"][-2:] == ["--mode", "watch"]

    def test_the_same_mirrored_image_without_a_kind_is_a_custom_engine(self) -> None:
        built = objects(spec({"engine": {"image": self.MIRRORED}}))
        engine = container(built["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        sidecar = container(built["Deployment", "gemma-pp2-decode"], SIDECAR_CONTAINER)
        assert "command" not in engine and sidecar["args"][-2:] == ["--mode", "transfer"]

    def test_an_explicit_kind_wins_over_the_image_name(self) -> None:
        model = spec({"engine": {"image": "vllm/vllm-openai:v0.33.0", "kind": "Custom"}})
        assert engine_kind(model, "prefill") is engine_kind(model, "decode") is EngineKind.CUSTOM
        engine = container(objects(model)["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)
        assert "command" not in engine and "--kv-transfer-config" not in engine.get("args", [])

    def test_an_unset_kind_is_the_role_images(self) -> None:
        model = spec(
            {
                "engine": {"image": self.MIRRORED},
                "prefill": {"overrides": {"image": "vllm/vllm-openai:v0.33.0"}},
            }
        )
        assert (engine_kind(model, "prefill"), engine_kind(model, "decode")) == (
            EngineKind.VLLM,
            EngineKind.CUSTOM,
        )

    def test_a_kind_outside_the_enum_is_refused(self) -> None:
        with pytest.raises(ValidationError, match="kind"):
            spec({"engine": {"kind": "vllm"}})
