"""The prefill cost model: predicted time of a request on the varlen path against the unified
path, from a per-arch calibration table (``python -m bench.calibrate``). Torch-free.

Per layer, for a request with n new and c cached tokens (work = visible (query, key) pairs x
query heads x head dim, docs/design.md's FLOP count over 4):

    varlen  = (n + c) x (cache bytes + packed bytes per token) / gather bandwidth
              + work / varlen_rate(n, c)
    unified = work / unified_rate(n, c)

Each path also has a per-layer launch cost (``launch_us``: the time of one small request, n = 16
after c = 16, alone; the host launch work and the kernels' latency floor), paid once per batch
by each path that gets a request. The planner compares, for the whole batch, "all varlen",
"all unified" and "each request on its cheaper path" (both launch costs), so a small prefill is
not split off to a second path whose launch costs more than it saves. A table without
``launch_us`` (older calibrations) counts 0.

A marginal cost says nothing of a request that cannot fill the GPU alone: a few new tokens after
a long cached prefix run on a handful of CTAs for the whole key range. Tables with
``<path>_latency_us`` grids (each request of the grid timed alone, B = 1) also give that
latency; a path then takes at least its longest request's latency (varlen: plus that request's
gather), and the planner compares max(sum of marginal costs, longest latency) per path.

Rates (work per microsecond) come from kernel times measured on the GPU over a grid of
(new, cached) for a few (heads, kv heads, head dim, window) shapes, each timed on a batch of
identical requests and divided by the batch size (the marginal cost of one request in a full
GPU). Between grid points the log of the rate is interpolated bilinearly in (log2 n,
log2(c + 1)); outside, the nearest edge holds. The shape used for a model: same head dim (else
nearest), same window class (full / windowed), nearest head count. A model whose layers have
different windows (``ModelFacts.layer_windows``) averages the per-layer predictions.

For the planner's 20 us budget, ``bind(facts)`` evaluates both predictions once per model on
a fine grid (1/16 octave in n and in c + 1); ``predict`` then costs two ``searchsorted`` and
two lookups for the whole batch. ``explain`` gives the exact (off-grid) numbers.
"""

from __future__ import annotations

import math

import numpy as np

from .decode_cost import DecodeCost
from .grids import bilinear, nearest_shape

SCHEMA = 1
_STEPS = 16  # grid points per octave of the bound tables
_MAX_LOG_NEW = 21  # 2M new tokens
_MAX_LOG_CACHED = 23  # 8M cached tokens
_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e4m3fnuz": 1}


