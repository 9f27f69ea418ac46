"""Split-KV decode over the paged KV cache (kernel: src/decode.hip), torch-facing.

`splitkv_decode(...)` runs one launch of the split kernel, grid (kv heads x row blocks, requests,
splits), writing fp32 partials into a workspace, then `hip_kernels.combine.combine` merges the
splits and applies the per-head sinks once. The tensor-core kernel needs no combine launch: with
one split it writes the output and lse itself, with up to FUSE_MAX_SPLITS
(FUSE_MAX_BALANCED_SPLITS when balanced) the last CTA of each (kv head, row block, request)
combines its group's partials (completion counters from `runtime.workspace.semaphores`). No host synchronisation:
every check here reads shapes, dtypes, strides and Python numbers only, so the call is CUDA-graph
capturable when the caller passes a fixed `workspace` and a fixed `num_splits` (the planner picks
it).

Semantics follow docs/design.md: query i of a request with sq new tokens and sk keys sits at
sk - sq + i; sliding window W keeps keys j > p - W, StreamingLLM sink tokens j < S stay visible;
soft-cap, FP8 e4m3 KV with a per-tensor scale or a per-page-per-head descale [num_blocks, hk].
Page of key j: block_table[b, j // block_size] (vLLM) or
kv_page_indices[kv_indptr[b] + j // block_size] (SGLang).

Split s of a request covers keys [lo + s*per, lo + (s+1)*per) of its visible range [lo, sk), where
lo is the first key the window lets the first query token see (0 without a window) and
per = ceil((sk - lo) / num_splits); split 0 also takes the StreamingLLM sink tokens below lo.
Without a window this is `planning.split_ranges`. Empty splits write lse = -inf, o = 0.
`split_rule` (the backend passes its planner's SplitRule: six ints, min keys per split, fill
target, long-split keys, CTAs per split, resident CTAs, wave fill %; empty = off): a request of
L = sk - lo visible keys splits over ns = atom::request_splits(L, num_splits, ...) splits
instead, the count the planner would give a batch of its length; splits ns.. stay idle
(lse -inf). num_splits is then the grid's bound, so a CUDA graph captured for long contexts
still gives a short request the splits its own length is worth.
Balanced mode (tensor-core kernel, 16-bit KV; `balance_pays`) departs from docs/design.md's contiguous
ranges on purpose: a request's splits (when it uses all of the grid's) claim 16-key slices of its
whole range at run time, so a partial covers the slices its CTA took (the combined attention is
the same; its rounding varies from run to run, and ATOM_DETERMINISTIC_DECODE=1 / balanced=False
restores fixed ranges).

Size (over 500 lines, on purpose): the host side of one kernel family, whose variant table, argument
checks for both page-table layouts and ``SplitKVPlan`` share one launch contract; split apart, each
part would restate it.
"""

from __future__ import annotations

import functools
import math

import torch

from hip_kernels.runtime.workspace import semaphores

SOURCE = "decode.hip"
KERNEL = "splitkv_decode"
NUM_THREADS = 128
# Tensor-core kernel (src/decode_mma.hip): 16 rows per CTA, _mma_defaults' warps, dynamic shared memory.
MMA_SOURCE = "decode_mma.hip"
MMA_KERNEL = "splitkv_decode_mma"
MMA_ROWS = 16
MMA_HEAD_DIMS = (64, 128)  # head_dim 256 would hold 128 fp32 accumulators per lane: CUDA-core kernel
IMPLS = ("mma", "fma")
HEAD_DIMS = (64, 128, 256)
MAX_QUERY_TOKENS = 8  # speculative decoding: 1..8 new tokens per request
_ROWS = (1, 2, 4, 8)
_LOG2E = 1.4426950408889634

_Q_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
# KV_DTYPE define: 0 bf16, 1 fp16, 2 e4m3fn, 3 e4m3fnuz
_KV_CODES = {torch.bfloat16: 0, torch.float16: 1}
for _name, _code in (("float8_e4m3fn", 2), ("float8_e4m3fnuz", 3)):
    if hasattr(torch, _name):
        _KV_CODES[getattr(torch, _name)] = _code
# The kernel decodes KV by shifting bits into fp32 fields; this power of two undoes it.
_FMT_FACTOR = {0: 1.0, 1: 2.0**112, 2: 2.0**120, 3: 2.0**119}


def _rows_max(kv_code: int) -> int:
    """Rows per CTA the registers hold (q and the accumulator: 16 floats per row per lane)."""
    return 8


