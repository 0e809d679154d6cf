"""What the runtime runs, as opposed to the layers one by one: fused projections that share a
scale, mixture-of-experts expert layers, and the KV cache's scales.
"""
