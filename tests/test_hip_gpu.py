"""GPU tests of the gather and combine kernels against atom_backend.reference (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _fp8_dtype():
    from hip_kernels import runtime

    return runtime.native_fp8_dtype(runtime.device_arch(0))


def _pool(nb, ps, h, d, dtype, pad=0):
    """kv[2, nb, ps, h, d(+pad)] like vLLM's cache; k/v are strided views of it."""
    base = torch.randn(2, nb, ps, h, d + pad, device=DEV)
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        base = base * 2.0  # spread over the e4m3 range, subnormals included
    kv = base.to(dtype)[..., :d]
    return kv[0], kv[1]


def _assign_pages(lens, ps, nb, gen):
    """Per-sequence physical pages: a permutation of the pool that starts with its last page."""
    need = sum(-(-n // ps) for n in lens)
    assert need <= nb
    perm = torch.randperm(nb - 1, generator=gen)[: max(need - 1, 0)].tolist()
    order = ([nb - 1] + perm) if need else []
    pages, i = [], 0
    for n in lens:
        k = -(-n // ps)
        pages.append(order[i : i + k])
        i += k
    return pages


def _tables(pages, lens, ps, extra_cols=2):
    """vLLM block_table (unused slots hold valid but wrong pages) and SGLang indptr/indices."""
    cols = max([len(p) for p in pages] + [1]) + extra_cols
    bt = torch.zeros(len(pages), cols, dtype=torch.int32)
    for b, p in enumerate(pages):
        bt[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    indptr = torch.tensor([0] + [sum(len(p) for p in pages[: b + 1]) for b in range(len(pages))], dtype=torch.int32)
    idx = torch.tensor([x for p in pages for x in p] or [0], dtype=torch.int32)
    return bt.to(DEV), indptr.to(DEV), idx.to(DEV)


def _subset(lens, gen):
    """Request indices to gather, in a shuffled order, and their cu_seqlens_k."""
    ids = torch.randperm(len(lens), generator=gen)[: max(1, len(lens) - 1)].tolist()
    cu = [0]
    for b in ids:
        cu.append(cu[-1] + lens[b])
    return ids, cu


CASES = [
    # page_size, seq lens (empty, on and one past a page boundary, ragged)
    (1, [0, 1, 7, 33, 0, 100]),
    (16, [16, 17, 0, 1, 300, 31, 64]),
    (1024, [1024, 1025, 0, 3000, 5]),
]


@pytest.mark.parametrize("layout", ["vllm", "sglang"])
@pytest.mark.parametrize("ps,lens", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_copy_matches_reference(layout, ps, lens, dtype):
    from hip_kernels.gather import gather_kv

    gen = torch.Generator().manual_seed(ps * 10 + (layout == "vllm") * 3 + (dtype == torch.float16))
    h, d = 4, 128
    nb = sum(-(-n // ps) for n in lens) + 5
    k_cache, v_cache = _pool(nb, ps, h, d, dtype, pad=16 if ps == 16 else 0)
    pages = _assign_pages(lens, ps, nb, gen)
    bt, indptr, idx = _tables(pages, lens, ps)
    ids, cu = _subset(lens, gen)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    ids_t = torch.tensor(ids, dtype=torch.int32, device=DEV)
    k_out = torch.full((cu[-1], h, d), float("nan"), dtype=dtype, device=DEV)
    v_out = torch.full_like(k_out, float("nan"))
    tables = dict(block_table=bt) if layout == "vllm" else dict(kv_indptr=indptr, kv_page_indices=idx)
    gather_kv(k_cache, v_cache, cu_t, cu[-1], seq_ids=ids_t, k_out=k_out, v_out=v_out, check_pages=True, **tables)
    torch.cuda.synchronize()
    rk, rv, rcu = ref.gather_pages(k_cache.cpu(), v_cache.cpu(), [pages[b] for b in ids], [lens[b] for b in ids])
    assert rcu.tolist() == cu
    # A copy is exact: any difference is a wrong row, page or slot.
    assert torch.equal(k_out.cpu().float(), rk), "k rows differ"
    assert torch.equal(v_out.cpu().float(), rv), "v rows differ"


@pytest.mark.parametrize("scale_mode", ["per_tensor_float", "per_tensor_tensor", "per_page"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,ps,lens", [("vllm", 16, [16, 17, 0, 200, 33]), ("sglang", 1, [5, 0, 64]),
                                            ("vllm", 1024, [1025, 7])])
def test_gather_fp8_dequant(scale_mode, out_dtype, layout, ps, lens):
    from hip_kernels.gather import gather_kv

    f8 = _fp8_dtype()
    gen = torch.Generator().manual_seed(7)
    h, d = 8, 64
    nb = sum(-(-n // ps) for n in lens) + 3
    k_cache, v_cache = _pool(nb, ps, h, d, f8)
    pages = _assign_pages(lens, ps, nb, gen)
    bt, indptr, idx = _tables(pages, lens, ps)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    scales, rscales = {}, {}
    if scale_mode == "per_page":
        # Scales differ page to page, so a row read with its neighbour page's scale fails.
        kd = (torch.rand(nb, h, device=DEV) * 3 + 0.05).contiguous()
        vd = (torch.rand(nb, h, device=DEV) * 3 + 0.05).contiguous()
        scales = dict(k_descale=kd, v_descale=vd)
        rscales = dict(k_descale=kd.cpu(), v_descale=vd.cpu())
    else:
        ks, vs = 0.37, 1.9
        if scale_mode == "per_tensor_tensor":
            scales = dict(k_scale=torch.tensor([ks], device=DEV), v_scale=torch.tensor([vs], device=DEV))
        else:
            scales = dict(k_scale=ks, v_scale=vs)
        rscales = dict(k_scale=ks, v_scale=vs)
    tables = dict(block_table=bt) if layout == "vllm" else dict(kv_indptr=indptr, kv_page_indices=idx)
    k_out = torch.full((cu[-1], h, d), float("nan"), dtype=out_dtype, device=DEV)
    v_out = torch.full_like(k_out, float("nan"))
    gather_kv(k_cache, v_cache, cu_t, cu[-1], out_dtype=out_dtype, k_out=k_out, v_out=v_out, **tables, **scales)
    torch.cuda.synchronize()
    rk, rv, _ = ref.gather_pages(k_cache.cpu(), v_cache.cpu(), pages, lens, **rscales)
    # docs/design.md's absolute bound is meant for attention outputs (|o| of order 1); dequantised
    # keys reach ~|20| where one bf16 ulp is 0.125. A gather must instead return exactly the
    # reference's fp32 product rounded once to out_dtype, which is stricter than any bound.
    assert not torch.isnan(k_out).any() and not torch.isnan(v_out).any(), "unwritten rows"
    assert torch.equal(k_out.cpu(), rk.to(out_dtype)), "k differs from the rounded reference"
    assert torch.equal(v_out.cpu(), rv.to(out_dtype)), "v differs from the rounded reference"


def test_gather_pool_over_4gib_last_pages():
    """Byte offsets past 2^32: pages at the end of a > 4 GiB pool."""
    from hip_kernels.gather import gather_kv

    ps, h, d = 16, 8, 128
    nb = 140_000  # 32 KiB pages: 4.3 GiB per cache
    kv = torch.empty(2, nb, ps, h, d, dtype=torch.bfloat16, device=DEV)
    pages = [[nb - 1, 3, nb - 2], [nb - 1000, nb - 3]]
    lens = [40, 20]
    for p in {x for pg in pages for x in pg}:
        kv[:, p] = torch.randn(2, ps, h, d, device=DEV).to(torch.bfloat16)
    bt, _, _ = _tables(pages, lens, ps)
    cu_t = torch.tensor([0, 40, 60], dtype=torch.int32, device=DEV)
    k, v = gather_kv(kv[0], kv[1], cu_t, 60, block_table=bt)
    torch.cuda.synchronize()
    for b, (pg, n) in enumerate(zip(pages, lens)):
        t = torch.arange(n)
        phys = torch.tensor(pg)[t // ps]
        want_k = kv[0][phys.to(DEV), (t % ps).to(DEV)]
        want_v = kv[1][phys.to(DEV), (t % ps).to(DEV)]
        rows = slice(0 if b == 0 else 40, 40 if b == 0 else 60)
        assert torch.equal(k[rows], want_k) and torch.equal(v[rows], want_v)
    del kv


def test_gather_all_empty_launches_nothing():
    from hip_kernels.gather import gather_kv

    k_cache, v_cache = _pool(4, 16, 2, 64, torch.bfloat16)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEV)
    k, v = gather_kv(k_cache, v_cache, torch.zeros(3, dtype=torch.int32, device=DEV), 0, block_table=bt)
    assert k.shape == (0, 2, 64) and v.shape == (0, 2, 64)


def test_gather_check_pages_rejects_out_of_range():
    from hip_kernels.gather import gather_kv

    k_cache, v_cache = _pool(4, 16, 2, 64, torch.bfloat16)
    bt = torch.tensor([[0, 4]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="outside"):
        gather_kv(k_cache, v_cache, torch.tensor([0, 20], dtype=torch.int32, device=DEV), 20, block_table=bt,
                  check_pages=True)


def _partials(S, tq, H, D, gen):
    lse = torch.randn(S, tq, H, generator=gen) * 3
    o = torch.randn(S, tq, H, D, generator=gen)
    empty = torch.rand(S, tq, H, generator=gen) < 0.3
    empty[:, : max(1, tq // 5)] = True  # whole rows with every split empty
    lse[empty] = float("-inf")
    o[empty] = 0.0  # the contract: an empty split writes o = 0
    return o, lse


@pytest.mark.parametrize("S", [1, 3, 8, 32, 40])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_combine_matches_reference(S, D, out_dtype, with_sinks):
    from hip_kernels.combine import combine

    gen = torch.Generator().manual_seed(S * 1000 + D)
    tq, H = 37, 8
    o, lse = _partials(S, tq, H, D, gen)
    sinks = torch.randn(H, generator=gen) if with_sinks else None
    # Strided out: rows padded, as when o is a view of a wider buffer.
    buf = torch.full((tq, H * D + 64), float("nan"), dtype=out_dtype, device=DEV)
    out = buf[:, : H * D].unflatten(1, (H, D))
    lse_out = torch.full((tq, H), float("nan"), device=DEV)
    combine(o.to(DEV), lse.to(DEV), out, lse_out=lse_out, sinks=None if sinks is None else sinks.to(DEV))
    torch.cuda.synchronize()
    ro, rlse = ref.combine_splits(o.double(), lse.double())
    ro = ref.apply_sinks(ro, rlse, None if sinks is None else sinks.double())
    assert_close(out.cpu(), ro, out_dtype, "o")
    assert_lse_close(lse_out.cpu(), rlse, torch.float32, "lse")
    all_empty = torch.isinf(lse).all(0)
    assert (out.cpu()[all_empty] == 0).all(), "all -inf rows must give o = 0"
    assert torch.isnan(buf[:, H * D :]).all(), "wrote outside out's view"
    # The combine weighs an empty split 0 and never uses its o_s, whatever the workspace holds.
    poisoned = o.clone()
    poisoned[torch.isinf(lse)] = float("nan")
    again = torch.empty_like(out)
    combine(poisoned.to(DEV), lse.to(DEV), again, sinks=None if sinks is None else sinks.to(DEV))
    assert torch.equal(again, out)


def test_combine_of_split_partials_equals_attention():
    """End to end with the reference's own split-KV partials: combine == unsplit attention."""
    from hip_kernels.combine import combine

    gen = torch.Generator().manual_seed(3)
    hq, hk, d = 8, 2, 64
    sk = [50, 1, 0, 300]
    sq = [1, 1, 0, 4]
    q = torch.randn(sum(sq), hq, d, generator=gen)
    k = torch.randn(sum(sk), hk, d, generator=gen)
    v = torch.randn(sum(sk), hk, d, generator=gen)
    cq = torch.tensor([0] + torch.tensor(sq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(sk).cumsum(0).tolist(), dtype=torch.int32)
    sinks = torch.randn(hq, generator=gen)
    o_s, lse_s = ref.split_kv_partials(q, k, v, cq, ck, 5, window=40)
    out = torch.full((q.shape[0], hq, d), float("nan"), device=DEV)
    lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
    combine(o_s.contiguous().to(DEV), lse_s.contiguous().to(DEV), out, lse_out=lse, sinks=sinks.to(DEV))
    torch.cuda.synchronize()
    ro, rlse = ref.varlen_attention(q.double(), k.double(), v.double(), cq, ck, window=40, sinks=sinks.double())
    assert_close(out.cpu(), ro, torch.float32, "o")
    assert_lse_close(lse.cpu(), rlse, torch.float32, "lse")


def test_cuda_graph_capture_and_replay():
    """Both kernels captured once, replayed on new inputs written into the same buffers."""
    from hip_kernels.combine import combine
    from hip_kernels.gather import gather_kv

    gen = torch.Generator().manual_seed(11)
    ps, h, d, nb = 16, 4, 128, 40
    lens = [33, 16, 100]
    k_cache, v_cache = _pool(nb, ps, h, d, torch.bfloat16)
    pages = _assign_pages(lens, ps, nb, gen)
    bt, _, _ = _tables(pages, lens, ps)
    cu = torch.tensor([0, 33, 49, 149], dtype=torch.int32, device=DEV)
    k_out = torch.empty(149, h, d, dtype=torch.bfloat16, device=DEV)
    v_out = torch.empty_like(k_out)
    S, tq, H, D = 4, 9, 8, 128
    o_p = torch.empty(S, tq, H, D, device=DEV)
    l_p = torch.empty(S, tq, H, device=DEV)
    out = torch.empty(tq, H, D, dtype=torch.bfloat16, device=DEV)
    lse_out = torch.empty(tq, H, device=DEV)

    def step():
        gather_kv(k_cache, v_cache, cu, 149, block_table=bt, k_out=k_out, v_out=v_out)
        combine(o_p, l_p, out, lse_out=lse_out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile/load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()

    for trial in range(2):
        k_cache.copy_(torch.randn_like(k_cache, dtype=torch.float32).to(torch.bfloat16))
        v_cache.copy_(torch.randn_like(v_cache, dtype=torch.float32).to(torch.bfloat16))
        pages = _assign_pages(lens, ps, nb, gen)
        bt.copy_(_tables(pages, lens, ps)[0])
        o, lse = _partials(S, tq, H, D, gen)
        o_p.copy_(o)
        l_p.copy_(lse)
        k_out.fill_(float("nan"))
        v_out.fill_(float("nan"))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        rk, rv, _ = ref.gather_pages(k_cache.cpu(), v_cache.cpu(), pages, lens)
        assert torch.equal(k_out.cpu().float(), rk) and torch.equal(v_out.cpu().float(), rv), f"trial {trial}"
        ro, rlse = ref.combine_splits(o.double(), lse.double())
        assert_close(out.cpu(), ro, torch.bfloat16, f"o (trial {trial})")
        assert_lse_close(lse_out.cpu(), rlse, torch.float32, f"lse (trial {trial})")


def test_load_is_memoised_and_launch_uses_current_stream():
    from hip_kernels import combine as cmod
    from hip_kernels import runtime

    v = cmod.variant(torch.float32)
    k1 = runtime.load(v)
    assert runtime.load(v) is k1
    S, tq, H, D = 2, 4, 2, 64
    o = torch.randn(S, tq, H, D, device=DEV)
    lse = torch.randn(S, tq, H, device=DEV)
    o_new, lse_new = torch.randn_like(o), torch.randn_like(lse)
    out = torch.full((tq, H, D), float("nan"), device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # A launch on any other stream would run before these copies land and combine old data.
        torch.cuda._sleep(50_000_000)
        o.copy_(o_new)
        lse.copy_(lse_new)
        cmod.combine(o, lse, out)
    s.synchronize()
    ro, _ = ref.combine_splits(o_new.cpu().double(), lse_new.cpu().double())
    assert_close(out.cpu(), ro, torch.float32)


def test_gather_fp8_cache_stored_as_uint8():
    """vLLM keeps fp8 caches in uint8 tensors: same bytes, same result as the float8 view."""
    from hip_kernels.gather import gather_kv

    f8 = _fp8_dtype()
    gen = torch.Generator().manual_seed(5)
    ps, h, d, lens = 16, 2, 128, [40, 17]
    nb = 8
    k_cache, v_cache = _pool(nb, ps, h, d, f8)
    pages = _assign_pages(lens, ps, nb, gen)
    bt, _, _ = _tables(pages, lens, ps)
    cu_t = torch.tensor([0, 40, 57], dtype=torch.int32, device=DEV)
    k8, v8 = gather_kv(k_cache, v_cache, cu_t, 57, block_table=bt, k_scale=0.5, v_scale=2.0)
    ku, vu = gather_kv(k_cache.view(torch.uint8), v_cache.view(torch.uint8), cu_t, 57, block_table=bt,
                       k_scale=0.5, v_scale=2.0)
    torch.cuda.synchronize()
    rk, rv, _ = ref.gather_pages(k_cache.cpu(), v_cache.cpu(), pages, lens, k_scale=0.5, v_scale=2.0)
    assert torch.equal(ku, k8) and torch.equal(vu, v8)
    assert torch.equal(ku.cpu(), rk.to(torch.bfloat16)) and torch.equal(vu.cpu(), rv.to(torch.bfloat16))
