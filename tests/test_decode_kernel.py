"""hip_kernels.decode (split-KV decode over the paged cache) against atom_backend.reference.

GPU tests (-m gpu) cover every must-have case of docs/design.md plus the decode-specific ones (FP8
page transitions with differing scales, pages in random order, the last page of a pool over
4 GiB, contexts of 1 token and of exactly one page, splits 1 vs many, CUDA-graph replay).
CPU tests cover the launch-time validation, the page-division magic numbers and the variant list.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close
from hip_kernels import decode
from hip_kernels.runtime import workspace

FP8 = getattr(torch, "float8_e4m3fn", None)

# Kernel under test: GPU tests run for the tensor-core ("mma") and CUDA-core ("fma") kernels.
_IMPL = {"v": None}


@pytest.fixture(params=decode.IMPLS)
def impl(request):
    _IMPL["v"] = request.param
    yield request.param
    _IMPL["v"] = None


def _skip_unsupported(d):
    if _IMPL["v"] == "mma" and d not in decode.MMA_HEAD_DIMS:
        pytest.skip(f"the tensor-core kernel serves head_dim {decode.MMA_HEAD_DIMS}")


# --- building a paged batch -----------------------------------------------------------------


def _pool_pages(rng: random.Random, needed: int, num_blocks: int) -> list[int]:
    """`needed` distinct physical pages in random order, always including the pool's last page."""
    assert needed <= num_blocks
    pages = rng.sample(range(num_blocks - 1), needed - 1) + [num_blocks - 1] if needed else []
    rng.shuffle(pages)
    return pages


