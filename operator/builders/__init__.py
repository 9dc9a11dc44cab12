"""Manifests for a `DisaggDeployment`, one module per kind of child: `desired = children.build(...)`. Pure.

Per prefill replica: a StatefulSet with one pod per pipeline stage (pod ordinal = PP rank, started in
parallel, `prefill`) and the headless Service that governs it (`services`). Decode: a Deployment (`decode`)
and a headless Service. A ConfigMap carries the topology plan every sidecar reads (`topology`). Every engine
pod (`pod_template`) gets the KV worker sidecar and a readiness gate on the condition the sidecar writes, and
runs as the deployment's own ServiceAccount, which a RoleBinding gives the installation's worker ClusterRole
(`worker_access`). The engine container's command, arguments and environment are `engine`'s; the router's
objects are `router`'s; what every child shares (owner metadata, security contexts, resources, the projected
API token) is `objects`'. Everything carries an owner reference to the DisaggDeployment, so deletion is
garbage collection, and only fields that exist in Kubernetes 1.20 (apps/v1, core/v1,
rbac.authorization.k8s.io/v1). `disagg plan` builds the same objects from a file, which has no uid yet: then
the owner reference is left out (the operator adds it).

The builders import no Kubernetes client and no kopf (the import contracts in pyproject.toml say so): they
turn a spec into dicts, and the control room applies them.
"""
