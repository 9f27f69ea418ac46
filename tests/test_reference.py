"""atom_backend.reference against the element-by-element loop oracle (docs/design.md must-haves)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_backend.planning import split_ranges
from atom_backend import reference as ref
from tests import loop_oracle as loop

F64 = torch.float64


def _lists(t: torch.Tensor):
    return t.tolist()


def _random_batch(gen, seqs, hq, hk, d):
    """Packed q, k, v (float64) and cu_seqlens for [(sq, sk), ...]."""
    tq = sum(sq for sq, _ in seqs)
    tk = sum(sk for _, sk in seqs)
    q = torch.randn(tq, hq, d, generator=gen, dtype=F64)
    k = torch.randn(tk, hk, d, generator=gen, dtype=F64)
    v = torch.randn(tk, hk, d, generator=gen, dtype=F64)
    cu_q = torch.tensor([0] + [sum(s for s, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(s for _, s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _compare(q, k, v, cu_q, cu_k, **opts):
    o, lse = ref.varlen_attention(q, k, v, cu_q, cu_k, **opts)
    lo, llse = loop.varlen(_lists(q), _lists(k), _lists(v), cu_q.tolist(), cu_k.tolist(), **{
        kk: (vv.tolist() if isinstance(vv, torch.Tensor) else vv) for kk, vv in opts.items()
    })
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    if q.shape[0]:
        torch.testing.assert_close(o, torch.tensor(lo, dtype=F64), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse, torch.tensor(llse, dtype=F64), rtol=1e-9, atol=1e-9)
    return o, lse


# Every must-have case of docs/design.md, by name: (seqs [(sq, sk)], hq, hk, opts)
MUST_HAVE = {
    "sq_eq_sk": ([(7, 7), (3, 3)], 2, 2, {}),
    "prefix_hit_sq_lt_sk": ([(3, 11), (5, 9)], 2, 2, {}),
    "sq1": ([(1, 9), (1, 1)], 2, 2, {}),
    "gqa1": ([(5, 8)], 3, 3, {}),
    "gqa4": ([(5, 8)], 8, 2, {}),
    "gqa8": ([(4, 6)], 8, 1, {}),
    "window_lt_sk": ([(6, 12)], 2, 1, {"window": 4}),
    "window_eq_sk": ([(6, 12)], 2, 1, {"window": 12}),
    "window_gt_sk": ([(6, 12)], 2, 1, {"window": 40}),
    "sink_tokens_0": ([(9, 14)], 2, 1, {"window": 3, "sink_tokens": 0}),
    "sink_tokens_1": ([(9, 14)], 2, 1, {"window": 3, "sink_tokens": 1}),
    "sink_tokens_8": ([(9, 14)], 2, 1, {"window": 3, "sink_tokens": 8}),
    "empty_seq": ([(0, 0), (3, 5), (0, 4)], 2, 2, {}),
    "softcap": ([(4, 7)], 2, 2, {"softcap": 5.0}),
    "sinks": ([(4, 7), (1, 3)], 4, 2, {"sinks": True}),
    "sinks_window_sink_tokens_softcap": ([(5, 13)], 4, 2, {"sinks": True, "window": 3, "sink_tokens": 2, "softcap": 3.0}),
    "non_causal": ([(4, 6)], 2, 2, {"causal": False}),
}


@pytest.mark.parametrize("case", list(MUST_HAVE), ids=list(MUST_HAVE))
def test_varlen_must_have(case):
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    seqs, hq, hk, opts = MUST_HAVE[case]
    d = 8
    q, k, v, cu_q, cu_k = _random_batch(gen, seqs, hq, hk, d)
    opts = dict(opts)
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(hq, generator=gen, dtype=F64)
    _compare(q, k, v, cu_q, cu_k, **opts)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (8, 1)]),
    d=st.sampled_from([1, 4, 8]),
    window=st.integers(0, 8),
    sink_tokens=st.integers(0, 3),
    softcap=st.sampled_from([0.0, 2.0]),
    with_sinks=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_varlen_property(seqs, heads, d, window, sink_tokens, softcap, with_sinks, causal, seed):
    seqs = [(min(a, a + b), a + b) for a, b in seqs]  # sq <= sk
    hq, hk = heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu_q, cu_k = _random_batch(gen, seqs, hq, hk, d)
    sinks = torch.randn(hq, generator=gen, dtype=F64) if with_sinks else None
    _compare(q, k, v, cu_q, cu_k, window=window, sink_tokens=sink_tokens, softcap=softcap, sinks=sinks, causal=causal)


def test_sinks_equal_sigmoid_scaling():
    gen = torch.Generator().manual_seed(1)
    q, k, v, cu_q, cu_k = _random_batch(gen, [(5, 9)], 4, 2, 8)
    sinks = torch.randn(4, generator=gen, dtype=F64) * 3
    o, lse = ref.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks)
    o0, lse0 = ref.varlen_attention(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(lse, lse0)  # lse never includes the sink
    torch.testing.assert_close(o, o0 * torch.sigmoid(lse0 - sinks)[..., None])


def test_fully_masked_row_is_zero_with_neg_inf_lse():
    # A non-causal split-free corner: a split whose keys are all outside the window.
    gen = torch.Generator().manual_seed(2)
    q, k, v, cu_q, cu_k = _random_batch(gen, [(1, 16)], 2, 2, 8)
    o_s, lse_s = ref.split_kv_partials(q, k, v, cu_q, cu_k, 4, window=3)
    assert torch.isneginf(lse_s[0]).all() and (o_s[0] == 0).all()  # keys 0..3 out of the window
    assert torch.isfinite(lse_s[3]).all()


def test_too_many_queries_is_an_error():
    gen = torch.Generator().manual_seed(3)
    q, k, v, _, _ = _random_batch(gen, [(4, 4)], 1, 1, 4)
    with pytest.raises(ValueError, match="queries but only"):
        ref.varlen_attention(q, k[:2], v[:2], torch.tensor([0, 4]), torch.tensor([0, 2]))


# --- paged gather ------------------------------------------------------------------------


def _paged_setup(gen, seq_lens, page_size, hk=2, d=4, extra_pages=3, fp8=None):
    """A cache whose pages are permuted and include the pool's last page."""
    need = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(need) + extra_pages
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    if sum(need) and num_blocks - 1 not in perm[: sum(need)]:
        perm[0], perm[perm.index(num_blocks - 1)] = num_blocks - 1, perm[0]
    pages, at = [], 0
    for n in need:
        pages.append(perm[at : at + n])
        at += n
    k_cache = torch.randn(num_blocks, page_size, hk, d, generator=gen)
    v_cache = torch.randn(num_blocks, page_size, hk, d, generator=gen)
    if fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    return k_cache, v_cache, pages


