"""disagg worker: the KV-transfer side of an engine pod, in the order the data flows through it.

- `kv`: the pure core (layout, wire format, layer-name routing, rules, decode checks, errors, the pod
  contract). No torch, NIXL, I/O or clock; the only part of the worker the operator may import.
- `connector`: the NIXL push connector (transport, side channel, KV pool, producer and consumer).
- `sidecar`: the process injected into every engine pod, which runs the connector for its engine.
- `reporting`: peer handshakes and what the sidecar writes to Kubernetes (Pod condition, Events), and the
  watch sidecar for engines that carry their own connector.
- `engine`: the small reference engine that proves the data path end to end.
- `cli`: the worker's `disagg` subcommands.

The worker never imports kopf or `disagg.operator`; the import contracts in pyproject.toml say so and
`make lint` checks them.
"""
