"""The batch planner: a pure function from a batch description to a plan with reasons.

No torch, no vLLM (numpy only): the metadata builder calls `plan()` once per batch on host-side lengths,
before any gather, and every layer's forward executes the same plan.

Routing, per request (new = new query tokens, cached = tokens already in the KV cache):
- new == 0                                  -> empty (nothing to compute)
- new <= decode_max_query_tokens            -> decode (split-KV kernel, or the unified path
                                               when the model does not fit the kernel)
- otherwise                                 -> prefill, varlen path unless a reason says
                                               unified. A prefix-cache hit (cached > 0) is no
                                               reason by itself: only the gather's cost
                                               relative to the work is (GATHER_COST).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from atom_backend.planning import rules as _rules
from atom_backend.planning.config import PlannerConfig
from atom_backend.planning.facts import ModelFacts, Path, Platform, PlanError, Reason
from atom_backend.planning.splits import SplitRule, decode_split_rule, decode_splits


@dataclass(frozen=True, eq=False)
class Plan:
    """What to run for one batch. Request indices (int64 arrays) refer to the order given
    to plan(); they are ascending."""

    decode: np.ndarray
    decode_path: Path
    decode_reason: Reason
    num_splits: int
    varlen: np.ndarray
    unified: np.ndarray
    unified_reasons: tuple  # Reason per entry of `unified`
    empty: np.ndarray
    gather_tokens: int  # keys (cached + new) gathered for the varlen requests
    gather_bytes: int  # bytes written into packed K and V
    decode_tokens: int
    varlen_tokens: int
    unified_tokens: int
    varlen_reason: Reason = Reason.PREFERRED  # COST when the cost model chose the prefill paths
    # Cost routing only: (prefill request indices, predicted varlen us, predicted unified us),
    # per layer, from the calibration table's grid (see atom_backend/planning/cost.py).
    predictions: tuple | None = None
    # How many of the num_splits each decode request uses, on the device (decode_split_rule).
    split_rule: SplitRule = SplitRule()
    # The varlen requests compute in FP8 (FP8 cache, gather of e4m3 bytes, FP8 prefill kernel);
    # otherwise in the query dtype, for varlen_compute_reason (model_fp8_compute_reason)
    varlen_fp8: bool = False
    varlen_compute_reason: Reason = Reason.KV_16BIT

    @classmethod
    def _make(cls, **fields) -> "Plan":
        """The planner's constructor: a frozen dataclass's __init__ sets each field through
        object.__setattr__ (~3 us for these 17); filling __dict__ at once costs a fifth. Every
        field is passed (plan() is the only caller)."""
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    def route_of(self, i: int) -> tuple[str, str, str]:
        """(phase, path, reason) of request i: for tables and debug logs, not the hot path."""
        if i in self.decode:
            return "decode", self.decode_path.value, self.decode_reason.value
        if i in self.varlen:
            return "prefill", Path.VARLEN.value, self.varlen_reason.value
        if i in self.unified:
            k = int(np.searchsorted(self.unified, i))
            return "prefill", Path.UNIFIED.value, self.unified_reasons[k].value
        return "empty", "-", "-"

    def predicted(self, i: int) -> tuple[float, float] | None:
        """(varlen us, unified us) the cost model predicted for prefill request i, or None."""
        if self.predictions is None:
            return None
        idx, tv, tu = self.predictions
        k = int(np.searchsorted(idx, i))
        if k < len(idx) and idx[k] == i:
            return float(tv[k]), float(tu[k])
        return None


@functools.lru_cache(maxsize=256)
def _path_reason(caps, facts: ModelFacts) -> Reason | None:
    """The registry's answer (rules.check) for one path and model, memoised: plan() pays a
    dict lookup. PathCaps hash by identity (built once per arch)."""
    r = _rules.check(caps, _rules.Signature.of(facts))
    return None if r is None else Reason(r.reason)


def model_varlen_reason(facts: ModelFacts, platform: Platform, config: PlannerConfig) -> Reason | None:
    """Why no prefill request of this model can take the varlen path (None: it can)."""
    if config.force_path == "unified":
        return Reason.FORCED
    if config.disable_varlen:
        return Reason.VARLEN_DISABLED
    if not platform.varlen_kernel:
        return Reason.NO_KERNEL
    return _path_reason(platform.varlen_caps, facts)


def model_fp8_compute_reason(facts: ModelFacts, platform: Platform, config: PlannerConfig) -> Reason | None:
    """Why varlen prefill of this model does not compute in FP8 (None: it does). KV_16BIT: the
    cache is not FP8; FORCED: ATOM_FP8_COMPUTE=0; a registry reason (head dim, arch, ...); COST:
    per-page scales on pages of no multiple of 16 keys take a scale per key, measured slower
    than the dequantizing gather + 16-bit prefill (docs/fp8.md "What is computed"; H100:
    docs/perf/prefill.md, 2026-11-25, "FP8 compute")."""
    if not facts.kv_dtype.startswith("fp8"):
        return Reason.KV_16BIT
    if not config.fp8_compute:
        return Reason.FORCED
    r = _path_reason(platform.varlen_fp8_caps, facts)
    if r is not None:
        return r
    if facts.kv_scale_mode == "per_page" and facts.page_size % 16:
        return Reason.COST
    return None


def model_splitkv_reason(facts: ModelFacts, platform: Platform) -> Reason | None:
    """Why decode of this model cannot take the split-KV kernel (None: it can)."""
    if not platform.splitkv_kernel:
        return Reason.NO_KERNEL
    return _path_reason(platform.splitkv_caps, facts)


def batch_routes(tv: np.ndarray, tu: np.ndarray, launch_us: tuple[float, float],
                 latency: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Which prefills take varlen (bool per request): the cheapest of all varlen, all unified,
    and each request on its cheaper path, counting each used path's launch cost once (the
    per-request predictions are marginal costs in a full GPU; a second path for one small
    request costs its launch, not the request's share of a full kernel). With `latency` (each
    request alone, per path), a path takes at least its longest request's latency: a few new
    tokens after a long cached prefix cannot fill the GPU, whatever their marginal cost."""
    lv, lu = launch_us
    cheaper = tv < tu
    n_v = int(np.count_nonzero(cheaper))
    if latency is None:
        if n_v == 0 or n_v == len(tv) or lv + lu == 0:
            return cheaper
        sv, su = float(_sum(tv)), float(_sum(tu))
        split = float(_sum(np.minimum(tv, tu))) + lv + lu
    else:
        av, au = latency
        sv, su = max(float(_sum(tv)), float(_max(av))), max(float(_sum(tu)), float(_max(au)))
        if n_v == 0 or n_v == len(tv):
            split = sv + lv if n_v else su + lu
        else:
            other = ~cheaper
            split = (max(float(_sum(tv[cheaper])), float(_max(av[cheaper]))) + lv
                     + max(float(_sum(tu[other])), float(_max(au[other]))) + lu)
    if sv + lv <= min(su + lu, split):
        return np.ones_like(cheaper)
    if su + lu <= split:
        return np.zeros_like(cheaper)
    return cheaper


