"""`builders.prefill`: a prefill replica's StatefulSet."""

from __future__ import annotations

from built import objects
from dd_specs import spec


class TestStatefulSet:
    def test_one_pod_per_stage_started_together(self) -> None:
        sts = objects(spec({"prefill": {"replicas": 2}}))["StatefulSet", "gemma-pp2-prefill-1"]
        assert sts["apiVersion"] == "apps/v1"
        assert sts["spec"]["replicas"] == 2
        assert sts["spec"]["podManagementPolicy"] == "Parallel"

    def test_selector_is_in_template_labels_and_distinguishes_replicas(self) -> None:
        built = objects(spec({"prefill": {"replicas": 2}}))
        selectors = []
        for replica in (0, 1):
            sts = built["StatefulSet", f"gemma-pp2-prefill-{replica}"]
            selector = sts["spec"]["selector"]["matchLabels"]
            assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
            assert built["Service", f"gemma-pp2-prefill-{replica}"]["spec"]["selector"] == selector
            selectors.append(selector)
        assert selectors[0] != selectors[1]

    def test_selector_does_not_change_with_the_spec(self) -> None:
        one = objects(spec())["StatefulSet", "gemma-pp2-prefill-0"]["spec"]["selector"]
        other = objects(
            spec({"prefill": {"replicas": 1, "tensorParallelSize": 4}, "decode": {"replicas": 3}})
        )
        assert other["StatefulSet", "gemma-pp2-prefill-0"]["spec"]["selector"] == one
