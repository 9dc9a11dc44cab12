"""`make demo-vllm` as a test: real vLLM engines under the operator on a private control plane, every
container a process; curl of the router's Service equals the monolithic run, and a decoder restarted on
bfloat16 is excluded because its dtype differs, then serves again once it runs as generated."""

from __future__ import annotations

import pytest

from disagg.rig import demo_vllm
from disagg.rig.control_plane import call_script, script_failure

pytestmark = pytest.mark.cluster


def test_the_vllm_demo_serves_through_the_router_and_names_a_skewed_decoders_dtype() -> None:
    install = call_script("install")
    if install.returncode != 0:
        pytest.fail(script_failure(install), pytrace=False)
    lines: list[str] = []
    code = demo_vllm.run_demo(lines.append, timeout_s=420.0, keep=False)
    output = "\n".join(lines)
    # Why it failed first: the pods' logs that follow can be longer than the message shows.
    failed = [line for line in lines if line.startswith("demo failed")]
    assert code == 0, "\n".join([*failed, output[-5000:]])
    assert "    identical, token for token" in lines
    assert "the engines differ in the KV dtype" in output
    assert "    served again, identical to the monolithic run" in lines
