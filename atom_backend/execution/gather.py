"""Paged KV cache -> packed K/V for the requests the planner sent to the varlen path.

One entry point, ``gather_kv(route, k_cache, v_cache, out_dtype, k_scale, v_scale)``: on a GPU it
launches ``hip_kernels.gather.gather_kv`` (one launch for all varlen requests, sized from the
host-known key count, no sync); on the CPU it indexes the cache with the (block, offset) pairs
the metadata builder computed once per batch. FP8 caches are dequantised with vLLM's
per-tensor scales on the way.

Only requests of the varlen route are ever gathered: the plan decides before any copy.
``STATS`` counts what was gathered (calls, keys, bytes written) in this process; tests and
the debug counter file read it, the Prometheus gather-bytes metric comes from the plan.
"""

from __future__ import annotations

import torch

STATS = {"calls": 0, "tokens": 0, "bytes": 0}

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _dequant_cpu(x: torch.Tensor, scale: float | None, out_dtype: torch.dtype) -> torch.Tensor:
    if x.dtype in _FP8:
        return (x.to(torch.float32) * float(scale if scale is not None else 1.0)).to(out_dtype)
    return x.to(out_dtype)


def gather_kv_fp8(route, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale=None, v_scale=None):
    """The route's keys as e4m3 bytes in the FP8 prefill's layout (``hip_kernels.gather.PackedFp8``:
    requests at multiples of 128 rows, V transposed), per-tensor scales (vLLM's); GPU only."""
    from hip_kernels import gather as hg

    packed = hg.gather_kv_fp8(k_cache, v_cache, route.cu_seqlens_k, route.cu_kp, route.total_pad,
                              block_table=route.full_block_table, seq_ids=route.seq_ids, k_scale=k_scale, v_scale=v_scale)
    STATS["calls"] += 1
    STATS["tokens"] += route.total_kv
    STATS["bytes"] += packed.k.numel() + packed.vt.numel()
    return packed


def gather_kv(route, k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype,
              k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (k, v) ``[route.total_kv, kv_heads, head_dim]`` in ``out_dtype``; rows
    ``route.cu_seqlens_k[i]:[i+1]`` are key positions 0.. of the route's i-th request."""
    total = route.total_kv
    if k_cache.device.type == "cpu":
        k = _dequant_cpu(k_cache[route.gather_blocks, route.gather_offsets], k_scale, out_dtype)
        v = _dequant_cpu(v_cache[route.gather_blocks, route.gather_offsets], v_scale, out_dtype)
    else:
        from hip_kernels import gather as hg

        fp8 = k_cache.dtype in _FP8 or k_cache.dtype == torch.uint8
        k, v = hg.gather_kv(
            k_cache, v_cache, route.cu_seqlens_k, total, block_table=route.full_block_table, seq_ids=route.seq_ids,
            k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None,
            out_dtype=out_dtype if fp8 else None,
        )
    STATS["calls"] += 1
    STATS["tokens"] += total
    STATS["bytes"] += 2 * k.numel() * k.element_size()
    return k, v
