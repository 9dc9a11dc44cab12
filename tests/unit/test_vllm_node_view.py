"""The rig's engines each see a NUMA node of their own core (`vllm_node.own_node_view`): vLLM's NIXL worker
on CPU moves its forward pass to the last `cpuN` entry of each node it finds there, which on the shared
machine was one core for every engine. Run for real: a process started with the prefix lists the node."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from disagg.rig.vllm_node import SYS_NODE, own_node_view


@pytest.mark.skipif(os.geteuid() != 0 or not SYS_NODE.exists(), reason="needs root and a NUMA sysfs")
def test_an_engine_sees_only_its_own_core_in_its_numa_node_and_the_real_node_files(tmp_path: Path) -> None:
    # The first core: vLLM would move the forward pass off it to the real node's last core.
    core = min(os.sched_getaffinity(0))
    prefix = own_node_view(core, tmp_path / "view")
    assert prefix is not None
    holder = next(n for n in sorted(SYS_NODE.glob("node[0-9]*")) if (n / f"cpu{core}").exists())
    script = f"ls {holder}; cat {holder}/cpulist"
    seen = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, check=True).stdout
    entries = seen.split()
    assert [e for e in entries if e.startswith("cpu") and e[3:].isdigit()] == [f"cpu{core}"]
    # lscpu, which vLLM reads its CPU list from, crashes without the node's cpumap: it stays the real one.
    assert "cpumap" in entries and entries[-1] == (holder / "cpulist").read_text().strip()
    # This process's own view is untouched.
    assert {p.name for p in holder.glob("cpu[0-9]*")} >= {f"cpu{core}"}
