"""What an engine and its sidecar share inside one pod, below both: the engine protocol and the KV pool.

- `engine_link`: the engine protocol over the pod's Unix socket (msgspec messages, framing, the engine's
  client), both ends in one module so they change together;
- `kv_pool`: the KV pool, one flat byte buffer over a shared-memory file that both processes map.

The reference engine imports this and nothing of the sidecar or the connector; the sidecar serves the
protocol (`sidecar.engine_socket`) and registers the pool with NIXL.
"""
