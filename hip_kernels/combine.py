"""Split-KV combine (kernel: src/combine.hip), per docs/design.md "Split-KV".

``combine(o_partial, lse_partial, out, lse_out=None, sinks=None)``:
``o_partial [S, total_q, H, D]`` and ``lse_partial [S, total_q, H]`` fp32 contiguous (an empty
split holds lse = -inf); writes ``out [total_q, H, D]`` (bf16 / fp16 / fp32; row and head
strides free, last dim contiguous) and, if given, ``lse_out [total_q, H]`` fp32 (without the
sink). ``sinks [H]`` fp32 logits are applied once, after the combine. All-(-inf) rows give
o = 0, lse = -inf. No host sync; safe under CUDA-graph capture.
"""

from __future__ import annotations

import functools

import torch

from . import runtime
from .runtime import Variant

SOURCE = "combine.hip"
KERNEL = "atom_combine_splits"
THREADS = 256
_OUT = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@functools.lru_cache(maxsize=None)
def variant(out_dtype: torch.dtype) -> Variant:
    return Variant(SOURCE, KERNEL, {"COMBINE_OUT": _OUT[out_dtype]})


def variants() -> list[Variant]:
    return [variant(d) for d in _OUT]


def combine(
    o_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: torch.Tensor,
    lse_out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    launch = packed(o_partial, lse_partial, out, lse_out, sinks)
    if launch is not None:
        launch.launch()
    return out


# Positions of out, lse_out and sinks in a packed combine: a caller that launches it for every
# layer of a batch swaps these (runtime.Packed.put) and checks out's alignment (out_alignment).
LAYER_ARGS = (0, 1, 4)


def out_alignment(out: torch.Tensor) -> int:
    """Bytes out's data pointer must be a multiple of: a thread stores 4 elements at once."""
    return 4 * out.element_size()


def packed(o_partial, lse_partial, out, lse_out=None, sinks=None) -> runtime.Packed | None:
    """The checked launch of combine(...) with these tensors, packed (None: nothing to combine)."""
    if o_partial.dim() != 4 or o_partial.dtype != torch.float32 or not o_partial.is_contiguous():
        raise ValueError(f"combine: o_partial must be contiguous fp32 [S, total_q, H, D], got "
                         f"{o_partial.dtype} {tuple(o_partial.shape)}")
    S, tq, H, D = o_partial.shape
    dev = o_partial.device
    if lse_partial.shape != (S, tq, H) or lse_partial.dtype != torch.float32 or not lse_partial.is_contiguous():
        raise ValueError(f"combine: lse_partial must be contiguous fp32 [{S}, {tq}, {H}], got "
                         f"{lse_partial.dtype} {tuple(lse_partial.shape)}")
    if S < 1:
        raise ValueError("combine: need at least one split")
    if D % 4 or D // 4 > THREADS:
        raise ValueError(f"combine: head_dim {D} must be a multiple of 4 and <= {4 * THREADS}")
    if out.dtype not in _OUT:
        raise TypeError(f"combine: out dtype {out.dtype} unsupported (bf16, fp16, fp32)")
    if tuple(out.shape) != (tq, H, D) or out.stride(2) != 1 or out.device != dev:
        raise ValueError(f"combine: out must be [{tq}, {H}, {D}] on {dev} with a contiguous last dim, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    vec_bytes = out_alignment(out)
    if out.data_ptr() % vec_bytes or (out.stride(0) % 4) or (out.stride(1) % 4):
        raise ValueError(f"combine: out must be {vec_bytes}-byte aligned with strides that are multiples of 4")
    for name, t, shape in (("lse_out", lse_out, (tq, H)), ("sinks", sinks, (H,))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous()
                              or t.device != dev):
            raise ValueError(f"combine: {name} must be contiguous fp32 {list(shape)} on {dev}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"combine: tensors must be on a GPU, got {dev}")
    pairs = tq * H
    if pairs == 0:
        return None
    groups = split_groups(S, D)
    per_block = THREADS // (D // 4 * groups)
    grid = (pairs + per_block - 1) // per_block
    kern = runtime.load(variant(out.dtype), dev)
    return runtime.Packed(kern, grid, THREADS, [out, lse_out, o_partial, lse_partial, sinks, S, tq, H, D,
                                                out.stride(0), out.stride(1), groups])


def split_groups(num_splits: int, head_dim: int) -> int:
    """Thread groups per (q, h) pair that share its splits: the power of two covering the splits,
    at most what one block holds. A thread loads its splits 8 at a time (splitkv_combine.h), so
    up to 8 splits per group is one round trip, however few the pairs (one long request: 32
    pairs x 32 splits)."""
    g = 1
    while g < num_splits and 2 * g * (head_dim // 4) <= THREADS:
        g *= 2
    return g
