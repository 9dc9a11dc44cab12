"""The operator's I/O: the kopf handlers, the reconcile steps, the admission webhook, the API server calls
(server-side apply, `k8s_apply`) and their backoffs.

The only room that imports kopf or the Kubernetes client; everything it decides it asks the pure rooms below
(`policies` for the verdict, `builders` for the desired children, `status` for the status). Its queues,
stores and clock are the operator's runtime (`disagg.operator.runtime`), which knows nothing of kopf.
"""
