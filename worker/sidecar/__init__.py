"""The transfer sidecar of an engine pod: the process that owns the NIXL agent and moves its engine's KV.

- `config`: the sidecar's configuration (environment and topology file);
- `engine_socket`: the Unix socket that serves the engine protocol (`disagg.worker.link.engine_link`);
- `layout_checks`: the engine's registration and requests checked against the configuration (no I/O);
- `republisher`: the serving worker's side channel answers for the engine's other workers;
- `metrics`: health, readiness and Prometheus; `logs`: one JSON object per line;
- `transfer`: the orchestrator (`Sidecar`), whose main thread owns the NIXL agent and runs the connector.

`python -m disagg.worker.cli.transfer` (or `disagg worker sidecar`) runs it, with a reporter to its Pod.
"""
