"""CUDA tensor maps (TMA descriptors) for the Hopper kernels, encoded on the host.

A map describes a packed `[rows, heads, head_dim]` 16-bit tensor (last dim contiguous) as a 3-D
tensor (head_dim, heads, rows) whose boxes are `[box_rows][64]` elements of one head, 128-byte
swizzled: the sw128 layout the wgmma descriptors of atom_mma.h read. Rows past the tensor read as
zero. The kernel takes the 128 bytes by value (`runtime.Blob`, a `__grid_constant__` parameter),
so a CUDA graph keeps its own copy.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hip_kernels import runtime

_SIZE = 128  # sizeof(CUtensorMap)


@functools.lru_cache(maxsize=None)
def _driver():
    from cuda.bindings import driver

    return driver


def _dtype_code(d, dtype):
    return {torch.bfloat16: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            torch.float16: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}[dtype]


@functools.lru_cache(maxsize=1024)  # per layer and batch the same few tensors: ~10 us an encode
def _encode(ptr: int, rows: int, heads: int, dim: int, row_stride: int, head_stride: int, dtype, box_rows: int,
            box_heads: int):
    d = _driver()
    es = 2
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    err, tmap = d.cuTensorMapEncodeTiled(
        _dtype_code(d, dtype), u32(3), ptr,
        [u64(dim), u64(heads), u64(max(rows, 1))], [u64(head_stride * es), u64(row_stride * es)],
        [u32(64), u32(box_heads), u32(box_rows)], [u32(1), u32(1), u32(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != d.CUresult.CUDA_SUCCESS:
        raise runtime.KernelError(f"cuTensorMapEncodeTiled(rows={rows}, heads={heads}, dim={dim}, strides="
                                  f"{row_stride}/{head_stride}, box={box_rows}): {err}")
    return runtime.Blob(ctypes.string_at(tmap.getPtr(), _SIZE))


def packed_rows_map(t: torch.Tensor, box_rows: int, box_heads: int = 1) -> "runtime.Blob":
    """Tensor map of t [rows, heads, head_dim] (bf16/fp16, head_dim a multiple of 64, 16-byte
    aligned strides and pointer: the caller checked) with boxes of box_rows rows x box_heads heads
    x 64 columns, landing in shared memory as [box_rows][box_heads][64] (row-major (row, head))."""
    rows, heads, dim = t.shape
    if dim % 64 or not 1 <= box_rows <= 256 or not 1 <= box_heads <= min(heads, 256):
        raise ValueError(f"tensor map: head_dim {dim} must be a multiple of 64, box rows {box_rows} in 1..256 "
                         f"and box heads {box_heads} in 1..{heads}")
    return _encode(t.data_ptr(), rows, heads, dim, t.stride(0), t.stride(1), t.dtype, box_rows, box_heads)
