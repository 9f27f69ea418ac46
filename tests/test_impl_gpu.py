"""The impl's GPU routes (hip split-KV decode + combine, hip gather + varlen prefill, Triton
unified) through the real builder and impl, against atom_backend.reference.

The GPU machine has no vLLM (docs/toolchains.md), so when vLLM is missing this module installs a
minimal stand-in for the few vLLM names our modules import (base classes and enums); every
line of atom_backend that runs here is the production code. Run: pytest -m gpu tests/test_impl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


from bench import _vllm  # noqa: E402  (the one stand-in; a no-op where vLLM is installed)

_vllm.install()

from atom_backend import reference as ref  # noqa: E402
from atom_backend.vllm.impl import split_kv_cache  # noqa: E402
from atom_backend.vllm.impl import AtomAttentionImpl  # noqa: E402
from atom_backend.planning import PlannerConfig  # noqa: E402
from atom_backend.tolerances import assert_close  # noqa: E402
from tests.test_impl_cpu import LAYER, MIXED_CACHED, MIXED_NEW, Case, _builder, _impl, _reference  # noqa: E402

# These tests pin the routes of the threshold rules; cost routing has its own tests
# (tests/test_cost_model.py on the CPU, bench.trace on the GPU).
THRESHOLDS = PlannerConfig(cost_routing=False)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def _write(case: Case) -> None:
    """New K/V into the pages (vLLM's own Triton store does this in production)."""
    k_cache, v_cache = split_kv_cache(case.kv_cache, case.d)
    if case.fp8:
        k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        kn = (case.k_new.float() / LAYER._k_scale_float).to(torch.float8_e4m3fn)
        vn = (case.v_new.float() / LAYER._v_scale_float).to(torch.float8_e4m3fn)
    else:
        kn, vn = case.k_new, case.v_new
    bs = k_cache.shape[1]
    blk, off = case.slot_mapping // bs, case.slot_mapping % bs
    k_cache[blk, off] = kn
    v_cache[blk, off] = vn


def _forward(case, impl, md):
    _write(case)
    out = torch.full_like(case.q, float("nan"))
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, md, out)
    torch.cuda.synchronize()
    return out


