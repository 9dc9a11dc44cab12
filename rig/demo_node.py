"""`make demo`'s cluster half, on the real node (`hack/node.sh`): the user's path as the README writes it.

The node comes up unless it runs already (and goes down at the end if this demo brought it up, unless
`--keep`); both images are pushed to its registry with `skopeo copy`; the chart is installed with `helm`; a
spec that cannot work is refused by the operator's webhook (through its Service); the reference sample is
applied, the kubelet pulls and runs its pods in containers, and a streamed `curl` of the router's Service
(through kube-proxy) is compared with the monolithic run of the same prompt. Each step prints the command
and what it printed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from disagg.operator.api import DisaggDeploymentSpec
from disagg.rig import node_cluster
from disagg.rig.demo_serving import REFERENCE_SAMPLE, monolithic_text
from disagg.rig.local import REPO
from disagg.rig.node_cluster import OPERATOR_NAMESPACE, NodeCluster, NodeError, failure
from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL, ROLE_LABEL

BROKEN_SAMPLE = REPO / "examples" / "bad-decode-pp.yaml"
PROMPT = "Disaggregated serving moves the KV cache from prefill to decode."
MAX_TOKENS = 16
TRANSPORT_METRICS = ("disagg_kv_transport_info", "disagg_kv_pair_bandwidth_gbps")


def say(line: str) -> None:
    print(line, flush=True)


def show(node: NodeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl args` as a person types it, and what it printed (an error included)."""
    say(f"$ kubectl {' '.join(args)}")
    proc = node.kubectl(*args, check=False)
    say((proc.stdout + proc.stderr).rstrip())
    return proc


def steps(node: NodeCluster) -> None:
    show(node, "get", "nodes", "-o", "wide")
    version = node_cluster.image_version()
    for ref in node_cluster.push_images(node, version):
        say(f"$ skopeo copy oci:build/images/...:{version} docker://{ref}")
    say("$ helm install disagg charts/disagg -n disagg-system --create-namespace --set image.repository=...")
    node_cluster.helm_install(node)
    node_cluster.wait_operator(node)
    show(node, "-n", OPERATOR_NAMESPACE, "get", "pods", "-o", "wide")
    refused = show(node, "apply", "-f", str(BROKEN_SAMPLE.relative_to(REPO)))
    if refused.returncode == 0:
        raise NodeError("the operator's webhook admitted a spec it must refuse")
    say(f"$ kubectl apply -f {REFERENCE_SAMPLE.relative_to(REPO)}")
    started = time.monotonic()
    name = node_cluster.apply_sample(node, REFERENCE_SAMPLE, pods=5)
    say(f"(Routable and Available, every pod Ready, in {time.monotonic() - started:.0f} s)")
    show(node, "get", "disagg")
    show(node, "get", "pods", "-o", "wide")
    model = node.json("get", "disagg", name)["spec"]["model"]["name"]
    say(f"$ curl -N {node_cluster.router_url(node, name)} (streamed, {MAX_TOKENS} tokens)")
    got = node_cluster.curl_text(node, name, model, PROMPT, MAX_TOKENS)
    want = monolithic_text(PROMPT, MAX_TOKENS)
    say(f"through the router's Service: {got!r}\nmonolithic run:              {want!r}")
    if got != want:
        raise NodeError("the answer through the router's Service differs from the monolithic run")
    say("identical.")
    show(node, "get", "disagg")
    show_transport(node, name)


def show_transport(node: NodeCluster, name: str) -> None:
    """What each prefill worker's sidecar says its KV moved over and how fast (`disagg_kv_transport_info`,
    `disagg_kv_pair_bandwidth_gbps`): UCX's own lane choice, read from its log, not from configuration."""
    spec = DisaggDeploymentSpec.model_validate(node.json("get", "disagg", name)["spec"])
    port = spec.worker.metrics_port
    for pod in node.pods("default", f"{DEPLOYMENT_LABEL}={name},{ROLE_LABEL}=prefill"):
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        say(f"$ curl -s {url} | grep -E '^disagg_kv_(transport_info|pair_bandwidth_gbps)'")
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        lines = [line for line in text.splitlines() if line.startswith(TRANSPORT_METRICS)]
        say("\n".join(lines) if lines else "(no pair has moved KV from this worker yet)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the node and the sample running")
    args = parser.parse_args(argv)
    started_here = node_cluster.call_script("status").returncode != 0
    if started_here:
        say("$ make cluster-up")
        up = node_cluster.call_script("up")
        if up.returncode != 0:
            say(failure(up))
            return 1
        say(up.stderr.strip().splitlines()[-1] if up.stderr.strip() else up.stdout.strip())
    node = NodeCluster.from_script()
    try:
        steps(node)
    except NodeError as exc:
        say(f"demo failed: {exc}")
        return 1
    finally:
        if started_here and not args.keep:
            say("$ make cluster-down")
            down = node_cluster.call_script("down")
            if down.returncode != 0:
                say(failure(down))
    return 0


if __name__ == "__main__":
    sys.exit(main())