def make_batch(seqs, hq, hk, d, bs, *, dtype=torch.bfloat16, kv="16", layout="vllm", storage="separate",
               extra_blocks=3, num_blocks=None, seed=0, data_seed=None, device="cuda"):
    """Random paged batch. seqs: [(sq, sk)]. kv: "16" (KV in q's dtype), "fp8_tensor", "fp8_page".
    seed draws the pages and, unless data_seed is given, the values (equal seeds, other
    data_seeds: the same page tables over other caches, as the layers of one batch).

    storage: "separate" (two tensors), "joint" (kv_cache[2, NB, ...] views), "blocks_first"
    (kv[NB, 2, ...][:, i] views: strided pages).
    """
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed if data_seed is None else data_seed)
    npages = [-(-sk // bs) for _, sk in seqs]
    needed = sum(npages)
    nb = num_blocks or max(needed + extra_blocks, 1)
    kv_dtype = dtype if kv == "16" else FP8
    shape = (nb, bs, hk, d)
    if storage == "joint":
        pool = torch.empty((2,) + shape, dtype=kv_dtype, device=device)
        k_cache, v_cache = pool[0], pool[1]
    elif storage == "blocks_first":
        pool = torch.empty((nb, 2, bs, hk, d), dtype=kv_dtype, device=device)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        v_cache = torch.empty(shape, dtype=kv_dtype, device=device)
    phys = _pool_pages(rng, needed, nb)
    # Only the pages in use get data; the rest keep whatever the allocator left (never read).
    if phys:
        idx = torch.tensor(phys, dtype=torch.long, device=device)
        for c in (k_cache, v_cache):
            vals = torch.randn((len(phys), bs, hk, d), generator=gen, device=device)
            if kv != "16":
                vals = vals * 3.0  # spread over e4m3's range, denormals included
            # index_copy_ has no fp8 kernel: copy the bytes
            c.view(torch.uint8).index_copy_(0, idx, vals.to(kv_dtype).view(torch.uint8))
    scales = {}
    # V scales keep |v| ~ 1, so that bf16 rounding of the output stays inside docs/design.md's
    # max-abs bound; K scales vary widely.
    if kv == "fp8_tensor":
        scales = {"k_scale": 0.37, "v_scale": 0.3}
    elif kv == "fp8_page":
        # Neighbouring pages get very different scales: a tile spanning two pages must use both.
        scales = {
            "k_descale": torch.rand((nb, hk), generator=gen, device=device) * 2.0 + 0.05,
            "v_descale": torch.rand((nb, hk), generator=gen, device=device) * 0.3 + 0.05,
        }
    pages_of, pos = [], 0
    for n in npages:
        pages_of.append(phys[pos:pos + n])
        pos += n
    batch = len(seqs)
    cu_q = torch.tensor([0] + list(_cumsum(sq for sq, _ in seqs)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([sk for _, sk in seqs], dtype=torch.int32, device=device)
    tq = int(sum(sq for sq, _ in seqs))
    q = torch.randn((tq, hq, d), generator=gen, device=device).to(dtype)
    tables = {}
    if layout == "vllm":
        width = max(npages + [1]) + 2
        # Entries past a sequence's pages hold ids far outside the pool: never to be read.
        bt = torch.full((batch, width), 2**30, dtype=torch.int32)
        for b, pg in enumerate(pages_of):
            bt[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        tables["block_table"] = bt.to(device)
    else:
        indptr = [0] + list(_cumsum(len(p) for p in pages_of))
        tables["kv_indptr"] = torch.tensor(indptr, dtype=torch.int32, device=device)
        tables["kv_page_indices"] = torch.tensor(sum(pages_of, []) or [0], dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_q=cu_q, seq_lens=seq_lens, tables=tables,
                scales=scales, pages_of=pages_of, seqs=seqs)


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def _gathered(batch):
    """q and the dense K, V of the batch in float32 on the CPU, from the pages in use only (pools
    may be huge): (q, k, v, cu_seqlens_k)."""
    used = sorted({p for pg in batch["pages_of"] for p in pg})
    remap = {p: i for i, p in enumerate(used)}
    dev = batch["k_cache"].device
    idx = torch.tensor(used or [0], dtype=torch.long, device=dev)
    kc = batch["k_cache"].index_select(0, idx).cpu()
    vc = batch["v_cache"].index_select(0, idx).cpu()
    sc = dict(batch["scales"])
    for key in ("k_descale", "v_descale"):
        if key in sc:
            sc[key] = sc[key].index_select(0, idx).cpu()
    pages = [[remap[p] for p in pg] for pg in batch["pages_of"]]
    seq_lens = [sk for _, sk in batch["seqs"]]
    k, v, cu_k = ref.gather_pages(kc, vc, pages, seq_lens, **sc)
    return batch["q"].float().cpu(), k, v, cu_k


def reference(batch, **attn):
    """Reference (o, lse) in float32 on the CPU."""
    q, k, v, cu_k = _gathered(batch)
    return ref.varlen_attention(q, k, v, batch["cu_q"].cpu(), cu_k, **attn)


def reference_partials(batch, num_splits, **attn):
    """reference.split_kv_partials of the batch: (o_s, lse_s) in float32 on the CPU."""
    q, k, v, cu_k = _gathered(batch)
    return ref.split_kv_partials(q, k, v, batch["cu_q"].cpu(), cu_k, num_splits, **attn)


def run_partials(batch, num_splits, max_query_len=None, **attn):
    mq = max_query_len or max([sq for sq, _ in batch["seqs"]] + [1])
    _skip_unsupported(batch["q"].shape[-1])
    return decode.splitkv_partials(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_q"], batch["seq_lens"],
        **batch["tables"], max_query_len=mq, num_splits=num_splits, impl=_IMPL["v"], **batch["scales"], **attn)


def run_decode(batch, num_splits, sinks=None, max_query_len=None, **attn):
    mq = max_query_len or max([sq for sq, _ in batch["seqs"]] + [1])
    out = torch.full_like(batch["q"], float("nan"))
    lse = torch.full(batch["q"].shape[:2], float("nan"), dtype=torch.float32, device=batch["q"].device)
    _skip_unsupported(batch["q"].shape[-1])
    decode.splitkv_decode(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_q"], batch["seq_lens"],
        **batch["tables"], max_query_len=mq, num_splits=num_splits, sinks=sinks, out=out, lse_out=lse,
        impl=_IMPL["v"],
        **batch["scales"], **attn)
    return out, lse


def combine_in_torch(o_part, lse_part, sinks):
    """The docs/design.md combine, in torch: isolates the split kernel from hip_kernels.combine."""
    o, lse = ref.combine_splits(o_part.double().cpu(), lse_part.double().cpu())
    return ref.apply_sinks(o, lse, None if sinks is None else sinks.double().cpu()), lse


# --- cases ----------------------------------------------------------------------------------

# name: (seqs [(sq, sk)], hq, hk, d, page size, options)
CASES = {
    "sq1_gqa1": ([(1, 37), (1, 100)], 4, 4, 128, 16, {}),
    "sq1_gqa4": ([(1, 300), (1, 17), (1, 1)], 32, 8, 128, 16, {}),
    "sq1_gqa8": ([(1, 250), (1, 64)], 16, 2, 128, 16, {}),
    "spec4_prefix_hit_sq_lt_sk": ([(4, 90), (3, 33)], 8, 2, 128, 16, {}),
    "spec8_gqa8_row_blocks": ([(8, 77), (2, 40)], 16, 2, 128, 16, {}),
    "sq_eq_sk": ([(5, 5), (8, 8)], 8, 2, 128, 16, {}),
    "empty_seq": ([(0, 0), (1, 20), (0, 13), (1, 1)], 4, 2, 128, 16, {}),
    "ctx_1_token": ([(1, 1), (1, 1), (1, 1)], 8, 2, 128, 16, {}),
    "ctx_exactly_one_page": ([(1, 16), (1, 16)], 8, 2, 128, 16, {}),
    "ends_on_page_boundary": ([(1, 64), (2, 48)], 8, 2, 128, 16, {}),
    "one_past_page_boundary": ([(1, 65), (1, 17)], 8, 2, 128, 16, {}),
    "page1": ([(1, 50), (3, 9)], 8, 2, 128, 1, {}),
    "page64": ([(1, 200), (1, 64), (1, 65)], 8, 2, 128, 64, {}),
    "page1024": ([(1, 1500), (1, 1024), (2, 1025)], 8, 2, 128, 1024, {}),
    "page24_any_size": ([(1, 100), (2, 48), (1, 49)], 8, 2, 128, 24, {}),
    "window_lt_sk": ([(1, 300), (4, 200)], 8, 2, 128, 16, {"window": 64}),
    "window_eq_sk": ([(1, 120), (2, 120)], 8, 2, 128, 16, {"window": 120}),
    "window_gt_sk": ([(2, 100)], 8, 2, 128, 16, {"window": 500}),
    "sink_tokens_0": ([(1, 200), (3, 90)], 8, 2, 128, 16, {"window": 32, "sink_tokens": 0}),
    "sink_tokens_1": ([(1, 200), (3, 90)], 8, 2, 128, 16, {"window": 32, "sink_tokens": 1}),
    "sink_tokens_8": ([(1, 200), (3, 90), (1, 20)], 8, 2, 128, 16, {"window": 32, "sink_tokens": 8}),
    "softcap": ([(1, 150), (2, 70)], 8, 2, 128, 16, {"softcap": 2.0}),
    "sinks": ([(1, 150), (2, 70)], 8, 2, 128, 16, {"sinks": True}),
    "all_features": ([(3, 333), (1, 40)], 16, 2, 128, 16,
                     {"sinks": True, "window": 50, "sink_tokens": 4, "softcap": 3.0}),
    "head_dim_64": ([(1, 130), (2, 33)], 8, 2, 64, 16, {}),
    "head_dim_256": ([(1, 130), (2, 33)], 8, 2, 256, 16, {}),
    "fp16": ([(1, 140), (4, 60)], 8, 2, 128, 16, {"dtype": torch.float16}),
    "fp16_gqa8": ([(1, 140)], 16, 2, 128, 16, {"dtype": torch.float16}),
    "fp8_per_tensor": ([(1, 140), (2, 61)], 32, 8, 128, 16, {"kv": "fp8_tensor"}),
    "fp8_per_page_transitions": ([(1, 140), (2, 61)], 32, 8, 128, 16, {"kv": "fp8_page"}),
    "fp8_per_page_page1": ([(1, 40), (2, 9)], 8, 2, 128, 1, {"kv": "fp8_page"}),
    "fp8_gqa8_row_blocks": ([(1, 100), (4, 50)], 16, 2, 128, 16, {"kv": "fp8_page"}),
    "fp8_head_dim_64_fp16_q": ([(1, 100)], 8, 2, 64, 16, {"kv": "fp8_tensor", "dtype": torch.float16}),
    "sglang_page1": ([(1, 70), (2, 33), (0, 5)], 8, 2, 128, 1, {"layout": "sglang"}),
    "sglang_page16": ([(1, 70), (2, 33)], 8, 2, 128, 16, {"layout": "sglang"}),
    "joint_kv_cache_views": ([(1, 90), (2, 31)], 8, 2, 128, 16, {"storage": "joint"}),
    "blocks_first_strided_views": ([(1, 90), (2, 31)], 8, 2, 128, 16, {"storage": "blocks_first"}),
}
_BUILD_KEYS = ("dtype", "kv", "layout", "storage")


def _split_opts(opts):
    build = {k: v for k, v in opts.items() if k in _BUILD_KEYS}
    attn = {k: v for k, v in opts.items() if k not in _BUILD_KEYS}
    return build, attn


def _run_case(name, num_splits):
    seqs, hq, hk, d, bs, opts = CASES[name]
    build, attn = _split_opts(opts)
    batch = make_batch(seqs, hq, hk, d, bs, seed=zlib.crc32(f"{name}/{num_splits}".encode()), **build)
    sinks = None
    if attn.pop("sinks", False):
        sinks = torch.randn(hq, generator=torch.Generator().manual_seed(7)).cuda()
    o_ref, lse_ref = reference(batch, sinks=None if sinks is None else sinks.cpu(), **attn)
    return batch, sinks, attn, o_ref, lse_ref


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_split_kernel_vs_reference(name, num_splits):
    """The split kernel's partials, combined by the docs/design.md formula, match the reference."""
    batch, sinks, attn, o_ref, lse_ref = _run_case(name, num_splits)
    o_part, lse_part = run_partials(batch, num_splits, **attn)
    torch.cuda.synchronize()
    assert not torch.isnan(o_part).any() and not torch.isnan(lse_part).any()
    o, lse = combine_in_torch(o_part, lse_part, sinks)
    dt = batch["q"].dtype
    assert_close(o.float(), o_ref, dt, f"{name} o")
    assert_lse_close(lse.float(), lse_ref, dt, f"{name} lse")


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("name", [n for n in CASES if "window" not in CASES[n][5] and "sink_tokens" not in CASES[n][5]])
def test_partials_match_reference_splits(name):
    """Without a window the split ranges are planning.split_ranges: compare split by split."""
    num_splits = 4
    seqs, hq, hk, d, bs, opts = CASES[name]
    build, attn = _split_opts(opts)
    attn.pop("sinks", None)
    batch = make_batch(seqs, hq, hk, d, bs, seed=11, **build)
    o_part, lse_part = run_partials(batch, num_splits, **attn)
    o_s, lse_s = reference_partials(batch, num_splits, **attn)
    dt = batch["q"].dtype
    assert_lse_close(lse_part.cpu(), lse_s, dt, f"{name} lse partials")
    assert_close(o_part.cpu(), o_s, dt, f"{name} o partials")


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("kv", ["16", "fp8_page"])
@pytest.mark.parametrize("rule, want", [
    ((256,), [8, 2, 2, 1, 1, 4, 4, 4]),  # clamp(sk // 256, 1, 8)
    # fill 2 (16 of 24 slots); 3000 and 1025 keys hold more than 300 a split: 3 fill the wave
    ((64, 2, 300, 8, 24, 95), [3, 2, 2, 1, 1, 3, 3, 3]),
    ((0, 3), [3, 3, 3, 3, 1, 3, 3, 3]),  # fill alone: no growth, no minimum
])
def test_split_rule_idles_the_splits_a_request_is_not_worth(kv, rule, want):
    """The split rule (planner.SplitRule): a request uses request_splits(sk, S, rule) of the grid's
    S splits (planning.split_ranges), split by split as the reference; idle splits write o = 0
    and lse = -inf over a NaN-poisoned workspace."""
    seqs = [(1, 3000), (2, 517), (1, 16), (1, 1), (3, 1025), (0, 7)]
    S = 8
    batch = make_batch(seqs, 32, 8, 128, 16, kv=kv, seed=9)
    total_q = batch["q"].shape[0]
    ws = torch.full((decode.workspace_elems(S, total_q, 32, 128),), float("nan"), device="cuda")
    o_part, lse_part = run_partials(batch, S, workspace=ws, split_rule=rule)
    o_s, lse_s = reference_partials(batch, S, split_rule=rule)
    assert_lse_close(lse_part.cpu(), lse_s, batch["q"].dtype, "lse partials")
    assert_close(o_part.cpu(), o_s, batch["q"].dtype, "o partials")
    used = torch.isfinite(lse_part[:, :, 0]).sum(0).tolist()  # splits holding keys, per query token
    assert used == want


def counters_zero() -> bool:
    """Every split-KV counter buffer is back at zero (the kernels reset what they used)."""
    torch.cuda.synchronize()
    return workspace.semaphores_zeroed()


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("num_splits", [6, 24, 40])  # last CTA: up to 16 (32 balanced); then the combine kernel
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("name", ["ragged_long", "all_features", "spec8_gqa8_row_blocks", "fp8_per_page_transitions"])
def test_split_rule_full_decode(name, num_splits, balanced):
    """A grid sized for longer contexts than its requests' (a CUDA graph's): every request's answer
    and lse, sinks applied once, whichever CTA finishes it. out, lse and the workspace start as
    NaN and the counters are back at zero after each of two launches (a counter left over would
    let the second launch combine early)."""
    if name == "ragged_long":
        batch = make_batch([(1, 3000), (2, 517), (1, 16), (1, 1), (3, 1025), (0, 7)], 32, 8, 128, 16, seed=13)
        sinks = torch.randn(32, generator=torch.Generator().manual_seed(3)).cuda()
        attn, rule = {}, (64, 2, 300, 8, 24, 95)
        o_ref, lse_ref = reference(batch, sinks=sinks.cpu())
    else:  # windows, sink tokens, soft-cap, row blocks, FP8 pages: short contexts, so small bounds
        batch, sinks, attn, o_ref, lse_ref = _run_case(name, num_splits)
        rule = (16, 2, 48, 8, 24, 95)
    total_q, hq, d = batch["q"].shape
    ws = torch.empty(decode.workspace_elems(num_splits, total_q, hq, d), dtype=torch.float32, device="cuda")
    for _ in range(2):
        ws.fill_(float("nan"))
        out, lse = run_decode(batch, num_splits, sinks=sinks, balanced=balanced, workspace=ws, split_rule=rule, **attn)
        assert counters_zero(), "the kernel must leave its counters at zero"
        dt = batch["q"].dtype
        assert_close(out.float().cpu(), o_ref, dt, f"{name} out")
        assert_lse_close(lse.cpu(), lse_ref, dt, f"{name} lse")


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("kv", ["16", "fp8_page"])
def test_one_kv_head_at_the_planners_split_count(kv):
    """A tensor-parallel rank with one kv head (8 / 1): the planner gives one long request
    hundreds of splits (its bound is 512 CTAs a request, planning.split_bound), each with its own
    rule, and a short request beside it few; answers and lse against the reference."""
    from atom_backend.planning import ModelFacts, Platform, PlannerConfig, decode_split_rule, decode_splits

    batch = make_batch([(1, 60000), (1, 700)], 8, 1, 128, 16, kv=kv, seed=21)
    fp8 = kv != "16"
    facts = ModelFacts(8, 1, 128, kv_dtype="fp8_e4m3" if fp8 else "bf16",
                       kv_scale_mode="per_page" if fp8 else "none")
    platform = Platform(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    rule = tuple(decode_split_rule(2, facts, platform, PlannerConfig()))
    splits = decode_splits(2, 60000, facts, platform, PlannerConfig(), rule)
    assert splits > 64, splits  # more than a whole model's bound
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)).cuda()
    o_ref, lse_ref = reference(batch, sinks=sinks.cpu())
    out, lse = run_decode(batch, splits, sinks=sinks, split_rule=rule)
    assert counters_zero(), "the kernel must leave its counters at zero"
    assert_close(out.float().cpu(), o_ref, batch["q"].dtype, f"8/1 {kv} out at {splits} splits")
    assert_lse_close(lse.cpu(), lse_ref, batch["q"].dtype, f"8/1 {kv} lse")


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("name", ["sq1_gqa4", "sinks", "all_features", "fp8_per_page_transitions", "empty_seq",
                                  "spec8_gqa8_row_blocks", "sglang_page1"])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_full_decode_with_combine(name, num_splits):
    """splitkv_decode end to end: hip_kernels.combine applies the sinks once; with one split the
    tensor-core kernel writes out and lse itself (no combine). out and lse start as NaN: every
    row of every request must be written."""
    pytest.importorskip("hip_kernels.combine")
    batch, sinks, attn, o_ref, lse_ref = _run_case(name, 5)
    out, lse = run_decode(batch, num_splits, sinks=sinks, **attn)
    torch.cuda.synchronize()
    dt = batch["q"].dtype
    assert_close(out.float().cpu(), o_ref, dt, f"{name} out")
    assert_lse_close(lse.cpu(), lse_ref, dt, f"{name} lse")


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("kv", ["16", "fp8_page"])
def test_num_splits_one_vs_many_same_answer(kv):
    seqs = [(1, 3000), (2, 517), (1, 16), (1, 1), (3, 1025)]
    batch = make_batch(seqs, 32, 8, 128, 16, kv=kv, seed=5)
    outs = []
    for s in (1, 2, 7, 32, 64):
        o_part, lse_part = run_partials(batch, s)
        outs.append(combine_in_torch(o_part, lse_part, None))
    o_ref, lse_ref = reference(batch)
    for o, lse in outs:
        assert_close(o.float(), o_ref, torch.bfloat16, "o vs reference")
        assert_lse_close(lse.float(), lse_ref, torch.bfloat16)
    # fp32 partials: splits only reorder fp32 sums, far inside the bf16 bound. The tensor-core
    # kernel rounds P to 16 bits relative to each split's running max, so splits also change
    # those roundings: held to the fp16 bound there.
    close = torch.float32 if _IMPL["v"] != "mma" else torch.float16
    for o, lse in outs[1:]:
        assert_close(o.float(), outs[0][0].float(), close, "o: splits=k vs splits=1")
        assert_lse_close(lse.float(), outs[0][1].float(), close)


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
def test_more_splits_than_keys_writes_empty_splits():
    batch = make_batch([(1, 5), (2, 3)], 8, 2, 128, 16, seed=3)
    o_part, lse_part = run_partials(batch, 16)
    # split s covers keys [s*ceil(sk/16), ...): all but the first sk splits are empty
    assert torch.isneginf(lse_part[5:, 0]).all() and (o_part[5:, 0] == 0).all()
    o, lse = combine_in_torch(o_part, lse_part, None)
    o_ref, lse_ref = reference(batch)
    assert_close(o.float(), o_ref, torch.bfloat16)
    assert_lse_close(lse.float(), lse_ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
def test_last_page_of_pool_over_4gib():
    """Page ids * page stride overflow 32 bits: the last pages of a > 4 GiB pool must be right."""
    hk, d, bs = 8, 128, 16
    page_bytes = bs * hk * d * 2
    nb = (4 * 2**30) // page_bytes + 4096  # K alone is over 4 GiB; V sits past it
    seqs = [(1, 700), (2, 300), (1, 16)]
    batch = make_batch(seqs, 32, hk, d, bs, num_blocks=nb, storage="joint", seed=9)
    assert batch["k_cache"].shape[0] * page_bytes > 4 * 2**30
    assert any(nb - 1 in pg for pg in batch["pages_of"])
    for s in (1, 4):
        o_part, lse_part = run_partials(batch, s)
        o, lse = combine_in_torch(o_part, lse_part, None)
        o_ref, lse_ref = reference(batch)
        assert_close(o.float(), o_ref, torch.bfloat16, f"splits={s}")
        assert_lse_close(lse.float(), lse_ref, torch.bfloat16)
    del batch
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
def test_cuda_graph_capture_and_replay():
    """Fixed workspace and splits: capture once, change the inputs in place, replay."""
    seqs = [(1, 520), (1, 90), (1, 33), (1, 1)]
    hq, hk, d, bs, splits = 32, 8, 128, 16, 6
    batch = make_batch(seqs, hq, hk, d, bs, seed=21, extra_blocks=64)
    ws = torch.empty(decode.workspace_elems(splits, batch["q"].shape[0], hq, d), dtype=torch.float32, device="cuda")
    o_static = torch.empty_like(batch["q"])
    o_part_holder = {}

    def step():
        o_part_holder["p"] = decode.splitkv_partials(
            batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_q"], batch["seq_lens"], **batch["tables"],
            max_query_len=1, num_splits=splits, workspace=ws, impl=_IMPL["v"])

    step()  # compile and load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    # New contents, same shapes: a new query, longer contexts and a different block table.
    new = make_batch([(1, 450), (1, 120), (1, 16), (1, 2)], hq, hk, d, bs, seed=22,
                     num_blocks=batch["k_cache"].shape[0])
    batch["q"].copy_(new["q"])
    batch["seq_lens"].copy_(new["seq_lens"])
    batch["k_cache"].copy_(new["k_cache"])
    batch["v_cache"].copy_(new["v_cache"])
    bt_new = new["tables"]["block_table"]
    bt = batch["tables"]["block_table"]
    assert bt_new.shape[1] <= bt.shape[1]
    bt.fill_(2**30)
    bt[:, : bt_new.shape[1]].copy_(bt_new)
    ws.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    o_part, lse_part = o_part_holder["p"]
    o, lse = combine_in_torch(o_part, lse_part, None)
    new["q"] = batch["q"]
    o_ref, lse_ref = reference(new)
    assert_close(o.float(), o_ref, torch.bfloat16, "replayed graph")
    assert_lse_close(lse.float(), lse_ref, torch.bfloat16)
    del o_static


@pytest.mark.gpu
@pytest.mark.usefixtures("impl")
@pytest.mark.parametrize("kv", ["16", "fp8_page", "fp8_tensor"])
@pytest.mark.parametrize("num_splits", [1, 5, decode.FUSE_MAX_SPLITS + 4])
def test_plan_runs_each_layer_on_its_own_tensors(kv, num_splits):
    """One SplitKVPlan, several layers (other caches, q, out, sinks, window, FP8 scales): a layer
    of an already packed layout swaps its pointers (and per-tensor scales) in; each layer matches
    its own reference. The split counts take the kernel's own finish (1), its last-CTA combine and
    the combine kernel."""
    seqs = [(1, 700), (2, 95), (1, 16), (1, 1)]
    hq, hk, d, bs = 32, 8, 128, 16
    layers = [make_batch(seqs, hq, hk, d, bs, kv=kv, seed=41, data_seed=100 + i) for i in range(3)]
    if kv == "fp8_tensor":  # calibrated checkpoints: every layer its own scales
        for i, b in enumerate(layers):
            b["scales"] = {"k_scale": 0.37 * (1 + 0.5 * i), "v_scale": 0.3 / (1 + 0.5 * i)}
    first = layers[0]
    plan = decode.SplitKVPlan(first["cu_q"], first["seq_lens"], **first["tables"], max_query_len=2,
                              num_splits=num_splits, impl=_IMPL["v"])
    gen = torch.Generator().manual_seed(3)
    params = [{}, {}, {"window": 40, "sinks": torch.randn(hq, generator=gen).cuda()}]
    # The third layer's layout differs (window, sinks); the first comes back with a new out.
    for i in (0, 1, 2, 0):
        b, attn = layers[i], params[i]
        out = torch.full_like(b["q"], float("nan"))
        lse = torch.full(b["q"].shape[:2], float("nan"), dtype=torch.float32, device="cuda")
        plan.run(b["q"], b["k_cache"], b["v_cache"], out=out, lse_out=lse, **b["scales"], **attn)
        torch.cuda.synchronize()
        ref_attn = dict(attn)
        if "sinks" in ref_attn:
            ref_attn["sinks"] = ref_attn["sinks"].cpu()
        o_ref, lse_ref = reference(b, **ref_attn)
        assert_close(out.float().cpu(), o_ref, torch.bfloat16, f"layer {i} out")
        assert_lse_close(lse.cpu(), lse_ref, torch.bfloat16, f"layer {i} lse")
    assert len(plan._launches) == 2


@pytest.mark.gpu
def test_plan_checks_every_call_a_layout_cannot_show():
    """What the packed layout does not fix is checked per call: a misaligned q of the same shape
    and strides is refused; a bigger layer regrows the workspace and the layers packed before
    still run correctly."""
    seqs = [(1, 300), (1, 40)]
    small = make_batch(seqs, 8, 2, 64, 16, seed=9)
    plan = decode.SplitKVPlan(small["cu_q"], small["seq_lens"], **small["tables"], max_query_len=1, num_splits=20)
    plan.run(small["q"], small["k_cache"], small["v_cache"])
    flat = torch.empty(small["q"].numel() + 1, dtype=small["q"].dtype, device="cuda")
    shifted = flat[1:].view_as(small["q"])
    shifted.copy_(small["q"])
    with pytest.raises(ValueError, match="16-byte"):
        plan.run(shifted, small["k_cache"], small["v_cache"])
    big = make_batch(seqs, 8, 2, 128, 16, seed=9, data_seed=5)
    for b in (big, small):
        out = plan.run(b["q"], b["k_cache"], b["v_cache"])
        torch.cuda.synchronize()
        o_ref, _ = reference(b)
        assert_close(out.float().cpu(), o_ref, torch.bfloat16, f"head_dim {b['q'].shape[-1]}")


@pytest.mark.gpu
def test_partials_keep_fixed_ranges_where_balancing_would_pay():
    """splitkv_partials is docs/design.md's fixed split ranges even on a grid where splitkv_decode
    would balance: bitwise equal to an explicitly unbalanced plan."""
    b = make_batch([(1, 2048)] * 64, 32, 8, 128, 16, seed=12)
    assert decode.balance_pays(b["q"], b["k_cache"], b["cu_q"], 4, 1)
    o, lse = decode.splitkv_partials(b["q"], b["k_cache"], b["v_cache"], b["cu_q"], b["seq_lens"], **b["tables"],
                                     max_query_len=1, num_splits=4)
    o, lse = o.clone(), lse.clone()
    plan = decode.SplitKVPlan(b["cu_q"], b["seq_lens"], **b["tables"], max_query_len=1, num_splits=4, balanced=False)
    o2, lse2 = plan.partials(b["q"], b["k_cache"], b["v_cache"])
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.gpu
def test_plan_survives_a_grown_counter_buffer():
    """The completion counters packed into a plan stay valid (and zero) when a larger batch of
    another plan grows the counter buffer between two of its layers."""
    b = make_batch([(1, 300), (1, 40)], 8, 2, 128, 16, seed=4)
    plan = decode.SplitKVPlan(b["cu_q"], b["seq_lens"], **b["tables"], max_query_len=1, num_splits=5)
    plan.run(b["q"], b["k_cache"], b["v_cache"])
    old = workspace.semaphores(b["q"].device, 1)
    assert workspace.semaphores(b["q"].device, old.numel() + 1).data_ptr() != old.data_ptr()
    out = plan.run(b["q"], b["k_cache"], b["v_cache"])
    torch.cuda.synchronize()
    assert_close(out.float().cpu(), reference(b)[0], torch.bfloat16, "after the counters grew")
    assert int(old.abs().sum()) == 0


# --- CPU: validation, magic numbers, variants ----------------------------------------------


def _cpu_args(**over):
    a = dict(
        q=torch.randn(2, 8, 128).to(torch.bfloat16),
        k_cache=torch.randn(10, 16, 2, 128).to(torch.bfloat16),
        v_cache=torch.randn(10, 16, 2, 128).to(torch.bfloat16),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32),
        block_table=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
    )
    kw = dict(max_query_len=1, num_splits=2)
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    return a, kw


@pytest.mark.parametrize("over, match", [
    ({"q": torch.randn(2, 8, 96).to(torch.bfloat16)}, "head_dim"),
    ({"q": torch.randn(2, 8, 128)}, "q dtype"),
    ({"q": torch.randn(2, 7, 128).to(torch.bfloat16)}, "multiple of num_kv_heads"),
    ({"k_cache": torch.randn(10, 16, 2, 128).to(torch.float16)}, "differ"),
    ({"cu_seqlens_q": torch.tensor([0, 1, 2])}, "int32"),
    ({"seq_lens": torch.tensor([5], dtype=torch.int32)}, "seq_lens has 1"),
    ({"max_query_len": 9}, "max_query_len"),
    ({"max_query_len": 0}, "max_query_len"),
    ({"num_splits": 0}, "num_splits"),
    ({"window": -1}, ">= 0"),
    ({"block_table": None}, "exactly one page table"),
    ({"k_scale": 1.0, "v_scale": 1.0}, "only apply to an FP8"),
    ({"block_table": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32).t()}, "contiguous rows"),
    ({"q": torch.randn(2, 8, 256).to(torch.bfloat16)[..., ::2]}, "contiguous"),
    ({}, "runs on a GPU"),
])
def test_launch_validation(over, match):
    a, kw = _cpu_args(**over)
    with pytest.raises(ValueError, match=match):
        decode.splitkv_partials(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                a["block_table"], **kw)


@pytest.mark.skipif(FP8 is None, reason="no float8_e4m3fn in this torch")
def test_fp8_needs_exactly_one_scale_mode():
    k8 = torch.randn(10, 16, 2, 128).to(FP8)
    a, kw = _cpu_args(k_cache=k8, v_cache=k8.clone())
    for extra in ({}, {"k_scale": 1.0, "v_scale": 1.0, "k_descale": torch.ones(10, 2), "v_descale": torch.ones(10, 2)}):
        with pytest.raises(ValueError, match="exactly one scale mode"):
            decode.splitkv_partials(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                    a["block_table"], **kw, **extra)
    with pytest.raises(ValueError, match=r"k_descale must be contiguous float32 \[num_blocks=10"):
        decode.splitkv_partials(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                a["block_table"], **kw, k_descale=torch.ones(9, 2), v_descale=torch.ones(10, 2))
    with pytest.raises(ValueError, match="Python float"):
        decode.splitkv_partials(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                a["block_table"], **kw, k_scale=torch.ones(2), v_scale=1.0)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 16, 24, 64, 100, 1000, 1024, 4097, 65535])
def test_page_division_magic(d):
    magic, shift = decode._div_magic(d)
    rng = random.Random(d)
    for n in [0, 1, d - 1, d, d + 1, 2**31 - 1] + [rng.randrange(2**31) for _ in range(2000)]:
        hi = (n * magic) >> 32
        assert (hi + n) >> shift == n // d, (n, d)


def test_variants_cover_every_launch():
    vs = decode.variants()
    assert len(vs) == len(set(vs))
    names = {v.name for v in vs}
    for d in decode.HEAD_DIMS:
        for q_code, kv_codes in ((0, (0, 2, 3)), (1, (1, 2, 3))):
            for kv_code in kv_codes:
                for g in (1, 2, 4, 8, 16):
                    for mq in range(1, decode.MAX_QUERY_TOKENS + 1):
                        rows, blocks = decode._pick_rows(mq * g, kv_code)
                        assert rows * blocks >= mq * g
                        assert decode._variant(d, rows, q_code, kv_code).name in names


def test_workspace_too_small_is_rejected():
    a, kw = _cpu_args()
    with pytest.raises(ValueError, match="workspace"):
        decode.splitkv_partials(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                a["block_table"], **kw, workspace=torch.empty(10))


def test_mma_smem_mirror_and_impl_choice():
    """decode.py's shared-memory formula is the kernel's (SMEM_BYTES), and the choice of kernel."""
    v = decode._mma_variant(128, 0, 0)
    # Q 16 x 128 bf16 + 4 warps x 2 stages x (K + V of 16 keys of 256 bytes)
    assert decode._mma_smem_bytes(v) == 16 * 128 * 2 + 4 * 2 * 2 * 16 * 256
    v8 = decode._mma_variant(128, 0, 2)
    # FP8: 2 warps x 3 stages x (K + V of 16 keys of 128 bytes + their per-page factors)
    assert decode._mma_smem_bytes(v8) == 16 * 128 * 2 + 2 * 3 * (2 * 16 * 128 + 2 * 16 * 4)
    assert decode.choose_impl("sm_90a", 128, 2) == "mma"
    assert decode.choose_impl("sm_75", 128, 0) == "fma"
    assert decode.choose_impl("sm_90a", 256, 0) == "fma"
    assert decode.choose_impl("gfx942", 64, 3) == "mma"


def test_planner_ctas_per_sm_mirror_the_kernel():
    """The planner (no torch import) restates the tensor-core kernel's CTAs per SM; both follow
    the warps per CTA of the default variants (8 resident warps of ~200 registers per SM)."""
    from atom_backend.planning import Platform

    p = Platform()
    assert decode.MMA_CTAS_PER_SM == {2: p.decode_ctas_per_sm, 1: p.decode_ctas_per_sm_fp8}
    for kv_code, elem in ((0, 2), (2, 1)):
        assert decode._mma_warps(decode._mma_variant(128, 0, kv_code)) * decode.MMA_CTAS_PER_SM[elem] == 8


def test_mma_decode_only_where_its_shared_memory_fits():
    """gfx942 gives a workgroup 64 KiB: d=128 with 16-bit KV (68 KiB) stays on the CUDA-core kernel."""
    assert decode._mma_smem_bytes(decode._mma_variant(128, 0, 0)) > 64 * 1024
    assert decode.choose_impl("gfx942", 128, 0) == "fma"
    assert decode.choose_impl("gfx942", 128, 3) == "mma"  # FP8 halves the ring
    assert decode.choose_impl("gfx950", 128, 0) == "mma" and decode.choose_impl("sm_90a", 128, 0) == "mma"
    assert decode.choose_impl("sm_90a", 256, 0) == "fma"
