"""The KV worker sidecar of an engine pod: configuration, the engine's local socket, metrics and the process.

`python -m disagg.worker.sidecar.transfer` (or `disagg worker sidecar`) runs it.
"""
