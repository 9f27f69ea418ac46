"""Launch wrappers of the unified path: validation at launch time, tile choice, grids.

Nothing here syncs with the device: checks use shapes, dtypes, strides and host-known lengths
only (``max_seqlen_k`` or seq_lens that already live on the host).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

from . import configs
from .configs import TileConfig, default_config, kernel_constexprs, next_pow2

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_PAGE_SIZE = 1024
LOG2E = 1.4426950408889634

def _interpreting() -> bool:
    """Whether this process runs Triton under its interpreter.

    Triton fixes that when it is first imported (triton.language's own helpers are decorated
    then), so it is a property of the process: CPU tensors need TRITON_INTERPRET=1 set before
    anything imports triton (tests/test_unified.py runs its cases in such a subprocess).
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels():
    from . import _kernels as k

    return k


_families: dict = {}


def _family():
    """The tile table (configs.TABLES key) of the device Triton compiles for: the current one."""
    dev = torch.cuda.current_device()
    if dev not in _families:
        from triton.runtime import driver

        t = driver.active.get_current_target()
        _families[dev] = configs.family_of(t.backend, t.arch)
    return _families[dev]


def _as_scale(x, device, what: str):
    """Per-tensor scale as a 1-element fp32 tensor on the device (float or 1-elem tensor)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{what} must be a float or a 1-element tensor, got shape {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{what} is on {x.device}, the caches on {device}")
        return x.reshape(1).to(torch.float32)
    return torch.full((1,), float(x), dtype=torch.float32, device=device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class _Launch:
    kern: object
    args: dict
    cfg: TileConfig
    hg: int
    block_q: int
    grid_tiles: int
    grid_heads: int
    interpret: bool
    declared: bool  # cfg is its target's table entry: kernels build compiled it, no retry


def _prepare(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, max_seqlen_q, scale, causal, window,
             sink_tokens, sinks, softcap, k_scale, v_scale, k_descale, v_descale, max_seqlen_k, config):
    # -- shapes and dtypes
    _check(isinstance(q, torch.Tensor) and q.dim() == 3, f"q must be [total_q, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    _check(q.dtype in _Q_DTYPES, f"q dtype {q.dtype} unsupported (float16, bfloat16; float32 for tests)")
    _check(k_cache.dim() == 4 and v_cache.dim() == 4,
           "k_cache / v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    _check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _check(k_cache.dtype == v_cache.dtype, f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    kv_fp8 = k_cache.dtype in _FP8
    _check(kv_fp8 or k_cache.dtype == q.dtype,
           f"KV cache dtype {k_cache.dtype} must equal q's ({q.dtype}) or be float8_e4m3fn/float8_e4m3fnuz")
    total_q, hq, d = q.shape
    num_blocks, page_size, hk, dk = k_cache.shape
    _check(dk == d, f"head_dim of q ({d}) != head_dim of the cache ({dk})")
    _check(8 <= d <= _MAX_HEAD_DIM and d % 8 == 0,
           f"head size {d} unsupported: need a multiple of 8 in [8, {_MAX_HEAD_DIM}]")
    _check(hk >= 1 and hq % hk == 0, f"num_q_heads={hq} is not a multiple of num_kv_heads={hk}")
    _check(1 <= page_size <= _MAX_PAGE_SIZE, f"page size {page_size} unsupported (1..{_MAX_PAGE_SIZE})")
    _check(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.dim() == 1, "cu_seqlens_q must be 1-D int32")
    _check(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1, "seq_lens must be 1-D int32")
    _check(block_table.dtype == torch.int32 and block_table.dim() == 2, "block_table must be 2-D int32")
    batch = seq_lens.shape[0]
    _check(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for {batch} sequences")
    _check(block_table.shape[0] >= batch, f"block_table has {block_table.shape[0]} rows for {batch} sequences")
    # -- devices
    dev = q.device
    named = {"k_cache": k_cache, "v_cache": v_cache, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens,
             "block_table": block_table, "sinks": sinks, "k_descale": k_descale, "v_descale": v_descale}
    for n, t in named.items():
        if t is not None:
            _check(t.device == dev, f"{n} is on {t.device} but q is on {dev}")
    # -- strides the kernel can take: unit stride along head_dim, and in the block table rows
    _check(q.stride(2) == 1, f"q must have unit stride along head_dim, strides {q.stride()}")
    _check(k_cache.stride(3) == 1 and v_cache.stride(3) == 1,
           f"k_cache / v_cache must have unit stride along head_dim, strides {k_cache.stride()} / {v_cache.stride()}")
    _check(block_table.stride(1) == 1, f"block_table rows must be contiguous, strides {block_table.stride()}")
    _check(cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous(), "cu_seqlens_q / seq_lens must be contiguous")
    # -- options
    _check(window >= 0 and sink_tokens >= 0 and softcap >= 0.0, "window, sink_tokens and softcap must be >= 0")
    _check(max_seqlen_q >= 0, "max_seqlen_q must be >= 0")
    if sinks is not None:
        _check(sinks.shape == (hq,) and sinks.dtype == torch.float32, f"sinks must be float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")
    per_page = k_descale is not None or v_descale is not None
    per_tensor = k_scale is not None or v_scale is not None
    _check(not (per_page and per_tensor), "give per-tensor (k_scale/v_scale) or per-page (k_descale/v_descale) scales, not both")
    if per_page:
        _check(k_descale is not None and v_descale is not None, "per-page scales need both k_descale and v_descale")
        for n, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            _check(t.shape == (num_blocks, hk) and t.dtype == torch.float32 and t.is_contiguous(),
                   f"{n} must be contiguous float32 [num_blocks={num_blocks}, num_kv_heads={hk}], got {t.dtype} {tuple(t.shape)}")
    # -- block table long enough for the longest sequence (host-known lengths only: no sync)
    if max_seqlen_k is None and seq_lens.device.type == "cpu":
        max_seqlen_k = int(seq_lens.max()) if batch else 0
    if max_seqlen_k is not None:
        need = -(-int(max_seqlen_k) // page_size)
        _check(need <= block_table.shape[1],
               f"block table too short: {max_seqlen_k} tokens need {need} blocks of {page_size}, table has {block_table.shape[1]}")

    interpret = _interpreting()
    _check(dev.type in ("cpu", "cuda"), f"unsupported device {dev} (CUDA or ROCm GPUs, or CPU under TRITON_INTERPRET=1)")
    group = hq // hk
    head_pad = max(16, next_pow2(d))
    family = _family() if config is None and dev.type == "cuda" and not interpret else None
    cfg = config or default_config(head_pad, group, max_seqlen_q, interpret, kv_fp8, window, family)
    const = kernel_constexprs(cfg, group=group, head_dim=d, page_size=page_size, q_fp32=q.dtype == torch.float32,
                              kv_fp8=kv_fp8, window=window, sink_tokens=sink_tokens, has_sinks=sinks is not None,
                              softcap=softcap, per_tensor=per_tensor, per_page=per_page, causal=causal)
    hg, block_q = const["HG"], const["BLOCK_Q"]
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if softcap > 0:
        cap_in, cap_out, qk_scale = sm_scale / softcap, softcap * LOG2E, 0.0
    else:
        cap_in, cap_out, qk_scale = 0.0, 0.0, sm_scale * LOG2E
    if per_tensor:
        ks = _as_scale(1.0 if k_scale is None else k_scale, dev, "k_scale")
        vs = _as_scale(1.0 if v_scale is None else v_scale, dev, "v_scale")
    else:
        ks = vs = None
    args = dict(
        q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, cu_q_ptr=cu_seqlens_q, seq_lens_ptr=seq_lens, bt_ptr=block_table,
        sinks_ptr=sinks, kscale_ptr=ks, vscale_ptr=vs, kds_ptr=k_descale, vds_ptr=v_descale,
        num_seqs=batch, num_kv_heads=hk, total_q=total_q, num_q_heads=hq,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vt=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_bt=block_table.stride(0),
        qk_scale=qk_scale, cap_in=cap_in, cap_out=cap_out, window=int(window), sink_tokens=int(sink_tokens),
        **const,
    )
    return _Launch(kern=_kernels(), args=args, cfg=cfg, hg=hg, block_q=block_q,
                   grid_tiles=total_q // block_q + batch, grid_heads=hk * (-(-group // hg)), interpret=interpret,
                   declared=family in configs.TABLES)


_COMPILE_ERRORS = ("PTXASError", "CompilationError", "OutOfResources", "CompileTimeAssertionFailure")
_fallback_cfg: dict = {}


def _fallbacks(cfg: TileConfig):
    """Configs to try when a variant fails to build on a target without a table, or with a config
    the caller chose (ptxas crashes, too little shared memory): same rows (the grid depends on
    them), lighter pipelines."""
    seen = [cfg]
    for c in (TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, max(1, cfg.num_stages - 1)),
              TileConfig(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps, 2),
              TileConfig(cfg.block_m, 16, 4, 1)):
        if c not in seen:
            seen.append(c)
    return seen


def _launch(kernel, grid, L, **extra):
    """Launch; if this variant does not build, fall back to a lighter config (remembered), except
    for a declared config: kernels build and the tests compile those, so a failure there is a
    regression to see, not to pay for silently on every process's first request."""
    if L.interpret:
        kernel[grid](**extra, **L.args)
        return
    if L.declared:
        kernel[grid](**extra, **L.args, num_warps=L.cfg.num_warps, num_stages=L.cfg.num_stages)
        return
    const = tuple(sorted((k, v) for k, v in {**L.args, **extra}.items() if k.isupper()))
    key = (kernel.__name__ if hasattr(kernel, "__name__") else id(kernel), const, L.cfg)
    cfg = _fallback_cfg.get(key, L.cfg)
    errors = []
    for c in ([cfg] if key in _fallback_cfg else _fallbacks(cfg)):
        args = dict(L.args, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)
        try:
            kernel[grid](**extra, **args)
        except Exception as e:  # noqa: BLE001 - only build failures are retried, see below
            if type(e).__name__ not in _COMPILE_ERRORS and "PassManager" not in str(e):
                raise
            errors.append(f"{c}: {type(e).__name__}")
            continue
        if c != L.cfg and key not in _fallback_cfg:
            _fallback_cfg[key] = c
            msg = f"unified kernel variant failed to build with {L.cfg}; using {c} ({'; '.join(errors)})"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            try:
                from atom_backend import metrics

                metrics.record_fallback("compile_failed_config", "unified")
            except Exception:  # noqa: BLE001 - metrics are optional here
                pass
        return
    raise RuntimeError(f"unified kernel failed to build with every fallback config: {errors}")


