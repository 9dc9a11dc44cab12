"""The worker's contracts that cross a process boundary, each typed once for both of its sides. Pure.

- `topology`: the topology document the operator writes and every sidecar reads;
- `pod_contract`: the labels, annotations, environment variables and ports the operator's builders put on an
  engine pod and the worker reads back; `engine_pods`: an engine Pod read back from the API server;
- `peer_report`: the peer report annotation a sidecar writes on its Pod;
- `pairing`: which prefill engine is routable to which decode pod, shared by the router and the operator;
- `releases`: the supported vLLM releases, one row each; `payload_facts`: what a peer's handshake payload
  shows about the engine that sent it;
- `kv_transfer_params`: vLLM's push `kv_transfer_params`, which the router writes and reads and the reference
  engine reads and writes.

Like the core (`disagg.worker.kv`), which is all they import of the project, nothing here imports torch, NIXL
or an I/O stack, so the router (light image) and the operator read the same contracts the sidecars do.
"""
