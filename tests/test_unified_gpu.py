"""Unified path on a GPU at realistic sizes, bf16/fp16, against atom_backend.reference (fp32).

Run on the device machine: ``PYTHONPATH=. pytest -m gpu tests/test_unified_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from atom_backend.planning import split_ranges
from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close
from atom_backend.unified import decode_workspace_numel, paged_attention, paged_decode
from tests.test_unified import FP8, make_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

DEV = "cuda"


def _reference(B, **opts):
    """fp32 reference on the GPU (the same literal code; the device context keeps it there)."""
    with torch.device(DEV):
        return ref.paged_attention(B.q.float(), B.k_cache, B.v_cache, B.cu_seqlens_q, B.block_table, B.seq_lens,
                                   **B.scales, **opts)


def _check(B, dtype, splits=(), **opts):
    ro, rl = _reference(B, **opts)
    bound = torch.bfloat16 if B.k_cache.dtype == FP8 else dtype
    out = torch.full_like(B.q, float("nan"))
    o, lse = paged_attention(*B.args(), max_seqlen_q=B.max_seqlen_q, out=out, return_lse=True, **B.scales, **opts)
    assert_close(o, ro, bound, "paged_attention")
    assert_lse_close(lse, rl, bound, "paged_attention lse")
    for s in splits:
        out = torch.full_like(B.q, float("nan"))
        o, lse = paged_decode(*B.args(), max_seqlen_q=B.max_seqlen_q, num_splits=s, out=out, return_lse=True,
                              **B.scales, **opts)
        assert_close(o, ro, bound, f"paged_decode splits={s}")
        assert_lse_close(lse, rl, bound, f"paged_decode lse splits={s}")


MIXED = [(1, 2000), (700, 700), (0, 64), (300, 1500), (1, 1), (33, 129)]
SHAPES = {"gptoss": (64, 8, 64), "llama": (32, 8, 128), "mqa": (16, 1, 128)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mixed_prefill_decode(shape, dtype):
    hq, hk, d = SHAPES[shape]
    B = make_batch(MIXED, hq, hk, d, 16, dtype=dtype, device=DEV, gen=torch.Generator().manual_seed(1))
    _check(B, dtype)


@pytest.mark.parametrize("opts", [dict(window=128, sinks=True), dict(window=128, sink_tokens=4), dict(softcap=30.0),
                                  dict(sinks=True)], ids=["window128_sinks", "window128_sinktok4", "softcap", "sinks"])
def test_gptoss_features(opts):
    B = make_batch(MIXED, 64, 8, 64, 16, dtype=torch.bfloat16, device=DEV, gen=torch.Generator().manual_seed(2))
    opts = dict(opts)
    if opts.get("sinks") is True:
        opts["sinks"] = torch.randn(64, device=DEV)
    _check(B, torch.bfloat16, splits=(4,), **opts)


@pytest.mark.parametrize("kv", ["fp8_tensor", "fp8_page"])
@pytest.mark.parametrize("page", [16, 64])
def test_fp8_kv(kv, page):
    B = make_batch(MIXED, 32, 8, 128, page, dtype=torch.bfloat16, kv=kv, device=DEV, gen=torch.Generator().manual_seed(3))
    _check(B, torch.bfloat16, splits=(3,))


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_decode_long_context(splits):
    seqs = [(1, 4096 - 37 * i) for i in range(24)] + [(4, 3000), (8, 1234)]
    B = make_batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, device=DEV, gen=torch.Generator().manual_seed(4))
    _check(B, torch.bfloat16, splits=(splits,), sinks=torch.randn(32, device=DEV))


@pytest.mark.parametrize("rule", [(256,), (64, 2, 300, 8, 24, 95), (0, 3)], ids=["min", "rule", "fill"])
def test_split_rule_compiled(rule):
    """The compiled kernel's per-request split counts (planner.SplitRule) split by split against
    reference.split_kv_partials, partials NaN-poisoned first; then the answer."""
    seqs = [(1, 3000), (2, 517), (1, 16), (1, 1), (3, 1025), (0, 7)]
    B = make_batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, device=DEV, gen=torch.Generator().manual_seed(6))
    S = 8
    ws = torch.full((decode_workspace_numel(S, B.q.shape[0], 32, 128),), float("nan"), device=DEV)
    o, (o_p, l_p) = paged_decode(*B.args(), max_seqlen_q=B.max_seqlen_q, num_splits=S, workspace=ws,
                                 return_partials=True, split_rule=rule)
    with torch.device(DEV):
        k, v, cu_k = ref.gather_vllm(B.k_cache, B.v_cache, B.block_table, B.seq_lens)
        ro, rl = ref.split_kv_partials(B.q.float(), k.float(), v.float(), B.cu_seqlens_q, cu_k, S, split_rule=rule)
    assert_lse_close(l_p, rl, torch.bfloat16, "lse partials")
    assert_close(o_p, ro, torch.bfloat16, "o partials")
    ranges = [split_ranges(sk, S, rule) for sk in B.seq_lens.tolist()]
    used = torch.isfinite(l_p[:, :, 0]).sum(0).tolist()  # splits with keys, per query token
    assert used == [sum(b > a for a, b in ranges[i]) for i, (sq, _) in enumerate(seqs) for _ in range(sq)]
    assert_close(o, _reference(B)[0], torch.bfloat16, "out")


@pytest.mark.parametrize("d", [80, 96, 256])
@pytest.mark.parametrize("page", [1, 1024])
def test_head_dims_and_page_sizes(d, page):
    seqs = [(1, 1500), (200, 1100), (0, 5), (64, 64)]
    B = make_batch(seqs, 8, 2, d, page, dtype=torch.bfloat16, device=DEV, gen=torch.Generator().manual_seed(5))
    _check(B, torch.bfloat16, splits=(5,))


def test_pool_over_4gib_last_pages():
    """64-bit page offsets: K and V pools of 4.5 GiB each, sequences living at the pool's end."""
    nb, bs, hk, d = 140_000, 16, 8, 128
    kc = torch.empty(nb, bs, hk, d, dtype=torch.bfloat16, device=DEV)
    vc = torch.empty_like(kc)
    seqs = [(1, 900), (100, 700)]
    n = [-(-sk // bs) for _, sk in seqs]
    ids = torch.arange(nb - sum(n), nb, device=DEV)[torch.randperm(sum(n), device=DEV)].int()
    kc[ids.long()] = torch.randn(sum(n), bs, hk, d, device=DEV, dtype=torch.bfloat16)
    vc[ids.long()] = torch.randn(sum(n), bs, hk, d, device=DEV, dtype=torch.bfloat16)
    bt = torch.zeros(2, max(n), dtype=torch.int32, device=DEV)
    bt[0, :n[0]] = ids[:n[0]]
    bt[1, :n[1]] = ids[n[0]:]
    cu = torch.tensor([0, 1, 101], dtype=torch.int32, device=DEV)
    sl = torch.tensor([900, 700], dtype=torch.int32, device=DEV)
    q = torch.randn(101, 32, d, device=DEV, dtype=torch.bfloat16)
    k, v, cu_k = ref.gather_vllm(kc[ids.long().min():], vc[ids.long().min():], bt - ids.min(), sl.cpu())
    with torch.device(DEV):
        ro, _ = ref.varlen_attention(q.float(), k, v, cu, cu_k.to(DEV))
    o = paged_attention(q, kc, vc, cu, sl, bt, max_seqlen_q=100, max_seqlen_k=900)
    assert_close(o, ro, torch.bfloat16, "paged_attention over a >4 GiB pool")
    o = paged_decode(q, kc, vc, cu, sl, bt, max_seqlen_q=100, num_splits=4)
    assert_close(o, ro, torch.bfloat16, "paged_decode over a >4 GiB pool")


def test_cuda_graph_capture():
    """No host sync inside: the decode path captures into a graph and replays correctly."""
    seqs = [(1, 1000 + 50 * i) for i in range(16)]
    B = make_batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, device=DEV, gen=torch.Generator().manual_seed(6))
    ws = torch.empty(8 * 16 * 32 * 129, dtype=torch.float32, device=DEV)
    out = torch.empty_like(B.q)
    kw = dict(max_seqlen_q=1, max_seqlen_k=1750, num_splits=8, workspace=ws, out=out)
    paged_decode(*B.args(), **kw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode(*B.args(), **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ro, _ = _reference(B)
    assert_close(out, ro, torch.bfloat16, "graph replay")


@pytest.mark.parametrize("facts", [
    dict(num_q_heads=8, num_kv_heads=2, head_dim=256, softcap=50.0, layer_windows=(0, 256)),
    dict(num_q_heads=16, num_kv_heads=2, head_dim=64, has_sinks=True, layer_windows=(0, 128)),
    dict(num_q_heads=8, num_kv_heads=2, head_dim=128, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor"),
], ids=["gemma2", "gptoss", "llama_fp8"])
def test_after_warm_a_served_batch_compiles_nothing(facts, monkeypatch):
    """The builder's warm-up (unified.warm) fills Triton's JIT with the variants serving launches:
    a batch of real sizes afterwards (long prefill over cached keys, decode rows) compiles and loads
    nothing, on each layer window."""
    import triton

    from atom_backend.planning import ModelFacts
    from atom_backend.unified import warm

    f = ModelFacts(**facts)
    arch = "sm_%d%da" % torch.cuda.get_device_capability()
    warm.warm(f, arch, torch.device("cuda"), max_query_tokens=1)
    events = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: events.append(kw["src"].fn.__name__))
    gen = torch.Generator().manual_seed(5)
    kv = "fp8_tensor" if f.kv_dtype.startswith("fp8") else "same"
    for seqs in ([(2048, 6144), (300, 300)], [(1, 5000), (1, 77)]):
        B = make_batch(seqs, f.num_q_heads, f.num_kv_heads, f.head_dim, 16, dtype=torch.bfloat16, kv=kv, gen=gen,
                       device="cuda")
        for window in (0, 128 if f.layer_windows else 0):
            opts = dict(window=window, softcap=f.softcap, sinks=torch.randn(f.num_q_heads, device="cuda")
                        if f.has_sinks else None, **B.scales)
            if seqs[0][0] == 1:
                paged_decode(*B.args(), max_seqlen_q=1, num_splits=8, **opts)
            else:
                paged_attention(*B.args(), max_seqlen_q=2048, **opts)
    torch.cuda.synchronize()
    assert events == [], events
