"""The worker's `disagg` subcommands (`wire decode`, `compat hash`, `probe`, `worker sidecar`) and the
transfer sidecar's process entry point (`transfer`): the top layer, the only one that imports both `sidecar`
and `reporting`."""