@needs_cuda
@pytest.mark.parametrize("d,layout", [(64, "LBNHC"), (128, "LBHNC"), (128, "LBNHC")])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (24, True)])
def test_mixed_batch_on_compiled_kernels(d, layout, window, with_sinks):
    from atom_backend.execution import gather as atom_gather
    from atom_backend.planning import Path

    case = Case(MIXED_NEW, MIXED_CACHED, d=d, dtype=torch.bfloat16, layout=layout, seed=d + window).to("cuda")
    sinks = torch.randn(case.hq, device="cuda") if with_sinks else None
    b = _builder(case.facts(has_sinks=with_sinks, window=window), THRESHOLDS, device="cuda")
    assert b.platform.varlen_kernel and b.platform.splitkv_kernel, b.platform
    md = b.build(0, case.common())
    assert md.plan.decode_path == Path.SPLITKV and md.decode_kernel == "hip"
    assert md.plan.varlen.tolist() == [0, 6] and md.plan.unified.tolist() == [2, 3]
    before = atom_gather.STATS["tokens"]
    out = _forward(case, _impl(case, window, 0.0, sinks), md)
    assert atom_gather.STATS["tokens"] - before == 105  # the varlen requests only
    assert not out.isnan().any()
    assert_close(out.float().cpu(), _reference(case, _impl(case, window, 0.0, sinks), sinks).float(), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("fp8_compute", [True, False], ids=["fp8_compute", "bf16_compute"])
def test_fp8_cache_on_compiled_kernels(fp8_compute):
    """An FP8 cache: the varlen requests compute in FP8 (the default, on sm_90a) within
    DESIGN's FP8-compute bound (docs/fp8.md), or in bf16 with ATOM_FP8_COMPUTE=0; decode and
    unified rows keep the bf16 tolerance either way."""
    from dataclasses import replace

    from atom_backend.tolerances import fp8_compute_bound
    from hip_kernels import prefill

    if fp8_compute and not prefill.fp8_compute_available(128, prefill._default_arch()):
        pytest.skip("no FP8-compute prefill kernel on this arch (the planner routes bf16: test_planner)")
    case = Case(MIXED_NEW, MIXED_CACHED, d=128, dtype=torch.bfloat16, fp8=True, seed=4).to("cuda")
    sinks = torch.randn(case.hq, device="cuda")
    md = _builder(case.facts(has_sinks=True), replace(THRESHOLDS, fp8_compute=fp8_compute),
                  device="cuda").build(0, case.common())
    assert len(md.plan.varlen) and md.plan.varlen_fp8 is fp8_compute and md.varlen.fp8 is fp8_compute
    impl = _impl(case, sinks=sinks)
    out = _forward(case, impl, md)
    got, want = out.float().cpu(), _reference(case, impl, sinks).float()
    if fp8_compute:
        fp8_rows = torch.zeros(got.shape[0], dtype=torch.bool)
        rows = md.varlen.rows
        fp8_rows[torch.arange(got.shape[0])[rows] if isinstance(rows, slice) else rows.cpu()] = True
        v_cache = split_kv_cache(case.kv_cache, case.d)[1].view(torch.float8_e4m3fn)
        v_max = v_cache.float().abs().max().item() * LAYER._v_scale_float
        assert_close(got[fp8_rows], want[fp8_rows], fp8_compute_bound(v_max), "fp8 compute rows")
        got, want = got[~fp8_rows], want[~fp8_rows]
    assert_close(got, want, torch.bfloat16)


@needs_cuda
def test_unsupported_head_dim_and_fp32_route_to_triton():
    from atom_backend.planning import Path, Reason

    case = Case(MIXED_NEW, MIXED_CACHED, d=32, dtype=torch.float32, seed=9).to("cuda")
    sinks = torch.randn(case.hq, device="cuda")
    md = _builder(case.facts(has_sinks=True), THRESHOLDS, device="cuda").build(0, case.common())
    assert md.plan.decode_path == Path.UNIFIED and md.decode_kernel == "triton"
    assert len(md.plan.varlen) == 0 and set(md.plan.unified_reasons) == {Reason.HEAD_DIM}
    impl = _impl(case, sinks=sinks)
    out = _forward(case, impl, md)
    assert_close(out.float().cpu(), _reference(case, impl, sinks).float(), torch.float32)


@needs_cuda
@pytest.mark.parametrize("d,dtype,fp8,qlen", [(128, torch.bfloat16, False, 1), (64, torch.bfloat16, True, 1),
                                              (32, torch.float32, False, 1), (128, torch.bfloat16, False, 3)])
def test_a_captured_decode_graph_replays_later_batches(d, dtype, fp8, qlen):
    """vLLM's FULL decode graphs (vllm/v1/worker/gpu_model_runner.py): its persistent
    query_start_loc / seq_lens / block table / slot mapping, a warm-up and a capture of a dummy
    batch (one token per request, lengths 1, max_seq_len = max_model_len) with metadata from
    build_for_cudagraph_capture, then for each later batch of the padded size: the buffers
    rewritten in place (padding: no query tokens, length 0, the null block 0), build() run
    eagerly, the graph of that size replayed. Two sizes are captured, and another graph of the
    same memory pool replays before each (vLLM shares one pool between its graphs: that graph's
    freed temporaries, filled with junk, sit where anything allocated during a decode capture
    would go). Every layer's output must match the reference; d=32 fp32 is
    the Triton decode route, the others the split-KV kernel (one with an FP8 cache, one with
    speculative decoding's 3-token verification requests, vLLM's UNIFORM_BATCH)."""
    from atom_backend.vllm.metadata import kv_format
    from atom_backend.planning import ModelFacts, PlannerConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

    B, hq, hk, bs, max_len, layers = 8, 8, 2, 16, 4096, 2
    width = max_len // bs
    num_blocks = B * width + 1
    dev = "cuda"
    gen = torch.Generator().manual_seed(d)
    cdt = torch.uint8 if fp8 else dtype
    kv = []
    for _ in range(layers):
        raw = torch.empty(num_blocks, bs, hk, 2 * d, dtype=cdt, device=dev).permute(0, 2, 1, 3)  # LBNHC
        fill = torch.randn(raw.shape, generator=gen).to(dev)
        if fp8:
            raw.view(torch.float8_e4m3fn).copy_((fill * 0.5).to(torch.float8_e4m3fn))
        else:
            raw.copy_(fill.to(dtype))
        kv.append(raw)
    sinks = torch.randn(hq, generator=gen).to(dev)
    kvd = kv_format("fp8" if fp8 else "auto", dtype, "cuda")
    facts = ModelFacts(num_q_heads=hq, num_kv_heads=hk, head_dim=d, page_size=bs, has_sinks=True, kv_dtype=kvd[0],
                       kv_scale_mode=kvd[1], dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    b = _builder(facts, PlannerConfig(cost_routing=False, decode_max_query_tokens=qlen), device=dev)
    impls = [AtomAttentionImpl(hq, d, d ** -0.5, hk, None, None, "fp8" if fp8 else "auto", None, sinks=sinks)
             for _ in range(layers)]
    # vLLM's persistent inputs, rewritten in place for every batch.
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    seq = torch.zeros(B, dtype=torch.int32, device=dev)
    bt = torch.zeros(B, width, dtype=torch.int32, device=dev)
    T = B * qlen
    slots = torch.zeros(T, dtype=torch.int64, device=dev)
    q = torch.zeros(T, hq, d, dtype=dtype, device=dev)
    kn, vn = torch.zeros(T, hk, d, dtype=dtype, device=dev), torch.zeros(T, hk, d, dtype=dtype, device=dev)
    outs = [torch.zeros(T, hq, d, dtype=dtype, device=dev) for _ in range(layers)]

    def load(lens, seed, size):
        """The batch `lens` padded to `size` requests, written into the persistent buffers."""
        n, t_size = len(lens), size * qlen
        rng = torch.Generator().manual_seed(seed)
        blocks = (torch.randperm(num_blocks - 1, generator=rng)[: n * width] + 1).view(n, width).to(torch.int32)
        qsl_cpu = torch.tensor([qlen * i for i in range(n + 1)] + [qlen * n] * (size - n), dtype=torch.int32)
        seq_cpu = torch.tensor(list(lens) + [0] * (size - n), dtype=torch.int32)
        bt_cpu = torch.zeros(size, width, dtype=torch.int32)
        bt_cpu[:n] = blocks
        slot_cpu = torch.zeros(t_size, dtype=torch.int64)  # padding writes go to the null block
        for i, t in enumerate(lens):
            for j, pos in enumerate(range(t - qlen, t)):
                slot_cpu[qlen * i + j] = int(bt_cpu[i, pos // bs]) * bs + pos % bs
        for dst, src in ((qsl, qsl_cpu), (seq, seq_cpu), (bt, bt_cpu), (slots, slot_cpu)):
            dst[: src.shape[0]].copy_(src)
        for t in (q, kn, vn):
            t[:t_size].copy_(torch.randn((t_size,) + t.shape[1:], generator=rng).to(dtype))
        return CommonAttentionMetadata(
            query_start_loc=qsl[: size + 1], query_start_loc_cpu=qsl_cpu, seq_lens=seq[:size], num_reqs=size,
            num_actual_tokens=t_size, max_query_len=qlen, max_seq_len=max(lens), block_table_tensor=bt[:size],
            slot_mapping=slots[:t_size], seq_lens_cpu_upper_bound=seq_cpu)

    def step(md, size):
        t_size = size * qlen
        sl = slots[:t_size]
        for layer in range(layers):
            k_cache, v_cache = split_kv_cache(kv[layer], d)
            kw, vw = kn[:t_size], vn[:t_size]
            if fp8:
                k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
                kw = (kw.float() / LAYER._k_scale_float).to(torch.float8_e4m3fn)
                vw = (vw.float() / LAYER._v_scale_float).to(torch.float8_e4m3fn)
            k_cache[sl // bs, sl % bs] = kw
            v_cache[sl // bs, sl % bs] = vw
            impls[layer].forward(LAYER, q[:t_size], kn[:t_size], vn[:t_size], kv[layer], md, outs[layer][:t_size])

    pool = torch.cuda.graph_pool_handle()  # vLLM's graphs share one pool
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other, pool=pool):
        junk = [torch.full((1 << k,), 12345, dtype=torch.int32, device=dev) for k in range(8, 21)]
        del junk
    graphs = {}
    for size in (B, B // 2):  # largest first, as vLLM captures
        cm = load([qlen] * size, seed=0, size=size)
        step(b.build(0, cm), size)  # warm-up (vLLM runs the dummy batch eagerly first)
        cm.max_seq_len = max_len
        md = b.build_for_cudagraph_capture(cm)
        assert md.decode_kernel == ("triton" if d == 32 else "hip") and md.num_splits > 1
        torch.cuda.synchronize()
        graphs[size] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[size], pool=pool):
            step(md, size)
        del md  # a graph outlives the metadata it was captured with
    batches = ((1, [max_len, 1, 17, 4000, 16, 2048, 3, 999]), (2, [300, 4095, 1, 64, 2500]), (3, [4096, 5, 700]),
               (4, [2]))
    for seed, lens in batches:
        lens = [max(t, qlen) for t in lens]
        size = B if len(lens) > B // 2 else B // 2
        cm = load(lens, seed, size)
        b.build(0, cm)  # vLLM builds the batch's metadata eagerly, then replays
        for o in outs:
            o.fill_(float("nan"))
        other.replay()
        graphs[size].replay()
        torch.cuda.synchronize()
        n = len(lens)
        for layer in range(layers):
            k_cache, v_cache = split_kv_cache(kv[layer], d)
            if fp8:
                k_cache = ref.dequant_per_tensor(k_cache.view(torch.float8_e4m3fn), LAYER._k_scale_float)
                v_cache = ref.dequant_per_tensor(v_cache.view(torch.float8_e4m3fn), LAYER._v_scale_float)
            want, _ = ref.paged_attention(q[: qlen * n].cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                          qsl[: n + 1].cpu(), bt[:n].cpu(), seq[:n].cpu(), scale=d ** -0.5,
                                          sinks=sinks.cpu().double())
            assert_close(outs[layer][: qlen * n].float().cpu(), want.float(), dtype,
                         what=f"replay {seed} (graph of {size}), layer {layer}, lengths {lens}")
