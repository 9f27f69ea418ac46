"""Decode routing from a device's calibration: the compiled split-KV kernel against the Triton
path (``unified.paged_decode``), each timed at the planner's split count and rule over a grid of
(decode requests, context) for a few (heads, kv heads, head dim, window) shapes by
``bench.calibrate`` (its cost table's ``"decode"`` entry). Torch-free.

A decode batch goes to the Triton path where its predicted time there is below ``MARGIN`` of the
compiled kernel's: between grid points the log of each time is interpolated bilinearly in
(log2 requests, log2 context), outside them the nearest edge holds. The shape used for a model:
same head dim (else nearest), same window class, nearest head count, as for prefill; a model
whose layers have different windows sums the per-layer predictions. Under vLLM's FULL CUDA
graphs the route of a captured batch size is decided when it is captured, at the context the
capture plans for, and holds for its replays.
"""

from __future__ import annotations

import math

import numpy as np

# The Triton path must be this much faster to take a batch: the grid's interpolation error and
# the run-to-run spread of the calibration stay on the compiled kernel's side.
MARGIN = 0.95


class _DecodeShape:
    def __init__(self, d: dict, shape: tuple, source: str):
        self.hq, self.hk, self.d = int(d["num_q_heads"]), int(d["num_kv_heads"]), int(d["head_dim"])
        self.window = int(d.get("window", 0))
        self.log_us = {}
        for path in ("splitkv", "unified"):
            t = np.asarray(d[f"{path}_us"], dtype=np.float64)
            if t.shape != shape or not np.all(t > 0):
                raise ValueError(f"{source}: decode shape {self.hq}/{self.hk}/{self.d} w{self.window}: {path}_us "
                                 f"must be positive, {shape[0]} x {shape[1]} (requests x context)")
            self.log_us[path] = np.log(t)


class DecodeCost:
    """The decode grid of one cost table (see the module docstring)."""

    def __init__(self, entry: dict, source: str = "<table>"):
        g = entry["grid"]
        self.batch = np.asarray(g["batch"], dtype=np.float64)
        self.ctx = np.asarray(g["ctx"], dtype=np.float64)
        for name, axis in (("batch", self.batch), ("ctx", self.ctx)):
            if len(axis) < 2 or np.any(np.diff(axis) <= 0) or axis[0] < 1:
                raise ValueError(f"{source}: decode grid {name} needs >= 2 increasing points >= 1")
        self._x, self._y = np.log2(self.batch), np.log2(self.ctx)
        self.shapes = [_DecodeShape(s, (len(self.batch), len(self.ctx)), source) for s in entry["shapes"]]
        if not self.shapes:
            raise ValueError(f"{source}: decode grid without shapes")

    def shape_for(self, facts, window: int) -> _DecodeShape:
        def score(s: _DecodeShape):
            return ((s.d != facts.head_dim) * 100 + abs(math.log2(s.d / facts.head_dim)) * 10
                    + ((s.window > 0) != (window > 0)) * 50 + abs(math.log2(s.hq / facts.num_q_heads))
                    + abs(math.log2(s.hk / facts.num_kv_heads)))

        return min(self.shapes, key=score)

    def _interp(self, lt, batch: int, ctx: int) -> float:
        x, y = math.log2(max(batch, 1)), math.log2(max(ctx, 1))
        X, Y = self._x, self._y
        xi = int(np.clip(np.searchsorted(X, x) - 1, 0, len(X) - 2))
        yi = int(np.clip(np.searchsorted(Y, y) - 1, 0, len(Y) - 2))
        tx = min(max((x - X[xi]) / (X[xi + 1] - X[xi]), 0.0), 1.0)
        ty = min(max((y - Y[yi]) / (Y[yi + 1] - Y[yi]), 0.0), 1.0)
        v = (lt[xi, yi] * (1 - tx) * (1 - ty) + lt[xi + 1, yi] * tx * (1 - ty)
             + lt[xi, yi + 1] * (1 - tx) * ty + lt[xi + 1, yi + 1] * tx * ty)
        return math.exp(v)

    def predict(self, facts, batch: int, ctx: int) -> tuple[float, float]:
        """(split-KV us, Triton us) per step of a decode batch of `batch` requests, longest `ctx` keys."""
        windows = list(getattr(facts, "layer_windows", ()) or ()) or [facts.window]
        ts = tu = 0.0
        for w in sorted(set(int(w) for w in windows)):
            weight = windows.count(w) / len(windows)
            s = self.shape_for(facts, w)
            ts += weight * self._interp(s.log_us["splitkv"], batch, ctx)
            tu += weight * self._interp(s.log_us["unified"], batch, ctx)
        return ts, tu

    def unified_faster(self, facts, batch: int, ctx: int) -> bool:
        ts, tu = self.predict(facts, batch, ctx)
        return tu < MARGIN * ts
