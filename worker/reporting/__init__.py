"""What the sidecar learns about its peers and tells Kubernetes: peer handshakes, the Pod condition, Events.

`watch` is the sidecar of an engine that moves its own KV (vLLM): it reports and moves no data.
"""
