"""The operator's own controller runtime: a deduplicating work queue (`work_queue`), stores of watched objects
by owner (`stores`), those objects frozen into shared tuples (`frozen`) and a clock of scheduled steps per key
(`ticker`). Like controller-runtime beside a Kubernetes controller, it knows nothing of disagg, kopf or the
Kubernetes client: it imports nothing of the project, so it can be read, tested and replaced on its own.
"""