_COST_REASONS = (Reason.GATHER_COST, Reason.SMALL_PREFILL)  # indexed by "new < min_new"
_sum = np.add.reduce  # skips ndarray.sum's Python wrapper (~0.2 us a call)
_max = np.maximum.reduce
_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False

# FP8 compute's pack (hip_kernels.gather.FP8_ALIGN; this module imports no kernel code): each
# request's keys start at a multiple of 128 rows, the rows between are written as zeros, and
# per-page scales add fp32 key scales (K's and V's) for every key plus V's largest per 128 keys.
FP8_PACK_ALIGN = 128


def fp8_pack_bytes(totals: np.ndarray, facts: ModelFacts) -> int:
    """Bytes the FP8 gather writes for requests of `totals` keys (PackedFp8)."""
    rows = int(_sum(-(-totals // FP8_PACK_ALIGN))) * FP8_PACK_ALIGN if len(totals) else 0
    scales = 4 * facts.num_kv_heads * (2 * rows + rows // FP8_PACK_ALIGN) if facts.kv_scale_mode == "per_page" else 0
    return rows * facts.kv_bytes_per_token + scales


def plan(
    new_tokens: Sequence[int] | np.ndarray,
    cached_tokens: Sequence[int] | np.ndarray,
    facts: ModelFacts,
    platform: Platform,
    config: PlannerConfig,
) -> Plan:
    """Route every request of a batch; deterministic and cheap (< 20 us for 256 requests when
    given integer arrays, as the metadata builder does; see bench/planner.py).

    Prefill routing, when the varlen path can serve the model and no path is forced: with a
    cost model for the arch (``platform.cost``, from ``atom_backend/catalog/tables/cost_<arch>.json``)
    the batch takes the cheapest of all varlen, all unified, or each request on its path of lower
    predicted time, with each used path's launch cost counted once (``batch_routes``; reason
    ``cost``); without one, the
    threshold rules (``varlen_min_new_tokens``, ``max_gather_ratio``) decide."""
    new = np.asarray(new_tokens, dtype=np.int64)
    cached = np.asarray(cached_tokens, dtype=np.int64)
    if new.shape != cached.shape or new.ndim != 1:
        raise PlanError(f"new tokens {new.shape} and cached tokens {cached.shape} must be 1-D and alike")
    if new.size and (new | cached).min() < 0:
        raise PlanError("token counts must be >= 0")
    model_reason = model_varlen_reason(facts, platform, config)

    # Every step below works on index arrays (few numpy calls: the 20 us budget is mostly
    # numpy's per-call cost, not per-request work).
    is_prefill = new > config.decode_max_query_tokens
    pf = is_prefill.nonzero()[0]
    if config.decode_max_query_tokens == 1:
        decode = (new == 1).nonzero()[0]
    else:
        decode = (is_prefill < (new > 0)).nonzero()[0]  # 0 < new <= decode_max_query_tokens
    n_pf = new[pf]
    predictions = None
    cost = platform.cost if config.cost_routing else None
    if model_reason is not None:
        varlen, unified = _EMPTY, pf
        reasons = (model_reason,) * len(pf)
    elif config.force_path == "varlen":
        varlen, unified, reasons = pf, _EMPTY, ()
    elif cost is not None and len(pf):
        tv, tu, alone = cost.predict_with_latency(facts, n_pf, cached[pf])
        cheaper = batch_routes(tv, tu, cost.launch_us, alone)
        varlen, unified = pf[cheaper], pf[~cheaper]
        reasons = (Reason.COST,) * len(unified)
        predictions = (pf, tv, tu)
    else:
        # The gather copies cached + new keys; past max_gather_ratio cached keys per new
        # token it costs more than reading the pages in place.
        ok = (n_pf >= config.varlen_min_new_tokens) & (cached[pf] <= config.max_gather_ratio * n_pf)
        varlen, unified = pf[ok], pf[~ok]
        small = (n_pf[~ok] < config.varlen_min_new_tokens).tolist()
        reasons = tuple(map(_COST_REASONS.__getitem__, small))
    n_dec = len(decode)
    varlen_tokens = int(_sum(new[varlen])) if len(varlen) else 0
    gather_tokens = varlen_tokens + int(_sum(cached[varlen])) if len(varlen) else 0
    if n_dec and config.decode_max_query_tokens == 1:
        max_ctx = int(cached[decode].max()) + 1
        decode_tokens = n_dec
        decode_reason = model_splitkv_reason(facts, platform)
    elif n_dec:
        nd = new[decode]
        max_ctx = int((nd + cached[decode]).max())
        decode_tokens = int(_sum(nd))
        decode_reason = model_splitkv_reason(facts, platform)
    else:
        max_ctx = decode_tokens = 0
        decode_reason = None
    decode_cost = getattr(cost, "decode", None)
    if (decode_reason is None and n_dec and decode_cost is not None and not config.force_path
            and decode_cost.unified_faster(facts, n_dec, max_ctx)):
        decode_reason = Reason.COST  # the Triton path, measured faster on this device for this batch
    split_rule = decode_split_rule(n_dec, facts, platform, config) if n_dec else SplitRule()
    fp8_reason = model_fp8_compute_reason(facts, platform, config) if len(varlen) else Reason.KV_16BIT
    keys = new[varlen] + cached[varlen] if fp8_reason is None else None
    limit = platform.fp8_max_keys if config.fp8_compute_max_keys is None else config.fp8_compute_max_keys
    if keys is not None and limit and int(keys.max()) > limit:
        fp8_reason = Reason.LONG_CONTEXT  # one pack per batch: its longest request decides
    fp8 = fp8_reason is None
    return Plan._make(
        decode=decode,
        decode_path=Path.SPLITKV if decode_reason is None else Path.UNIFIED,
        decode_reason=Reason.PREFERRED if decode_reason is None else decode_reason,
        num_splits=decode_splits(n_dec, max_ctx, facts, platform, config, split_rule),
        split_rule=split_rule,
        varlen=varlen,
        unified=unified,
        unified_reasons=reasons,
        empty=(new == 0).nonzero()[0] if len(pf) + n_dec < len(new) else _EMPTY,
        gather_tokens=gather_tokens,
        # FP8 compute copies the cache's bytes (requests padded to 128 keys, per-page scales)
        gather_bytes=fp8_pack_bytes(keys, facts) if fp8
        else gather_tokens * facts.gathered_bytes_per_token,
        decode_tokens=decode_tokens,
        varlen_tokens=varlen_tokens,
        unified_tokens=(int(_sum(n_pf)) if len(pf) else 0) - varlen_tokens,
        varlen_reason=Reason.COST if predictions is not None else Reason.PREFERRED,
        predictions=predictions,
        varlen_fp8=fp8,
        varlen_compute_reason=Reason.PREFERRED if fp8 else fp8_reason,
    )
