"""The policies on what the pods need from the spec or the installation: a valid KV pool, a model volume
the model lies in, a sidecar image, and the devices of the transport the spec demands. Pure.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from disagg.operator.api import DisaggDeploymentSpec, KVTransport
from disagg.operator.builders.pod_template import RESERVED_MOUNTS
from disagg.operator.naming import TRANSFER_IMAGE_ENV, WORKER_IMAGE_ENV, Installation
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.kv.errors import Violation


def kv_pool_is_valid(given: PolicyInput) -> Sequence[Violation]:
    return kv_pool_violations(given.spec)


def kv_pool_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """A huge page pool needs a size in whole pages, and every container that maps it (engine and sidecar)
    needs a cpu or memory request or limit beside its hugepages, which Kubernetes refuses otherwise."""
    pool = spec.kv_transfer.kv_pool
    page = None if pool is None else pool.medium.huge_page_bytes
    resource = None if pool is None else pool.medium.resource_name
    if pool is None or page is None or resource is None:
        return []
    size = pool.size_bytes()
    found: list[Violation] = []
    pages = pool.medium.value.split("-", 1)[1]
    if size is None or size <= 0 or size % page:
        given = "not set" if pool.size_limit is None else repr(pool.size_limit)
        found.append(
            Violation(
                "KVPoolSizeInvalid",
                f"spec.kvTransfer.kvPool.medium {pool.medium.value} needs sizeLimit, a positive whole number "
                f"of {pages} pages, but it is {given}: set spec.kvTransfer.kvPool.sizeLimit to the pool's "
                "size rounded up to whole pages (e.g. 16Gi)",
            )
        )
    containers = {
        "spec.prefill.resources": spec.prefill.resources,
        "spec.decode.resources": spec.decode.resources,
        "spec.worker.resources": spec.worker.resources,
    }
    for path, resources in containers.items():
        declared = resources.sections() if resources is not None else {}
        sections = [declared.get(key) or {} for key in ("requests", "limits")]
        if not any(name in section for section in sections for name in ("cpu", "memory")):
            found.append(
                Violation(
                    "KVPoolResourcesInvalid",
                    f"{path} has no cpu or memory request or limit, which Kubernetes requires of a container "
                    f"with {resource}: add requests.memory (or cpu) to {path}",
                )
            )
        other = {str(section[resource]) for section in sections if resource in section} - {pool.size_limit}
        if other:
            found.append(
                Violation(
                    "KVPoolResourcesInvalid",
                    f"{path} sets {resource} to {sorted(other)[0]!r} but spec.kvTransfer.kvPool.sizeLimit is "
                    f"{pool.size_limit!r}: remove {resource} from {path}, the operator sets it from the pool",
                )
            )
    return found


def model_volume_is_valid(given: PolicyInput) -> Sequence[Violation]:
    return model_volume_violations(given.spec)


def model_volume_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """A model volume must hold the model: `spec.model.name` an absolute path beneath the mount path, which
    may not be `/` (it would hide the image) nor a folder the pod mounts something else at or under."""
    volume, name = spec.model.volume, spec.model.name
    if volume is None:
        return []
    mount = posixpath.normpath(volume.mount_for(name))
    path = posixpath.normpath(name)
    if not name.startswith("/") or not path.startswith(mount.rstrip("/") + "/"):
        return [
            Violation(
                "ModelVolumeInvalid",
                f"spec.model.name {name!r} does not lie beneath the model volume's mount path {mount!r}: "
                "name the model by its absolute path in the volume (e.g. /models/llama-3-8b) or set "
                "spec.model.volume.mountPath to a folder that holds it",
            )
        ]
    clash = [m for m in RESERVED_MOUNTS if f"{m}/".startswith(f"{mount}/") or mount.startswith(f"{m}/")]
    if mount == "/" or clash:
        taken = "the root file system" if mount == "/" else clash[0]
        return [
            Violation(
                "ModelVolumeInvalid",
                f"spec.model.volume would be mounted at {mount!r}, which would hide or be hidden by {taken} "
                "in the engine container: mount the volume at a folder of its own (e.g. /models) with "
                "spec.model.volume.mountPath, and name the model beneath it",
            )
        ]
    return []


def worker_image_is_named(given: PolicyInput) -> Sequence[Violation]:
    return worker_image_violations(given.spec, given.installation)


def worker_image_violations(spec: DisaggDeploymentSpec, installation: Installation) -> list[Violation]:
    """A sidecar image neither the spec nor the installation names."""
    if installation.sidecar_image(spec) is not None:
        return []
    return [
        Violation(
            "WorkerImageMissing",
            f"spec.worker.image is not set and the operator has no default sidecar image "
            f"({WORKER_IMAGE_ENV} and {TRANSFER_IMAGE_ENV} are unset): set spec.worker.image, or install the "
            "operator with the Helm chart, which sets them from worker.image and worker.transferImage",
        )
    ]


def transport_has_devices(given: PolicyInput) -> Sequence[Violation]:
    return transport_violations(given.spec)


def transport_violations(spec: DisaggDeploymentSpec) -> list[Violation]:
    """`rdma` demanded of pods that request no RDMA device: UCX would find none and every sidecar would fail
    at its start, so the spec is refused before any pod exists."""
    kv = spec.kv_transfer
    if kv.transport is not KVTransport.RDMA or kv.rdma is not None:
        return []
    return [
        Violation(
            "KVTransportNeedsRdma",
            "spec.kvTransfer.transport is rdma but spec.kvTransfer.rdma requests no RDMA device, so UCX "
            "would find none in the pods: set spec.kvTransfer.rdma (e.g. {resourceName: rdma/ib, count: 1}) "
            "or set spec.kvTransfer.transport to any",
        )
    ]
