"""The pure core: KV layout, vLLM's wire format, layer-name routing, rules, decode checks, typed errors,
the pod contract, peer reports and the pairing of prefill engines with decode pods.

Nothing here imports torch or NIXL, does I/O or reads a clock, so the operator can run the same rules and
build the same layouts before any pod exists.
"""
