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
import math
import os
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from atom_backend.kernels import rules as _rules


class Path(str, Enum):
    VARLEN = "varlen"
    UNIFIED = "unified"
    SPLITKV = "splitkv"


class Reason(str, Enum):
    PREFERRED = "preferred"
    FORCED = "forced_by_config"
    VARLEN_DISABLED = "varlen_disabled"
    HEAD_DIM = "unsupported_head_dim"
    DTYPE = "unsupported_dtype"
    KV_FORMAT = "unsupported_kv_format"
    PAGE_SIZE = "unsupported_page_size"
    FEATURE = "unsupported_feature"
    NO_KERNEL = "kernel_unavailable"
    SMALL_PREFILL = "small_prefill"
    GATHER_COST = "gather_cost"
    COST = "cost"
    LONG_CONTEXT = "fp8_long_context"
    # Not a refusal: a 16-bit KV cache computes in 16 bits (atom_varlen_compute_requests_total)
    KV_16BIT = "kv_cache_16bit"


class PlanError(ValueError):
    """The batch cannot be served by any path (raised at plan time, never inside a kernel)."""


_ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e4m3fnuz": 1}
_KV_FORMATS = {"bf16", "fp16", "fp8_e4m3", "fp8_e4m3fnuz"}
_SCALE_MODES = {"none", "per_tensor", "per_page"}


@dataclass(frozen=True)
class ModelFacts:
    """Per-layer facts of the model that decide which kernels can serve it."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"  # query/output dtype: bf16 | fp16 | fp32
    kv_dtype: str = "bf16"  # bf16 | fp16 | fp8_e4m3 | fp8_e4m3fnuz
    kv_scale_mode: str = "none"  # none | per_tensor | per_page
    has_sinks: bool = False
    window: int = 0
    sink_tokens: int = 0
    softcap: float = 0.0
    page_size: int = 16
    # Window of each layer sharing this plan (0: full attention), e.g. (0, 128) for gpt-oss's
    # alternating layers; empty means every layer has `window`. Only the cost model reads it.
    layer_windows: tuple = ()

    def __post_init__(self) -> None:
        if self.num_q_heads <= 0 or self.num_kv_heads <= 0 or self.num_q_heads % self.num_kv_heads:
            raise PlanError(f"num_q_heads={self.num_q_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise PlanError(f"query dtype {self.dtype!r} is not one of bf16, fp16, fp32")
        if self.kv_dtype not in _KV_FORMATS:
            raise PlanError(f"kv dtype {self.kv_dtype!r} is not one of {sorted(_KV_FORMATS)}")
        if self.kv_scale_mode not in _SCALE_MODES:
            raise PlanError(f"kv scale mode {self.kv_scale_mode!r} is not one of {sorted(_SCALE_MODES)}")
        if self.kv_dtype.startswith("fp8") and self.kv_scale_mode == "none":
            raise PlanError("an fp8 KV cache needs a scale (per_tensor or per_page)")
        if not 1 <= self.page_size <= 1024:
            raise PlanError(f"page size {self.page_size} is outside 1..1024")
        if any(int(w) < 0 for w in self.layer_windows):
            raise PlanError(f"layer windows {self.layer_windows} must be >= 0")
        if self.head_dim <= 0 or self.head_dim > 256 or self.head_dim % 8:
            raise PlanError(f"head dim {self.head_dim} is unsupported by every path (multiple of 8, at most 256)")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token across all kv heads, as stored in the cache."""
        return 2 * self.num_kv_heads * self.head_dim * _ELEM_BYTES[self.kv_dtype]

    @property
    def gathered_bytes_per_token(self) -> int:
        """Bytes of K plus V written into the packed tensor (dequantised to the query dtype)."""
        return 2 * self.num_kv_heads * self.head_dim * _ELEM_BYTES[self.dtype]


