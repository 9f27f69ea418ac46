"""What the planner decides from: paths and reasons, the model's facts, the platform's kernels.

Pure Python: the planner, the registry and the benches share these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from atom_backend.planning import rules as _rules


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

    Build it with ``atom_backend.catalog.platform_for(arch)`` (GPU archs) or take
    ``CPU_PLATFORM``-like values (``varlen_caps=ANY``): the capability fields are the
    registry's ``PathCaps`` for the arch, never hand-written sets. ``None`` caps mean no kernel
    of that path is declared (reason ``kernel_unavailable``). ``cost``: the arch's calibrated
    cost model (``atom_backend.planning.cost.CostModel``) or None (threshold routing)."""

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
    # The fill target in CTAs where the device's table measured it (0: num_sms x the per-SM fill
    # above): enough CTAs that their stream rates add up to the copy rate
    # (catalog.registry.stream_fill_ctas).
    decode_fill_ctas: int = 0
    decode_fill_ctas_fp8: int = 0
    # The split kernel's balanced slices (16-bit KV: a request's splits claim its keys at run time)
    # where its rule says they pay (hip_kernels.decode.balance_pays, measured on an H100); False on
    # a device where bench.calibrate measured them slower (its table's "decode" entry).
    decode_balanced: bool = True


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
