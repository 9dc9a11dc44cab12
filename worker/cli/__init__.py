"""The worker's `disagg` subcommands: `wire decode`, `compat hash`, `probe` and `worker sidecar`."""
