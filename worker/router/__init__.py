"""The router: one OpenAI-compatible endpoint per DisaggDeployment, speaking vLLM's push P/D protocol.

- `protocol`: the two legs' bodies, the prefill answer's check, the error JSON (pure).
- `balance`: which routable pair takes a request, by load (pure; its docstring is the policy).
- `discovery`: the deployment's engine pods, listed then watched through the API server.
- `app`: the aiohttp server and the two-leg request path.
- `metrics`: what `/metrics` serves, and the clock each request's latencies are measured by.
- `cli`: `disagg router run`.

It ships in the light image: it imports the pure core (`disagg.worker.kv`) and the contracts
(`disagg.worker.contracts`: pairing, pod contract, `kv_transfer_params`) and nothing of the data path, the
engine link, the sidecar or torch/NIXL (an import contract in pyproject.toml says so).
"""
