"""Execute one route of a plan for one layer.

GPU (CUDA / ROCm torch): split-KV decode -> ``hip_kernels.decode.SplitKVPlan`` (made by the
batch's first layer, launched by every layer; + combine),
or the Triton ``atom_backend.unified.paged_decode`` when the plan says unified decode; varlen
prefill -> ``atom_backend.execution.gather`` then ``hip_kernels.prefill.varlen_attention``; unified
prefill -> ``atom_backend.unified.paged_attention`` straight over the pages. A compiled kernel
that fails at run time (compile error, missing toolchain) sends its requests to the Triton
path (FP8 compute first to the dequantizing gather + 16-bit kernel), counted
(``metrics.record_fallback``) and remembered: later batches are planned without it.

CPU: the same three routes in plain torch, following ``atom_backend.reference`` (docs/design.md)
but batched per sequence with matmuls instead of element loops: decode computes fp32 partials
per split and combines them, varlen attends over the packed gather, unified reads each
sequence's pages directly from the cache. No SDPA: sinks, windows and soft-cap are explicit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_backend import metrics
from atom_backend.execution import gather as _gather
from atom_backend.execution import health
from atom_backend.planning import SplitRule, split_ranges

NEG_INF = float("-inf")
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@dataclass
class LayerParams:
    scale: float
    window: int  # 0: none
    softcap: float  # 0: none
    sinks: torch.Tensor | None  # fp32 [num_q_heads]
    k_scale: float | None  # fp8 caches only (host floats: reading device scales would sync)
    v_scale: float | None
    out_dtype: torch.dtype


# --- CPU -------------------------------------------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sk: int, p: LayerParams,
           key_lo: int = 0, key_hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (o [sq, Hq, D], lse [sq, Hq]) of one sequence's sq queries (positions sk - sq + i)
    over keys ``key_lo:key_hi`` of k, v ``[n, Hk, D]`` (row r = key position r). No sinks;
    rows with no visible key give o = 0, lse = -inf."""
    key_hi = sk if key_hi is None else key_hi
    sq, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    qf = q.float().reshape(sq, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * sq, d)
    kf = k[key_lo:key_hi].float().permute(1, 2, 0)  # [Hk, D, n]
    vf = v[key_lo:key_hi].float().permute(1, 0, 2)  # [Hk, n, D]
    s = torch.bmm(qf, kf).mul_(p.scale)
    if p.softcap > 0:
        s = torch.tanh(s / p.softcap).mul_(p.softcap)
    qpos = torch.arange(sk - sq, sk).view(1, sq, 1)
    kpos = torch.arange(key_lo, key_hi).view(1, 1, -1)
    vis = kpos <= qpos
    if p.window > 0:
        vis = vis & (kpos > qpos - p.window)
    s = s.view(hk, g, sq, -1).masked_fill(~vis.unsqueeze(0), NEG_INF).view(hk, g * sq, -1)
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else torch.full((hk, g * sq, 1), NEG_INF)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    o = torch.bmm(e, vf) / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.log(l) + m  # log(0) = -inf for fully masked rows
    o = o.view(hk, g, sq, d).permute(2, 0, 1, 3).reshape(sq, hq, d)
    lse = lse.view(hk, g, sq).permute(2, 0, 1).reshape(sq, hq)
    return o, lse


def _apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is None:
        return o
    return o * torch.sigmoid(lse - sinks.float().view(1, -1)).unsqueeze(-1)


def _visible_lo(sk: int, sq: int, window: int) -> int:
    """First key any of the sq queries can see: keys below it are never read."""
    return max(0, sk - sq - window + 1) if window > 0 else 0


def _read_pages(cache: torch.Tensor, block_row: torch.Tensor, lo: int, hi: int, scale) -> torch.Tensor:
    """Keys lo:hi of one sequence, read in place from its pages (no packed copy of others)."""
    bs = cache.shape[1]
    b0, b1 = lo // bs, -(-hi // bs)
    x = cache[block_row[b0:b1].long()].reshape(-1, cache.shape[2], cache.shape[3])[lo - b0 * bs: hi - b0 * bs]
    if x.dtype in _FP8:
        x = x.float() * float(scale)
    return x


