"""The literal semantics of docs/design.md, in float32 (or float64 when given float64).

This module is the oracle for every test: it is written for clarity, builds every mask
explicitly and takes no shortcut. It is never on a hot path.

Conventions (docs/design.md, "Tensors and layouts"):
- q: [total_q, num_q_heads, head_dim], rows of sequence b are cu_seqlens_q[b]:cu_seqlens_q[b+1].
- k, v: [total_kv, num_kv_heads, head_dim], rows cu_seqlens_k[b]:cu_seqlens_k[b+1], row r is
  key position r.
- Paged caches are given per tensor: k_cache, v_cache [num_blocks, block_size, kv_heads, dim]
  (vLLM's kv_cache[0] and kv_cache[1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atom_backend.planning import split_ranges

NEG_INF = float("-inf")


@dataclass(frozen=True)
class MaskSpec:
    """Which keys a query may see (docs/design.md, "Visibility")."""

    causal: bool = True
    window: int = 0  # sliding window W in tokens; 0 means no window
    sink_tokens: int = 0  # StreamingLLM: keys j < S stay visible through the window

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [len(q_pos), len(k_pos)]: may query at absolute q_pos see key k_pos."""
        qp = q_pos[:, None]
        kp = k_pos[None, :]
        vis = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q_pos.device)
        if self.causal:
            vis &= kp <= qp
        if self.window > 0:
            in_window = kp > qp - self.window
            if self.sink_tokens > 0:
                in_window |= kp < self.sink_tokens
            vis &= in_window
        return vis


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """x[h, i, j] = scale * <q_i, k_j>, soft-capped when softcap > 0. q: [sq, H, d], k: [sk, H, d]."""
    x = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    return x