def _block_table(pages, width):
    bt = torch.full((len(pages), max(width, 1)), -1, dtype=torch.int32)
    for b, p in enumerate(pages):
        bt[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    return bt


GATHER_CASES = {
    "page_size_1": (1, [3, 1, 0, 5]),
    "page_size_16": (16, [16, 17, 5, 0]),  # exactly one page, one past a page, partial, empty
    "page_size_1024": (1024, [1024, 1025, 3]),
    "page_boundary_exact": (4, [8, 4]),
    "page_boundary_plus1": (4, [9, 5]),
}


@pytest.mark.parametrize("layout", ["vllm", "sglang"])
@pytest.mark.parametrize("scale_mode", ["none", "fp8_per_tensor", "fp8_per_page"])
@pytest.mark.parametrize("case", list(GATHER_CASES), ids=list(GATHER_CASES))
def test_gather_against_loop(case, scale_mode, layout):
    page_size, seq_lens = GATHER_CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 7 + page_size)
    k_cache, v_cache, pages = _paged_setup(gen, seq_lens, page_size, fp8=scale_mode != "none")
    scales = {}
    if scale_mode == "fp8_per_tensor":
        scales = {"k_scale": 0.5, "v_scale": 1.75}
    elif scale_mode == "fp8_per_page":
        # distinct scales per page and head, so a page transition changes the scale
        scales = {
            "k_descale": torch.rand(k_cache.shape[0], k_cache.shape[2], generator=gen) + 0.25,
            "v_descale": torch.rand(k_cache.shape[0], k_cache.shape[2], generator=gen) + 0.25,
        }
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    if layout == "vllm":
        k, v, cu = ref.gather_vllm(k_cache, v_cache, _block_table(pages, max(map(len, pages))), sl, **scales)
    else:
        indptr = torch.tensor([0] + [sum(map(len, pages[: i + 1])) for i in range(len(pages))], dtype=torch.int32)
        indices = torch.tensor([p for pg in pages for p in pg], dtype=torch.int32)
        k, v, cu = ref.gather_sglang(k_cache, v_cache, indptr, indices, sl, **scales)
    assert cu.tolist() == [sum(seq_lens[:i]) for i in range(len(seq_lens) + 1)]
    kf, vf = k_cache.float().tolist(), v_cache.float().tolist()
    kd = scales.get("k_descale")
    vd = scales.get("v_descale")
    for b, s in enumerate(seq_lens):
        want_k = loop.gather(kf, pages[b], s, page_size, kd.tolist() if kd is not None else None, scales.get("k_scale"))
        want_v = loop.gather(vf, pages[b], s, page_size, vd.tolist() if vd is not None else None, scales.get("v_scale"))
        # float32 product against Python's double: equal up to one float32 rounding
        torch.testing.assert_close(k[cu[b] : cu[b + 1]], torch.tensor(want_k).reshape(-1, *k.shape[1:]), rtol=1e-6, atol=0)
        torch.testing.assert_close(v[cu[b] : cu[b + 1]], torch.tensor(want_v).reshape(-1, *v.shape[1:]), rtol=1e-6, atol=0)


def test_gather_rejects_out_of_range_pages_and_short_tables():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, pages = _paged_setup(gen, [5], 4)
    bt = _block_table(pages, 2)
    bad = bt.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        ref.gather_vllm(k_cache, v_cache, bad, torch.tensor([5]))
    with pytest.raises(ValueError, match="need 3 blocks"):
        ref.gather_vllm(k_cache, v_cache, bt, torch.tensor([9]))


