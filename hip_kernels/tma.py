"""CUDA tensor maps (TMA descriptors) for the Hopper kernels, encoded on the host.

A map describes a packed `[rows, heads, head_dim]` tensor (last dim contiguous) as a 3-D tensor
(head_dim, heads, rows) whose boxes are `[box_rows][128 bytes]` of one head, 128-byte swizzled:
the sw128 layout the wgmma descriptors of atom_mma.h read; the FP8 prefill adds V^T and its key
scales (transposed_map, rows_map). Rows past the tensor read as zero; stores through a map (the
prefill's O) leave them unwritten. The kernel takes the 128 bytes by value (`runtime.Blob`, a
`__grid_constant__` parameter), so a CUDA graph keeps its own copy.
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
    t = d.CUtensorMapDataType
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8):
        return t.CU_TENSOR_MAP_DATA_TYPE_UINT8
    return {torch.bfloat16: t.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, torch.float16: t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            torch.float32: t.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]


@functools.lru_cache(maxsize=1024)  # per layer and batch the same few tensors: ~10 us an encode
def _encode(ptr: int, dtype, dims: tuple, strides: tuple, box: tuple, swizzle: int):
    """dims / box innermost first (elements); strides of dims 1.. in bytes; swizzle: 0, 32, 64 or 128 bytes."""
    d = _driver()
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    err, tmap = d.cuTensorMapEncodeTiled(
        _dtype_code(d, dtype), u32(len(dims)), ptr, [u64(max(x, 1)) for x in dims], [u64(x) for x in strides],
        [u32(x) for x in box], [u32(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(d.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}B" if swizzle else "CU_TENSOR_MAP_SWIZZLE_NONE"),
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != d.CUresult.CUDA_SUCCESS:
        raise runtime.KernelError(f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, box={box}): {err}")
    return runtime.Blob(ctypes.string_at(tmap.getPtr(), _SIZE))


def packed_rows_map(t: torch.Tensor, box_rows: int, box_heads: int = 1) -> "runtime.Blob":
    """Tensor map of t [rows, heads, head_dim] (16-bit or e4m3; rows of a multiple of 128 bytes,
    16-byte aligned strides and pointer: the caller checked) with boxes of box_rows rows x
    box_heads heads x 128 bytes, landing in shared memory as [box_rows][box_heads][128 bytes]
    (row-major (row, head))."""
    rows, heads, dim = t.shape
    es = t.element_size()
    if (dim * es) % 128 or not 1 <= box_rows <= 256 or not 1 <= box_heads <= min(heads, 256):
        raise ValueError(f"tensor map: head_dim {dim} must be a multiple of {128 // es}, box rows {box_rows} in "
                         f"1..256 and box heads {box_heads} in 1..{heads}")
    return _encode(t.data_ptr(), t.dtype, (dim, heads, rows), (t.stride(1) * es, t.stride(0) * es),
                   (128 // es, box_heads, box_rows), 128)


def transposed_map(vt: torch.Tensor, box_keys: int = 128) -> "runtime.Blob":
    """Map of an e4m3 V^T [heads, head_dim, keys] (contiguous): boxes of all head_dim rows x
    box_keys keys of one head, rows of box_keys bytes swizzled as one panel (128, 64 or 32 bytes)."""
    heads, dim, keys = vt.shape
    if vt.element_size() != 1 or not vt.is_contiguous() or keys % 16 or box_keys not in (32, 64, 128) \
            or not 1 <= dim <= 256:
        raise ValueError(f"tensor map: V^T must be contiguous 8-bit [heads, dim <= 256, keys % 16 == 0], "
                         f"got {vt.dtype} {tuple(vt.shape)}; box of 32, 64 or 128 keys, got {box_keys}")
    return _encode(vt.data_ptr(), vt.dtype, (keys, dim, heads), (keys, dim * keys), (box_keys, dim, 1), box_keys)


def rows_map(x: torch.Tensor, box: int) -> "runtime.Blob":
    """Map of a contiguous fp32 [rows, n] (n * 4 a multiple of 16): boxes of `box` consecutive
    values of one row, unswizzled."""
    rows, n = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or n % 4 or not 1 <= box <= 256:
        raise ValueError(f"tensor map: fp32 [rows, n % 4 == 0] contiguous and box in 1..256, got {x.dtype} "
                         f"{tuple(x.shape)}, box {box}")
    return _encode(x.data_ptr(), x.dtype, (n, rows), (n * 4,), (box, 1), 0)
