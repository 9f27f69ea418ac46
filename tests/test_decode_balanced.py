"""The tensor-core decode kernel's balanced splits and in-kernel combine (hip_kernels.decode).

Balanced: the splits of one (kv head, row block, request) claim 16-key slices from a shared
counter, so partial s covers whatever slices its CTA took (16-bit KV; FP8 keeps fixed ranges);
the combined answer must still be the reference's, for every docs/design.md case. In-kernel combine:
the last CTA of each group combines, so the counters (which the kernel leaves at zero) decide
correctness across launches and CUDA-graph replays.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from atom_backend.tolerances import assert_close, assert_lse_close
from hip_kernels import decode
from tests.test_decode_kernel import CASES, _split_opts, counters_zero, make_batch, reference

FP8 = getattr(torch, "float8_e4m3fn", None)
_MMA_CASES = [n for n in CASES if CASES[n][3] in decode.MMA_HEAD_DIMS]


def _decode(batch, num_splits, sinks=None, balanced=True, **attn):
    mq = max([sq for sq, _ in batch["seqs"]] + [1])
    out = torch.full_like(batch["q"], float("nan"))
    lse = torch.full(batch["q"].shape[:2], float("nan"), dtype=torch.float32, device=batch["q"].device)
    decode.splitkv_decode(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_q"], batch["seq_lens"],
                          **batch["tables"], max_query_len=mq, num_splits=num_splits, sinks=sinks, out=out,
                          lse_out=lse, impl="mma", balanced=balanced, **batch["scales"], **attn)
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("num_splits", [3, 16, 32, 33])  # past FUSE_MAX_SPLITS / FUSE_MAX_BALANCED_SPLITS
@pytest.mark.parametrize("name", _MMA_CASES)
def test_in_kernel_combine_vs_reference(name, num_splits, balanced):
    """out and lse start as NaN: every row must be written, by the last CTA of each group (up to
    FUSE_MAX_SPLITS splits, FUSE_MAX_BALANCED_SPLITS balanced) or by the combine kernel."""
    seqs, hq, hk, d, bs, opts = CASES[name]
    build, attn = _split_opts(opts)
    batch = make_batch(seqs, hq, hk, d, bs, seed=zlib.crc32(f"bal/{name}/{num_splits}".encode()), **build)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(3)).cuda() if attn.pop("sinks", False) else None
    o_ref, lse_ref = reference(batch, sinks=None if sinks is None else sinks.cpu(), **attn)
    out, lse = _decode(batch, num_splits, sinks=sinks, balanced=balanced, **attn)
    dt = batch["q"].dtype
    assert_close(out.float().cpu(), o_ref, dt, f"{name} out")
    assert_lse_close(lse.cpu(), lse_ref, dt, f"{name} lse")
    assert counters_zero(), "the kernel must leave its counters at zero"


@pytest.mark.gpu
def test_balanced_long_contexts_many_splits_repeated():
    """Long and ragged contexts where every warp claims many slices; three launches in a row
    (the counters left by one are the next one's start) all match the reference."""
    seqs = [(1, 9000), (1, 3001), (2, 700), (1, 16), (1, 1), (0, 5)]
    batch = make_batch(seqs, 32, 8, 128, 16, seed=31)
    o_ref, lse_ref = reference(batch)
    for s in (5, 32, 64, 5):
        out, lse = _decode(batch, s)
        assert_close(out.float().cpu(), o_ref, torch.bfloat16, f"splits={s}")
        assert_lse_close(lse.cpu(), lse_ref, torch.bfloat16)
        assert counters_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["16", "fp8_page"])
def test_cuda_graph_replays_of_the_balanced_decode(kv):
    """Captured once (semaphores and workspace fixed), replayed with new contents three times."""
    seqs = [(1, 1500), (1, 90), (1, 33), (1, 1)]
    hq, hk, d, bs, splits = 32, 8, 128, 16, 8
    batch = make_batch(seqs, hq, hk, d, bs, kv=kv, seed=41, extra_blocks=300)
    ws = torch.empty(decode.workspace_elems(splits, batch["q"].shape[0], hq, d), dtype=torch.float32, device="cuda")
    out = torch.empty_like(batch["q"])

    def step():
        decode.splitkv_decode(batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_q"], batch["seq_lens"],
                              **batch["tables"], max_query_len=1, num_splits=splits, out=out, workspace=ws,
                              impl="mma", balanced=True, **batch["scales"])

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i, lens in enumerate(([(1, 1400), (1, 120), (1, 16), (1, 2)], [(1, 17), (1, 1500), (1, 1), (1, 800)],
                              [(1, 1500), (1, 1500), (1, 1500), (1, 1500)])):
        new = make_batch(lens, hq, hk, d, bs, kv=kv, seed=50 + i, num_blocks=batch["k_cache"].shape[0])
        for key in ("q", "seq_lens", "k_cache", "v_cache"):
            batch[key].copy_(new[key])
        for key, t in new["scales"].items():
            if isinstance(t, torch.Tensor):
                batch["scales"][key].copy_(t)
        bt = batch["tables"]["block_table"]
        bt.fill_(2**30)
        bt[:, : new["tables"]["block_table"].shape[1]].copy_(new["tables"]["block_table"])
        out.fill_(float("nan"))
        ws.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        new["q"] = batch["q"]
        o_ref, lse_ref = reference(new)
        assert_close(out.float().cpu(), o_ref, torch.bfloat16, f"replay {i}")
        assert counters_zero()


@pytest.mark.gpu
def test_balance_pays_only_on_a_full_grid_of_16_bit_kv():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slots = sms * decode.MMA_CTAS_PER_SM[2]

    def pays(batch, splits, kv_dtype=torch.bfloat16, hk=8):
        q = torch.empty(batch, 4 * hk, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 16, hk, 128, dtype=kv_dtype, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        return decode.balance_pays(q, k, cu, splits, 1)

    full = -(-slots // 8)  # splits of one request filling a wave of 8-kv-head CTAs
    assert pays(1, full) and pays(8, -(-full // 8))
    assert not pays(1, full // 2), "half a wave is latency bound: fixed ranges"
    assert not pays(64, 1), "one split has nothing to balance"
    if FP8 is not None:
        assert not pays(1, full, kv_dtype=FP8), "FP8 runs fixed ranges"
