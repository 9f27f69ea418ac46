"""The unified path's compiles, made before serving: one launch of every variant a model can
launch (``aot.launch_plan``) on small inputs of the model's shapes. Triton compiles a variant at
its first launch (seconds for a large head dim) and keeps it for the process; done here, a batch
routed unified later in serving never waits on a compile. The inputs only select the variant:
the integers Triton specializes on (strides, head counts) take the values a real launch has, and
the per-batch ones are never specialized (``_kernels.PER_BATCH_ARGS``)."""

from __future__ import annotations

import time

import torch

from . import aot
from .api import paged_attention, paged_decode

# paged_decode's split counts (1..256) as the combine pads them: one launch each
SPLIT_PADS = (2, 4, 8, 16, 32, 64, 128, 256)
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz}


def _inputs(facts, sq: int, device: torch.device) -> dict:
    """q, caches, metadata and options (but the window: each variant has its own) for one request
    of sq new tokens over sq keys."""
    d, hq, hk, page = facts.head_dim, facts.num_q_heads, facts.num_kv_heads, facts.page_size
    pages = -(-sq // page)
    # the serving cache's layout: [blocks, kv heads, page, 2 * d], K and V as views of it
    kv = torch.zeros((pages + 1, hk, page, 2 * d), dtype=_TORCH_DTYPES[facts.kv_dtype], device=device)
    k, v = kv.transpose(1, 2).split(d, dim=-1)
    opts = dict(sink_tokens=facts.sink_tokens, softcap=facts.softcap)
    if facts.has_sinks:
        opts["sinks"] = torch.zeros((hq,), dtype=torch.float32, device=device)
    if facts.kv_scale_mode == "per_tensor":
        opts.update(k_scale=1.0, v_scale=1.0)
    elif facts.kv_scale_mode == "per_page":
        opts.update(k_descale=torch.ones((pages + 1, hk), dtype=torch.float32, device=device),
                    v_descale=torch.ones((pages + 1, hk), dtype=torch.float32, device=device))
    return dict(q=torch.zeros((sq, hq, d), dtype=_TORCH_DTYPES[facts.dtype], device=device), k=k, v=v,
                cu=torch.tensor([0, sq], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([sq], dtype=torch.int32, device=device),
                block_table=torch.arange(pages, dtype=torch.int32, device=device).reshape(1, pages), opts=opts)


def warm(facts, arch: str, device: torch.device, max_query_tokens: int = 1) -> list[str]:
    """Launch every unified variant ``facts`` can use on ``device`` once; the names launched.
    Each layer window of ``facts.layer_windows`` is its own variant."""
    names = []
    for sq, v in aot.launch_plan(arch, facts, max_query_tokens):
        x = _inputs(facts, sq, device)
        opts = dict(x["opts"], window=v.window)
        if v.entry == "paged_decode":  # the combine compiles once per power-of-two pad of the split count
            for splits in SPLIT_PADS:
                paged_decode(x["q"], x["k"], x["v"], x["cu"], x["seq_lens"], x["block_table"], max_seqlen_q=sq,
                             num_splits=splits, max_seqlen_k=sq, **opts)
        else:
            paged_attention(x["q"], x["k"], x["v"], x["cu"], x["seq_lens"], x["block_table"], max_seqlen_q=sq,
                            max_seqlen_k=sq, **opts)
        names.append(v.name)
    return names


def timed_warm(facts, arch: str, device: torch.device, max_query_tokens: int = 1) -> tuple[list[str], float]:
    """warm(...) and the seconds it took, the device synchronized."""
    t0 = time.perf_counter()
    names = warm(facts, arch, device, max_query_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return names, time.perf_counter() - t0
