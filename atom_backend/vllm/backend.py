"""vLLM v1 attention backend declaration (``vllm.v1.attention.backend``, vLLM 0.26 to 0.33).

Only declarations live here (as in vLLM's own backends): what the backend supports, stated so that vLLM's
selector can reject a configuration with every reason at once. The metadata builder
(``metadata.py``) plans each batch; the impl (``impl.py``) executes the plan.

Support, per execution route (``docs/vllm.md`` has the table):
- dtypes: fp16, bf16 everywhere; fp32 through the unified path (Triton) on a GPU and the torch
  routes on the CPU (the compiled HIP kernels are 16-bit only; the planner routes around them).
- head sizes: multiples of 8 up to 256 (the unified Triton path pads to a power of two; the
  varlen / split-KV kernels take 64, 128, 256 and the planner sends the rest to unified).
- KV cache: the logical ``[num_blocks, kv_heads, block_size, 2 * head_size]`` per layer (vLLM's
  own from 0.29, stated by ``get_kv_cache_shape`` before: ``compat.KV_CACHE_LAYOUT_API``),
  K in the first half of the last axis and V in the second; every kernel takes strides, so the
  two layer-compact layouts (token-major LBNHC / NHD, head-major LBHNC / HND) both work.
- kv_cache_dtype: auto / float16 / bfloat16, and fp8 (= fp8_e4m3) with vLLM's per-tensor
  ``layer._k_scale`` / ``_v_scale``. fp8_e5m2 is not supported (no kernel reads e5m2).
- sinks (gpt-oss), per-layer sliding window, logits soft-cap: yes. ALiBi, MLA, sparse,
  encoder / cross attention, non-causal, cascade: no.
- CUDA graphs: FULL graphs for batches of uniform decodes (``metadata.AtomMetadataBuilder``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

from atom_backend.vllm import compat

MAX_HEAD_SIZE = 256
MAX_BLOCK_SIZE = 1024  # the planner's page-size bound (64-bit offsets, any page up to 1024)


class AtomAttentionBackend(AttentionBackend):
    # The impl writes new K/V in do_kv_cache_update, which vLLM calls before forward().
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        # vLLM maps get_name() back to AttentionBackendEnum[...]: it must be a member name.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        from atom_backend.vllm.impl import AtomAttentionImpl

        return AtomAttentionImpl

    @staticmethod
    def get_builder_cls():
        from atom_backend.vllm.metadata import AtomMetadataBuilder

        return AtomMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Every path addresses pages by block id and offset (64-bit): any page size works.
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_BLOCK_SIZE

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 8 == 0 and 8 <= head_size <= MAX_HEAD_SIZE

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    if compat.KV_CACHE_LAYOUT_API:  # vLLM 0.29+: vLLM owns the logical shape, we name layouts
        @classmethod
        def supported_kv_cache_layouts(cls):
            from vllm.v1.kv_cache_layout import KVCacheLayout

            # Layer-compact layouts keep K and V of one (block, token, head) adjacent in the last
            # axis, which is what the per-layer (block, token, head, dim) views below assume.
            return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)
    else:  # vLLM 0.26 - 0.28: the backend states the logical shape and its physical order
        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                               cache_dtype_str: str = "auto") -> tuple[int, ...]:
            return (num_blocks, num_kv_heads, block_size, 2 * head_size)

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            return compat.kv_cache_stride_order(get_kv_cache_layout(), include_num_layers_dimension)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # vLLM 0.28+ (adaptive verification): the builder plans from the host query lengths,
        # so a batch whose device lengths differ must not reach it (vLLM then refuses the
        # selection with its reason). Older vLLM has no such batches.
        return False

    @classmethod
    def validate_configuration(cls, **config) -> list[str]:
        """vLLM's reasons, each naming the offending value and what is supported."""
        detail = {
            "head_size not supported": f"head_size {config.get('head_size')} not supported: multiples of 8 from 8 to "
                                       f"{MAX_HEAD_SIZE} (the compiled kernels take 64, 128 and 256; others run "
                                       f"on the Triton path)",
            "dtype not supported": f"dtype {config.get('dtype')} not supported: "
                                   f"{', '.join(str(d).removeprefix('torch.') for d in cls.supported_dtypes)}",
            "kv_cache_dtype not supported": f"kv_cache_dtype {config.get('kv_cache_dtype')!r} not supported: "
                                            f"{', '.join(cls.supported_kv_cache_dtypes)}",
            "block_size not supported": f"block_size {config.get('block_size')} not supported: 1 to {MAX_BLOCK_SIZE}",
        }
        return [detail.get(r, r) for r in super().validate_configuration(**config)]

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype is not None and str(kv_cache_dtype).startswith("fp8") and dtype == torch.float32:
            return "fp8 KV cache needs a 16-bit model dtype (the kernels dequantise to bf16/fp16)"
        return None
