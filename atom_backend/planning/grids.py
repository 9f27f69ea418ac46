"""What the prefill and the decode cost models share: the calibrated shape nearest a model, and
bilinear interpolation over a log-spaced grid. Torch-free."""

from __future__ import annotations

import math

import numpy as np


def nearest_shape(shapes, facts, window: int):
    """The calibrated shape (with hq, hk, d, window) for a layer of `facts` with `window`: same head
    dim (else nearest), same window class (full / windowed, then the nearest window), nearest
    query and kv head counts."""
    def score(s):
        return ((s.d != facts.head_dim) * 100 + abs(math.log2(s.d / facts.head_dim)) * 10
                + ((s.window > 0) != (window > 0)) * 50 + abs(math.log2(max(s.window, 1) / max(window, 1)))
                + abs(math.log2(s.hq / facts.num_q_heads)) + abs(math.log2(s.hk / facts.num_kv_heads)))

    return min(shapes, key=score)


def bilinear(values, X, Y, x, y):
    """values[i, j] at axis points (X[i], Y[j]), interpolated bilinearly at (x, y) (arrays or
    scalars, in the axes' units); outside the grid the nearest edge holds."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xi = np.clip(np.searchsorted(X, x) - 1, 0, len(X) - 2)
    yi = np.clip(np.searchsorted(Y, y) - 1, 0, len(Y) - 2)
    tx = np.clip((x - X[xi]) / (X[xi + 1] - X[xi]), 0.0, 1.0)
    ty = np.clip((y - Y[yi]) / (Y[yi + 1] - Y[yi]), 0.0, 1.0)
    return (values[xi, yi] * (1 - tx) * (1 - ty) + values[xi + 1, yi] * tx * (1 - ty)
            + values[xi, yi + 1] * (1 - tx) * ty + values[xi + 1, yi + 1] * tx * ty)