@functools.lru_cache(maxsize=None)
def _variant(head_dim: int, rows: int, q_code: int, kv_code: int):
    from hip_kernels.runtime import Variant

    defines = {"HEAD_DIM": head_dim, "ROWS": rows, "Q_DTYPE": q_code, "KV_DTYPE": kv_code, "NUM_THREADS": NUM_THREADS}
    return Variant(SOURCE, KERNEL, defines)


def _mma_defaults(kv_code: int) -> dict:
    """Tuning of the tensor-core kernel (docs/perf/decode.md): warps per CTA, 16-key tiles per
    warp per chunk and ring depth. FP8 runs 2-warp CTAs, 4 per SM (5-6% faster than 4 warps at 2
    per SM: its loop is latency bound, more independent CTAs hide it); MMA_CTAS_PER_SM follows."""
    fp8 = kv_code >= 2
    return {"NUM_WARPS": 2 if fp8 else 4, "KTILES": 1, "STAGES": 3 if fp8 else 2, "MIN_CTAS": 1}


def _mma_variant(head_dim: int, q_code: int, kv_code: int, tune=None):
    from hip_kernels.runtime import Variant

    defines = {"HEAD_DIM": head_dim, "Q_DTYPE": q_code, "KV_DTYPE": kv_code, **_mma_defaults(kv_code), **(tune or {})}
    return Variant(MMA_SOURCE, MMA_KERNEL, defines)


