"""The `disagg` command line (`main`) and the operator's commands: `check`, `plan` and `crd` (`check`), and
`operator run` (`operator`). The worker and the rig declare their own command modules as entry points."""
