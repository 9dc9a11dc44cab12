"""What the operator's builders put on an engine pod and the KV worker reads back from it. Pure constants.

The operator builds pods with these names (`disagg.operator.builders`) and the worker finds its peers, its
configuration and its readiness condition by them (`peer_check`, `sidecar.config`, `pod_report`); both import
them from here so a renamed label or variable cannot leave one side behind. The operator may import this
module; it must stay free of I/O and of imports.
"""

from __future__ import annotations

from typing import Final

# Labels on every engine pod: the peers of a sidecar are the pods of its deployment with the other role.
DEPLOYMENT_LABEL: Final = "disagg.io/deployment"
ROLE_LABEL: Final = "disagg.io/role"

# Router pods carry the deployment label and this component label (value `ROUTER_COMPONENT`), not the role
# label, so nothing that selects engine pods by role picks them up.
ROUTER_COMPONENT_LABEL: Final = "disagg.io/component"
ROUTER_COMPONENT: Final = "router"

# The engine container and its OpenAI-compatible HTTP port (the prefill leg goes to a prefill engine's head
# pod on it, the decode leg to a decode pod).
ENGINE_CONTAINER: Final = "engine"
ENGINE_HTTP_PORT_NAME: Final = "http"
DEFAULT_ENGINE_HTTP_PORT: Final = 8000

# The sidecar container, and the port NIXL's handshake side channel listens on (in whichever container moves
# the KV: the engine for vLLM images, otherwise the sidecar).
SIDECAR_CONTAINER: Final = "kv-worker"
SIDE_CHANNEL_PORT_NAME: Final = "side-channel"
DEFAULT_SIDE_CHANNEL_PORT: Final = 5600

# The Pod condition the sidecar writes and the pod's readiness gate waits on.
POD_CONDITION: Final = "disagg.io/kv-transfer-ready"

# Every engine pod's sidecar writes its latest peer checks on its own Pod as this annotation
# (`peer_report.PeerReport`, JSON), only when they changed; routers and the operator pair pods by it.
PEER_REPORT_ANNOTATION: Final = "disagg.io/kv-peers"

# The operator marks an engine pod of a revision being replaced with this annotation (its value: when the
# drain began, RFC 3339): routers send it no new request (pairing's `Draining`), its in-flight ones finish,
# and the operator deletes it once its sidecar reports nothing in flight (`peer_report.InFlight`), or at the
# latest once the rollout's `drainSeconds` have passed.
DRAINING_ANNOTATION: Final = "disagg.io/draining"

# The pod's identity, from the downward API.
POD_NAME_ENV: Final = "POD_NAME"
POD_NAMESPACE_ENV: Final = "POD_NAMESPACE"
POD_UID_ENV: Final = "POD_UID"
POD_IP_ENV: Final = "POD_IP"
NODE_NAME_ENV: Final = "NODE_NAME"

# The sidecar's configuration (`sidecar.config` documents each); the first group the builders set.
DEPLOYMENT_ENV: Final = "DISAGG_DEPLOYMENT"
ROLE_ENV: Final = "DISAGG_ROLE"
PIPELINE_PARALLEL_SIZE_ENV: Final = "DISAGG_PIPELINE_PARALLEL_SIZE"
TENSOR_PARALLEL_SIZE_ENV: Final = "DISAGG_TENSOR_PARALLEL_SIZE"
BLOCK_SIZE_ENV: Final = "DISAGG_BLOCK_SIZE"
SIDE_CHANNEL_PORT_ENV: Final = "DISAGG_SIDE_CHANNEL_PORT"
TOPOLOGY_FILE_ENV: Final = "DISAGG_TOPOLOGY_FILE"
# A PP prefill engine has one side channel, on its head pod (stage 0), serving every (pp, tp) rank:
# the head's address for the other stages' pods, and the stage pods the head's transfer sidecar republishes.
ENGINE_SIDE_CHANNEL_HOST_ENV: Final = "DISAGG_ENGINE_SIDE_CHANNEL_HOST"
ENGINE_WORKERS_ENV: Final = "DISAGG_ENGINE_WORKERS"
COMPATIBILITY_HASH_ENV: Final = "DISAGG_COMPATIBILITY_HASH"
METRICS_PORT_ENV: Final = "DISAGG_METRICS_PORT"
KV_POOL_ENV: Final = "DISAGG_KV_POOL"
KV_TRANSPORT_ENV: Final = "DISAGG_KV_TRANSPORT"
"""`spec.kvTransfer.transport` on the sidecar: the transport its pairs' KV must take."""
UCX_LOG_FILE_ENV: Final = "UCX_LOG_FILE"
UCX_LOG_DIR: Final = "/dev/shm"
UCX_LOG_FILE: Final = f"{UCX_LOG_DIR}/ucx.%h.%p.log"
"""Where the process that owns a pod's NIXL agent has UCX write its log (one file per process), in the
shared-memory volume both containers mount: a watching sidecar reads its vLLM engine's lanes there."""
ENGINE_ID_ENV: Final = "DISAGG_ENGINE_ID"
PP_RANK_ENV: Final = "DISAGG_PP_RANK"
TP_RANK_ENV: Final = "DISAGG_TP_RANK"
SIDE_CHANNEL_HOST_ENV: Final = "DISAGG_SIDE_CHANNEL_HOST"
ENGINE_SOCKET_ENV: Final = "DISAGG_ENGINE_SOCKET"
METRICS_HOST_ENV: Final = "DISAGG_METRICS_HOST"
# The address the engine's and the router's HTTP servers bind; unset (a pod's own network) means all of them.
# The local rig sets it to each pod's loopback address, its stand-in for a pod's network namespace.
HTTP_HOST_ENV: Final = "DISAGG_HTTP_HOST"
LOG_LEVEL_ENV: Final = "DISAGG_LOG_LEVEL"