@dataclass(frozen=True)
class Platform:
    """What the machine can run, as the kernel registry declares it.

    Build it with ``atom_backend.kernels.platform_for(arch)`` (GPU archs) or take
    ``CPU_PLATFORM``-like values (``varlen_caps=ANY``): the capability fields are the
    registry's ``PathCaps`` for the arch, never hand-written sets. ``None`` caps mean no kernel
    of that path is declared (reason ``kernel_unavailable``). ``cost``: the arch's calibrated
    cost model (``atom_backend.kernels.cost.CostModel``) or None (threshold routing)."""

    vendor: str = "nvidia"  # nvidia | amd | cpu
    arch: str = "sm_90a"
    num_sms: int = 132
    # An executor for the path exists here: the compiled kernel on a GPU, the torch route on
    # the CPU (vendor "cpu"). False when, e.g., the toolchain is missing.
    varlen_kernel: bool = True
    splitkv_kernel: bool = True
    varlen_caps: _rules.PathCaps | None = None
    # FP8 compute inside the varlen path (FP8 prefill kernel, its gather, Q's quantizer)
    varlen_fp8_caps: _rules.PathCaps | None = None
    # The longest varlen request (keys) FP8 compute is known accurate for here (0: any): the FP8
    # kernel's accumulator over a long request (hip_kernels.prefill.fp8_accurate_keys)
    fp8_max_keys: int = 0
    splitkv_caps: _rules.PathCaps | None = None
    cost: object | None = None
    # Split-KV CTAs resident per SM (H100, tensor-core decode kernel at head_dim 128: register
    # and shared-memory bound, hip_kernels.decode.MMA_CTAS_PER_SM): the most CTAs one launch
    # runs at once. 16-bit KV: 4-warp CTAs, 2 per SM; FP8 KV: 2-warp CTAs, 4 per SM.
    decode_ctas_per_sm: int = 2
    decode_ctas_per_sm_fp8: int = 4
    # CTAs per SM the splits of a short batch aim for: one 16-bit CTA per SM already streams at
    # the GPU's bandwidth and splits cost a combine, so 16-bit KV fills one per SM; an FP8 CTA
    # alone does not, FP8 fills all it holds (H100 sweep: docs/perf/decode.md, 2026-11-24, "split
    # counts from a sweep").
    decode_fill_per_sm: int = 1
    decode_fill_per_sm_fp8: int = 4


