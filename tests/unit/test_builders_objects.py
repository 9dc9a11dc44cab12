"""`builders.objects`: every child is owned, labelled and stamped the same way."""

from __future__ import annotations

from built import objects
from dd_specs import spec

from disagg.operator.naming import Owner


class TestOwnedObjects:
    def test_every_object_is_owned_labelled_and_stamped(self) -> None:
        for obj in objects(spec()).values():
            metadata = obj["metadata"]
            assert metadata["namespace"] == "ns1"
            assert metadata["ownerReferences"] == [
                {
                    "apiVersion": "disagg.io/v1alpha1",
                    "kind": "DisaggDeployment",
                    "name": "gemma-pp2",
                    "uid": "0f0e-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            assert metadata["labels"]["app.kubernetes.io/instance"] == "gemma-pp2"
            assert metadata["labels"]["app.kubernetes.io/managed-by"] == "disagg-operator"
            assert metadata["labels"]["app.kubernetes.io/name"] == "disagg"
            assert metadata["annotations"]["disagg.io/generation"] == "7"

    def test_without_a_uid_nothing_is_owned_and_nothing_else_differs(self) -> None:
        # `disagg plan` builds from a file, which has no uid: the operator adds the reference.
        unowned = objects(spec(), Owner(name="gemma-pp2", namespace="ns1", uid=None, generation=7))
        owned = objects(spec())
        assert all("ownerReferences" not in obj["metadata"] for obj in unowned.values())
        for key, obj in owned.items():
            metadata = {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}
            assert unowned[key] == {**obj, "metadata": metadata}
