"""Unified path: Triton attention straight over the paged KV cache (vLLM layout), any batch.

``paged_attention`` handles prefill, prefix hits, decode and mixed batches in one launch;
``paged_decode`` is its split-KV variant for few query tokens over long contexts (fp32
partials, then a Triton combine that applies sinks once). Semantics: docs/design.md.
CPU tensors run the same kernels under Triton's interpreter (tests); CUDA tensors compile.
"""

from .api import TileConfig, decode_workspace_numel, default_config, paged_attention, paged_decode

__all__ = ["paged_attention", "paged_decode", "decode_workspace_numel", "TileConfig", "default_config"]
