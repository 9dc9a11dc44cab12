"""What the two-node suite's fixtures and tests share: the prompt, and the node label the stages spread on."""

from __future__ import annotations

PROMPT = "Disaggregated serving moves the KV cache from prefill to decode."
MAX_TOKENS = 16
# The node label each kubelet registers (`--node-labels disagg.io/node=<its name>`): the stages' topology key.
NODE_LABEL = "disagg.io/node"
