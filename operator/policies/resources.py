"""What the operator generates for an engine container whose role's spec requests no CPU or memory, and why:
a note of the compatibility report (`disagg check` prints it), not a refusal.

The operator writes a role's `resources` as given and adds nothing of its own (but the RDMA and huge-page
resources the KV transfer needs): what an engine needs depends on the model, the hardware and the engine's
build, which the spec does not say. An engine container without requests makes a BestEffort pod: the
scheduler counts neither its cores nor its memory, so engines can land on one node's same cores. On CPU
that costs more than sharing: vLLM's NIXL worker moves each engine's forward pass to the last core of each
NUMA node (docs/real-vllm.md), so engines that share a node compute on one core.
"""

from __future__ import annotations

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.api.spec import Resources

CPU_BACKENDS = frozenset({"CPU_ATTN"})


def _lacks(resources: Resources | None, on_cpu: bool) -> bool:
    """Whether the role's engine container would get nothing the scheduler counts: no resources at all, or,
    for an engine on CPU, where the CPU and memory are the accelerator, no cpu and memory requests."""
    if resources is None or not resources.sections():
        return True
    requests = resources.requests or {}
    return on_cpu and not ("cpu" in requests and "memory" in requests)


def resources_note(spec: DisaggDeploymentSpec) -> str | None:
    """The note for the roles whose engine containers the scheduler would place without counting what they
    need (`_lacks`); None when every role says it."""
    on_cpu = spec.engine.attention_backend in CPU_BACKENDS
    bare = [
        name
        for name, role in (("prefill", spec.prefill), ("decode", spec.decode))
        if _lacks(role.resources, on_cpu)
    ]
    if not bare:
        return None
    fields = " and ".join(f"spec.{name}.resources" for name in bare)
    note = (
        f"{fields} request no cpu and memory: the operator writes only what the spec gives into those engine "
        "containers and guesses nothing, since what an engine needs depends on the model and the node "
        "(without requests a pod is BestEffort: the scheduler counts neither, and engines can share a "
        "node's cores)"
    )
    if on_cpu:
        note += (
            ". On CPU request per engine a core for the forward pass plus one for NIXL's progress thread "
            "(cpu: 2) below its limit, so the pod stays in the shared CPU pool (vLLM moves the forward pass "
            "to the last core of each NUMA node, which an exclusive cpuset refuses), memory for the weights "
            "plus VLLM_CPU_KVCACHE_SPACE, and place one engine per NUMA node (docs/real-vllm.md)"
        )
    return note