def masked_softmax_attention(
    x: torch.Tensor, vis: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over visible keys. x: [H, sq, sk], vis: [sq, sk], v: [sk, H, d].

    Returns o [sq, H, d] and lse [sq, H]; a row with no visible key gets o = 0, lse = -inf.
    """
    x = x.masked_fill(~vis[None], NEG_INF)
    lse = torch.logsumexp(x, dim=-1)  # [H, sq], -inf where nothing is visible
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(x - safe_lse[..., None])  # exp(-inf) = 0 on masked keys
    o = torch.einsum("hij,jhd->ihd", p, v)
    return o, lse.transpose(0, 1).contiguous()


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """o * sigmoid(lse - s_h): the sink logit joins the denominator and adds no value."""
    if sinks is None:
        return o
    w = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :])  # lse = -inf gives 0
    return o * w[..., None]


def expand_kv_heads(t: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """GQA/MQA: query head h reads kv head h // (num_q_heads // num_kv_heads)."""
    num_kv_heads = t.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return t.repeat_interleave(num_q_heads // num_kv_heads, dim=1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
    sink_tokens: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed varlen queries over packed KV; returns (o, lse) in float32/64.

    Query i of a sequence with sq queries and sk keys sits at position sk - sq + i.
    lse excludes the sink logit; o includes it.
    """
    cdt = _compute_dtype(q)
    hq, d = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = MaskSpec(causal=causal, window=window, sink_tokens=sink_tokens)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    o = torch.zeros(q.shape[0], hq, d, dtype=cdt)
    lse = torch.full((q.shape[0], hq), NEG_INF, dtype=cdt)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        if sq > sk:
            raise ValueError(f"sequence {b}: {sq} queries but only {sk} keys")
        qb = q[q0:q1].to(cdt)
        kb = expand_kv_heads(k[k0:k1].to(cdt), hq)
        vb = expand_kv_heads(v[k0:k1].to(cdt), hq)
        q_pos = torch.arange(sk - sq, sk)
        k_pos = torch.arange(sk)
        vis = mask.visible(q_pos, k_pos)
        ob, lb = masked_softmax_attention(scores(qb, kb, scale, softcap), vis, vb)
        o[q0:q1] = apply_sinks(ob, lb, sinks)
        lse[q0:q1] = lb
    return o, lse


# --- FP8 dequantisation -------------------------------------------------------------------


def dequant_per_tensor(x8: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """k = k8 * k_scale with one fp32 scalar for the whole tensor."""
    return x8.to(torch.float32) * float(scale)


def dequant_per_page(cache8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """cache8 [num_blocks, block_size, kv_heads, d]; descale [num_blocks, kv_heads] (fp32).

    Every key in block p, kv head g uses descale[p, g].
    """
    if descale.shape != (cache8.shape[0], cache8.shape[2]):
        raise ValueError(f"descale shape {tuple(descale.shape)} != (num_blocks, kv_heads)")
    return cache8.to(torch.float32) * descale.to(torch.float32)[:, None, :, None]


def dequant_cache(
    cache: torch.Tensor, scale: float | torch.Tensor | None = None, descale: torch.Tensor | None = None
) -> torch.Tensor:
    """Float view of a cache, whatever its quantisation (none, per-tensor or per-page)."""
    if descale is not None:
        return dequant_per_page(cache, descale)
    if scale is not None:
        return dequant_per_tensor(cache, scale)
    return cache.to(_compute_dtype(cache))


# --- Paged KV -> packed KV ----------------------------------------------------------------


def pages_of_vllm(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[list[int]]:
    """Physical pages of each sequence from a vLLM 2D block table, validated."""
    pages = []
    for b, sk in enumerate(seq_lens.tolist()):
        n = -(-sk // block_size)
        if n > block_table.shape[1]:
            raise ValueError(f"sequence {b}: {sk} tokens need {n} blocks, block table has {block_table.shape[1]}")
        pages.append(block_table[b, :n].tolist())
    return pages


def pages_of_sglang(kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor) -> list[list[int]]:
    """Physical pages of each sequence from SGLang's indptr / page indices."""
    ptr = kv_indptr.tolist()
    idx = kv_page_indices.tolist()
    return [idx[ptr[b] : ptr[b + 1]] for b in range(len(ptr) - 1)]


def gather_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: list[list[int]],
    seq_lens: list[int],
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (k, v, cu_seqlens_k) of the given sequences, dequantised to float.

    Token t of sequence b lives in page pages[b][t // page_size], slot t % page_size.
    """
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    kf = dequant_cache(k_cache, k_scale, k_descale)
    vf = dequant_cache(v_cache, v_scale, v_descale)
    ks, vs, cu = [], [], [0]
    for b, (pg, sk) in enumerate(zip(pages, seq_lens)):
        if len(pg) * page_size < sk:
            raise ValueError(f"sequence {b}: {sk} tokens but only {len(pg)} pages of {page_size}")
        if any(p < 0 or p >= num_blocks for p in pg[: -(-sk // page_size)]):
            raise ValueError(f"sequence {b}: page id out of range [0, {num_blocks})")
        t = torch.arange(sk)
        phys = torch.tensor(pg, dtype=torch.long)[t // page_size] if sk else t
        ks.append(kf[phys, t % page_size])
        vs.append(vf[phys, t % page_size])
        cu.append(cu[-1] + sk)
    return torch.cat(ks), torch.cat(vs), torch.tensor(cu, dtype=torch.int32)


def gather_vllm(k_cache, v_cache, block_table, seq_lens, **scales):
    """vLLM layout: block_table[b, i] is the physical block of logical block i."""
    pages = pages_of_vllm(block_table, seq_lens, k_cache.shape[1])
    return gather_pages(k_cache, v_cache, pages, seq_lens.tolist(), **scales)


def gather_sglang(k_cache, v_cache, kv_indptr, kv_page_indices, seq_lens, **scales):
    """SGLang layout: pages of b are kv_page_indices[kv_indptr[b]:kv_indptr[b+1]]."""
    pages = pages_of_sglang(kv_indptr, kv_page_indices)
    return gather_pages(k_cache, v_cache, pages, seq_lens.tolist(), **scales)


def write_kv(k_cache, v_cache, k_new, v_new, slot_mapping) -> None:
    """Store new tokens through slot_mapping (block * block_size + offset); negative = padding."""
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, slot % bs] = k_new[t].to(k_cache.dtype)
        v_cache[slot // bs, slot % bs] = v_new[t].to(v_cache.dtype)


def paged_attention(
    q, k_cache, v_cache, cu_seqlens_q, block_table, seq_lens, *,
    k_scale=None, v_scale=None, k_descale=None, v_descale=None, **attn,
):
    """Attention over the vLLM paged cache: gather, then varlen_attention."""
    k, v, cu_k = gather_vllm(
        k_cache, v_cache, block_table, seq_lens,
        k_scale=k_scale, v_scale=v_scale, k_descale=k_descale, v_descale=v_descale,
    )
    if q.dtype == torch.float64:
        k, v = k.double(), v.double()
    return varlen_attention(q, k, v, cu_seqlens_q, cu_k, **attn)


# --- Split-KV (decode) --------------------------------------------------------------------


def split_kv_partials(
    q, k, v, cu_seqlens_q, cu_seqlens_k, num_splits: int, *,
    scale=None, causal=True, window=0, sink_tokens=0, softcap=0.0, split_rule=(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split normalised o_s [S, total_q, H, d] and lse_s [S, total_q, H] (no sinks)."""
    cdt = _compute_dtype(q)
    hq, d = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = MaskSpec(causal=causal, window=window, sink_tokens=sink_tokens)
    o_s = torch.zeros(num_splits, q.shape[0], hq, d, dtype=cdt)
    lse_s = torch.full((num_splits, q.shape[0], hq), NEG_INF, dtype=cdt)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        qb = q[q0:q1].to(cdt)
        kb = expand_kv_heads(k[k0:k1].to(cdt), hq)
        vb = expand_kv_heads(v[k0:k1].to(cdt), hq)
        q_pos = torch.arange(sk - sq, sk)
        for s, (j0, j1) in enumerate(split_ranges(sk, num_splits, split_rule)):
            if j1 == j0:
                continue
            vis = mask.visible(q_pos, torch.arange(j0, j1))
            x = scores(qb, kb[j0:j1], scale, softcap)
            o_s[s, q0:q1], lse_s[s, q0:q1] = masked_softmax_attention(x, vis, vb[j0:j1])
    return o_s, lse_s


def combine_splits(o_s: torch.Tensor, lse_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lse = log sum_s exp(lse_s); o = sum_s exp(lse_s - lse) o_s; all -inf gives o = 0, lse = -inf."""
    lse = torch.logsumexp(lse_s, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(lse_s - safe[None])  # -inf splits weigh 0
    w = torch.where(torch.isfinite(lse)[None], w, torch.zeros_like(w))
    o = (w[..., None] * o_s).sum(dim=0)
    return o, lse
