"""What the node suite's tests share: the prompt, and a curl of a router's Service as a person sends it."""

from __future__ import annotations

from disagg.rig import node_cluster
from disagg.rig.node_cluster import NodeCluster

PROMPT = "Disaggregated serving moves the KV cache from prefill to decode."
MAX_TOKENS = 16


def curl_text(node: NodeCluster, name: str, model: str) -> str:
    return node_cluster.curl_text(node, name, model, PROMPT, MAX_TOKENS)
