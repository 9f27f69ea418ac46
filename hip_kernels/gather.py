"""Paged KV cache -> packed K/V for the varlen prefill path (kernel: src/gather.hip).

``gather_kv(k_cache, v_cache, cu_seqlens_k, total_kv, block_table=... | kv_indptr=..., kv_page_indices=...)``
returns ``(k, v)`` of shape ``[total_kv, num_kv_heads, head_dim]``: rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` are key positions 0.. of request ``seq_ids[i]`` (default i).
``total_kv`` is the host-known ``cu_seqlens_k[-1]`` (the planner's ``gather_tokens``): the grid is
sized from it, so nothing reads device memory back. FP8 caches (e4m3, the platform's native
flavour, or uint8 holding it) are dequantised to ``out_dtype`` (default bf16) with a per-tensor
``k_scale``/``v_scale`` (float or 1-element fp32 tensor) or per-page ``k_descale``/``v_descale``
``[num_blocks, num_kv_heads]``.

``gather_kv_fp8(...)`` copies an e4m3 cache as it is into the layout of the FP8 prefill (``PackedFp8``:
K, V transposed in the key order of the device's FP8 MMA; per-key scales in the per-page modes, a
(k, v) pair per tensor), see ``FP8_ALIGN``,
``FP8_KEY_ORDERS`` and src/fp8_pack.h.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import runtime
from .runtime import Variant

SOURCE = "gather.hip"
KERNEL = "atom_gather_kv"
FP8_KERNEL = "atom_gather_kv_fp8"  # e4m3 bytes into the FP8 prefill's layout (gather_kv_fp8)
V_REF_KERNEL = "atom_fp8_v_ref"  # per-page scales: each request's largest V scale, before FP8_KERNEL (long requests)
THREADS = 256
MAX_ROWS = 256
_ITEMS_PER_BLOCK = 2048  # 16-byte chunks per block: 8 per thread, enough loads in flight

_OUT = {torch.bfloat16: 1, torch.float16: 2}
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8)


@functools.lru_cache(maxsize=None)
def variant(layout: str, fp8: bool, out_dtype: torch.dtype = torch.bfloat16, scale: str = "per_tensor") -> Variant:
    """layout 'vllm' | 'sglang'; fp8 False -> 16-bit byte copy; scale 'per_tensor' | 'per_page'."""
    d = {"GATHER_LAYOUT": {"vllm": 0, "sglang": 1}[layout], "GATHER_FP8": int(fp8)}
    if fp8:
        d["GATHER_OUT"] = _OUT[out_dtype]
        d["GATHER_SCALE"] = {"per_tensor": 1, "per_page": 2}[scale]
    return Variant(SOURCE, KERNEL, d)


@functools.lru_cache(maxsize=None)
def fp8_variant(layout: str, scale: str) -> Variant:
    """The FP8-layout gather (atom_gather_kv_fp8): layout 'vllm' | 'sglang', scale 'per_tensor' | 'per_page'."""
    return Variant(SOURCE, FP8_KERNEL, {"GATHER_LAYOUT": {"vllm": 0, "sglang": 1}[layout],
                                                  "GATHER_SCALE": {"per_tensor": 1, "per_page": 2}[scale]})


@functools.lru_cache(maxsize=None)
def v_ref_variant(layout: str) -> Variant:
    """The per-request V reference of per-page scales (atom_fp8_v_ref), layout 'vllm' | 'sglang'."""
    return Variant(SOURCE, V_REF_KERNEL, {"GATHER_LAYOUT": {"vllm": 0, "sglang": 1}[layout], "GATHER_SCALE": 2})


def variants() -> list[Variant]:
    out = []
    for layout in ("vllm", "sglang"):
        out.append(variant(layout, False))
        for od in _OUT:
            for sc in ("per_tensor", "per_page"):
                out.append(variant(layout, True, od, sc))
        for sc in ("per_tensor", "per_page"):
            out.append(fp8_variant(layout, sc))
        out.append(v_ref_variant(layout))
    return out


# The FP8 prefill's K/V layout (src/fp8_pack.h). Every request starts at a multiple of FP8_ALIGN rows
# (the Hopper kernel's 128-key tile, so a 128-row block of keys is one tile of one request); per-page
# V scales are stored relative to their request's largest (per head, in v_max); within each 32 keys,
# V^T holds key FP8_KEY_ORDERS[order][p] at position p: the order in which P's accumulators, as they
# stand, are the e4m3 left operand of P V on the device (atom_mma.h to_operand_fp8, fp8_p_key).
#   "nvidia": wgmma k32 (the Hopper kernel) and mma.sync m16n8k32 (the portable body, sm_89+) take
#             the same A fragment: lane q = lane % 4 holds keys 2q, 2q+1, 8+2q, 9+2q of each 16.
#   "mfma":   MFMA 16x16x32 fp8 (the portable body on gfx942 / gfx950): lane group q = lane / 16
#             holds keys 4q..4q+3 and 16+4q..16+4q+3 of each 32 as its K-bytes 8q..8q+7.
FP8_ALIGN = 128
# Per-page packs: requests of at most this many pages take their V reference (largest V scale) inside
# the gather, every 128-row block reading all of its request's pages with half of its threads while the
# other half resolves its rows (2048: 16 loads a thread); longer ones a pre-pass that reads each page
# once (atom_fp8_v_ref).
FP8_INLINE_REF_PAGES = 2048
FP8_KEY_ORDERS = {
    "nvidia": tuple(16 * (p >> 4) + 2 * ((p >> 2) & 3) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(32)),
    "mfma": tuple(4 * (p >> 3) + (p & 3) + 16 * ((p >> 2) & 1) for p in range(32)),
}


def fp8_key_order(arch: str) -> str:
    """The V^T key order gather_kv_fp8 writes on `arch` (the kernels' ATOM_MFMA decides it)."""
    return "mfma" if runtime.is_mfma_arch(arch) else "nvidia"


class PackedFp8(NamedTuple):
    """Packed e4m3 K/V for the FP8 prefill (hip_kernels.prefill.varlen_attention with kv=...)."""

    k: torch.Tensor  # [total_pad, H, D] e4m3
    vt: torch.Tensor  # [H, D, total_pad] e4m3, keys of every 32 in FP8_KEY_ORDERS[order]
    cu_kp: torch.Tensor  # int32 [n + 1]: first row of each request (multiples of FP8_ALIGN)
    scale: str  # "per_tensor" | "per_page" (a scale per key) | "per_page16" (pages of a multiple of 16 keys)
    kv_scale: torch.Tensor | None  # per_tensor: fp32 [2] (k, v)
    key_scales: torch.Tensor | None  # per_page: fp32 [H, total_pad / 128, 2, 128] (lane order)
    v_max: torch.Tensor | None  # per_page: fp32 [H, total_pad / 128], each block its request's largest V scale
    order: str = "nvidia"  # V^T's key order (fp8_key_order of the device that packed it)


def fp8_padded_starts(seqlens_k) -> list[int]:
    """Host: the cu_kp of FP8_ALIGN-aligned requests of these key counts (n + 1 entries)."""
    out = [0]
    for n in seqlens_k:
        out.append(out[-1] + -(-int(n) // FP8_ALIGN) * FP8_ALIGN)
    return out


def fp8_lane_order() -> torch.Tensor:
    """index [128]: the key of a 128-key block whose scale sits at position i (src/gather.hip)."""
    j = torch.arange(FP8_ALIGN)
    pos = 32 * ((j >> 1) & 3) + 4 * (j >> 4) + 2 * ((j >> 3) & 1) + (j & 1)
    return torch.empty_like(j).scatter_(0, pos, j)


def _check_i32(name: str, t: torch.Tensor | None, dev: torch.device, ndim: int) -> None:
    if t is None:
        return
    if t.dtype != torch.int32:
        raise TypeError(f"gather_kv: {name} must be int32, got {t.dtype}")
    if t.device != dev:
        raise ValueError(f"gather_kv: {name} is on {t.device}, cache on {dev}")
    if t.dim() != ndim:
        raise ValueError(f"gather_kv: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"gather_kv: {name} must be contiguous in its last dim")


def _scale_arg(name: str, s, dev):
    """(pointer tensor or None, value) for a per-tensor scale given as float or tensor."""
    if s is None:
        return None, 1.0
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != dev:
            raise ValueError(f"gather_kv: {name} tensor must be one fp32 element on {dev}")
        return s, 1.0
    return None, _host_scale(name, s)


def _host_scale(name: str, s) -> float:
    """A per-tensor scale given as a host number: finite and >= 0 (a NaN would reach every logit;
    a device tensor's value is not read here, that would sync)."""
    x = float(s)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"gather_kv: {name} must be a finite scale >= 0, got {s!r}")
    return x


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_kv: int,
    *,
    block_table: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_page_indices: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale=None,
    v_scale=None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    check_pages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (k, v). check_pages=True also validates page ids on the device (syncs: debug only)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"gather_kv: caches must both be [num_blocks, page_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("gather_kv: k_cache and v_cache must share dtype and strides")
    num_blocks, page_size, heads, dim = k_cache.shape
    dev = k_cache.device
    fp8 = k_cache.dtype in _FP8
    if fp8:
        out_dtype = out_dtype or torch.bfloat16
        if out_dtype not in _OUT:
            raise TypeError(f"gather_kv: fp8 dequantises to bf16 or fp16, not {out_dtype}")
    else:
        if k_cache.dtype not in _OUT:
            raise TypeError(f"gather_kv: cache dtype {k_cache.dtype} unsupported (bf16, fp16, e4m3)")
        if out_dtype not in (None, k_cache.dtype):
            raise TypeError(f"gather_kv: a {k_cache.dtype} cache is copied as is; out_dtype {out_dtype} differs")
        if any(x is not None for x in (k_scale, v_scale, k_descale, v_descale)):
            raise ValueError("gather_kv: scales are only meaningful for an fp8 cache")
        out_dtype = k_cache.dtype
    esz = k_cache.element_size()
    if k_cache.stride(3) != 1 or (dim * esz) % 16:
        raise ValueError(f"gather_kv: head_dim must be contiguous and a multiple of 16 bytes ({dim} x {esz} B)")
    for s in k_cache.stride()[:3]:
        if (s * esz) % 16:
            raise ValueError(f"gather_kv: cache strides {k_cache.stride()} are not multiples of 16 bytes")
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.data_ptr() % 16:
            raise ValueError(f"gather_kv: {n} is not 16-byte aligned")

    num_seqs, layout, table, indptr, table_stride = _table_args(dev, cu_seqlens_k, seq_ids, block_table, kv_indptr,
                                                                kv_page_indices)
    total_kv = int(total_kv)
    if total_kv < 0 or (num_seqs == 0 and total_kv):
        raise ValueError("gather_kv: total_kv must be >= 0 (0 without requests)")

    scale = "per_tensor"
    kptr = vptr = None
    kval = vval = 1.0
    if fp8:
        if _per_page("gather_kv", k_scale, v_scale, k_descale, v_descale, num_blocks, heads, dev):
            scale, kptr, vptr = "per_page", k_descale, v_descale
        else:
            kptr, kval = _scale_arg("k_scale", k_scale, dev)
            vptr, vval = _scale_arg("v_scale", v_scale, dev)

    if dev.type != "cuda":
        raise ValueError(f"gather_kv: caches must be on a GPU, got {dev}")
    if fp8:
        arch = _arch(dev)
        native = runtime.native_fp8_dtype(arch)
        if k_cache.dtype not in (native, torch.uint8):
            raise TypeError(f"gather_kv: {arch} converts {native} natively, cache is {k_cache.dtype}")
    shape = (total_kv, heads, dim)
    k_out = _out("k_out", k_out, shape, out_dtype, dev)
    v_out = _out("v_out", v_out, shape, out_dtype, dev)
    if check_pages:
        _check_pages_on_device(layout, table, indptr, cu_seqlens_k, seq_ids, page_size, num_blocks, total_kv)
    if total_kv == 0:
        return k_out, v_out

    cpr = heads * dim * esz // (8 if fp8 else 16)  # work items per row (gather.hip IN_CHUNK)
    rows = max(1, min(MAX_ROWS, _ITEMS_PER_BLOCK // cpr))
    grid = (total_kv + rows - 1) // rows
    kern = runtime.load(variant(layout, fp8, out_dtype, scale), dev)
    kern(
        grid, THREADS,
        k_out, v_out, k_cache, v_cache, cu_seqlens_k, seq_ids, table, indptr,
        kptr, vptr, kval, vval,
        total_kv, num_seqs, table_stride, page_size,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        heads, dim, rows,
    )
    return k_out, v_out


def _per_page(who, k_scale, v_scale, k_descale, v_descale, num_blocks, heads, dev) -> bool:
    """True for per-page-per-head scales (k_descale / v_descale [num_blocks, H], checked), False for
    per-tensor ones (k_scale / v_scale or none); mixing the two is an error."""
    if k_descale is None and v_descale is None:
        return False
    if k_descale is None or v_descale is None or k_scale is not None or v_scale is not None:
        raise ValueError(f"{who}: per-page scales need both k_descale and v_descale and no k/v_scale")
    for n, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t.shape != (num_blocks, heads) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{who}: {n} must be contiguous fp32 [{num_blocks}, {heads}] on {dev}")
    return True


def _table_args(dev, cu_seqlens_k, seq_ids, block_table, kv_indptr, kv_page_indices):
    """(num_seqs, layout, table, indptr, table_stride) of a vLLM block table or SGLang page list."""
    _check_i32("cu_seqlens_k", cu_seqlens_k, dev, 1)
    _check_i32("seq_ids", seq_ids, dev, 1)
    num_seqs = cu_seqlens_k.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("gather_kv: cu_seqlens_k needs at least one element")
    if seq_ids is not None and seq_ids.shape[0] != num_seqs:
        raise ValueError(f"gather_kv: seq_ids has {seq_ids.shape[0]} entries, cu_seqlens_k names {num_seqs}")
    if block_table is not None:
        if kv_indptr is not None or kv_page_indices is not None:
            raise ValueError("gather_kv: pass block_table (vLLM) or kv_indptr + kv_page_indices (SGLang), not both")
        _check_i32("block_table", block_table, dev, 2)
        layout, table, indptr, table_stride = "vllm", block_table, None, block_table.stride(0)
    elif kv_indptr is not None and kv_page_indices is not None:
        _check_i32("kv_indptr", kv_indptr, dev, 1)
        _check_i32("kv_page_indices", kv_page_indices, dev, 1)
        layout, table, indptr, table_stride = "sglang", kv_page_indices, kv_indptr, 0
    else:
        raise ValueError("gather_kv: need block_table, or kv_indptr and kv_page_indices")
    if seq_ids is None and layout == "vllm" and block_table.shape[0] < num_seqs:
        raise ValueError(f"gather_kv: block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    if seq_ids is None and layout == "sglang" and kv_indptr.shape[0] < num_seqs + 1:
        raise ValueError(f"gather_kv: kv_indptr has {kv_indptr.shape[0]} entries for {num_seqs} sequences "
                         f"(needs {num_seqs + 1})")
    return num_seqs, layout, table, indptr, table_stride


def gather_kv_fp8(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_kp: torch.Tensor,
    total_pad: int,
    *,
    block_table: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_page_indices: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale=None,
    v_scale=None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    check_pages: bool = False,
    max_seqlen_k: int | None = None,
) -> PackedFp8:
    """An e4m3 cache's keys in the FP8 prefill's layout (PackedFp8), bytes unchanged.

    cu_kp: device int32 [n + 1] from fp8_padded_starts (host lengths); total_pad its last entry (a
    host int). Scales as for gather_kv: per tensor (k_scale / v_scale, floats or one-element fp32
    tensors) or per page (k_descale / v_descale [num_blocks, H]). check_pages: as for gather_kv.
    max_seqlen_k (host int, optional): the longest request's keys; per page, requests of at most
    FP8_INLINE_REF_PAGES pages then take their V reference inside the gather (no pre-pass)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError("gather_kv_fp8: caches must both be [num_blocks, page_size, kv_heads, head_dim], alike")
    num_blocks, page_size, heads, dim = k_cache.shape
    dev = k_cache.device
    if dev.type != "cuda":
        raise ValueError(f"gather_kv_fp8: caches must be on a GPU, got {dev}")
    arch = _arch(dev)
    native = runtime.native_fp8_dtype(arch)
    if k_cache.dtype not in (native, torch.uint8):
        raise TypeError(f"gather_kv_fp8: the cache must be {native} (or uint8 holding it), got {k_cache.dtype}")
    if k_cache.stride(3) != 1 or dim % 16 or dim > 256 or any(st % 16 for st in k_cache.stride()[:3]) \
            or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        raise ValueError(f"gather_kv_fp8: head_dim ({dim}) and strides {k_cache.stride()} must be multiples of 16 "
                         "bytes (head_dim <= 256), pointers 16-byte aligned")
    num_seqs, layout, table, indptr, table_stride = _table_args(dev, cu_seqlens_k, seq_ids, block_table, kv_indptr,
                                                                kv_page_indices)
    _check_i32("cu_kp", cu_kp, dev, 1)
    total_pad = int(total_pad)
    if cu_kp.shape != cu_seqlens_k.shape or total_pad < 0 or total_pad % FP8_ALIGN or (num_seqs == 0 and total_pad):
        raise ValueError(f"gather_kv_fp8: cu_kp must match cu_seqlens_k and end at a multiple of {FP8_ALIGN} "
                         "(0 without requests)")
    if check_pages:
        cu_h = cu_seqlens_k.cpu().tolist()
        _check_fp8_starts(cu_h, cu_kp.cpu().tolist(), total_pad)
        _check_pages_on_device(layout, table, indptr, cu_seqlens_k, seq_ids, page_size, num_blocks, cu_h[-1])
    blocks = total_pad // FP8_ALIGN
    k8 = torch.empty((total_pad, heads, dim), dtype=k_cache.dtype, device=dev)
    vt8 = torch.empty((heads, dim, total_pad), dtype=k_cache.dtype, device=dev)
    kv_scale = key_scales = v_max = v_ref = None
    if _per_page("gather_kv_fp8", k_scale, v_scale, k_descale, v_descale, num_blocks, heads, dev):
        scale = "per_page16" if page_size % 16 == 0 else "per_page"  # every 16 keys in one page
        key_scales = torch.empty((heads, blocks, 2, FP8_ALIGN), dtype=torch.float32, device=dev)
        v_max = torch.empty((heads, blocks), dtype=torch.float32, device=dev)
        inline_ref = max_seqlen_k is not None and -(-int(max_seqlen_k) // page_size) <= FP8_INLINE_REF_PAGES
        if not inline_ref:
            v_ref = torch.zeros((num_seqs, heads), dtype=torch.float32, device=dev)  # atomic maxes land here
    else:
        scale = "per_tensor"
        kv_scale = _pair(k_scale, v_scale, dev)
    out = PackedFp8(k8, vt8, cu_kp, scale, kv_scale, key_scales, v_max, fp8_key_order(arch))
    if blocks == 0:
        return out
    if v_ref is not None:
        runtime.load(v_ref_variant(layout), dev)(blocks, THREADS, v_ref, cu_seqlens_k, cu_kp,
                                                  seq_ids, table, indptr, v_descale, num_seqs, table_stride,
                                                  page_size, heads)
    kern = runtime.load(fp8_variant(layout, "per_tensor" if scale == "per_tensor" else "per_page"), dev)
    kern((blocks, heads), THREADS, k8, vt8, key_scales, v_max, k_cache, v_cache, cu_seqlens_k, cu_kp, seq_ids, table,
         indptr, k_descale, v_descale, v_ref, total_pad, num_seqs, table_stride, page_size,
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), heads, dim)
    return out


def _pair(k_scale, v_scale, dev) -> torch.Tensor:
    """fp32 [2] (k, v) on dev from floats or one-element tensors (1.0 where None)."""
    parts = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(x, torch.Tensor):
            if x.numel() != 1 or x.device != dev:
                raise ValueError(f"gather_kv_fp8: {name} tensor must have one element on {dev}")
            parts.append(x.reshape(1).to(torch.float32))
        else:
            parts.append(torch.full((1,), 1.0 if x is None else _host_scale(name, x), dtype=torch.float32, device=dev))
    return torch.cat(parts)


def _out(name, t, shape, dtype, dev):
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
        raise ValueError(f"gather_kv: {name} must be contiguous {dtype} {list(shape)} on {dev}, got "
                         f"{t.dtype} {list(t.shape)} on {t.device}")
    if t.data_ptr() % 16:
        raise ValueError(f"gather_kv: {name} is not 16-byte aligned")
    return t


_arch_cache: dict[int, str] = {}


def _arch(dev: torch.device) -> str:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _arch_cache:
        _arch_cache[idx] = runtime.device_arch(idx)
    return _arch_cache[idx]


def _check_fp8_starts(cu_h: list, cu_kp_h: list, total_pad: int) -> None:
    """cu_kp (fp8_padded_starts) gives every request room for its keys from a multiple of FP8_ALIGN,
    and ends at total_pad: else a request's last rows would be read as the next one's."""
    if cu_kp_h[0] != 0 or cu_kp_h[-1] != total_pad or any(
            p % FP8_ALIGN or q - p < b - a for a, b, p, q in zip(cu_h, cu_h[1:], cu_kp_h, cu_kp_h[1:])):
        raise ValueError(f"gather_kv_fp8: cu_kp must start at 0, give each request its keys from a multiple of "
                         f"{FP8_ALIGN} and end at total_pad={total_pad} (fp8_padded_starts)")


def _check_pages_on_device(layout, table, indptr, cu, seq_ids, page_size, num_blocks, total_kv):
    """Every page a gathered row touches lies in [0, num_blocks). Syncs with the host."""
    cu_h = cu.cpu().tolist()
    if cu_h[0] != 0 or any(b < a for a, b in zip(cu_h, cu_h[1:])) or cu_h[-1] != total_kv:
        raise ValueError(f"gather_kv: cu_seqlens_k must start at 0, not decrease and end at total_kv={total_kv}")
    ids = seq_ids.cpu().tolist() if seq_ids is not None else list(range(len(cu_h) - 1))
    tab = table.cpu()
    ptr = indptr.cpu().tolist() if indptr is not None else None
    rows = tab.shape[0] if layout == "vllm" else len(ptr) - 1
    for i, b in enumerate(ids):
        if not 0 <= b < rows:
            raise ValueError(f"gather_kv: seq_ids[{i}] = {b} is not a row of the {layout} table ({rows} rows)")
        n = -(-(cu_h[i + 1] - cu_h[i]) // page_size)
        if layout == "vllm":
            if n > tab.shape[1]:
                raise ValueError(f"gather_kv: request {b} needs {n} pages, block_table has {tab.shape[1]}")
            pages = tab[b, :n]
        else:
            if ptr[b + 1] - ptr[b] < n or ptr[b] < 0 or ptr[b] + n > tab.shape[0]:
                raise ValueError(f"gather_kv: request {b} needs {n} pages from kv_indptr[{b}] = {ptr[b]} "
                                 f"(kv_indptr gives {ptr[b + 1] - ptr[b]}, kv_page_indices has {tab.shape[0]})")
            pages = tab[ptr[b] : ptr[b] + n]
        if n and (pages.min() < 0 or pages.max() >= num_blocks):
            raise ValueError(f"gather_kv: request {b} has page ids outside [0, {num_blocks})")