def test_per_page_descale_shape_is_checked():
    with pytest.raises(ValueError, match="num_blocks, kv_heads"):
        ref.dequant_per_page(torch.zeros(3, 4, 2, 8), torch.ones(3, 3))


def test_write_kv_skips_padding_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k_new = torch.randn(3, 1, 2)
    ref.write_kv(k_cache, v_cache, k_new, k_new * 2, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[1, 1], k_new[0]) and torch.equal(k_cache[0, 0], k_new[2])
    assert torch.equal(v_cache[1, 1], 2 * k_new[0])
    assert int((k_cache != 0).any(-1).sum()) == 2


def test_paged_attention_equals_varlen_on_gathered_kv():
    gen = torch.Generator().manual_seed(6)
    seq_lens = [9, 16, 1]
    k_cache, v_cache, pages = _paged_setup(gen, seq_lens, 4, hk=2, d=8)
    bt = _block_table(pages, 4)
    q = torch.randn(2 + 3 + 1, 4, 8, generator=gen)
    cu_q = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    o, lse = ref.paged_attention(q, k_cache, v_cache, cu_q, bt, torch.tensor(seq_lens), window=5)
    k, v, cu_k = ref.gather_vllm(k_cache, v_cache, bt, torch.tensor(seq_lens))
    o2, lse2 = ref.varlen_attention(q, k, v, cu_q, cu_k, window=5)
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(lse, lse2)


# --- split-KV ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 20])
@pytest.mark.parametrize("opts", [{}, {"window": 5, "sink_tokens": 2}, {"softcap": 4.0}], ids=["plain", "window_sink_tokens", "softcap"])
def test_split_kv_combine_equals_full_attention(num_splits, opts):
    gen = torch.Generator().manual_seed(num_splits)
    q, k, v, cu_q, cu_k = _random_batch(gen, [(1, 13), (2, 9), (1, 1), (0, 3)], 4, 2, 8)
    sinks = torch.randn(4, generator=gen, dtype=F64)
    o_s, lse_s = ref.split_kv_partials(q, k, v, cu_q, cu_k, num_splits, **opts)
    o, lse = ref.combine_splits(o_s, lse_s)
    o_full, lse_full = ref.varlen_attention(q, k, v, cu_q, cu_k, **opts)
    torch.testing.assert_close(lse, lse_full)
    torch.testing.assert_close(o, o_full)
    # sinks are applied once, after the combine
    o_sink, _ = ref.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, **opts)
    torch.testing.assert_close(ref.apply_sinks(o, lse, sinks), o_sink)


def test_split_ranges_cover_keys_once():
    for sk in (0, 1, 5, 16, 17, 300):
        for s in (1, 2, 3, 8):
            for rule in ((), (1,), (4,), (64,), (4, 1, 100, 2, 8, 95), (1, 2), (1, 1, 4, 1, 3, 90)):
                r = split_ranges(sk, s, rule)
                assert len(r) == s
                assert [j for a, b in r for j in range(a, b)] == list(range(sk))


def test_split_ranges_min_split_tokens_bounds_the_splits_used():
    # clamp(sk // m, 1, S) splits of ceil(sk / n) keys, the rest empty
    assert split_ranges(300, 8, (64,)) == [(0, 75), (75, 150), (150, 225), (225, 300)] + [(300, 300)] * 4
    assert split_ranges(63, 8, (64,)) == [(0, 63)] + [(63, 63)] * 7
    assert split_ranges(0, 3, (64,)) == [(0, 0)] * 3
    assert split_ranges(4096, 8, (256,)) == split_ranges(4096, 8)  # long enough: all splits


def test_split_ranges_fill_and_long_split_tokens():
    # fill target 2; growth needs the wave bounds (CTAs per split 2, 8 slots): 4 splits fill it
    assert split_ranges(1000, 8, (64, 2, 400)) == [(0, 500), (500, 1000)] + [(1000, 1000)] * 6
    grow = (64, 2, 400, 2, 8, 95)
    assert split_ranges(2000, 8, grow) == [(j, j + 500) for j in range(0, 2000, 500)] + [(2000, 2000)] * 4
    assert split_ranges(800, 8, grow) == [(0, 400), (400, 800)] + [(800, 800)] * 6  # <= 400 keys a split
    assert split_ranges(100, 8, grow) == [(0, 100)] + [(100, 100)] * 7  # 100 // 64 = 1
    assert split_ranges(1000, 8, (0, 3)) == split_ranges(1000, 3) + [(1000, 1000)] * 5  # fill alone


def test_combine_all_empty_splits():
    o_s = torch.randn(3, 2, 2, 4)
    lse_s = torch.full((3, 2, 2), -math.inf)
    lse_s[1, 0, 0] = 0.3
    o, lse = ref.combine_splits(o_s, lse_s)
    assert torch.isneginf(lse[1]).all() and (o[1] == 0).all()  # every split empty
    torch.testing.assert_close(o[0, 0], o_s[1, 0, 0])  # the one non-empty split alone
    assert lse[0, 0].item() == pytest.approx(0.3)
    assert not torch.isnan(o).any()