def reduce_layer_windows(windows) -> tuple:
    """Per-layer windows reduced to their smallest equivalent list (same proportions), for
    ``ModelFacts.layer_windows`` (cheap to hash): 12 x 0 and 12 x 128 -> (0, 128); one
    window for every layer -> ()."""
    import math
    from collections import Counter

    counts = Counter(int(w or 0) for w in windows)
    if len(counts) <= 1:
        return ()
    g = math.gcd(*counts.values())
    return tuple(w for w, c in sorted(counts.items()) for _ in range(c // g))


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise PlanError(f"{name}={raw!r} is not an integer") from None


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise PlanError(f"{name}={raw!r} is not a flag (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class PlannerConfig:
    """Every routing threshold, with its environment override (documented in the README)."""

    force_path: str = ""  # ATOM_FORCE_PATH: "" | varlen | unified (prefill routing)
    disable_varlen: bool = False  # ATOM_DISABLE_VARLEN=1
    decode_max_query_tokens: int = 1  # ATOM_DECODE_MAX_QUERY_TOKENS (<= 8: speculative decode)
    varlen_min_new_tokens: int = 8  # ATOM_VARLEN_MIN_NEW_TOKENS: shorter prefills go unified
    max_gather_ratio: int = 64  # ATOM_MAX_GATHER_RATIO: cached/new above this goes unified
    max_splits: int = 64  # ATOM_MAX_SPLITS: cap (one FP8 request of 128k fills its 4 CTAs per SM at 64)
    # ATOM_MIN_SPLIT_TOKENS: cap of m, the fewest keys per split (request_split_tokens: 64 x
    # isqrt(decode requests), at most this); a request of L keys takes at most L // m splits
    min_split_tokens: int = 256
    # ATOM_LONG_SPLIT_TOKENS: a request whose fill-target splits would hold more keys than this
    # takes more splits (whole waves of CTAs), one per this many keys at most
    long_split_tokens: int = 1024
    wave_fill: int = 95  # ATOM_DECODE_WAVE_FILL: % the last wave of decode CTAs must be filled
    cost_routing: bool = True  # ATOM_COST_ROUTING=0: thresholds even where a cost table exists
    # ATOM_DETERMINISTIC_DECODE=1: split-KV decode on fixed key ranges (bitwise repeatable runs);
    # by default a request's splits share its keys at run time (balanced across SMs, 1-2% faster)
    deterministic_decode: bool = False
    # ATOM_FP8_COMPUTE=0: varlen prefill over an FP8 cache dequantizes to the query dtype and
    # computes in 16 bits (accuracy-sensitive models); by default it computes in FP8 where the
    # kernel exists (docs/fp8.md)
    fp8_compute: bool = True
    # ATOM_FP8_COMPUTE_MAX_KEYS: a varlen batch with a request of more keys computes in 16 bits (0:
    # no limit). Unset: the platform's fp8_max_keys (none where the FP8 kernels move O to fp32 every
    # 1024 keys, as on sm_90a, gfx942, gfx950; 1024 where O would stay in the accumulator:
    # docs/fp8.md "Long requests").
    fp8_compute_max_keys: int | None = None

    def __post_init__(self) -> None:
        if self.force_path not in ("", "varlen", "unified"):
            raise PlanError(f"ATOM_FORCE_PATH={self.force_path!r}: use varlen, unified or leave unset")
        if not 1 <= self.decode_max_query_tokens <= 8:
            raise PlanError("ATOM_DECODE_MAX_QUERY_TOKENS must be in 1..8")
        if self.max_splits < 1 or self.min_split_tokens < 1 or self.long_split_tokens < 1:
            raise PlanError("ATOM_MAX_SPLITS, ATOM_MIN_SPLIT_TOKENS and ATOM_LONG_SPLIT_TOKENS must be >= 1")
        if not 1 <= self.wave_fill <= 100:
            raise PlanError("ATOM_DECODE_WAVE_FILL must be in 1..100 (percent)")
        if self.fp8_compute_max_keys is not None and self.fp8_compute_max_keys < 0:
            raise PlanError("ATOM_FP8_COMPUTE_MAX_KEYS must be >= 0 (0: no limit)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PlannerConfig":
        env = os.environ if env is None else env
        if "ATOM_TARGET_WAVES" in env:  # a setting that would now do nothing must not pass silently
            raise PlanError("ATOM_TARGET_WAVES is gone: decode splits fill whole waves of CTAs "
                            "(ATOM_DECODE_WAVE_FILL, percent, default 95)")
        return cls(
            force_path=env.get("ATOM_FORCE_PATH", "").strip().lower(),
            disable_varlen=env_flag(env, "ATOM_DISABLE_VARLEN", False),
            decode_max_query_tokens=_env_int(env, "ATOM_DECODE_MAX_QUERY_TOKENS", 1),
            varlen_min_new_tokens=_env_int(env, "ATOM_VARLEN_MIN_NEW_TOKENS", 8),
            max_gather_ratio=_env_int(env, "ATOM_MAX_GATHER_RATIO", 64),
            max_splits=_env_int(env, "ATOM_MAX_SPLITS", 64),
            min_split_tokens=_env_int(env, "ATOM_MIN_SPLIT_TOKENS", 256),
            long_split_tokens=_env_int(env, "ATOM_LONG_SPLIT_TOKENS", 1024),
            wave_fill=_env_int(env, "ATOM_DECODE_WAVE_FILL", 95),
            cost_routing=env_flag(env, "ATOM_COST_ROUTING", True),
            deterministic_decode=env_flag(env, "ATOM_DETERMINISTIC_DECODE", False),
            fp8_compute=env_flag(env, "ATOM_FP8_COMPUTE", True),
            fp8_compute_max_keys=_env_int(env, "ATOM_FP8_COMPUTE_MAX_KEYS", None),
        )


class SplitRule(NamedTuple):
    """How many of a launch's S splits a decode request uses: the count ``decode_splits`` would
    give a batch of requests of its length, decided per request on the device (every split
    kernel and the reference apply ``request_splits``), so a CUDA graph sized for max_model_len
    gives each request what an eager batch of its length gets. A tuple of six ints, in the
    kernels' argument order; zeros (``SplitRule()``) use all S splits.

    min_tokens: at most keys // min_tokens splits. fill: the fill target (0: no bound but
    min_tokens). long_tokens: fill-target splits of more keys than this grow. ctas, slots,
    wave_fill: CTAs per split, CTAs resident at once, and the % of its last wave a grown
    count's CTAs must fill."""

    min_tokens: int = 0
    fill: int = 0
    long_tokens: int = 0
    ctas: int = 0
    slots: int = 0
    wave_fill: int = 0


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
    # per layer, from the calibration table's grid (see atom_backend/kernels/cost.py).
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


def path_refusal(caps, facts: ModelFacts):
    """The full Refusal (reason + detail) for logs and the CLI."""
    return _rules.check(caps, _rules.Signature.of(facts))


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


def fills_last_wave(ctas: int, slots: int, fill: int) -> bool:
    """`ctas` CTAs fill their last wave of `slots` to at least fill %."""
    waves = -(-ctas // slots)
    return 100 * ctas >= fill * waves * slots


def whole_wave_splits(ctas_per_split: int, slots: int, cap: int, fill: int = 95) -> int:
    """Fewest splits s <= cap whose ctas_per_split * s CTAs fill their last wave of `slots` to at
    least fill % (a partly filled wave costs about a full one); 0 when none does. Closed form per
    wave count k: the smallest s reaching k waves at fill % is ceil(fill * k * slots / (100 * ctas))."""
    k = -(-ctas_per_split // slots)  # waves of a single split
    while True:
        s = max(1, -(-fill * k * slots // (100 * ctas_per_split)))
        if s > cap:
            return 0
        if ctas_per_split * s <= k * slots:
            return s
        k += 1


def request_splits(keys: int, num_splits: int, rule: Sequence[int] = ()) -> int:
    """The split count of a request of `keys` visible keys (the one definition; the kernels
    mirror it), at most num_splits:
    - at most keys // min_tokens;
    - the fill target when its splits hold at most long_tokens keys each and its CTAs run in one
      wave, or when its CTAs fill their last wave anyway;
    - else the fewest splits, at most max(fill, keys // long_tokens), whose CTAs fill their last
      wave to wave_fill % (whole_wave_splits); none does: the fill target."""
    m, fill, long_tokens, ctas, slots, wave_fill = tuple(rule) + (0,) * (6 - len(rule))
    cap = num_splits if m <= 0 else min(num_splits, keys // m)
    cap = max(1, cap)
    if fill <= 0:
        return cap
    fill = min(fill, cap)
    if long_tokens <= 0 or ctas <= 0 or slots <= 0:
        return fill
    if (keys <= fill * long_tokens and ctas * fill <= slots) or fills_last_wave(ctas * fill, slots, wave_fill):
        return fill
    return whole_wave_splits(ctas, slots, min(cap, max(fill, keys // long_tokens)), wave_fill) or fill


def request_split_tokens(num_decodes: int, config: PlannerConfig) -> int:
    """Fewest keys per split. Few requests leave the GPU idle, so short splits still cut their
    latency; more requests fill it and want longer ones. On H100, 8 kv heads, the best bound
    measured is 64 keys at 1-2 requests, 128 at 4-8, 256 from 16 (docs/perf/decode.md,
    2026-11-24, "splits per request on the device" and "split counts from a sweep"):
    64 * isqrt(n), at most min_split_tokens."""
    return max(1, min(config.min_split_tokens, 64 * math.isqrt(max(1, num_decodes))))


def decode_split_rule(num_decodes: int, facts: ModelFacts, platform: Platform, config: PlannerConfig) -> SplitRule:
    """The batch's SplitRule. Its fill target puts the platform's fill CTAs on every SM
    (``decode_fill_per_sm``: one 16-bit CTA, four FP8 ones on H100), short of the last slot: a
    grid that needs every slot at once waits for the slowest to free (H100, FP8 2 x 4k keys: 33
    splits, 528 CTAs on 528 slots, 23.7 us; 32 splits 21.2 us). Grown counts fill whole waves
    of the CTAs resident at once (``decode_ctas_per_sm`` per SM)."""
    fp8 = facts.kv_dtype.startswith("fp8")
    ctas = max(1, num_decodes * facts.num_kv_heads)
    fill_per_sm = platform.decode_fill_per_sm_fp8 if fp8 else platform.decode_fill_per_sm
    resident = platform.decode_ctas_per_sm_fp8 if fp8 else platform.decode_ctas_per_sm
    return SplitRule(min_tokens=request_split_tokens(num_decodes, config),
                     fill=max(1, (platform.num_sms * fill_per_sm - 1) // ctas),
                     long_tokens=config.long_split_tokens, ctas=ctas, slots=platform.num_sms * resident,
                     wave_fill=config.wave_fill)


def decode_splits(
    num_decodes: int, max_context: int, facts: ModelFacts, platform: Platform, config: PlannerConfig,
    rule: SplitRule | None = None,
) -> int:
    """The launch's splits S: request_splits of the batch's longest request under the batch's
    SplitRule, at most `max_splits`. H100, 110 shapes of 1-96 requests x 512-128k keys
    (docs/perf/decode.md, 2026-11-24, "split counts from a sweep"): +0.54% (bf16) and +0.99%
    (FP8) over the best measured split count, geomean; +5.8% and +13.9% at worst. One count for
    the whole batch keeps the grid and the workspace shape fixed (CUDA graphs); each request then
    uses the count its own length is worth, on the device. `rule`: decode_split_rule of the batch
    when the caller has it."""
    if num_decodes == 0:
        return 1
    if facts.window > 0:  # the split kernels divide the window's keys; sink tokens are not split
        max_context = min(max_context, facts.window + config.decode_max_query_tokens - 1)
    return request_splits(max_context, config.max_splits, rule or decode_split_rule(num_decodes, facts, platform, config))


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
    cost model for the arch (``platform.cost``, from ``atom_backend/tables/cost_<arch>.json``)
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
