"""The control-plane half of `make demo`: the operator on a real Kubernetes 1.20 API server, start to finish.

`python -m disagg.rig.demo_cluster` starts a private control plane (its own state folder and ports, so it
never touches one that tests share), runs `disagg operator run` with its admission webhook, applies the valid
sample and plays kubelet for its pods (each pod's KV sidecar runs as a local process with the pod's identity,
handshakes its peers and writes its Pod condition), shows `kubectl get disagg` until Compatible, KV and Ready
are all True, then applies a broken sample and shows the webhook refuse it with its reason. Each step says
what it does. Whatever happens (an error, Ctrl-C, SIGTERM), everything it started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from disagg.rig import local
from disagg.rig.control_plane import SCRIPT, Paths, call_script
from disagg.rig.local import REPO, free_port
from disagg.worker.contracts.pod_contract import POD_CONDITION, ROLE_LABEL

CRD = REPO / "crds" / "disagg.io_disaggdeployments.yaml"
VALID_SAMPLE = REPO / "examples" / "pp2-hma.yaml"
BROKEN_SAMPLE = REPO / "examples" / "bad-version-mismatch.yaml"
WEBHOOK_CONFIGURATION = "demo.validate.disagg.io"
NAMESPACE = "default"
T = TypeVar("T")
Say = Callable[[str], None]


class DemoFailed(Exception):
    """A step that did not do what it should; the message says which and shows what was seen."""


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
    return local.wait_for(what, probe, timeout_s, interval_s=0.5, error=DemoFailed)


@dataclass(frozen=True)
class ControlPlane:
    """A private control plane: `hack/control-plane.sh` with its own state folder and ports."""

    env: dict[str, str]
    kubeconfig: Path
    bin_dir: Path

    @classmethod
    def private(cls, state: Path) -> ControlPlane:
        env = {
            **os.environ,
            "DISAGG_STATE": str(state),
            "DISAGG_ETCD_PORT": str(free_port()),
            "DISAGG_ETCD_PEER_PORT": str(free_port()),
            "DISAGG_APISERVER_PORT": str(free_port()),
            # The CRD before the controller manager starts, so its garbage collector knows the kind at once.
            "DISAGG_PRE_APPLY": str(CRD),
        }
        paths = Paths.from_script(env)
        return cls(env, paths.kubeconfig, paths.bin_dir)

    def script(self, *args: str) -> subprocess.CompletedProcess[str]:
        return call_script(*args, env=self.env)

    def kubectl_env(self) -> dict[str, str]:
        return {**self.env, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{self.env['PATH']}"}


class Demo:
    def __init__(self, workdir: Path, say: Say) -> None:
        self.workdir = workdir
        self.say = say
        self.control_plane = ControlPlane.private(workdir / "control-plane")
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_log = workdir / "operator.log"
        self.kubelet: Any = None
        self.serving: list[Any] = []
        """The reference deployment's kubelet, kube-proxy stand-in and their loop, once started."""
        self.started_control_plane = False

    # -- steps -----------------------------------------------------------------------------------------------

    def start_control_plane(self) -> None:
        self.say("==> Starting a private Kubernetes v1.20.2 control plane on 127.0.0.1")
        self.say(
            "    (etcd, kube-apiserver, kube-controller-manager; no kubelet, no scheduler; the CRD applied)"
        )
        self.started_control_plane = True
        # The script's own progress lines, as they come: the first run on a machine builds for minutes.
        with subprocess.Popen(
            ["bash", str(SCRIPT), "start"],
            env=self.control_plane.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as started:
            assert started.stderr is not None
            for line in started.stderr:
                self.say(f"    {line.rstrip()}")
        if started.returncode != 0:
            raise DemoFailed(f"hack/control-plane.sh start exited with {started.returncode}")

    def start_operator(self) -> None:
        webhook_port, health_port = free_port(), free_port()
        self.say("==> Starting the operator: disagg operator run --namespace default --webhook-dev")
        command = [
            sys.executable,
            "-m",
            "disagg.operator.cli.main",
            "operator",
            "run",
            "--namespace",
            NAMESPACE,
            "--webhook-port",
            str(webhook_port),
            "--webhook-dev",
            "--webhook-configuration",
            WEBHOOK_CONFIGURATION,
            "--health-port",
            str(health_port),
            "--log-level",
            "warning",
        ]
        env = {**self.control_plane.kubectl_env(), "PYTHONSAFEPATH": "1"}
        with self.operator_log.open("ab") as log:
            self.operator = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/"
            )

        def healthy() -> bool:
            assert self.operator is not None
            if self.operator.poll() is not None:
                raise DemoFailed(
                    f"the operator exited with {self.operator.returncode}:\n{self.operator_tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=1) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        wait_for("the operator's /healthz", healthy, timeout_s=60)
        wait_for(
            "the admission webhook's registration",
            lambda: (
                self.kubectl("get", "validatingwebhookconfiguration", WEBHOOK_CONFIGURATION).returncode == 0
            ),
            timeout_s=60,
        )
        self.say(f"    operator healthy; its validating webhook {WEBHOOK_CONFIGURATION} is registered")

    def apply_valid_sample(self) -> None:
        self.show("kubectl", "apply", "-f", str(VALID_SAMPLE.relative_to(REPO)), cwd=REPO, check=True)

    def run_pods_until_ready(self, timeout_s: float) -> None:
        from kubernetes import config

        from disagg.rig.local_kubelet import LocalKubelet

        self.say(
            "==> Playing kubelet for the operator's pods (there is none here): each pod is bound, gets its"
        )
        self.say(
            "    own loopback IP and runs its KV sidecar as a local process with the pod's identity; the"
        )
        self.say(f"    sidecars handshake their peers and write the {POD_CONDITION} Pod condition")
        name = self._sample_name(VALID_SAMPLE)
        api = config.new_client_from_config(config_file=str(self.control_plane.kubeconfig))  # type: ignore[no-untyped-call]
        self.kubelet = LocalKubelet(
            api, self.control_plane.kubeconfig, NAMESPACE, name, self.workdir / "pods"
        )
        self.watch_until(name, ("True", "True", "True"), "Compatible, KV and Ready to turn True", timeout_s)
        self.show("kubectl", "get", "pods", "-o", "wide")
        self.show(
            "kubectl",
            "get",
            "pods",
            "-o",
            "custom-columns=POD:.metadata.name,KV-TRANSFER-READY:"
            f'.status.conditions[?(@.type=="{POD_CONDITION}")].message',
        )

    def break_and_fix_a_decoder(self, timeout_s: float) -> None:
        """What only the sidecars can see: a pod whose engine differs from the spec (a stale image)."""
        import yaml

        from disagg.operator.api import DisaggDeploymentSpec
        from disagg.operator.policies.compat import role_factors
        from disagg.rig.local_kubelet import with_engine_hash
        from disagg.worker.kv import wire

        name = self._sample_name(VALID_SAMPLE)
        spec = DisaggDeploymentSpec.model_validate(yaml.safe_load(VALID_SAMPLE.read_text())["spec"])
        decoders = self.kubectl("get", "pods", "-l", f"{ROLE_LABEL}=decode", "-o", "name").stdout.split()
        decoder = sorted(decoders)[0].removeprefix("pod/")
        stale = wire.compat_hash({**role_factors(spec, "decode"), "vllm_version": "0.13.0"})
        self.say(f"==> Restarting decode pod {decoder} on engine 0.13.0 (a stale image the spec cannot see)")
        self.kubelet.restart(decoder, with_engine_hash("decode", stale))
        self.watch_until(name, ("True", "False", "False"), "KV to turn False", timeout_s)
        self.show_kv_condition(name)
        self.show(
            "kubectl",
            "get",
            "events",
            "--field-selector",
            f"involvedObject.name={decoder},type=Warning",
            "-o",
            "custom-columns=REASON:.reason,COUNT:.count,MESSAGE:.message",
        )
        self.say(f"==> Restarting decode pod {decoder} on the right engine version")
        self.kubelet.restart(decoder)
        self.watch_until(name, ("True", "True", "True"), "KV and Ready to turn True again", timeout_s)
        self.show_kv_condition(name)

    def apply_broken_sample(self) -> None:
        self.say(f"==> Applying a broken sample: {BROKEN_SAMPLE.name} (decode runs another engine version)")
        refused = self.show("kubectl", "apply", "-f", str(BROKEN_SAMPLE.relative_to(REPO)), cwd=REPO)
        if refused.returncode == 0:
            raise DemoFailed("the broken sample was admitted; the webhook should have refused it")
        if "denied the request" not in refused.stderr:
            raise DemoFailed(f"kubectl failed for another reason than the webhook:\n{refused.stderr}")
        self.say("    refused at admission: nothing was created")
        self.show("kubectl", "get", "disagg")

    def watch_until(self, name: str, columns: tuple[str, str, str], what: str, timeout_s: float) -> None:
        """Play kubelet, printing `kubectl get disagg` when it changes, until Compatible/KV/Ready read so."""
        self.say("$ kubectl get disagg   (again each time a column other than AGE changes)")
        shown: list[list[str]] = []

        def reached() -> bool:
            self.kubelet.sync()
            table = self.kubectl("get", "disagg", name).stdout.rstrip()
            row = table.splitlines()[-1].split() if table else []
            if row[:-1] and (not shown or row[:-1] != shown[-1]):
                self.say(table)
                shown.append(row[:-1])
            return tuple(row[1:4]) == columns

        wait_for(what, reached, timeout_s=timeout_s)

    def show_kv_condition(self, name: str) -> None:
        condition = '{.status.conditions[?(@.type=="KVTransferReady")]'
        self.show(
            "kubectl",
            "get",
            "disagg",
            name,
            "-o",
            f'jsonpath=KVTransferReady={condition}.status}} reason={condition}.reason}}{{"\\n"}}'
            f"{condition}.message}}",
        )

    def serve_requests(self, timeout_s: float) -> None:
        from kubernetes import config

        from disagg.rig.demo_serving import Serving
        from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet
        from disagg.rig.service_proxy import ServiceProxy

        first = self._sample_name(VALID_SAMPLE)
        self.say(f"==> Deleting {first}: its sidecars stop, its children go with it (owner references)")
        self.kubelet.stop_all()
        self.show("kubectl", "delete", "disagg", first, "--wait=false")
        serving = Serving(self, wait_for, DemoFailed)
        api = config.new_client_from_config(config_file=str(self.control_plane.kubeconfig))  # type: ignore[no-untyped-call]
        kubelet = LocalKubelet(
            api, self.control_plane.kubeconfig, NAMESPACE, serving.name(), self.workdir / "serving"
        )
        proxy = ServiceProxy(api, NAMESPACE)
        loop = KubeletLoop([kubelet.sync, proxy.sync]).start()
        self.serving = [loop, proxy, kubelet]
        serving.run(kubelet, loop, timeout_s)

    # -- teardown --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Everything this run started, newest first; each step runs even if an earlier one failed."""
        if self.serving:
            self.say("==> Stopping the served deployment's processes and the kube-proxy stand-in")
            loop, proxy, kubelet = self.serving
            with contextlib.suppress(Exception):
                loop.stop()  # its error, if any, was reported where it stopped the demo
            proxy.close()
            kubelet.stop_all()
            kubelet.api.close()
        if self.kubelet is not None:
            self.say("==> Stopping the local sidecars")
            self.kubelet.stop_all()
            self.kubelet.api.close()
        if self.operator is not None and self.operator.poll() is None:
            self.say("==> Stopping the operator")
            self.operator.send_signal(signal.SIGTERM)
            try:
                self.operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(timeout=30)
        if self.started_control_plane:
            self.say("==> Stopping the control plane")
            self.control_plane.script("teardown")

    # -- helpers ---------------------------------------------------------------------------------------------

    def kubectl(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.control_plane.bin_dir / "kubectl"), *args],
            env=self.control_plane.kubectl_env(),
            capture_output=True,
            text=True,
            check=False,
            cwd=cwd,
        )

    def show(
        self, *command: str, cwd: Path | None = None, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run a kubectl command and print it with its output, as a person at a terminal would see it."""
        self.say("$ " + " ".join(command))
        result = self.kubectl(*command[1:], cwd=cwd)
        for line in (result.stdout + result.stderr).rstrip().splitlines():
            self.say(line)
        if check and result.returncode != 0:
            raise DemoFailed(f"{' '.join(command)} exited with {result.returncode}")
        return result

    def operator_tail(self, lines: int = 30) -> str:
        if not self.operator_log.exists():
            return ""
        return "\n".join(self.operator_log.read_text(errors="replace").splitlines()[-lines:])

    @staticmethod
    def _sample_name(path: Path) -> str:
        import yaml

        name: str = yaml.safe_load(path.read_text())["metadata"]["name"]
        return name


@contextlib.contextmanager
def _signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the cleanup in `finally` always runs; once unwinding, a
    repeated signal (a process group signalled twice) must not interrupt the cleanup itself."""

    def raise_exit(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_steps(say: Say, steps: Callable[[Demo], str], *, keep: bool, prefix: str) -> int:
    """Run `steps` (which return what they showed) on a fresh `Demo`; whatever happens, stop everything it
    started. 0 when they showed it, 1 (with the logs) when a step failed, 130 when interrupted."""
    from disagg.rig.local_kubelet import SidecarExited

    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    demo = Demo(workdir, say)
    with _signals_as_exit():
        try:
            say(steps(demo))
            return 0
        except (DemoFailed, SidecarExited) as exc:
            say(f"demo failed: {exc}")
            for kubelet in [demo.kubelet, *demo.serving[2:]]:
                for pod in sorted(kubelet.pods) if kubelet is not None else ():
                    say(f"--- logs of {pod}\n{kubelet.log_tail(pod, 10)}")
            say(f"--- operator log\n{demo.operator_tail()}")
            return 1
        except KeyboardInterrupt:
            say("demo interrupted")
            return 130
        finally:
            demo.stop()
            if keep:
                say(f"logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def run_demo(say: Say, *, timeout_s: float, keep: bool) -> int:
    def steps(demo: Demo) -> str:
        demo.start_control_plane()
        demo.start_operator()
        demo.apply_valid_sample()
        demo.run_pods_until_ready(timeout_s)
        demo.break_and_fix_a_decoder(timeout_s)
        demo.apply_broken_sample()
        demo.serve_requests(timeout_s)
        return (
            "==> Done: the valid sample reached Compatible, KV and Ready; the sidecars caught a stale "
            "decoder and cleared it once fixed; the broken sample was refused at admission; the "
            "reference deployment served curl through its router, identical to the monolithic run, and "
            "kept serving through the healthy pair while a skewed decoder was excluded"
        )

    return run_steps(say, steps, keep=keep, prefix="disagg-demo-cluster-")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.rig.demo_cluster", description=__doc__)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="Seconds to wait for the sample to be Ready."
    )
    parser.add_argument("--keep-logs", action="store_true", help="Keep the operator and sidecar logs.")
    args = parser.parse_args(argv)
    return run_demo(lambda line: print(line, flush=True), timeout_s=args.timeout, keep=args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
