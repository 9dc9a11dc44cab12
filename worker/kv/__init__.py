"""The pure core, the KV math: layout and HMA grouping, vLLM's wire format, layer-name routing, the
connector's rules, the checks a prefill rank runs on a decoder, and typed errors.

Nothing here imports torch or NIXL, does I/O or reads a clock, or imports another disagg package, so the
operator can run the same rules and build the same layouts before any pod exists. The contracts that cross a
process boundary (topology, pod contract, peer reports, pairing, releases) are `disagg.worker.contracts`.
"""
