"""clipless: differentially private deep learning without per-sample gradient clipping.

Lipschitz-constrained layers (:mod:`clipless.nn`) whose per-layer gradient sensitivity is bounded
analytically (:mod:`clipless.bounds`), so DP-SGD needs no per-sample gradients; and DP statistics
(:mod:`clipless.stats`).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
