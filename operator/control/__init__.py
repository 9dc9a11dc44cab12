"""The operator's I/O: the kopf handlers, the reconcile steps, the status refresh queue, the admission
webhook, the API server calls (server-side apply, `k8s_apply`) and their backoffs.

The only room that imports kopf or the Kubernetes client; everything it decides it asks the pure rooms below
(`policies` for the verdict, `builders` for the desired children, `status` for the status).
"""
