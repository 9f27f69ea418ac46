"""Triton kernels of the unified path: attention straight over the paged KV cache.

Semantics are docs/design.md's. This file is loaded twice at most by ``api.py``: once
compiled for GPUs and once under Triton's interpreter (CPU tensors), so nothing here may read
global state at import time except ``triton``.

Layout of the work: program (tile, kv head [, split]). A tile is BLOCK_M rows; row r is query
token ``r // HG`` of the tile and query head ``r % HG`` of the kv head's group, so the HG query
heads that share one kv head sit in the M dimension of the dots and K/V is read once for all of
them (GQA packing). Keys are visited BLOCK_N at a time; each key looks up its own page
(``token // PAGE_SIZE``), so tiles and pages need not line up and any page size works.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _request_splits(keys, num_splits, min_keys, fill, long_keys, ctas, slots, wave_fill):
    """planner.request_splits (the one definition; see there)."""
    cap = num_splits
    if min_keys > 0:
        cap = tl.minimum(cap, keys // min_keys)
    cap = tl.maximum(cap, 1)
    ns = cap
    if fill > 0:
        f = tl.minimum(fill, cap)
        ns = f
        if (long_keys > 0) & (ctas > 0) & (slots > 0):
            fc = ctas * f
            one_wave = (keys <= f * long_keys) & (fc <= slots)
            full = 100 * fc >= wave_fill * ((fc + slots - 1) // slots) * slots
            if not (one_wave | full):
                grow_cap = tl.minimum(cap, tl.maximum(f, keys // long_keys))
                k = (ctas + slots - 1) // slots
                done = 0
                while done == 0:  # whole_wave_splits
                    s = tl.maximum((wave_fill * k * slots + 100 * ctas - 1) // (100 * ctas), 1)
                    if s > grow_cap:
                        done = 1
                    elif ctas * s <= k * slots:
                        ns = s
                        done = 1
                    k += 1
    return ns


@triton.jit
def _find_seq(cu_q_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence b owns tile ids cu_q[b] // BLOCK_Q + b onwards: an upper bound of the tiles of all
    # earlier sequences that needs no host-side prefix sum (and so no device-to-host sync).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_tiles(
    acc, l_i, m_i, q, q_pos,
    t_lo, t_hi, key0, key_end,
    k_ptr, v_ptr, bt_row_ptr, kvh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    kds_ptr, vds_ptr, num_kv_heads,
    qk_scale, cap_in, cap_out, window, sink_tokens,
    offs_d,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINK_TOKENS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, PER_PAGE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, DOT_IEEE: tl.constexpr,
    PV_FP16: tl.constexpr,
):
    """Online softmax over key tiles t_lo..t_hi-1 (tile t starts at key0 + t * BLOCK_N).

    Scores live in log2 units (log2(e) is folded into qk_scale / cap_out), so exp2 does the work.
    MASK=False is for tiles every row of the program fully sees: no key bound, no causal or
    window test.
    """
    d_ok = offs_d < HEAD_DIM
    for t in range(t_lo, t_hi):
        offs_n = key0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        # -- page lookup, per key: page = token // page size; 64-bit offsets into the pool
        if MASK:
            n_ok = offs_n < key_end
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kb + slot * stride_kt + kvh * stride_kh
        v_off = page * stride_vb + slot * stride_vt + kvh * stride_vh
        kt_ptrs = k_ptr + k_off[None, :] + offs_d[:, None]  # K^T tile [D, N]
        v_ptrs = v_ptr + v_off[:, None] + offs_d[None, :]  # V tile [N, D]
        if MASK:
            if PAD_D:
                kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                kt = tl.load(kt_ptrs, mask=n_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            if PAD_D:
                kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)

        # -- S = Q K^T (FP8 keys are exact in fp16/bf16, so they join the dot in q's dtype)
        if DOT_IEEE:
            qk = tl.dot(q, kt.to(q.dtype), input_precision="ieee")
        else:
            qk = tl.dot(q, kt.to(q.dtype))
        if PER_PAGE:
            # each key's own page scale: a tile spanning two pages uses both
            if MASK:
                kd = tl.load(kds_ptr + page * num_kv_heads + kvh, mask=n_ok, other=0.0)
            else:
                kd = tl.load(kds_ptr + page * num_kv_heads + kvh)
            qk = qk * kd[None, :]
        if USE_SOFTCAP:
            # x = c * tanh(scale * qk / c); tanh(y) = 1 - 2 / (exp(2y) + 1) saturates cleanly
            y = qk * cap_in
            s = (1.0 - 2.0 / (tl.exp2(y * (2.0 * 1.4426950408889634)) + 1.0)) * cap_out
        else:
            s = qk * qk_scale
        if MASK:
            vis = n_ok[None, :]
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                in_win = offs_n[None, :] > q_pos[:, None] - window
                if USE_SINK_TOKENS:
                    in_win = in_win | (offs_n[None, :] < sink_tokens)
                vis = vis & in_win
            s = tl.where(vis, s, float("-inf"))

        # -- online softmax (m_i starts finite, so a fully masked tile gives p = 0, never NaN)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PER_PAGE:
            if MASK:
                vd = tl.load(vds_ptr + page * num_kv_heads + kvh, mask=n_ok, other=0.0)
            else:
                vd = tl.load(vds_ptr + page * num_kv_heads + kvh)
            p = p * vd[None, :]
        if DOT_IEEE:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision="ieee")
        elif PV_FP16:
            # FP8 values are exact in fp16, and P keeps 3 more bits there than in bf16
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tile_range(b0, b1, f_lo, f_hi, BLOCK_N: tl.constexpr):
    """Split keys [b0, b1) into tiles: masked [0, t1), unmasked [t1, t2), masked [t2, n)."""
    n = tl.cdiv(tl.maximum(b1 - b0, 0), BLOCK_N)
    f0 = tl.maximum(f_lo, b0)
    f1 = tl.minimum(f_hi, b1)
    t1 = tl.cdiv(tl.maximum(f0 - b0, 0), BLOCK_N)
    t2 = tl.maximum(f1 - b0, 0) // BLOCK_N
    none_full = t2 <= t1
    t1 = tl.where(none_full, 0, t1)
    t2 = tl.where(none_full, 0, t2)
    return n, t1, t2


# Arguments that change from batch to batch. Triton would otherwise compile a kernel per value
# class (equal to 1, a multiple of 16, other) of each: up to 3^9 forms, each a compile or a disk
# load inside a serving step. Unspecialized, one form serves every batch (and the ahead-of-time
# build compiles it, unified.aot).
PER_BATCH_ARGS = ("num_seqs", "total_q", "stride_bt", "min_split_keys", "fill_splits", "long_split_keys",
                  "split_ctas", "split_slots", "wave_fill")


@triton.jit(do_not_specialize=PER_BATCH_ARGS)
def unified_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    cu_q_ptr, seq_lens_ptr, bt_ptr,
    sinks_ptr, kscale_ptr, vscale_ptr, kds_ptr, vds_ptr,
    num_seqs, num_kv_heads, total_q, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    qk_scale, cap_in, cap_out, window, sink_tokens,
    min_split_keys, fill_splits, long_split_keys, split_ctas, split_slots, wave_fill,
    GROUP: tl.constexpr, HG: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAD_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINK_TOKENS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PER_TENSOR: tl.constexpr, PER_PAGE: tl.constexpr,
    SPLIT: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_IEEE: tl.constexpr, PV_FP16: tl.constexpr,
):
    """One program: BLOCK_Q query tokens x HG query heads of one kv head [x one key split].

    SPLIT=False writes out (sinks applied) and optionally lse. SPLIT=True writes the split's
    normalised fp32 partial out_ptr[s, t, h, :] and lse_ptr[s, t, h] (no sinks; the combine
    applies them once).
    """
    # Later tiles of a causal sequence see more keys: hand them out first.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1) // tl.cdiv(GROUP, HG)
    hsplit = tl.program_id(1) % tl.cdiv(GROUP, HG)
    seq = _find_seq(cu_q_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    sq = tl.load(cu_q_ptr + seq + 1) - q_start
    qt = tile_id - (q_start // BLOCK_Q + seq)
    if qt * BLOCK_Q >= sq:
        return
    sk = tl.load(seq_lens_ptr + seq)

    # -- rows of this program: (token, head) pairs, GQA-packed
    offs_m = tl.arange(0, BLOCK_M)
    tok = qt * BLOCK_Q + offs_m // HG
    head_in_group = hsplit * HG + offs_m % HG
    row_ok = (offs_m < BLOCK_Q * HG) & (tok < sq) & (head_in_group < GROUP)
    head = kvh * GROUP + head_in_group
    q_pos = sk - sq + tok  # bottom-right aligned absolute position
    offs_d = tl.arange(0, HEAD_PAD)
    tok64 = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if PAD_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    if PER_TENSOR:
        k_scale = tl.load(kscale_ptr).to(tl.float32)
        qk_scale = qk_scale * k_scale
        cap_in = cap_in * k_scale

    # -- key range this program must visit
    q_lo = sk - sq + qt * BLOCK_Q  # position of the first row
    q_hi = sk - sq + tl.minimum(qt * BLOCK_Q + BLOCK_Q, sq) - 1  # of the last real row
    hi = sk
    f_hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, q_hi + 1)
        f_hi = tl.minimum(sk, q_lo + 1)
    lo = 0
    f_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(q_lo - window + 1, 0)
        f_lo = tl.maximum(q_hi - window + 1, 0)
    s_lo = 0
    s_hi = sk
    if SPLIT:
        split = tl.program_id(2)
        ns = tl.num_programs(2)
        # The split rule over [0, sk); splits ns.. stay empty.
        ns = _request_splits(sk, ns, min_split_keys, fill_splits, long_split_keys, split_ctas, split_slots,
                             wave_fill)
        per = tl.cdiv(sk, ns)
        s_lo = tl.minimum(split * per, sk)
        s_hi = tl.minimum(s_lo + per, sk)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt

    if USE_SINK_TOKENS:
        # StreamingLLM sink tokens under the window: keys [0, min(S, lo)) outside segment B
        a1 = tl.minimum(tl.minimum(tl.minimum(sink_tokens, lo), s_hi), hi)
        n_a = tl.cdiv(tl.maximum(a1 - s_lo, 0), BLOCK_N)
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q_pos, 0, n_a, s_lo, a1,
            k_ptr, v_ptr, bt_row_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            kds_ptr, vds_ptr, num_kv_heads, qk_scale, cap_in, cap_out, window, sink_tokens, offs_d,
            True, CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_SOFTCAP, PER_PAGE, PAGE_SIZE,
            BLOCK_N, HEAD_DIM, PAD_D, DOT_IEEE, PV_FP16)

    # Segment B: keys [b0, b1), masked only on the tiles that cross a causal/window/range edge.
    b0 = tl.maximum(lo, s_lo)
    b1 = tl.minimum(hi, s_hi)
    n_b, t1, t2 = _tile_range(b0, b1, f_lo, f_hi, BLOCK_N)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, 0, t1, b0, b1,
        k_ptr, v_ptr, bt_row_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        kds_ptr, vds_ptr, num_kv_heads, qk_scale, cap_in, cap_out, window, sink_tokens, offs_d,
        True, CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_SOFTCAP, PER_PAGE, PAGE_SIZE,
        BLOCK_N, HEAD_DIM, PAD_D, DOT_IEEE, PV_FP16)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, t1, t2, b0, b1,
        k_ptr, v_ptr, bt_row_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        kds_ptr, vds_ptr, num_kv_heads, qk_scale, cap_in, cap_out, window, sink_tokens, offs_d,
        False, CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_SOFTCAP, PER_PAGE, PAGE_SIZE,
        BLOCK_N, HEAD_DIM, PAD_D, DOT_IEEE, PV_FP16)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q, q_pos, t2, n_b, b0, b1,
        k_ptr, v_ptr, bt_row_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        kds_ptr, vds_ptr, num_kv_heads, qk_scale, cap_in, cap_out, window, sink_tokens, offs_d,
        True, CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_SOFTCAP, PER_PAGE, PAGE_SIZE,
        BLOCK_N, HEAD_DIM, PAD_D, DOT_IEEE, PV_FP16)

    # -- epilogue: normalise; a row with no visible key gets o = 0, lse = -inf
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if PER_TENSOR:
        o = o * tl.load(vscale_ptr).to(tl.float32)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    d_ok = offs_d < HEAD_DIM
    if SPLIT:
        row64 = (tl.program_id(2) * total_q + q_start + tok).to(tl.int64) * num_q_heads + head
        tl.store(out_ptr + row64[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + row64, lse, mask=row_ok)
    else:
        if HAS_SINKS:
            # o * sigmoid(lse - s_h): the sink joins the denominator, adds no value
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            o = o / (1.0 + tl.exp(sink - lse))[:, None]
        o_ptrs = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:
            tl.store(lse_ptr + tok64 * num_q_heads + head, lse, mask=row_ok)


# The split count is a run-time value (its power-of-two pad is the constexpr): a batch's count
# follows its length and size, and one compile per count would land inside serving.
@triton.jit(do_not_specialize=("total_q", "num_splits"))
def combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, sinks_ptr,
    total_q, num_q_heads, stride_ot, stride_oh, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """docs/design.md's combine for one (token, head): -inf splits weigh 0; sinks once, after."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_splits
    row = (offs_s * total_q + t) * num_q_heads + h
    lse_s = tl.load(lse_part_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    tot = tl.sum(w, 0)
    has = tot > 0.0
    w = w / tl.where(has, tot, 1.0)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
    o_s = tl.load(o_part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(o_s * w[:, None], 0)
    if HAS_SINKS:
        o = o / (1.0 + tl.exp(tl.load(sinks_ptr + h).to(tl.float32) - lse))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    if RETURN_LSE:
        tl.store(lse_ptr + t * num_q_heads + h, lse)
