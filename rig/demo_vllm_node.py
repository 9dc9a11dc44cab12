"""`make demo-vllm-node`: the vLLM PP2 sample in containers on the real node (`hack/node.sh`).

The user's path, as written: the light image and the vLLM engine image (`make image`, `make image-vllm`)
pushed to the node's registry with `skopeo copy` (containerd mirrors ghcr.io from it), the chart installed
with `helm`, the tiny hybrid model put in the node folder the sample's `spec.model.volume` names, and
`kubectl apply -f examples/vllm-cpu-pp2.yaml`. The kubelet pulls `disagg-vllm` and runs every engine in a
container: a PP2 prefill (stage 1 headless, finding stage 0 by its DNS name) that pushes its KV by layer name
into a PP1 decoder over NIXL, and the router in front. Then a `curl` of the router's Service, compared with
the decoder alone (no `kv_transfer_params`: the monolithic run of the same prompt on the same engine).

Nothing here plays a part of the cluster; every step is printed with how long it took.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from disagg.rig import node_cluster
from disagg.rig.demo_serving import curl_command, sse_text
from disagg.rig.local import REPO
from disagg.rig.node_cluster import NodeCluster, NodeError

SAMPLE: Final = REPO / "examples" / "vllm-cpu-pp2.yaml"
# The sample's model: hack/vllm/tiny_model.py's hybrid of rig.vllm_engines.SHAPES["hybrid-5g"].
MODEL_SHAPE: Final = "hybrid-5g"
PROMPT: Final = (
    "disaggregated serving moves the kv cache from prefill to decode over nixl with layer name routing"
)
MAX_TOKENS: Final = 16
# Two prefill stages, one decoder, one router.
PODS: Final = 4
IMAGES: Final = ("disagg", "disagg-vllm")

Say = Callable[[str], None]


def sample() -> dict[str, Any]:
    import yaml

    document: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    return document


def place_model(target: Path, say: Say) -> None:
    """The tiny model, copied into the node folder the sample mounts, readable by the engine image's user
    (the model cache's weights are the owner's alone, and a link would not resolve inside the container)."""
    from disagg.rig.vllm_engines import tiny_model

    source = tiny_model(MODEL_SHAPE)

    def digest(folder: Path) -> str:
        files = sorted(f for f in folder.iterdir() if f.is_file()) if folder.is_dir() else []
        return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()

    if digest(target) == digest(source):
        return
    say(f"==> The model: {source} copied to {target} (hack/vllm/tiny_model.py {MODEL_SHAPE})")
    if target.is_symlink() or target.is_file():
        target.unlink()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, mode=0o755)
    for folder in (target, *target.parents):
        if folder == Path("/"):
            break
        os.chmod(folder, os.stat(folder).st_mode | 0o005)
    for f in source.iterdir():
        shutil.copyfile(f, target / f.name)
        os.chmod(target / f.name, 0o644)


@contextmanager
def timed(say: Say, what: str) -> Iterator[None]:
    start = time.monotonic()
    yield
    say(f"    ({what}: {time.monotonic() - start:.0f} s)")


def show(node: NodeCluster, say: Say, *args: str) -> str:
    say("$ kubectl " + " ".join(args))
    out = node.kubectl(*args).stdout.rstrip()
    say(out)
    return out


def install(node: NodeCluster, version: str, say: Say) -> None:
    """Both images pushed to the node's registry, the chart installed, the operator's pod Ready."""
    for image in IMAGES:
        say(f"$ skopeo copy oci:build/images/{image}:{version} docker://{node.image_ref(image, version)}")
    node_cluster.push_images(node, version, IMAGES)
    namespace = node_cluster.OPERATOR_NAMESPACE
    say(f"$ helm upgrade --install {node_cluster.RELEASE} charts/disagg -n {namespace} --create-namespace")
    node_cluster.helm_install(node)
    node_cluster.wait_operator(node)


def pods_of(node: NodeCluster, name: str, role: str) -> list[dict[str, Any]]:
    pods = node.pods("default", f"disagg.io/deployment={name},disagg.io/role={role}")
    return sorted(pods, key=lambda p: str(p["metadata"]["name"]))


def stage_peer(node: NodeCluster, name: str) -> tuple[str, str]:
    """(stage 1's pod, the DNS name it reaches stage 0 by): its engine's `--master-addr`."""
    stage_1 = pods_of(node, name, "prefill")[1]
    engine = next(c for c in stage_1["spec"]["containers"] if c["name"] == "engine")
    args = list(engine.get("args") or [])
    return stage_1["metadata"]["name"], args[args.index("--master-addr") + 1]


def completion(url: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    proc = subprocess.run(curl_command(url, body), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NodeError(f"curl {url} exited {proc.returncode}: {proc.stderr} {proc.stdout[-1000:]}")
    return sse_text(proc.stdout)


def decoder_url(node: NodeCluster, name: str) -> str:
    decoder = pods_of(node, name, "decode")[0]
    return f"http://{decoder['status']['podIP']}:8000/v1/completions"


def external_prompt_tokens(node: NodeCluster, name: str) -> float:
    """The prompt tokens the decoder took as KV from the prefill engine (its own counter)."""
    from disagg.rig.vllm_engines import metric

    decoder = pods_of(node, name, "decode")[0]
    url = f"http://{decoder['status']['podIP']}:8000/metrics"
    command = ["curl", "-sS", "--max-time", "30", url]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NodeError(f"curl {url} exited {proc.returncode}: {proc.stderr}")
    return metric(proc.stdout, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


@dataclass(frozen=True)
class Served:
    name: str
    through_router: str
    again: str
    alone: str
    # The prompt tokens the decoder took from the prefill engine for the second request through the router.
    external_tokens: float
    stage_1: str
    stage_0_dns: str


def run(node: NodeCluster, say: Say, timeout_s: float) -> Served:
    """The whole path: the text through the router's Service and the decoder alone's, and what shows the KV
    came from the PP2 prefill."""
    version = node_cluster.image_version()
    document = sample()
    model = str(document["spec"]["model"]["name"])
    place_model(Path(model), say)
    say(f"==> Pushing the light and the vLLM images to the node's registry, installing the chart ({version})")
    with timed(say, "push and install"):
        install(node, version, say)
    say(f"==> Applying {SAMPLE.relative_to(REPO)}: vLLM 0.32.0 in containers, PP2 prefill -> PP1 decode")
    say(f"$ kubectl apply -f {SAMPLE.relative_to(REPO)}")
    with timed(say, "apply to Routable, Available, every pod Ready"):
        name = node_cluster.apply_sample(node, SAMPLE, PODS, timeout_s)
    show(node, say, "get", "disagg", name)
    show(node, say, "get", "pods", "-l", f"disagg.io/deployment={name}", "-o", "wide")
    stage_1, master = stage_peer(node, name)
    say(f"==> Stage 1 ({stage_1}) joins stage 0 by its DNS name: --master-addr {master} --headless")
    say("==> A request through the router's Service (the router canaries the new pair first)")
    with timed(say, "the first request"):
        through_router = completion(node_cluster.router_url(node, name), model)
    # The counter also holds the canary's prompt: the second request's share of it is this request's alone.
    before = external_prompt_tokens(node, name)
    again = completion(node_cluster.router_url(node, name), model)
    external = external_prompt_tokens(node, name) - before
    same = "the same text" if again == through_router else f"ANOTHER TEXT: {again!r}"
    say(f"==> The same request again: {same}; the decoder's")
    say(f"    vllm:prompt_tokens_by_source_total{{source=external_kv_transfer}} rose by {external:.0f}")
    say("==> The monolithic run: the same request to the decoder alone (no kv_transfer_params)")
    alone = completion(decoder_url(node, name), model)
    say(f"    through the router: {through_router!r}")
    say(f"    decoder alone:      {alone!r}")
    return Served(name, through_router, again, alone, external, stage_1, master)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.rig.demo_vllm_node", description=__doc__)
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds to wait for the sample.")
    parser.add_argument("--keep", action="store_true", help="Leave the node up with the sample applied.")
    args = parser.parse_args(argv)

    with node_cluster.exclusive():
        return _demo(timeout_s=args.timeout, keep=args.keep)


def _demo(*, timeout_s: float, keep: bool) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    started_here = node_cluster.call_script("status").returncode != 0
    if started_here:
        say("==> Bringing the node up (hack/node.sh up)")
        up = node_cluster.call_script("up")
        if up.returncode != 0:
            say(node_cluster.failure(up))
            return 1
    start = time.monotonic()
    try:
        node = NodeCluster.from_script()
        served = run(node, say, timeout_s)
        if not served.through_router or served.through_router != served.alone or served.again != served.alone:
            say("FAILED: the text through the router differs from the decoder alone")
            return 1
        if served.external_tokens <= 0:
            say("FAILED: the decoder took no prompt token's KV from the prefill engine")
            return 1
        say(f"==> Done in {time.monotonic() - start:.0f} s: identical, token for token")
        return 0
    except NodeError as exc:
        say(f"FAILED: {exc}")
        return 1
    finally:
        if not keep:
            node = NodeCluster.from_script()
            node.kubectl("delete", "-f", str(SAMPLE), "--ignore-not-found", "--wait=false", check=False)
            if started_here:
                say("==> Taking the node down (hack/node.sh down)")
                node_cluster.call_script("down")


if __name__ == "__main__":
    sys.exit(main())
