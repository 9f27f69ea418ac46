"""Decode routing from a device's calibration: the compiled split-KV kernel against the Triton
path (``unified.paged_decode``), each timed at the planner's split count and rule over a grid of
(decode requests, context) for a few (heads, kv heads, head dim, window) shapes by
``bench.calibrate`` (its cost table's ``"decode"`` entry). Torch-free.

A decode batch goes to the Triton path where its predicted time there is below ``MARGIN`` of the
compiled kernel's: between grid points the log of each time is interpolated bilinearly in
(log2 requests, log2 context), outside them the nearest edge holds. The shape used for a model
is the prefill model's choice (``grids.nearest_shape``); a model
whose layers have different windows sums the per-layer predictions. Under vLLM's FULL CUDA
graphs the route of a captured batch size is decided when it is captured, at the context the
capture plans for, and holds for its replays.
"""

from __future__ import annotations

import math

import numpy as np

from .grids import bilinear, nearest_shape

# The Triton path must be this much faster to take a batch: the grid's interpolation error and
# the run-to-run spread of the calibration stay on the compiled kernel's side.
MARGIN = 0.95
_STEPS = 8  # decisions per octave of requests and of context, evaluated once per model
_MAX_LOG_BATCH = 12  # 4096 requests
_MAX_LOG_CTX = 23  # 8M keys


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
        self._bound: dict = {}

    def _time(self, facts, window: int, path: str, log_batch, log_ctx):
        s = nearest_shape(self.shapes, facts, window)
        return np.exp(bilinear(s.log_us[path], self._x, self._y, log_batch, log_ctx))

    def predict(self, facts, batch, ctx):
        """(split-KV us, Triton us) per step of a decode batch of `batch` requests, longest `ctx`
        keys (scalars or arrays)."""
        windows = list(getattr(facts, "layer_windows", ()) or ()) or [facts.window]
        x = np.log2(np.maximum(np.asarray(batch, dtype=np.float64), 1.0))
        y = np.log2(np.maximum(np.asarray(ctx, dtype=np.float64), 1.0))
        ts = tu = 0.0
        for w in sorted(set(int(w) for w in windows)):
            weight = windows.count(w) / len(windows)
            ts = ts + weight * self._time(facts, w, "splitkv", x, y)
            tu = tu + weight * self._time(facts, w, "unified", x, y)
        return ts, tu

    def unified_faster(self, facts, batch: int, ctx: int) -> bool:
        """The route of one batch, looked up in the model's decisions (``_decisions``): the planner
        asks once per step and group, within its budget of microseconds."""
        table = self._bound.get(facts)
        if table is None:
            table = self._bound[facts] = self._decisions(facts)
        i = min(max(round(math.log2(max(batch, 1)) * _STEPS), 0), table.shape[0] - 1)
        j = min(max(round(math.log2(max(ctx, 1)) * _STEPS), 0), table.shape[1] - 1)
        return bool(table[i, j])

    def _decisions(self, facts) -> np.ndarray:
        """Triton faster by MARGIN, per (requests, context) on a grid of _STEPS points an octave."""
        b = 2.0 ** (np.arange(_MAX_LOG_BATCH * _STEPS + 1) / _STEPS)
        c = 2.0 ** (np.arange(_MAX_LOG_CTX * _STEPS + 1) / _STEPS)
        ts, tu = self.predict(facts, b[:, None], c[None, :])
        return tu < MARGIN * ts