def visible_pairs(n, c, window: int):
    """Visible (query, key) pairs of a request with n new queries after c cached keys (causal,
    bottom-right aligned, sliding window W keeps W keys per query); numpy-vectorised."""
    n = np.asarray(n, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    # query i sees min(c + i + 1, W) keys: sum over x = c+1 .. c+n of min(x, W)
    if window <= 0:
        return n * c + n * (n + 1) / 2
    a, b = c + 1, c + n
    top = np.minimum(b, window)
    below = np.where(top >= a, (top * (top + 1) - (a - 1) * a) / 2, 0.0)
    above = np.maximum(0.0, b - np.maximum(a - 1, window)) * window
    return below + above


class _Shape:
    def __init__(self, d: dict, grid_new, grid_cached):
        self.hq, self.hk, self.d = int(d["num_q_heads"]), int(d["num_kv_heads"]), int(d["head_dim"])
        self.window = int(d.get("window", 0))
        n, c = np.meshgrid(grid_new, grid_cached, indexing="ij")
        work = visible_pairs(n, c, self.window) * self.hq * self.d
        self.log_rate = {}
        for path in ("varlen", "unified"):
            t = np.asarray(d[f"{path}_us"], dtype=np.float64)
            if t.shape != work.shape or not np.all(t > 0):
                raise ValueError(f"cost table shape {self.hq}/{self.hk}/{self.d} w{self.window}: {path}_us must be "
                                 f"positive, {work.shape[0]} x {work.shape[1]} (new x cached)")
            self.log_rate[path] = np.log(work / t)
        # Optional (later calibrations): each grid request alone, per layer (us).
        self.log_latency = {}
        for path in ("varlen", "unified"):
            if f"{path}_latency_us" in d:
                t = np.asarray(d[f"{path}_latency_us"], dtype=np.float64)
                if t.shape != work.shape or not np.all(t > 0):
                    raise ValueError(f"cost table shape {self.hq}/{self.hk}/{self.d} w{self.window}: "
                                     f"{path}_latency_us must be positive, {work.shape[0]} x {work.shape[1]}")
                self.log_latency[path] = np.log(t)


class CostModel:
    """Predictions from one calibration table (see the module docstring)."""

    def __init__(self, table: dict, source: str = "<table>"):
        if table.get("schema") != SCHEMA:
            raise ValueError(f"{source}: cost table schema {table.get('schema')!r}, this version reads {SCHEMA}")
        self.source = source
        self.arch = table.get("arch", "?")
        self.produced_by = table.get("produced_by", {})
        g = table["gather"]
        self.gather_gbps = {k: float(v["gbps"]) for k, v in g.items()}
        if not {"16bit", "fp8"} & set(self.gather_gbps) or min(self.gather_gbps.values()) <= 0:
            raise ValueError(f"{source}: gather bandwidth needs a positive '16bit' or 'fp8' entry")
        self.grid_new = np.asarray(table["grid"]["new"], dtype=np.float64)
        self.grid_cached = np.asarray(table["grid"]["cached"], dtype=np.float64)
        if (len(self.grid_new) < 2 or len(self.grid_cached) < 2 or np.any(np.diff(self.grid_new) <= 0)
                or np.any(np.diff(self.grid_cached) <= 0) or self.grid_new[0] < 1 or self.grid_cached[0] < 0):
            raise ValueError(f"{source}: grid axes need >= 2 increasing points, new >= 1, cached >= 0")
        self._x = np.log2(self.grid_new)
        self._y = np.log2(self.grid_cached + 1)
        self.shapes = [_Shape(s, self.grid_new, self.grid_cached) for s in table["shapes"]]
        launch = table.get("launch_us", {})
        self.launch_us = (float(launch.get("varlen", 0.0)), float(launch.get("unified", 0.0)))
        if min(self.launch_us) < 0 or not all(map(math.isfinite, self.launch_us)):
            raise ValueError(f"{source}: launch_us must be finite and >= 0, got {launch}")
        if not self.shapes:
            raise ValueError(f"{source}: no calibrated shapes")
        self.has_latency = all(len(s.log_latency) == 2 for s in self.shapes)
        self._bound: dict = {}
        # whether the split kernel's balanced slices pay on the device measured (None: not measured)
        dec = table.get("decode", {})
        self.decode_balanced = dec.get("balanced")
        if self.decode_balanced not in (None, True, False):
            raise ValueError(f"{source}: decode.balanced must be true, false or absent, got {self.decode_balanced!r}")
        # the copy rate and one split-KV CTA's stream rate, GB/s (None: not measured)
        self.decode_copy_gbps = dec.get("copy_gbps")
        self.decode_cta_gbps = dict(dec.get("cta_gbps", {}))
        rates = [self.decode_copy_gbps, *self.decode_cta_gbps.values()] if self.decode_copy_gbps is not None else []
        if any(not isinstance(r, (int, float)) or not r > 0 for r in rates):
            raise ValueError(f"{source}: decode copy_gbps / cta_gbps must be positive numbers")
        # the compiled split-KV kernel against the Triton path (None: not measured: split-KV)
        self.decode = DecodeCost(dec, source) if "grid" in dec else None

    # -- choosing the calibrated shape and interpolating its rate ---------------------------
    def shape_for(self, facts, window: int) -> _Shape:
        return nearest_shape(self.shapes, facts, window)

    def _rate(self, shape: _Shape, path: str, n, c):
        """Interpolated work per us at (n, c) (arrays of one shape): bilinear in log space."""
        return self._interp(shape.log_rate[path], n, c)

    def _interp(self, lr, n, c):
        """exp of the bilinear interpolation of a log grid at (n, c), in (log2 n, log2(c + 1))."""
        x = np.log2(np.maximum(np.asarray(n, dtype=np.float64), 1.0))
        y = np.log2(np.asarray(c, dtype=np.float64) + 1)
        return np.exp(bilinear(lr, self._x, self._y, x, y))

    def _gather_gbps(self, facts) -> float:
        key = "fp8" if facts.kv_dtype.startswith("fp8") else "16bit"
        return self.gather_gbps.get(key) or next(iter(self.gather_gbps.values()))

    def _layers(self, facts):
        ws = list(getattr(facts, "layer_windows", ()) or ()) or [facts.window]
        uniq = sorted(set(int(w) for w in ws))
        return [(w, ws.count(w) / len(ws)) for w in uniq]

    def explain(self, facts, n, c) -> dict:
        """Exact per-layer predictions (us) of requests (n, c): for logs, tests and docs."""
        n = np.atleast_1d(np.asarray(n, dtype=np.float64))
        c = np.atleast_1d(np.asarray(c, dtype=np.float64))
        bytes_tok = facts.kv_bytes_per_token + facts.gathered_bytes_per_token
        gather = (n + c) * bytes_tok / (self._gather_gbps(facts) * 1e3)
        tv = np.array(gather)
        tu = np.zeros_like(n)
        lat = {"varlen": np.array(gather), "unified": np.zeros_like(n)} if self.has_latency else None
        for w, weight in self._layers(facts):
            s = self.shape_for(facts, w)
            work = visible_pairs(n, c, w) * facts.num_q_heads * facts.head_dim
            tv = tv + weight * work / self._rate(s, "varlen", n, c)
            tu = tu + weight * work / self._rate(s, "unified", n, c)
            if lat is not None:
                for path in lat:
                    # taken as is from the nearest shape: a request alone is latency bound, its
                    # heads run side by side
                    lat[path] = lat[path] + weight * self._interp(s.log_latency[path], n, c)
        out = {"varlen_us": tv, "unified_us": tu, "gather_us": gather}
        if lat is not None:
            out["varlen_latency_us"], out["unified_latency_us"] = lat["varlen"], lat["unified"]
        return out

    # -- the planner's fast path ------------------------------------------------------------
    def bind(self, facts) -> "_Bound":
        b = self._bound.get(facts)
        if b is None:
            b = self._bound[facts] = _Bound(self, facts)
        return b

    def predict(self, facts, new: np.ndarray, cached: np.ndarray):
        """(varlen us, unified us) per request, from the bound fine grid (float32 arrays)."""
        b = self._bound.get(facts) or self.bind(facts)
        k = b.n_mid.searchsorted(new) * b.ncols + b.c_mid.searchsorted(cached)  # methods: half the call cost
        z = b.z.take(k)  # both predictions in one lookup: varlen + 1j * unified
        return z.real, z.imag

    def predict_with_latency(self, facts, new: np.ndarray, cached: np.ndarray):
        """(varlen us, unified us, (varlen us, unified us) of each request alone or None): the
        planner's call, all four from one lookup."""
        b = self._bound.get(facts) or self.bind(facts)
        k = b.n_mid.searchsorted(new) * b.ncols + b.c_mid.searchsorted(cached)
        if not self.has_latency:
            z = b.z.take(k)
            return z.real, z.imag, None
        t = b.zz.take(k, axis=0)  # [n, 4]: varlen, unified, each alone
        return t[:, 0], t[:, 1], (t[:, 2], t[:, 3])

    def __repr__(self) -> str:
        return f"CostModel({self.arch}, {len(self.shapes)} shapes, {self.source})"


class _Bound:
    """Both predictions of one model on the fine (n, c) grid."""

    def __init__(self, model: CostModel, facts):
        kn = np.arange(_STEPS * _MAX_LOG_NEW + 1)
        kc = np.arange(_STEPS * _MAX_LOG_CACHED + 1)
        n_pts = np.round(2.0 ** (kn / _STEPS))
        c_pts = np.concatenate([[0.0], np.round(2.0 ** (kc / _STEPS))])
        n_pts, c_pts = np.unique(n_pts), np.unique(c_pts)
        # a request maps to the grid point nearest in log space
        # integer edges (floor of the geometric midpoints): searchsorted on int64 against int64
        # is twice as fast as against floats, and for integer counts "edge < x" is unchanged
        self.n_mid = np.floor(np.sqrt(n_pts[:-1] * n_pts[1:])).astype(np.int64)
        self.c_mid = np.floor(np.concatenate([[0.5], np.sqrt(c_pts[1:-1] * c_pts[2:])])).astype(np.int64)
        N, C = np.meshgrid(n_pts, c_pts, indexing="ij")
        e = model.explain(facts, N.ravel(), C.ravel())
        self.tv = e["varlen_us"].reshape(N.shape).astype(np.float32)
        self.tu = e["unified_us"].reshape(N.shape).astype(np.float32)
        self.ncols = N.shape[1]
        self.z = (self.tv + 1j * self.tu).astype(np.complex64).ravel()
        if model.has_latency:
            self.zz = np.stack([self.tv.ravel(), self.tu.ravel(), e["varlen_latency_us"].astype(np.float32),
                                e["unified_latency_us"].astype(np.float32)], axis=1)