def _cpu_paged(route, q, out, k_cache, v_cache, p: LayerParams, num_splits: int = 1,
               split_rule: SplitRule = SplitRule()) -> None:
    qs = q[route.rows] if isinstance(route.rows, slice) else q.index_select(0, route.rows)
    res = torch.empty(qs.shape, dtype=out.dtype)
    cu = route.cu_seqlens_q.tolist()
    for i, sk in enumerate(route.total.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        sq = q1 - q0
        lo = _visible_lo(sk, sq, p.window)
        k = _read_pages(k_cache, route.block_table[i], lo, sk, p.k_scale)
        v = _read_pages(v_cache, route.block_table[i], lo, sk, p.v_scale)
        if num_splits <= 1:
            o, lse = attend(qs[q0:q1], k, v, sk - lo, p)
        else:
            o, lse = _split_combine(qs[q0:q1], k, v, sk - lo, p, num_splits, split_rule)
        res[q0:q1] = _apply_sinks(o, lse, p.sinks).to(out.dtype)
    _store(out, route.rows, res)


def _split_combine(q, k, v, sk, p, num_splits, split_rule: SplitRule):
    """Split-KV on the CPU: fp32 partials over the kernels' contiguous key ranges, then the
    combine of docs/design.md (empty splits weigh 0)."""
    parts = [attend(q, k, v, sk, p, j0, j1) for j0, j1 in split_ranges(sk, num_splits, split_rule)]
    o_s = torch.stack([o for o, _ in parts])
    lse_s = torch.stack([l for _, l in parts])
    lse = torch.logsumexp(lse_s, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.where(torch.isfinite(lse_s), torch.exp(lse_s - safe), torch.zeros_like(lse_s))
    return (w.unsqueeze(-1) * o_s).sum(0), lse


def _cpu_varlen(route, q, out, k_cache, v_cache, p: LayerParams) -> None:
    k, v = _gather.gather_kv(route, k_cache, v_cache, torch.float32 if k_cache.dtype in _FP8 else k_cache.dtype,
                             p.k_scale, p.v_scale)
    qs = q[route.rows] if isinstance(route.rows, slice) else q.index_select(0, route.rows)
    res = torch.empty(qs.shape, dtype=out.dtype)
    cu_q = route.cu_seqlens_q.tolist()
    cu_k = route.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        sk = k1 - k0
        lo = _visible_lo(sk, q1 - q0, p.window)
        o, lse = attend(qs[q0:q1], k[k0 + lo:k1], v[k0 + lo:k1], sk - lo, p)
        res[q0:q1] = _apply_sinks(o, lse, p.sinks).to(out.dtype)
    _store(out, route.rows, res)


def _store(out: torch.Tensor, rows, res: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = res
    else:
        out.index_copy_(0, rows, res)


# --- GPU -------------------------------------------------------------------------------------


def _rows_in(q, out, rows):
    if isinstance(rows, slice):
        return q[rows], out[rows], None
    return q.index_select(0, rows), torch.empty((rows.shape[0],) + tuple(out.shape[1:]), dtype=out.dtype,
                                               device=out.device), rows


def _gpu_unified(route, q, out, k_cache, v_cache, p: LayerParams) -> None:
    from atom_backend.unified import paged_attention

    qs, os_, rows = _rows_in(q, out, route.rows)
    paged_attention(qs, k_cache, v_cache, route.cu_seqlens_q, route.seq_lens, route.block_table,
                    max_seqlen_q=route.max_seqlen_q, max_seqlen_k=route.max_seqlen_k, scale=p.scale, window=p.window,
                    sinks=p.sinks, softcap=p.softcap, k_scale=p.k_scale, v_scale=p.v_scale, out=os_)
    if rows is not None:
        out.index_copy_(0, rows, os_)


def _gpu_triton_decode(route, q, out, k_cache, v_cache, p: LayerParams, num_splits: int, workspace=None,
                       split_rule: SplitRule = SplitRule()) -> None:
    from atom_backend.unified import paged_decode

    qs, os_, rows = _rows_in(q, out, route.rows)
    paged_decode(qs, k_cache, v_cache, route.cu_seqlens_q, route.seq_lens, route.block_table,
                 max_seqlen_q=route.max_seqlen_q, num_splits=max(1, min(num_splits, 256)),
                 split_rule=split_rule, workspace=workspace, scale=p.scale,
                 window=p.window, sinks=p.sinks, softcap=p.softcap, k_scale=p.k_scale, v_scale=p.v_scale, out=os_,
                 max_seqlen_k=route.max_seqlen_k)
    if rows is not None:
        out.index_copy_(0, rows, os_)


def _gpu_hip_decode(route, q, out, k_cache, v_cache, p: LayerParams, num_splits: int, balanced=None,
                    workspace=None, counters=None, split_rule: SplitRule = SplitRule()) -> None:
    key = ("splitkv", num_splits, balanced, split_rule)
    plan = route.cache.get(key)
    if plan is None:  # planned by the batch's first layer, launched by every layer
        from hip_kernels.decode import SplitKVPlan

        plan = route.cache[key] = SplitKVPlan(
            route.cu_seqlens_q, route.seq_lens, route.block_table, max_query_len=route.max_seqlen_q,
            num_splits=num_splits, split_rule=split_rule, balanced=balanced, workspace=workspace, counters=counters)
    qs, os_, rows = _rows_in(q, out, route.rows)
    plan.run(qs, k_cache, v_cache, out=os_, scale=p.scale, window=p.window, sinks=p.sinks, softcap=p.softcap,
             k_scale=p.k_scale, v_scale=p.v_scale)
    if rows is not None:
        out.index_copy_(0, rows, os_)


def _gpu_varlen(route, q, out, k_cache, v_cache, p: LayerParams, fp8: bool) -> None:
    from hip_kernels.prefill import varlen_attention

    if fp8:  # FP8 compute: the cache's e4m3 bytes, no dequantization (docs/fp8.md)
        k, v = _gather.gather_kv_fp8(route, k_cache, v_cache, p.k_scale, p.v_scale), None
        # the work list of the pack's scale mode: the kernel's tile (BLOCK_M) depends on it
        window_work = _work(route, q.shape[2], p.window, q.device, k.scale)
    else:
        k, v = _gather.gather_kv(route, k_cache, v_cache, q.dtype, p.k_scale, p.v_scale)
        window_work = _work(route, q.shape[2], p.window, q.device, None)
    qs, os_, rows = _rows_in(q, out, route.rows)
    res = varlen_attention(qs, k, v, route.cu_seqlens_q, route.cu_seqlens_k, max_seqlen_q=route.max_seqlen_q,
                           max_seqlen_k=route.max_seqlen_k, scale=p.scale, window=p.window, sinks=p.sinks,
                           softcap=p.softcap, work=window_work)
    if rows is None:
        os_.copy_(res)
    else:
        out.index_copy_(0, rows, res)


def _gpu_varlen_or_fallback(route, q, out, k_cache, v_cache, p: LayerParams) -> None:
    """The varlen route: FP8 compute if planned, else (or once it failed) the dequantizing gather
    + 16-bit kernel, else (once that failed) the Triton path over the pages. A failure is
    recorded (health.mark_kernel_failed) and the builder plans later batches without it."""
    fp8 = route.fp8 and health.usable("varlen_fp8")
    while health.usable("varlen"):
        try:
            _gpu_varlen(route, q, out, k_cache, v_cache, p, fp8)
            return
        except RuntimeError as e:  # KernelError and launch failures
            health.mark_kernel_failed("varlen_fp8" if fp8 else "varlen", f"{type(e).__name__}: {e}")
            fp8 = False
    _gpu_unified(route, q, out, k_cache, v_cache, p)


def _work(route, head_dim: int, window: int, device, fp8: str | None):
    """Host work list of the varlen kernel for this window (and FP8 scale mode), built once per batch."""
    key = ("work", window, fp8)
    if key not in route.cache:
        from hip_kernels.prefill import work_items

        route.cache[key] = work_items(route.new.tolist(), route.total.tolist(), head_dim=head_dim,
                                      window=window, fp8=fp8).to(device, non_blocking=True)
    return route.cache[key]


# --- dispatch --------------------------------------------------------------------------------


def run(md, q, out, k_cache, v_cache, p: LayerParams) -> None:
    """Every route of the batch, each written into its own rows of ``out``."""
    if md.on_cpu:
        if md.decode is not None:
            _cpu_paged(md.decode, q, out, k_cache, v_cache, p, md.num_splits, md.split_rule)
        if md.varlen is not None:
            _cpu_varlen(md.varlen, q, out, k_cache, v_cache, p)
        if md.unified is not None:
            _cpu_paged(md.unified, q, out, k_cache, v_cache, p)
        return
    if md.decode is not None:
        with metrics.kernel_timer(md.decode.path):
            if md.decode_kernel == "hip" and health.usable("splitkv"):
                try:
                    _gpu_hip_decode(md.decode, q, out, k_cache, v_cache, p, md.num_splits, md.decode_balanced,
                                    md.workspace, md.counters, md.split_rule)
                except RuntimeError as e:  # KernelError and launch failures
                    health.mark_kernel_failed("splitkv", f"{type(e).__name__}: {e}")
                    _gpu_triton_decode(md.decode, q, out, k_cache, v_cache, p, md.num_splits, md.workspace,
                                       md.split_rule)
            else:
                _gpu_triton_decode(md.decode, q, out, k_cache, v_cache, p, md.num_splits, md.workspace,
                                   md.split_rule)
    if md.varlen is not None:
        with metrics.kernel_timer("varlen"):
            _gpu_varlen_or_fallback(md.varlen, q, out, k_cache, v_cache, p)
    if md.unified is not None:
        with metrics.kernel_timer("unified"):
            _gpu_unified(md.unified, q, out, k_cache, v_cache, p)
