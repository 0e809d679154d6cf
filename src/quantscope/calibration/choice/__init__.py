"""Choosing ranges and formats by the model's output rather than one tensor at a time: automatic
per-layer observer choice, sensitivity and fallback curves, importance weights, per-layer choice
and SmoothQuant-style smoothing.
"""
