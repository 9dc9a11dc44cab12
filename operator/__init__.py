"""disagg operator: the DisaggDeployment API, pre-flight compatibility, manifest builders and kopf handlers.

Never imports torch or nixl: the operator image stays small and starts fast.
"""
