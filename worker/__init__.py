"""disagg worker: KV layout, vLLM-compatible wire format, layer-name routing, NIXL transport and the sidecar.

Pure modules (layout, wire, routing, rules) import neither torch nor nixl at module level, so the operator
can reuse them. This package never imports kopf.
"""
