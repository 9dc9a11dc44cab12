"""The names a `DisaggDeployment`'s children carry, and who they belong to. Pure.

Labels and annotations every child carries (the handlers list children, and kopf watches pods, by them), the
children's names (`child_name` turns any DisaggDeployment name into a DNS-1035 label short enough for
StatefulSet pods), the `Owner` the children belong to and the `Installation` (what the Helm chart decides
through environment variables). Everything that builds, judges or reconciles a child reads its names here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

from disagg.operator.api import API_VERSION, KIND, DisaggDeploymentSpec, Role
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    ROLE_LABEL,
    ROUTER_COMPONENT,
    ROUTER_COMPONENT_LABEL,
)

FIELD_MANAGER: Final = "disagg-operator"
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
PART_OF_LABEL: Final = "app.kubernetes.io/part-of"
# The owner's full name: a label value is capped at 63 characters, an object name is not.
DEPLOYMENT_ANNOTATION: Final = "disagg.io/deployment"
MAX_LABEL_VALUE: Final = 63
REPLICA_LABEL: Final = "disagg.io/replica"
GENERATION_ANNOTATION: Final = "disagg.io/generation"
HASH_ANNOTATION: Final = "disagg.io/compatibility-hash"
TOPOLOGY_ANNOTATION: Final = "disagg.io/topology-checksum"
# What an engine child's pairs depend on (`builders.topology.revision`), on the workload and its pods; and
# which set of children it is: `a` keeps the plain names, `b` is the other set a rollout brings up beside it.
REVISION_LABEL: Final = "disagg.io/revision"
SLOT_LABEL: Final = "disagg.io/slot"
SLOTS: Final = ("a", "b")
# On an engine workload: when its slot began to run its revision (RFC 3339), what a rollout's progress
# deadline counts from.
SINCE_ANNOTATION: Final = "disagg.io/revision-since"
WORKER_IMAGE_ENV: Final = "DISAGG_WORKER_IMAGE"
ROUTER_IMAGE_ENV: Final = "DISAGG_ROUTER_IMAGE"
# The transfer sidecar's default image (it needs NIXL and torch: the chart's disagg-transfer image); the watch
# sidecar's is WORKER_IMAGE_ENV (the light image). Either stands in for the other when only one is set: the
# transfer image runs the watch sidecar too, and a single all-in-one image runs both.
TRANSFER_IMAGE_ENV: Final = "DISAGG_TRANSFER_IMAGE"
WORKER_CLUSTER_ROLE_ENV: Final = "DISAGG_WORKER_CLUSTERROLE"
DEFAULT_WORKER_CLUSTER_ROLE: Final = "disagg-worker"

# A StatefulSet's pods carry `controller-revision-hash: <name>-<10 chars>`, a label value capped at 63.
MAX_CHILD_NAME: Final = 52


@dataclass(frozen=True)
class Owner:
    """The DisaggDeployment the children belong to (passed explicitly: builders have no kopf context)."""

    name: str
    namespace: str
    # None for a spec read from a file (`disagg plan`): the object does not exist yet, so nothing can own.
    uid: str | None
    generation: int

    def references(self) -> list[dict[str, Any]]:
        if self.uid is None:
            return []
        return [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": self.name,
                "uid": self.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


@dataclass(frozen=True)
class Installation:
    """What the operator's installation (the Helm chart, through environment variables) decides for the
    children; read with the rest of the operator's settings (`settings.Settings.from_environ`)."""

    worker_cluster_role: str = DEFAULT_WORKER_CLUSTER_ROLE
    # The sidecar images of a spec that names none: the watch sidecar's, and the transfer sidecar's.
    worker_image: str | None = None
    # The router image of a spec that names none.
    router_image: str | None = None
    transfer_image: str | None = None

    def sidecar_image(self, spec: DisaggDeploymentSpec, *, transfer: bool = False) -> str | None:
        """The spec's sidecar image, else this installation's default for the sidecar's mode (the other
        mode's when only that one is set); None when none is named."""
        defaults = (
            (self.transfer_image, self.worker_image) if transfer else (self.worker_image, self.transfer_image)
        )
        return spec.worker.image or defaults[0] or defaults[1]

    def router_image_of(self, spec: DisaggDeploymentSpec) -> str | None:
        """The spec's router image, else this installation's default, else the sidecar image (every disagg
        image has `disagg router run`), so a spec the sidecar can run needs nothing new for its router."""
        return spec.router.image or self.router_image or self.sidecar_image(spec)


