"""The verdict on a `DisaggDeployment` spec: the refusal chain, its policies, and the compatibility report.

`policy` says what a policy is and evaluates a chain; one module per thing the policies check (`topology`,
`handshake`, `engine_release`, `engine_args`, `pods`, `reference_engine`); `chain` orders them into
`COMPATIBILITY_CHAIN` and `REFUSAL_CHAIN`; `compat` runs the chain and predicts the compatibility hashes
(`evaluate`). Pure: no Kubernetes client, no kopf (the import contracts in pyproject.toml say so).
"""