@functools.lru_cache(maxsize=None)
def _mma_row_blocks(max_query_len: int, group: int) -> int:
    """16-row blocks of the tensor-core kernel per (request, kv head): query tokens x GQA heads."""
    return -(-(max_query_len * group) // MMA_ROWS)


def _mma_smem_bytes(variant) -> int:
    """Dynamic shared memory of a decode_mma.hip variant (mirrors SMEM_BYTES there)."""
    dd = dict(variant.defines)
    d, kv_bytes = int(dd["HEAD_DIM"]), (1 if int(dd["KV_DTYPE"]) >= 2 else 2)
    nw, kpw, nst = int(dd["NUM_WARPS"]), 16 * int(dd["KTILES"]), int(dd["STAGES"])
    keyb = d * kv_bytes
    stage = 2 * kpw * keyb + (2 * kpw * 4 if kv_bytes == 1 else 0)
    ring = nw * nst * stage
    merge = nw * MMA_ROWS * (d + 10) * 4  # rows D + 8 floats apart, then m and l
    return MMA_ROWS * d * 2 + max(ring, merge)


def _mma_threads(variant, device) -> int:
    """Threads per CTA of a decode_mma.hip variant: its NUM_WARPS warps."""
    return _mma_warps(variant) * _warp_size(device)


@functools.lru_cache(maxsize=None)
def _mma_warps(variant) -> int:
    return int(dict(variant.defines)["NUM_WARPS"])


def variants() -> list:
    """Every variant splitkv_decode can request (CI compiles them all for every arch)."""
    out = []
    for d in HEAD_DIMS:
        for q_code in (0, 1):
            for kv_code in (q_code, 2, 3):
                for rows in _ROWS:
                    if rows <= _rows_max(kv_code):
                        out.append(_variant(d, rows, q_code, kv_code))
                if d in MMA_HEAD_DIMS:
                    out.append(_mma_variant(d, q_code, kv_code))
    return out


def _mma_arch(arch: str) -> bool:
    """Archs whose atom_mma.h back end has tensor cores: mma.sync (sm_80+) or MFMA (gfx94x/950)."""
    if arch.startswith("sm_"):
        digits = "".join(ch for ch in arch[3:] if ch.isdigit())
        return bool(digits) and int(digits) >= 80
    from hip_kernels.runtime import is_mfma_arch

    return is_mfma_arch(arch)


@functools.lru_cache(maxsize=None)
def choose_impl(arch: str, head_dim: int, kv_code: int) -> str:
    """"mma" (tensor cores) or "fma" (CUDA-core kernel), from the H100 measurements in
    docs/perf/decode.md; "fma" where the mma variant's shared memory does not fit (gfx942 has
    64 KiB per workgroup: d=128 with 16-bit KV needs 68 KiB)."""
    from hip_kernels.runtime import max_dynamic_smem

    if head_dim in MMA_HEAD_DIMS and _mma_arch(arch) and \
            _mma_smem_bytes(_mma_variant(head_dim, 0, kv_code)) <= max_dynamic_smem(arch):
        return "mma"
    return "fma"


@functools.lru_cache(maxsize=None)  # per launch: a Variant costs ~10 us to build
def launch_variant(impl: str, head_dim: int, q_code: int, kv_code: int, rows_needed: int):
    """The variant splitkv_partials launches for `impl` and rows (query tokens x GQA group) per
    kv head: the registry's build selection asks this same function."""
    if impl == "mma":
        return _mma_variant(head_dim, q_code, kv_code)
    rows, _ = _pick_rows(rows_needed, kv_code)
    return _variant(head_dim, rows, q_code, kv_code)


def _pick_rows(rows_needed: int, kv_code: int) -> tuple[int, int]:
    """(rows per CTA, row blocks): the smallest variant holding every row, else row blocks."""
    cap = _rows_max(kv_code)
    for r in _ROWS:
        if r >= rows_needed or r == cap:
            return r, -(-rows_needed // r)
    raise AssertionError("unreachable")


def _div_magic(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31."""
    shift = (d - 1).bit_length()  # ceil(log2 d)
    magic = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return magic & 0xFFFFFFFF, shift


def _as_float(name: str, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.device.type != "cpu":
            raise ValueError(
                f"{name} must be a Python float (or a one-element CPU tensor): reading a device "
                "tensor would synchronise the host (pass layer._k_scale_float / _v_scale_float)"
            )
        return float(x.item())
    return float(x)


def _check_int32(name: str, t: torch.Tensor, ndim: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    es = t.element_size()
    if any((st * es) % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name}: the kernel reads 16-byte vectors; strides {t.stride()} x {es} bytes and the data pointer must be multiples of 16")


def _validate(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, kv_indptr, kv_page_indices,
              max_query_len, num_splits, window, sink_tokens, softcap, sinks,
              k_scale, v_scale, k_descale, v_descale):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [total_q, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is unsupported (bfloat16 or float16)")
    total_q, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is unsupported by the decode kernel ({HEAD_DIMS})")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} differ")
    num_blocks, block_size, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"cache head_dim {dk} != q head_dim {d}")
    if hk <= 0 or hq % hk:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hk}")
    if num_blocks <= 0 or not 1 <= block_size < 2**31 // 2:
        raise ValueError(f"cache of {num_blocks} blocks of {block_size} tokens")
    kv_code = _KV_CODES.get(k_cache.dtype)
    if kv_code is None:
        raise ValueError(f"KV dtype {k_cache.dtype} is unsupported (bf16, fp16, float8_e4m3fn, float8_e4m3fnuz)")
    if kv_code < 2 and k_cache.dtype != q.dtype:
        raise ValueError(f"16-bit KV must match q's dtype: KV {k_cache.dtype}, q {q.dtype}")
    per_tensor = k_scale is not None or v_scale is not None
    per_page = k_descale is not None or v_descale is not None
    if kv_code >= 2:
        if per_tensor == per_page:
            raise ValueError("an FP8 KV cache needs exactly one scale mode: k_scale and v_scale, or k_descale and v_descale")
        if per_tensor and (k_scale is None or v_scale is None):
            raise ValueError("give both k_scale and v_scale")
        if per_page:
            if k_descale is None or v_descale is None:
                raise ValueError("give both k_descale and v_descale")
            for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
                if t.dtype != torch.float32 or tuple(t.shape) != (num_blocks, hk) or not t.is_contiguous():
                    raise ValueError(f"{name} must be contiguous float32 [num_blocks={num_blocks}, num_kv_heads={hk}], got {t.dtype} {tuple(t.shape)}")
                if t.device != q.device:
                    raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    elif per_tensor or per_page:
        raise ValueError(f"KV scales only apply to an FP8 cache, the cache is {k_cache.dtype}")
    if not isinstance(max_query_len, int) or not 1 <= max_query_len <= MAX_QUERY_TOKENS:
        raise ValueError(f"max_query_len must be an int in 1..{MAX_QUERY_TOKENS}, got {max_query_len!r}")
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits must be an int in 1..65535, got {num_splits!r}")
    if window < 0 or sink_tokens < 0 or softcap < 0:
        raise ValueError(f"window={window}, sink_tokens={sink_tokens}, softcap={softcap} must be >= 0")
    if (block_table is None) == (kv_indptr is None):
        raise ValueError("give exactly one page table: block_table (vLLM) or kv_indptr + kv_page_indices (SGLang)")
    _check_int32("cu_seqlens_q", cu_seqlens_q, 1, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q needs batch + 1 entries")
    _check_int32("seq_lens", seq_lens, 1, q.device)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, cu_seqlens_q describes {batch} requests")
    if block_table is not None:
        _check_int32("block_table", block_table, 2, q.device)
        if block_table.shape[0] < batch or block_table.shape[1] < 1 or block_table.stride(1) != 1:
            raise ValueError(f"block_table must be [>= batch={batch}, >= 1] with contiguous rows, got {tuple(block_table.shape)} strides {block_table.stride()}")
    else:
        if kv_page_indices is None:
            raise ValueError("kv_indptr needs kv_page_indices")
        _check_int32("kv_indptr", kv_indptr, 1, q.device)
        _check_int32("kv_page_indices", kv_page_indices, 1, q.device)
        if kv_indptr.shape[0] != batch + 1:
            raise ValueError(f"kv_indptr has {kv_indptr.shape[0]} entries, expected batch + 1 = {batch + 1}")
        if kv_page_indices.stride(0) != 1 and kv_page_indices.numel() > 1:
            raise ValueError("kv_page_indices must be contiguous")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
                              or tuple(sinks.shape) != (hq,) or not sinks.is_contiguous() or sinks.device != q.device):
        raise ValueError(f"sinks must be contiguous float32 [num_q_heads={hq}] on {q.device}, got "
                         f"{getattr(sinks, 'dtype', type(sinks))} {tuple(getattr(sinks, 'shape', ()))}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_aligned(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    return batch, total_q, hq, hk, d, num_blocks, block_size, kv_code


# Counters of the tensor-core split kernel with several splits (the balanced mode's slice counter
# and the completion count that picks the CTA which combines): two int32 per (request, kv head,
# row block), zero between launches (the last CTA of each group resets its pair), from the
# per-stream runtime.workspace.semaphores. A graph that outlives its capture takes counters made
# outside it (SplitKVPlan(counters=...)).


# Splits the last CTA of a group still combines faster than a combine launch on fixed ranges
# (H100, docs/perf/decode.md: 8 x 32k at 4 splits -1.3 us; FP8 at 63 splits +5 us: fixed ranges end apart
# and the last CTA starts the combine late). Balanced splits end together: their last CTA
# combines up to 32 as fast as the combine kernel (1 x 128k / 1 x 64k at 32; at 64
# it is 3.6 us slower), and a CUDA graph sized for long contexts then keeps no combine launch
# for short ones (1 x 512 keys: 14.7 -> 12.6 us per layer).
FUSE_MAX_SPLITS = 16
FUSE_MAX_BALANCED_SPLITS = 32


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def balance_pays(q, k_cache, cu_seqlens_q, num_splits: int, max_query_len: int) -> bool:
    """Balanced splits where they pay (H100, docs/perf/decode.md): 16-bit KV, several
    splits and a grid that fills at least 90% of a wave. A full GPU is where SMs of unequal speed
    leave the slow ones finishing alone (8 x 32k -1.7%, 1 x 128k -2%); a partly filled one is
    latency bound, and the claims cost (6 x <=3k at 3 splits: +8%)."""
    if num_splits <= 1 or not isinstance(k_cache, torch.Tensor) or k_cache.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or k_cache.dim() != 4 or q.device.type != "cuda":
        return False
    hk = k_cache.shape[2]
    ctas = (cu_seqlens_q.shape[0] - 1) * hk * _mma_row_blocks(max_query_len, q.shape[1] // max(hk, 1)) * num_splits
    return 10 * ctas >= 9 * _num_sms(q.device) * MMA_CTAS_PER_SM[2]


def counter_elems(batch: int, num_q_heads: int, num_kv_heads: int, max_query_len: int) -> int:
    """int32 counters the tensor-core split kernel needs: two per (request, kv head, row block)."""
    return 2 * batch * num_kv_heads * _mma_row_blocks(max_query_len, num_q_heads // max(num_kv_heads, 1))


def workspace_elems(num_splits: int, total_q: int, num_q_heads: int, head_dim: int) -> int:
    """float32 elements of the workspace: o_partial [S, T, H, D] then lse_partial [S, T, H]."""
    return num_splits * total_q * num_q_heads * (head_dim + 1)


def _layout(t):
    """What a launch depends on besides the data pointer (None for an absent tensor)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class _Launch:
    """A layer layout's packed launches: the split kernel and, when it does not finish, the
    combine; `at` maps each tensor a layer brings to its argument positions."""

    __slots__ = ("split", "at", "scales_at", "combine", "combine_at", "out_vec", "o_part", "lse_part")

    def run(self, stream, q, k_cache, v_cache, out, lse_out, sinks, k_descale, v_descale, k_scale, v_scale) -> None:
        if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15:
            raise ValueError("q, k_cache and v_cache: the kernel reads 16-byte vectors; their data pointers must be "
                             "multiples of 16")
        if self.split is not None:
            p = self.split
            for i, t in zip(self.at, (q, k_cache, v_cache, k_descale, v_descale, out, lse_out, sinks)):
                if i >= 0:
                    p.put(i, t)
            if self.scales_at is not None:  # FP8 per-tensor scales: calibrated models differ per layer
                i, factor = self.scales_at
                p.put_f32(i, k_scale * factor)
                p.put_f32(i + 1, v_scale * factor)
            p.launch(stream)
        if self.combine is not None:
            if out.data_ptr() % self.out_vec:
                raise ValueError(f"combine: out must be {self.out_vec}-byte aligned")
            c = self.combine
            for i, t in zip(self.combine_at, (out, lse_out, sinks)):
                c.put(i, t)
            c.launch(stream)


class SplitKVPlan:
    """A decode batch planned once on the host and launched per layer (FlashInfer's plan / run).

    The batch (request bounds, page table, query tokens, split count, mode) is fixed here; `run`
    takes one layer's q, caches, out and parameters. The first call of each layer layout (shapes,
    strides, dtypes, parameters, stream) checks everything and packs the launch; the other layers
    of the batch only swap their tensors' pointers into it (docs/perf/decode.md, "host cost").
    The fp32 workspace is the plan's, sized for its largest layout, so a captured graph replays
    fixed buffers. balanced: None = where it pays (`balance_pays`), True = on (16-bit KV), False =
    fixed key ranges (bitwise repeatable). impl: None (choose_impl for the device), "mma" or "fma".
    workspace: fp32 buffer to use (>= workspace_elems), else the plan allocates one per stream and
    keeps every buffer it allocated while it lives: a graph captured from `run` must not outlive
    the plan. counters: zeroed int32 buffer (>= counter_elems) for the split kernel's completion
    and slice counters, else the per-stream `semaphores`; a graph that outlives the plan needs
    one allocated outside its capture (one made inside would come from the graph pool, where
    other graphs' temporaries may overwrite it). _tune / _source: bench builds only (extra defines of
    the split kernel; a source file to build instead of the shipped one, bench/overlay.py).
    """

    def __init__(self, cu_seqlens_q, seq_lens, block_table=None, *, kv_indptr=None, kv_page_indices=None,
                 max_query_len, num_splits, split_rule=(), balanced=None, impl=None, workspace=None,
                 counters=None, _tune=None, _source=None):
        rule = tuple(split_rule)
        if len(rule) > 6 or not all(isinstance(v, int) and v >= 0 for v in rule):
            raise ValueError(f"split_rule must be up to 6 ints >= 0 (planner.SplitRule), got {split_rule!r}")
        self.cu_seqlens_q, self.seq_lens, self.block_table = cu_seqlens_q, seq_lens, block_table
        self.kv_indptr, self.kv_page_indices = kv_indptr, kv_page_indices
        self.max_query_len, self.num_splits = max_query_len, num_splits
        self.split_rule = rule + (0,) * (6 - len(rule))
        self.balanced, self.impl, self._tune, self._source = balanced, impl, _tune, _source
        self._workspace = workspace
        self._counters = counters
        self._own: dict = {}  # stream -> workspace this plan allocated
        self._retired: list = []  # outgrown workspaces: launches captured earlier may still write them
        self._launches: dict = {}

    def run(self, q, k_cache, v_cache, *, out=None, lse_out=None, scale=None, window=0, sink_tokens=0, sinks=None,
            softcap=0.0, k_scale=None, v_scale=None, k_descale=None, v_descale=None) -> torch.Tensor:
        """Decode attention of one layer: `out` [total_q, num_q_heads, head_dim] in q's dtype
        (allocated when None); `lse_out` [total_q, num_q_heads] fp32, when given, receives the
        log-sum-exp without the sinks. Rows of q past cu_seqlens_q[-1] (graph padding) are
        unspecified."""
        if out is None and isinstance(q, torch.Tensor):
            out = torch.empty_like(q)
        self._launch(True, q, k_cache, v_cache, out, lse_out, scale, window, sink_tokens, sinks, softcap,
                     k_scale, v_scale, k_descale, v_descale)
        return out

    def partials(self, q, k_cache, v_cache, *, scale=None, window=0, sink_tokens=0, softcap=0.0, k_scale=None,
                 v_scale=None, k_descale=None, v_descale=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The split kernel alone: fp32 (o_partial [S, T, H, D], lse_partial [S, T, H]), no sinks.
        Views of the plan's workspace: the plan's next launch on this stream overwrites them."""
        la = self._launch(False, q, k_cache, v_cache, None, None, scale, window, sink_tokens, None, softcap,
                          k_scale, v_scale, k_descale, v_descale)
        return la.o_part, la.lse_part

    def _launch(self, final, q, k_cache, v_cache, out, lse_out, scale, window, sink_tokens, sinks, softcap,
                k_scale, v_scale, k_descale, v_descale) -> _Launch:
        if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
            self._check(q, k_cache, v_cache, window, sink_tokens, softcap, sinks, k_scale, v_scale, k_descale,
                        v_descale)  # raises the clear error
        if k_scale is not None and type(k_scale) is not float:
            k_scale = _as_float("k_scale", k_scale)
        if v_scale is not None and type(v_scale) is not float:
            v_scale = _as_float("v_scale", v_scale)
        stream = _stream(q)
        # k_scale / v_scale values are swapped per call (calibrated FP8 models differ per layer).
        key = (final, _layout(q), _layout(k_cache), _layout(v_cache), _layout(out), _layout(lse_out), _layout(sinks),
               _layout(k_descale), _layout(v_descale), scale, window, sink_tokens, softcap, k_scale is None,
               v_scale is None, stream)
        la = self._launches.get(key)
        if la is None:
            la = self._prepare(final, q, k_cache, v_cache, out, lse_out, scale, window, sink_tokens, sinks, softcap,
                               k_scale, v_scale, k_descale, v_descale, stream)
            self._launches[key] = la
        la.run(stream, q, k_cache, v_cache, out, lse_out, sinks, k_descale, v_descale, k_scale, v_scale)
        return la

    def _check(self, q, k_cache, v_cache, window, sink_tokens, softcap, sinks, k_scale, v_scale, k_descale, v_descale):
        return _validate(q, k_cache, v_cache, self.cu_seqlens_q, self.seq_lens, self.block_table, self.kv_indptr,
                         self.kv_page_indices, self.max_query_len, self.num_splits, window, sink_tokens, softcap,
                         sinks, k_scale, v_scale, k_descale, v_descale)

    def _workspace_for(self, need: int, device, stream: int) -> torch.Tensor:
        ws = self._workspace
        if ws is not None:
            if ws.dtype != torch.float32 or not ws.is_contiguous() or ws.numel() < need or ws.device != device:
                raise ValueError(f"workspace must be a contiguous float32 tensor on {device} with >= {need} elements "
                                 "(workspace_elems)")
            return ws
        ws = self._own.get(stream)
        if ws is None or ws.numel() < need or ws.device != device:
            # Launches packed earlier point into the old buffer: they are packed again when used.
            self._launches.clear()
            if ws is not None:
                self._retired.append(ws)
            ws = self._own[stream] = torch.empty(need, dtype=torch.float32, device=device)
        return ws

    def _prepare(self, final, q, k_cache, v_cache, out, lse_out, scale, window, sink_tokens, sinks, softcap,
                 k_scale, v_scale, k_descale, v_descale, stream) -> _Launch:
        num_splits = self.num_splits
        if final:
            if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
                raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
                                 f"{None if out is None else (tuple(out.shape), out.dtype)}")
            if out.stride(2) != 1:
                raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
            if lse_out is not None and (tuple(lse_out.shape) != tuple(q.shape[:2]) or lse_out.dtype != torch.float32
                                        or not lse_out.is_contiguous()):
                raise ValueError(f"lse_out must be contiguous float32 {tuple(q.shape[:2])}, got {lse_out.dtype} "
                                 f"{tuple(lse_out.shape)}")
        batch, total_q, hq, hk, d, num_blocks, block_size, kv_code = self._check(
            q, k_cache, v_cache, window, sink_tokens, softcap, sinks, k_scale, v_scale, k_descale, v_descale)
        fmt = _FMT_FACTOR[kv_code]
        if k_scale is not None:
            kf, vf = k_scale * fmt, v_scale * fmt
        else:
            kf = vf = fmt
        flat = self._workspace_for(workspace_elems(num_splits, total_q, hq, d), q.device, stream).view(-1)
        if q.device.type != "cuda":
            raise ValueError(f"the decode kernel runs on a GPU; q is on {q.device}")
        n_o = num_splits * total_q * hq * d
        la = _Launch()
        la.o_part = flat[:n_o].view(num_splits, total_q, hq, d)
        la.lse_part = flat[n_o:n_o + num_splits * total_q * hq].view(num_splits, total_q, hq)
        la.split = la.combine = la.scales_at = None
        la.at = ()
        done = False
        if batch > 0 and total_q > 0:
            done = self._pack_split(la, final, q, k_cache, v_cache, out, lse_out, sinks, k_descale, v_descale,
                                    batch, total_q, hq, hk, d, num_blocks, block_size, kv_code, kf, vf, k_scale,
                                    v_scale, scale, window, sink_tokens, softcap)
        if final and not done and total_q > 0:
            from hip_kernels import combine

            la.combine = combine.packed(la.o_part, la.lse_part, out, lse_out, sinks)
            la.combine_at = combine.LAYER_ARGS
            la.out_vec = combine.out_alignment(out)
        return la

    def _pack_split(self, la, final, q, k_cache, v_cache, out, lse_out, sinks, k_descale, v_descale, batch,
                    total_q, hq, hk, d, num_blocks, block_size, kv_code, kf, vf, k_scale, v_scale, scale, window,
                    sink_tokens, softcap) -> bool:
        """Packs the split kernel into `la`; True when it finishes the decode itself."""
        from hip_kernels import runtime

        num_splits, max_query_len, impl = self.num_splits, self.max_query_len, self.impl
        if impl is None:
            impl = choose_impl(runtime.device_arch(q.device), d, kv_code)
        if impl not in IMPLS or (impl == "mma" and d not in MMA_HEAD_DIMS):
            raise ValueError(f"impl={impl!r}: one of {IMPLS} (mma for head_dim {MMA_HEAD_DIMS})")
        group = hq // hk
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        softcap = float(softcap)
        magic, shift = _div_magic(block_size)
        kes, ves = k_cache.element_size(), v_cache.element_size()
        bt = self.block_table
        # Argument 0: q, 3: k_cache, 4: v_cache, 19: k_descale, 20: v_descale (the layer's tensors).
        head = [
            q, q.stride(0), q.stride(1),
            k_cache, v_cache,
            k_cache.stride(0) * kes, k_cache.stride(1) * kes, k_cache.stride(2) * kes,
            v_cache.stride(0) * ves, v_cache.stride(1) * ves, v_cache.stride(2) * ves, num_blocks,
            self.cu_seqlens_q, self.seq_lens,
            bt, bt.stride(0) if bt is not None else 0, bt.shape[1] if bt is not None else 0,
            self.kv_indptr, self.kv_page_indices if self.kv_indptr is not None else None,
            k_descale, v_descale,
        ]
        tail = [
            scale * (_LOG2E if softcap == 0 else 1.0),
            softcap * _LOG2E, (1.0 / softcap) if softcap > 0 else 0.0,
            int(window), int(sink_tokens), *self.split_rule,
        ]
        layer_at = [0, 3, 4, 19, 20]
        if impl == "mma":
            # FP8: the kernel converts e4m3 to its value (flavour handled in the kernel); per-page
            # factors come from k_descale / v_descale, so the per-tensor factors are then 1.
            mkf, mvf = (k_scale, v_scale) if kv_code >= 2 and k_scale is not None else (1.0, 1.0)
            row_blocks = _mma_row_blocks(max_query_len, group)
            var = launch_variant(impl, d, _Q_DTYPES[q.dtype], kv_code, max_query_len * group)
            if self._tune or self._source:  # a bench build: extra defines, another source file
                var = _mma_variant(d, _Q_DTYPES[q.dtype], kv_code, self._tune)
                var = type(var)(self._source or var.source, var.kernel, var.defines)
            balanced = self.balanced
            if balanced is None:
                balanced = balance_pays(q, k_cache, self.cu_seqlens_q, num_splits, max_query_len)
            balanced = bool(balanced) and kv_code < 2  # the kernel balances 16-bit KV only
            # One split writes the output itself; several count their CTAs and the last of each
            # group combines: up to FUSE_MAX_SPLITS, FUSE_MAX_BALANCED_SPLITS when balanced.
            done = final and num_splits <= (FUSE_MAX_BALANCED_SPLITS if balanced else FUSE_MAX_SPLITS)
            sem = None
            if num_splits > 1 and (done or balanced):
                need = counter_elems(batch, hq, hk, max_query_len)
                sem = self._counters if self._counters is not None else semaphores(q.device, need)
                if sem.dtype != torch.int32 or not sem.is_contiguous() or sem.numel() < need or sem.device != q.device:
                    raise ValueError(f"counters must be a contiguous int32 tensor on {q.device} with >= {need} "
                                     "elements (counter_elems), zeroed")
            fin = [out, out.stride(0), out.stride(1), lse_out, sinks] if done else [None, 0, 0, None, None]
            args = head + [mkf, mvf, la.o_part, la.lse_part] + fin + [
                total_q, hq, hk, group, row_blocks, num_splits, block_size, magic, shift] + tail + [sem, int(balanced)]
            n0 = len(head) + 4
            layer_at += [n0, n0 + 3, n0 + 4] if done else [-1, -1, -1]
            if kv_code >= 2 and k_scale is not None:
                la.scales_at = (len(head), 1.0)
            la.split = runtime.Packed(runtime.load(var, q.device), (hk * row_blocks, batch, num_splits),
                                      (_mma_threads(var, q.device), 1, 1), args, shared_mem=_mma_smem_bytes(var))
            la.at = tuple(layer_at)
            return done
        _, row_blocks = _pick_rows(max_query_len * group, kv_code)
        var = launch_variant(impl, d, _Q_DTYPES[q.dtype], kv_code, max_query_len * group)
        if self._tune or self._source:  # a bench build: extra defines (UNROLL, STAGES), another source file
            var = type(var)(self._source or SOURCE, KERNEL, {**dict(var.defines), **(self._tune or {})})
        args = head + [kf, vf, _FMT_FACTOR[kv_code], la.o_part, la.lse_part, total_q, hq, hk, group, row_blocks,
                       num_splits, block_size, magic, shift] + tail
        la.split = runtime.Packed(runtime.load(var, q.device), (hk * row_blocks, batch, num_splits),
                                  (NUM_THREADS, 1, 1), args)
        la.at = tuple(layer_at + [-1, -1, -1])
        if k_scale is not None:
            la.scales_at = (len(head), _FMT_FACTOR[kv_code])
        return False


def _warp_size(device) -> int:
    from hip_kernels.runtime import device_arch, warp_size

    return warp_size(device_arch(device))


def _stream(q) -> int:
    from hip_kernels import runtime

    return runtime.current_stream(q.get_device()) if q.is_cuda else 0


def splitkv_partials(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table=None, *, kv_indptr=None, kv_page_indices=None,
    max_query_len, num_splits, split_rule=(), scale=None, window=0, sink_tokens=0, softcap=0.0, k_scale=None,
    v_scale=None, k_descale=None, v_descale=None, workspace=None, impl=None, _tune=None, _source=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel alone, once, over fixed key ranges (docs/design.md's split ranges, bitwise
    repeatable): SplitKVPlan(..., balanced=False).partials(...)."""
    plan = SplitKVPlan(cu_seqlens_q, seq_lens, block_table, kv_indptr=kv_indptr, kv_page_indices=kv_page_indices,
                       max_query_len=max_query_len, num_splits=num_splits, split_rule=split_rule,
                       balanced=False, impl=impl, workspace=workspace, _tune=_tune, _source=_source)
    return plan.partials(q, k_cache, v_cache, scale=scale, window=window, sink_tokens=sink_tokens, softcap=softcap,
                         k_scale=k_scale, v_scale=v_scale, k_descale=k_descale, v_descale=v_descale)


def splitkv_decode(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table=None, *, kv_indptr=None, kv_page_indices=None,
    max_query_len, num_splits, split_rule=(), scale=None, window=0, sink_tokens=0, sinks=None, softcap=0.0,
    k_scale=None, v_scale=None, k_descale=None, v_descale=None, out=None, lse_out=None, workspace=None, impl=None,
    balanced=None,
) -> torch.Tensor:
    """Decode attention of 1..max_query_len new tokens per request over the paged cache, once:
    SplitKVPlan(...).run(...). A caller launching several layers on one batch keeps the plan."""
    plan = SplitKVPlan(cu_seqlens_q, seq_lens, block_table, kv_indptr=kv_indptr, kv_page_indices=kv_page_indices,
                       max_query_len=max_query_len, num_splits=num_splits, split_rule=split_rule,
                       balanced=balanced, impl=impl, workspace=workspace)
    return plan.run(q, k_cache, v_cache, out=out, lse_out=lse_out, scale=scale, window=window,
                    sink_tokens=sink_tokens, sinks=sinks, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
                    k_descale=k_descale, v_descale=v_descale)


# CTAs of one variant that fit on an SM at once (H100: registers and shared memory of the
# default variants, from the compile report), by rows per CTA (the CUDA-core kernel; the
# benchmarks size its splits in these units).
_CTAS_PER_SM = {1: 4, 2: 4, 4: 3, 8: 2}
# The tensor-core kernel at head_dim 128, by KV bytes per element: 16-bit KV runs 4 warps of ~200
# registers (2 CTAs per SM), FP8 2 warps (4 per SM). The planner mirrors it
# (atom_backend.planning.Platform.decode_ctas_per_sm / decode_ctas_per_sm_fp8).
MMA_CTAS_PER_SM = {2: 2, 1: 4}