def child_name(owner: str, *parts: str) -> str:
    """`<owner>-<parts>` as a DNS-1035 label (what a Service name must be) short enough for StatefulSet pods.

    A DisaggDeployment name is a DNS subdomain: it may hold dots, start with a digit or be long. Such a name
    is rewritten (dots to dashes, a leading letter, truncation), and a hash of the original keeps two
    rewritten names from colliding.
    """
    suffix = "-".join(parts)
    name = f"{owner}-{suffix}"
    if len(name) <= MAX_CHILD_NAME and "." not in owner and owner[:1].isalpha():
        return name
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    stem = owner.replace(".", "-")
    if not stem[:1].isalpha():
        stem = f"d-{stem}"
    keep = MAX_CHILD_NAME - len(suffix) - len(digest) - 2
    return f"{stem[:keep].rstrip('-')}-{digest}-{suffix}"


def _slotted(slot: str, *parts: str) -> tuple[str, ...]:
    """Slot `a`'s children keep the names a deployment that never rolled out has; slot `b`'s say `b`."""
    return parts if slot == SLOTS[0] else (slot, *parts)


def prefill_name(owner: str, replica: int, slot: str = SLOTS[0]) -> str:
    return child_name(owner, *_slotted(slot, "prefill", str(replica)))


def decode_name(owner: str, slot: str = SLOTS[0]) -> str:
    return child_name(owner, *_slotted(slot, "decode"))


def topology_name(owner: str, slot: str = SLOTS[0]) -> str:
    return child_name(owner, *_slotted(slot, "topology"))


def worker_account_name(owner: str) -> str:
    """The engine pods' ServiceAccount and the RoleBinding that grants it the worker ClusterRole."""
    return child_name(owner, "kv-worker")


def label_value(owner: str) -> str:
    """The owner's name as a label value: itself when it fits, else a prefix and a hash of the whole."""
    if len(owner) <= MAX_LABEL_VALUE:
        return owner
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    return f"{owner[: MAX_LABEL_VALUE - len(digest) - 1].rstrip('-.')}-{digest}"


def owner_labels(owner: str) -> dict[str, str]:
    """Labels on every child; the handlers list children (and kopf watches pods) by these."""
    return {
        NAME_LABEL: "disagg",
        INSTANCE_LABEL: label_value(owner),
        MANAGED_BY_LABEL: FIELD_MANAGER,
        PART_OF_LABEL: "disagg",
        DEPLOYMENT_LABEL: label_value(owner),
    }


def selector_labels(
    owner: str, role: Role, replica: int | None = None, slot: str = SLOTS[0]
) -> dict[str, str]:
    """Immutable selector of one workload: never includes anything a spec change could alter.

    Slot `a`'s is what it was before slots existed (a selector cannot change), so it also matches slot `b`'s
    pods; the controllers tell them apart by owner (a StatefulSet by pod name, a ReplicaSet by its
    pod-template-hash), and slot `b`'s own selector names its slot."""
    labels = {INSTANCE_LABEL: label_value(owner), COMPONENT_LABEL: role, ROLE_LABEL: role}
    if replica is not None:
        labels[REPLICA_LABEL] = str(replica)
    if slot != SLOTS[0]:
        labels[SLOT_LABEL] = slot
    return labels


def router_name(owner: str) -> str:
    """The router's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return child_name(owner, "router")


def router_selector(owner: str) -> dict[str, str]:
    """The router Deployment's immutable selector: engine pods never carry the component label."""
    return {DEPLOYMENT_LABEL: label_value(owner), ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT}
