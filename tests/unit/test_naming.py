"""`naming`: child names, label values and what long or odd owner names become."""

from __future__ import annotations

import re

from built import objects
from dd_specs import spec
from hypothesis import given
from hypothesis import strategies as st

from disagg.operator.naming import MAX_CHILD_NAME, Owner, child_name, label_value


class TestNames:
    def test_long_owner_names_are_shortened_stably_and_distinctly(self) -> None:
        owner = "a" * 200
        names = {child_name(owner, "prefill", str(r)) for r in range(12)}
        assert len(names) == 12
        assert all(len(name) <= MAX_CHILD_NAME for name in names)
        assert child_name(owner, "decode") == child_name(owner, "decode")
        assert child_name(owner, "decode") != child_name("a" * 199 + "b", "decode")

    def test_long_owner_names_fit_label_values_and_stay_in_an_annotation(self) -> None:
        owner = Owner(name="m" * 120, namespace="ns1", uid="u", generation=1)
        for obj in objects(spec(), owner).values():
            labels = obj["metadata"]["labels"]
            assert all(len(value) <= 63 for value in labels.values())
            assert labels["app.kubernetes.io/instance"] == label_value(owner.name)
            assert obj["metadata"]["annotations"]["disagg.io/deployment"] == owner.name
            if "template" in obj.get("spec", {}):
                template = obj["spec"]["template"]["metadata"]
                assert template["annotations"]["disagg.io/deployment"] == owner.name
                assert obj["spec"]["selector"]["matchLabels"].items() <= template["labels"].items()
        assert label_value("m" * 120) != label_value("m" * 119 + "n")

    def test_short_names_are_plain(self) -> None:
        assert child_name("gemma", "prefill", "0") == "gemma-prefill-0"

    def test_dotted_and_digit_names_become_distinct_service_names(self) -> None:
        dotted, dashed = child_name("gemma.v1", "decode"), child_name("gemma-v1", "decode")
        assert dashed == "gemma-v1-decode"
        assert dotted.startswith("gemma-v1-") and dotted != dashed
        assert child_name("3b-model", "decode").startswith("d-3b-model-")


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# DNS subdomains, as Kubernetes allows for a custom object's name.
owner_names = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,200}[a-z0-9])?", fullmatch=True).filter(
    lambda name: ".." not in name and "-." not in name and ".-" not in name
)


@given(owner=owner_names, replica=st.integers(min_value=0, max_value=999))
def test_child_names_are_dns_labels_short_enough_for_statefulset_pods(owner: str, replica: int) -> None:
    for name in (
        child_name(owner, "prefill", str(replica)),
        child_name(owner, "decode"),
        child_name(owner, "topology"),
    ):
        assert len(name) <= MAX_CHILD_NAME
        assert DNS_LABEL.match(name), name
