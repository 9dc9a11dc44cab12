"""The request path of `make demo`: a reference-engine DisaggDeployment served through its router's Service.

After the control-plane demo's checks, `Serving` applies `examples/reference-pp2-hma.yaml` (a PP2 prefill
with HMA and two decoders of the project's reference engine), plays kubelet for its pods with every container
a real process (`disagg engine serve`, the transfer sidecars, `disagg router run`), stands in for kube-proxy
so the router's ClusterIP answers, and sends what a person would: `curl` of `/v1/completions`, streamed, to
the Service's address. The text must equal the monolithic run's token for token. Then one decoder is
restarted with another engine version's compatibility hash: the sidecars refuse it, `kubectl get disagg`
shows its pairs excluded and why, and requests keep succeeding through the healthy pair.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from disagg.rig.local import REPO
from disagg.rig.local_serving import wait_until_served

REFERENCE_SAMPLE = REPO / "examples" / "reference-pp2-hma.yaml"
PROMPT = "Disaggregated serving moves the KV cache from prefill to decode."
MAX_TOKENS = 16
SKEWED_REQUESTS = 8
ROUTABLE = "Routable"


class Shell(Protocol):
    """What the control-plane demo gives this step: its kubectl, its output and its waiting."""

    def say(self, line: str) -> None: ...

    def kubectl(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]: ...

    def show(
        self, *command: str, cwd: Path | None = None, check: bool = False
    ) -> subprocess.CompletedProcess[str]: ...


def monolithic_text(prompt: str, max_tokens: int) -> str:
    """The reference model run whole in this process, as the engines would run it together."""
    import torch

    from disagg.worker.engine.config import TinyConfig, decode, encode
    from disagg.worker.engine.model import TinyModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        text: str = decode(TinyModel(TinyConfig()).generate(encode(prompt), max_tokens))
        return text
    finally:
        torch.set_num_threads(threads)


def sse_text(stream: str) -> str:
    """The text of a streamed completion: each `data:` event's choices' text, in order, until `[DONE]`."""
    parts: list[str] = []
    for line in stream.splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        event: dict[str, Any] = json.loads(data)
        if "error" in event:
            raise ValueError(f"the stream carried an error: {event['error']}")
        parts.extend(choice.get("text", "") for choice in event.get("choices") or ())
    return "".join(parts)


def curl_command(url: str, body: dict[str, Any]) -> list[str]:
    return [
        "curl",
        "-sS",
        "-N",
        "--fail-with-body",
        "--max-time",
        "120",
        url,
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(body, separators=(",", ":")),
    ]


class Serving:
    def __init__(self, shell: Shell, wait_for: Callable[..., Any], fail: Callable[[str], Exception]) -> None:
        self.shell = shell
        self.wait_for = wait_for
        self.fail = fail
        self.check: Callable[[], None] = lambda: None

    def name(self) -> str:
        import yaml

        name: str = yaml.safe_load(REFERENCE_SAMPLE.read_text())["metadata"]["name"]
        return name

    def model(self) -> str:
        import yaml

        model: str = yaml.safe_load(REFERENCE_SAMPLE.read_text())["spec"]["model"]["name"]
        return model

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        found = self.shell.kubectl("get", "disagg", name, "-o", "json")
        if found.returncode != 0:
            return {}
        conditions = (json.loads(found.stdout).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c.get("type") == kind), {})

    def wait_until_routable(
        self, name: str, routable: str, timeout_s: float, *, ready: bool = True, excluded_for: str = ""
    ) -> None:
        """Until PAIRS reads `routable` (e.g. "2/2") and, if `ready`, READY (`Available`) is True; printing
        the table as it changes."""
        self.shell.say("$ kubectl get disagg   (again each time a column other than AGE changes)")
        shown: list[str] = []

        def reached() -> bool:
            self.check()
            table = self.shell.kubectl("get", "disagg", name).stdout.rstrip()
            row = " ".join(table.splitlines()[-1].split()[:-1]) if table else ""
            if row and (not shown or row != shown[-1]):
                self.shell.say(table)
                shown.append(row)
            pairs = self.shell.kubectl(
                "get", "disagg", name, "-o", "jsonpath={.status.routablePairs}"
            ).stdout.strip()
            available = self.condition(name, "Available").get("status") == "True"
            why = self.condition(name, ROUTABLE).get("message") or ""
            refused = not excluded_for or f": {excluded_for}:" in why
            return pairs == routable and (available or not ready) and refused

        self.wait_for(f"{name} Ready with {routable} pairs routable", reached, timeout_s=timeout_s)

    def service_url(self, name: str) -> str:
        address = self.shell.kubectl(
            "get", "service", f"{name}-router", "-o", "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}"
        ).stdout.strip()
        if not address or address.startswith(":"):
            raise self.fail(f"the router's Service {name}-router has no address")
        url = f"http://{address}"
        try:
            wait_until_served(url, self.check)
        except AssertionError as exc:
            raise self.fail(str(exc)) from None
        return url

    def curl(self, url: str, body: dict[str, Any], *, show: bool) -> str:
        command = curl_command(url, body)
        if show:
            shown = [part if part != command[-1] else f"'{part}'" for part in command]
            self.shell.say(
                "$ "
                + " ".join(shown).replace(
                    "Content-Type: application/json", "'Content-Type: application/json'"
                )
            )
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if show:
            for line in result.stdout.rstrip().splitlines():
                self.shell.say(line)
        if result.returncode != 0:
            raise self.fail(
                f"curl exited with {result.returncode}: {result.stderr.strip()} {result.stdout[-500:]}"
            )
        return result.stdout

    # -- the step --------------------------------------------------------------------------------------------

    def run(self, kubelet: Any, loop: Any, timeout_s: float) -> None:
        """Apply the sample, serve one streamed curl through the Service, skew a decoder, keep serving.

        `kubelet` plays kubelet for the sample's pods; `loop` (a `KubeletLoop`) keeps it and the kube-proxy
        stand-in syncing meanwhile, and its `check()` raises what stopped it."""
        from disagg.rig.local_kubelet import with_engine_hash

        self.check = loop.check

        name = self.name()
        say = self.shell.say
        say(
            f"==> Serving requests: {REFERENCE_SAMPLE.name}, the project's reference engine (PP2 prefill with"
        )
        say("    HMA, two decoders, a router), every container a local process: disagg engine serve, the")
        say("    transfer sidecars (real NIXL), disagg router run; a kube-proxy stand-in serves ClusterIPs")
        self.shell.show(
            "kubectl", "apply", "-f", str(REFERENCE_SAMPLE.relative_to(REPO)), cwd=REPO, check=True
        )
        self.wait_until_routable(name, "2/2", timeout_s)
        self.shell.show("kubectl", "get", "pods", "-l", f"disagg.io/deployment={name}", "-o", "wide")
        self.shell.show("kubectl", "get", "service", f"{name}-router")
        url = self.service_url(name) + "/v1/completions"
        expected = monolithic_text(PROMPT, MAX_TOKENS)
        body = {"model": self.model(), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
        text = sse_text(self.curl(url, body, show=True))
        say(f"    streamed text:   {text!r}")
        say(f"    monolithic run:  {expected!r}")
        if text != expected:
            raise self.fail("the text through the router differs from the monolithic run")
        say("    identical, token for token")

        decoders = self.shell.kubectl(
            "get", "pods", "-l", f"disagg.io/deployment={name},disagg.io/role=decode", "-o", "name"
        ).stdout.split()
        skewed = sorted(decoders)[0].removeprefix("pod/")
        say(f"==> Restarting decode pod {skewed} on engine 0.32.0 (version skew the spec cannot see)")
        kubelet.restart(skewed, with_engine_hash("decode", self.stale_hash()))
        # One decoder of two refused: the deployment is not fully available, yet one pair serves.
        # A restarting pod is excluded at once (PodNotReady); wait until the sidecars' refusal is the reason.
        self.wait_until_routable(
            name, "1/2", timeout_s, ready=False, excluded_for="CompatibilityHashMismatch"
        )
        routable = self.condition(name, ROUTABLE)
        say(f"    Routable={routable.get('status')} reason={routable.get('reason')}")
        say(f"    {routable.get('message')}")
        say(f"==> {SKEWED_REQUESTS} more requests through the Service while {skewed} is excluded")
        for index in range(SKEWED_REQUESTS):
            prompt = f"{PROMPT} ({index})"
            got = sse_text(self.curl(url, {**body, "prompt": prompt}, show=False))
            if got != monolithic_text(prompt, MAX_TOKENS):
                raise self.fail(f"request {index} through the router differs from the monolithic run")
        say(f"    {SKEWED_REQUESTS} of {SKEWED_REQUESTS} succeeded, each identical to the monolithic run")

    def stale_hash(self) -> str:
        import yaml

        from disagg.operator.api import DisaggDeploymentSpec
        from disagg.operator.policies.compat import role_factors
        from disagg.worker.kv import wire

        spec = DisaggDeploymentSpec.model_validate(yaml.safe_load(REFERENCE_SAMPLE.read_text())["spec"])
        stale: str = wire.compat_hash({**role_factors(spec, "decode"), "vllm_version": "0.32.0"})
        return stale
