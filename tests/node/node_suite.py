"""What the node suite's tests share: the prompt, and a curl of a router's Service as a person sends it."""

from __future__ import annotations

import subprocess

from disagg.rig.demo_serving import curl_command, sse_text
from disagg.rig.node_cluster import NodeCluster

PROMPT = "Disaggregated serving moves the KV cache from prefill to decode."
MAX_TOKENS = 16


def router_url(node: NodeCluster, name: str) -> str:
    svc = node.json("get", "service", f"{name}-router")
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/v1/completions"


def curl_text(node: NodeCluster, name: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    proc = subprocess.run(
        curl_command(router_url(node, name), body), capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr, proc.stdout[-500:])
    return sse_text(proc.stdout)
