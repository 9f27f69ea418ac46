"""The vLLM AttentionImpl: write new K/V into the cache, then execute the batch's plan.

vLLM (0.26 to 0.33, ``forward_includes_kv_cache_update = False``) calls ``do_kv_cache_update``
before ``forward`` for every layer that owns its cache, so by the time forward runs the pages
hold cached + new keys and every route reads one consistent cache. ``forward`` only launches:
the plan and all index tensors were made by the metadata builder once per batch.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from atom_backend.execution import routes

logger = logging.getLogger("atom_backend")

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _fp8_dtype() -> torch.dtype:
    try:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    except Exception:
        return torch.float8_e4m3fn


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) views ``[num_blocks, block_size, kv_heads, head_size]`` of one layer's
    ``[num_blocks, kv_heads, block_size, 2 * head_size]`` cache (no copy; strides follow the
    layout vLLM chose)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"KV cache must be [num_blocks, kv_heads, block_size, 2*{head_size}], got {tuple(kv_cache.shape)}")
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


class AtomAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("atom-backend does not implement ALiBi")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"atom-backend serves decoder self-attention only, not {attn_type}")
        if kv_cache_dtype == "fp8_e5m2":
            raise NotImplementedError("atom-backend reads fp8 e4m3 KV caches, not e5m2")
        extra = {k: v for k, v in unsupported.items() if v not in (None, False, -1)}
        if extra:
            raise NotImplementedError(f"atom-backend does not implement {sorted(extra)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        self.sliding_window = int(sliding_window) if sliding_window else 0
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8 = kv_cache_dtype.startswith("fp8")
        self.fp8_dtype = _fp8_dtype() if self.is_fp8 else None
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape[0] != num_heads:
            raise ValueError(f"sinks has {sinks.shape[0]} entries for {num_heads} heads")
        self.sinks = sinks
        self._sinks_f32: torch.Tensor | None = None
        self._sinks_stale = True
        # Per layer, the same cache tensor and parameters come back every step: their views and
        # LayerParams are made once (a layer's host time is what eager decode steps pay).
        self._views: tuple | None = None  # (kv_cache, data_ptr, k_cache, v_cache)
        self._params: routes.LayerParams | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        self._sinks_stale = True  # loaded values: convert again on first use
        self._params = None

    def _sinks(self) -> torch.Tensor | None:
        if self.sinks is None:
            return None
        if self._sinks_stale:
            # fp32 contiguous as the kernels take it; a fp32 parameter is used as is (no copy). A
            # reload (vLLM keeps its CUDA graphs across in-place weight reloads) lands in the
            # buffer the graphs read.
            new = self.sinks.detach().to(torch.float32).contiguous()
            old = self._sinks_f32
            if old is not None and new.data_ptr() != old.data_ptr() and old.shape == new.shape and old.device == new.device:
                old.copy_(new)
            else:
                self._sinks_f32 = new
            self._sinks_stale = False
        return self._sinks_f32

    def _caches(self, kv_cache: torch.Tensor):
        views = self._views
        if views is not None and views[0] is kv_cache and views[1] == kv_cache.data_ptr():
            return views[2], views[3]
        k, v = split_kv_cache(kv_cache, self.head_size)
        if self.is_fp8 and k.dtype != self.fp8_dtype:
            k, v = k.view(self.fp8_dtype), v.view(self.fp8_dtype)
        self._views = (kv_cache, kv_cache.data_ptr(), k, v)
        return k, v

    def _layer_params(self, layer, out_dtype: torch.dtype) -> routes.LayerParams:
        k_scale = float(layer._k_scale_float) if self.is_fp8 else None
        v_scale = float(layer._v_scale_float) if self.is_fp8 else None
        sinks = self._sinks()
        p = self._params
        if p is None or p.k_scale != k_scale or p.v_scale != v_scale or p.sinks is not sinks or p.out_dtype != out_dtype:
            p = self._params = routes.LayerParams(
                scale=self.scale, window=self.sliding_window, softcap=self.logits_soft_cap, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype)
        return p

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        k_cache, v_cache = self._caches(kv_cache)
        if kv_cache.device.type != "cpu":
            # vLLM's own Triton store: handles padding slots (< 0) and fp8 scales without a sync.
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

            triton_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, self.kv_cache_dtype,
                                           layer._k_scale, layer._v_scale)
            return
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
        else:
            key, value = key[:n], value[:n]
        bs = k_cache.shape[1]
        blk, off = slots // bs, slots % bs
        if self.is_fp8:
            key = (key.float() / layer._k_scale_float).to(k_cache.dtype)
            value = (value.float() / layer._v_scale_float).to(v_cache.dtype)
        k_cache[blk, off] = key.to(k_cache.dtype)
        v_cache[blk, off] = value.to(v_cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom-backend does not fuse output quantisation")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        k_cache, v_cache = self._caches(kv_cache)
        routes.run(attn_metadata, query, output, k_cache, v_cache, self._layer_params(layer, output.dtype))
        return output