def _check_runnable(L, q):
    _check(q.device.type != "cpu" or L.interpret,
           "CPU tensors run only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")


def _check_out(out, q, what="out"):
    _check(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
           f"{what} must match q: {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    _check(out.stride(2) == 1, f"{what} must have unit stride along head_dim")


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, max_seqlen_q, scale=None,
                    causal=True, window=0, sink_tokens=0, sinks=None, softcap=0.0, k_scale=None, v_scale=None,
                    k_descale=None, v_descale=None, out=None, return_lse=False, max_seqlen_k=None, _config=None):
    """Attention of packed varlen queries over the vLLM paged KV cache (docs/design.md semantics).

    q [total_q, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hk, D] (fp16/bf16 = q's dtype, or
    FP8 e4m3 with per-tensor k_scale/v_scale or per-page k_descale/v_descale [num_blocks, Hk]);
    cu_seqlens_q [B+1], seq_lens [B] (cached + new), block_table [B, max_blocks], all int32.
    Returns out (q's dtype), or (out, lse [total_q, Hq] fp32, natural log, without sinks).
    ``max_seqlen_k``, when given (or when seq_lens is on the host), lets the launch check that
    the block table is long enough; page ids themselves are trusted (checking them would sync).
    """
    L = _prepare(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q=max_seqlen_q, scale=scale,
                 causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, softcap=softcap,
                 k_scale=k_scale, v_scale=v_scale, k_descale=k_descale, v_descale=v_descale,
                 max_seqlen_k=max_seqlen_k, config=_config)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_out(out, q)
    _check_runnable(L, q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if return_lse else None
    if q.shape[0] and seq_lens.shape[0]:
        _launch(L.kern.unified_attn_kernel, (L.grid_tiles, L.grid_heads), L,
                out_ptr=out, lse_ptr=lse, stride_ot=out.stride(0), stride_oh=out.stride(1),
                **_split_args(()), SPLIT=False, RETURN_LSE=return_lse)
    return (out, lse) if return_lse else out


def _split_args(split_rule) -> dict:
    """The kernel's split-rule arguments from planner.SplitRule (up to six ints >= 0)."""
    rule = tuple(split_rule)
    _check(len(rule) <= 6 and all(isinstance(v, int) and v >= 0 for v in rule),
           f"split_rule must be up to 6 ints >= 0 (planner.SplitRule), got {split_rule!r}")
    rule += (0,) * (6 - len(rule))
    names = ("min_split_keys", "fill_splits", "long_split_keys", "split_ctas", "split_slots", "wave_fill")
    return dict(zip(names, rule))


def decode_workspace_numel(num_splits: int, total_q: int, num_q_heads: int, head_dim: int) -> int:
    """fp32 elements of a flat workspace for paged_decode (partials then their lse)."""
    return num_splits * total_q * num_q_heads * (head_dim + 1)


def _workspace(workspace, num_splits, total_q, hq, d, device):
    n_o = num_splits * total_q * hq * d
    n_l = num_splits * total_q * hq
    if workspace is None:
        flat = torch.empty(n_o + n_l, dtype=torch.float32, device=device)
    elif isinstance(workspace, (tuple, list)):
        o_p, l_p = workspace
        _check(o_p.dtype == torch.float32 and l_p.dtype == torch.float32 and o_p.is_contiguous() and l_p.is_contiguous(),
               "workspace (o_partial, lse_partial) must be contiguous float32")
        _check(o_p.numel() >= n_o and l_p.numel() >= n_l,
               f"workspace too small: need o_partial >= {n_o} and lse_partial >= {n_l} elements")
        _check(o_p.device == device and l_p.device == device, "workspace must be on q's device")
        return o_p.view(-1)[:n_o].view(num_splits, total_q, hq, d), l_p.view(-1)[:n_l].view(num_splits, total_q, hq)
    else:
        flat = workspace
        _check(flat.dtype == torch.float32 and flat.is_contiguous() and flat.device == device,
               "workspace must be a contiguous float32 tensor on q's device")
        _check(flat.numel() >= n_o + n_l, f"workspace too small: {flat.numel()} < {n_o + n_l} float32 elements")
    flat = flat.view(-1)
    return flat[:n_o].view(num_splits, total_q, hq, d), flat[n_o:n_o + n_l].view(num_splits, total_q, hq)


def paged_decode(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, max_seqlen_q, num_splits: int,
                 split_rule=(), workspace=None, scale=None, causal=True, window=0, sink_tokens=0, sinks=None,
                 softcap=0.0, k_scale=None, v_scale=None, k_descale=None, v_descale=None, out=None, return_lse=False,
                 max_seqlen_k=None, return_partials=False, _config=None):
    """Split-KV paged attention: each of ``num_splits`` contiguous key ranges (ceil(sk / S) keys,
    as in docs/design.md) writes fp32 partials o[S, T, Hq, D] and lse[S, T, Hq]; a Triton combine
    merges them and applies sinks once. ``workspace``: None, a flat float32 tensor of at least
    ``decode_workspace_numel(...)`` elements, or a pair (o_partial, lse_partial); preallocate it
    for CUDA graphs. ``return_partials`` also returns the two partial views (tests).
    ``split_rule`` (planner.SplitRule, up to six ints; empty = off): a request of sk keys uses
    planner.request_splits(sk, num_splits, split_rule) of them (splits ns.. empty), so num_splits
    is a bound sized for the longest context (graphs).
    """
    _check(isinstance(num_splits, int) and 1 <= num_splits <= 256, f"num_splits must be an int in [1, 256], got {num_splits}")
    rule = _split_args(split_rule)
    L = _prepare(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q=max_seqlen_q, scale=scale,
                 causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, softcap=softcap,
                 k_scale=k_scale, v_scale=v_scale, k_descale=k_descale, v_descale=v_descale,
                 max_seqlen_k=max_seqlen_k, config=_config)
    total_q, hq, d = q.shape
    o_p, l_p = _workspace(workspace, num_splits, total_q, hq, d, q.device)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_out(out, q)
    _check_runnable(L, q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device) if return_lse else None
    if total_q and seq_lens.shape[0]:
        _launch(L.kern.unified_attn_kernel, (L.grid_tiles, L.grid_heads, num_splits), L,
                out_ptr=o_p, lse_ptr=l_p, stride_ot=0, stride_oh=0, **rule,
                SPLIT=True, RETURN_LSE=False)
        L.kern.combine_kernel[(total_q, hq)](
            o_p, l_p, out, lse, sinks, total_q, hq, out.stride(0), out.stride(1), num_splits,
            SPLITS_PAD=max(2, next_pow2(num_splits)), HEAD_DIM=d,
            HEAD_PAD=L.args["HEAD_PAD"], HAS_SINKS=sinks is not None, RETURN_LSE=return_lse,
            **({} if L.interpret else {"num_warps": 4 if d >= 128 else 2}))
    res = (out, lse) if return_lse else out
    if return_partials:
        return res, (o_p, l_p)
    return res
