"""vLLM in containers on the node: examples/vllm-cpu-pp2.yaml as a user applies it, with the engine image the
project builds (`make image-vllm`). Marker node_vllm (`make test-node-vllm` runs it alone); `make test` and
`make test-node` run it with the rest of the node suite, on the same node (about 4 minutes)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest

from disagg.rig import demo_vllm_node, node_cluster
from disagg.rig.demo_serving import REFERENCE_SAMPLE
from disagg.rig.node_cluster import NodeCluster, pod_ready

# The first test's clock covers the fixture: the push of a 1.2 GB image, the chart and the sample (about 4
# minutes here). Its own wait ends first, so a sample that never serves fails with the node's diagnosis.
pytestmark = [pytest.mark.node_vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def served(node: NodeCluster) -> Iterator[demo_vllm_node.Served]:
    # The node's two cores to the vLLM engines: the reference sample of the tests before goes first.
    node.kubectl("delete", "-f", str(REFERENCE_SAMPLE), "--ignore-not-found", "--wait=true", timeout=300)
    try:
        yield demo_vllm_node.run(node, print, timeout_s=600)
    finally:
        node.kubectl("delete", "-f", str(demo_vllm_node.SAMPLE), "--ignore-not-found", check=False)


def test_the_engines_run_the_pushed_vllm_image_in_containers(
    node: NodeCluster, served: demo_vllm_node.Served
) -> None:
    version = node_cluster.image_version()
    pods = node.pods("default", f"disagg.io/deployment={served.name}")
    tasks = node.ctr("tasks", "ls").stdout
    engines = 0
    for pod in pods:
        assert pod_ready(pod) and pod["spec"]["nodeName"] == node.node, pod["metadata"]["name"]
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network("10.244.0.0/24")
        for status in pod["status"]["containerStatuses"]:
            cid = status["containerID"].removeprefix("containerd://")
            assert f"{cid} " in tasks and "running" in status["state"], (pod["metadata"]["name"], status)
            if status["name"] == "engine":
                engines += 1
                # The sample's ghcr.io name, pulled through the node's mirror of ghcr.io.
                assert status["image"] == f"ghcr.io/disagg/disagg-vllm:{version}", status
    assert engines == 3


def test_stage_1_finds_stage_0_by_its_dns_name(served: demo_vllm_node.Served) -> None:
    # A name, not an address: the kubelet's resolver (cluster DNS) answers it inside the container.
    assert served.stage_0_dns == f"{served.name}-prefill-0-0.{served.name}-prefill-0.default.svc"
    assert served.stage_1.endswith("-1")


def test_curl_of_the_router_service_equals_the_decoder_alone(served: demo_vllm_node.Served) -> None:
    print(f"through the router's Service: {served.through_router!r}\ndecoder alone: {served.alone!r}")
    assert served.through_router and served.through_router == served.again == served.alone
    # The decoder took the second request's prompt KV from the PP2 prefill: not the decoder computing alone.
    assert served.external_tokens > 0
