"""Rows of a 16-bit tensor -> e4m3 with one fp32 scale per row (kernel: src/quant.hip).

``quantize_rows(x)`` for x ``[rows, heads, dim]`` (bf16 / fp16, last dim contiguous) returns
``(x8, scale)``: x8 ``[rows, heads, dim]`` in the platform's e4m3, scale fp32 ``[rows, heads]``,
``x ~= x8 * scale`` with ``scale = max|x| / e4m3_max`` (1 for an all-zero row). The FP8 prefill
quantizes Q this way: one scale per (token, head) bounds every element's error by half an e4m3
step of its own magnitude (DESIGN.md, "FP8 compute").
"""

from __future__ import annotations

import functools

import torch

from . import runtime
from .runtime import Variant

SOURCE = "quant.hip"
KERNEL = "atom_quantize_rows"
WARPS = 8  # rows per block (src/quant.hip QUANT_WARPS)
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


@functools.lru_cache(maxsize=None)
def variant(dtype: torch.dtype) -> Variant:
    return Variant(SOURCE, KERNEL, {"DTYPE": _DTYPES[dtype]})


def variants() -> list[Variant]:
    return [variant(d) for d in _DTYPES]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 3 or x.dtype not in _DTYPES:
        raise ValueError(f"quantize_rows: x must be bf16/fp16 [rows, heads, dim], got {x.dtype} {tuple(x.shape)}")
    rows, heads, dim = x.shape
    if x.stride(2) != 1 or dim % 4 or dim > 256 or x.stride(0) % 4 or x.stride(1) % 4 or x.data_ptr() % 8:
        raise ValueError(f"quantize_rows: dim ({dim}) must be contiguous, a multiple of 4 and <= 256, strides "
                         f"{x.stride()} multiples of 4")
    dev = x.device
    x8 = torch.empty((rows, heads, dim), dtype=runtime.native_fp8_dtype(runtime.device_arch(dev)), device=dev)
    scale = torch.empty((rows, heads), dtype=torch.float32, device=dev)
    n = rows * heads
    if n:
        kern = runtime.load(variant(x.dtype), dev)
        kern(-(-n // WARPS), WARPS * runtime.warp_size(kern.compiled.arch), x8, scale, x, rows, heads, dim,
             x.stride(0), x.stride(1))
    return x8, scale
