"""Unified path (Triton over the paged cache) against atom_backend.reference, on the CPU.

The kernels run under Triton's interpreter, which is a property of the whole process (Triton
fixes it at import), so a plain ``pytest`` run executes this file's cases in a child process with
TRITON_INTERPRET=1 (one test, ``test_interpreter_suite``); other test files are not affected.
``TRITON_INTERPRET=1 pytest tests/test_unified.py`` runs the cases in-process with their ids.
Inputs are fp16/fp32: bf16 dots are wrong under the interpreter (docs/toolchains.md); bf16 is
proven by tests/test_unified_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close
from atom_backend.unified import TileConfig, decode_workspace_numel, paged_attention, paged_decode

INTERP = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = torch.float8_e4m3fn

# --- batch builder (shared with tests/test_unified_gpu.py) ---------------------------------


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    scales: dict = field(default_factory=dict)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_table)

    def reference(self, **opts):
        return ref.paged_attention(self.q.cpu().float(), self.k_cache.cpu(), self.v_cache.cpu(), self.cu_seqlens_q.cpu(),
                                   self.block_table.cpu(), self.seq_lens.cpu(),
                                   **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in self.scales.items()},
                                   **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()})


def make_batch(seqs, hq, hk, d, page, *, dtype=torch.float16, kv="same", gen=None, device="cpu", spare_blocks=3,
               joint=False) -> Batch:
    """Random batch over a paged pool: pages permuted, the pool's last page always in use.

    seqs: [(sq, sk)]; kv: "same" (cache in q's dtype), "fp8_tensor" or "fp8_page".
    joint=True stores K and V interleaved per block ([nb, 2, bs, hk, d]) so the caches are
    non-contiguous views, as some vLLM layouts give them.
    """
    gen = gen or torch.Generator().manual_seed(0)
    n_pages = [-(-sk // page) for _, sk in seqs]
    nb = sum(n_pages) + spare_blocks
    ids = torch.randperm(nb, generator=gen)[: sum(n_pages)]
    if sum(n_pages) and not (ids == nb - 1).any():
        ids[-1] = nb - 1
    width = max(n_pages + [1]) + 1
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = ids[i:i + n]
        i += n
    cache_dt = dtype if kv == "same" else FP8
    if joint:
        kvj = torch.randn(nb, 2, page, hk, d, generator=gen).to(cache_dt)
        kc, vc = kvj[:, 0], kvj[:, 1]
    else:
        kc = torch.randn(nb, page, hk, d, generator=gen).to(cache_dt)
        vc = torch.randn(nb, page, hk, d, generator=gen).to(cache_dt)
    # Scales stay <= 1.25 so outputs stay O(1): docs/design.md's bf16 max-abs bound (2e-2) is absolute,
    # and a bf16 output above 8 is rounded by up to 3e-2 on its own.
    scales = {}
    if kv == "fp8_tensor":
        scales = dict(k_scale=0.5 + 0.75 * torch.rand(1, generator=gen).item(),
                      v_scale=0.5 + 0.75 * torch.rand(1, generator=gen).item())
    elif kv == "fp8_page":
        # scales differ page to page, so a tile that crosses a page boundary must switch scale
        scales = dict(k_descale=(0.25 + torch.rand(nb, hk, generator=gen)).to(device),
                      v_descale=(0.25 + torch.rand(nb, hk, generator=gen)).to(device))
    cu = [0]
    for sq, _ in seqs:
        cu.append(cu[-1] + sq)
    q = torch.randn(cu[-1], hq, d, generator=gen).to(dtype)
    return Batch(q.to(device), kc.to(device) if not joint else kc, vc.to(device) if not joint else vc,
                 torch.tensor(cu, dtype=torch.int32, device=device),
                 torch.tensor([sk for _, sk in seqs], dtype=torch.int32, device=device), bt.to(device),
                 max(sq for sq, _ in seqs) if seqs else 0, scales)


def check_batch(B: Batch, dtype, *, splits=(3,), config=None, **opts):
    """paged_attention and paged_decode (each split count) against the reference."""
    if "sinks" in opts and opts["sinks"] is True:
        opts["sinks"] = torch.randn(B.q.shape[1]).to(B.q.device)
    ro, rl = B.reference(**opts)
    bound_dt = torch.bfloat16 if B.k_cache.dtype == FP8 else dtype
    out = torch.full_like(B.q, float("nan"))
    o, lse = paged_attention(*B.args(), max_seqlen_q=B.max_seqlen_q, out=out, return_lse=True, _config=config,
                             **B.scales, **opts)
    assert o is out
    assert_close(o, ro, bound_dt, "paged_attention out")
    assert_lse_close(lse, rl, bound_dt, "paged_attention lse")
    for s in splits:
        out = torch.full_like(B.q, float("nan"))
        o, lse = paged_decode(*B.args(), max_seqlen_q=B.max_seqlen_q, num_splits=s, out=out, return_lse=True,
                              _config=config, **B.scales, **opts)
        assert_close(o, ro, bound_dt, f"paged_decode(splits={s}) out")
        assert_lse_close(lse, rl, bound_dt, f"paged_decode(splits={s}) lse")


# --- cases: every docs/design.md must-have, by name ---------------------------------------------
# name: (seqs [(sq, sk)], hq, hk, d, page, opts, extra) ; extra: dtype / kv / config / joint
CASES = {
    "sq_eq_sk": ([(40, 40), (7, 7)], 4, 2, 32, 16, {}, {}),
    "prefix_hit": ([(9, 50), (20, 33)], 4, 2, 32, 16, {}, {}),
    "sq1": ([(1, 45), (1, 1), (1, 17)], 4, 2, 32, 16, {}, {}),
    "gqa1": ([(12, 30), (1, 19)], 2, 2, 32, 16, {}, {}),
    "gqa4": ([(12, 30), (1, 19)], 8, 2, 32, 16, {}, {}),
    "gqa8": ([(12, 30), (1, 19)], 8, 1, 32, 16, {}, {}),
    "gqa8_two_kv_heads": ([(5, 21)], 16, 2, 32, 16, {}, {}),
    "mqa_group_over_tile": ([(3, 20)], 32, 1, 16, 16, {}, {"config": TileConfig(16, 32, 4, 1)}),
    "window_lt_sk": ([(20, 60), (1, 37)], 4, 2, 32, 16, {"window": 9}, {}),
    "window_eq_sk": ([(20, 37), (1, 37)], 4, 2, 32, 16, {"window": 37}, {}),
    "window_gt_sk": ([(20, 37), (1, 30)], 4, 2, 32, 16, {"window": 100}, {}),
    "sink_tokens_0": ([(20, 60), (1, 45)], 4, 2, 32, 16, {"window": 8, "sink_tokens": 0}, {}),
    "sink_tokens_1": ([(20, 60), (1, 45)], 4, 2, 32, 16, {"window": 8, "sink_tokens": 1}, {}),
    "sink_tokens_8": ([(20, 60), (1, 45)], 4, 2, 32, 16, {"window": 8, "sink_tokens": 8}, {}),
    "sink_tokens_over_window_edge": ([(30, 70)], 4, 2, 32, 16, {"window": 20, "sink_tokens": 40}, {}),
    "empty_seq": ([(0, 20), (5, 5), (0, 0), (1, 9)], 4, 2, 32, 16, {}, {}),
    "page_boundary_exact": ([(8, 32), (1, 16)], 4, 2, 32, 16, {}, {}),
    "page_boundary_plus1": ([(8, 33), (1, 17)], 4, 2, 32, 16, {}, {}),
    "page_size_1": ([(6, 23), (1, 9)], 4, 2, 32, 1, {}, {}),
    "page_size_16": ([(6, 40), (1, 33)], 4, 2, 32, 16, {}, {}),
    "page_size_1024": ([(24, 1030), (1, 700)], 2, 1, 16, 1024, {}, {"config": TileConfig(32, 256, 4, 1)}),
    "tile_lt_page": ([(10, 70)], 4, 2, 32, 32, {}, {"config": TileConfig(16, 16, 4, 1)}),
    "fp8_per_tensor": ([(10, 40), (1, 33)], 4, 2, 32, 16, {}, {"kv": "fp8_tensor"}),
    "fp8_per_page_transition": ([(10, 40), (1, 33)], 4, 2, 32, 16, {}, {"kv": "fp8_page"}),
    "fp8_per_page_window_sinks": ([(10, 40)], 4, 2, 32, 8, {"window": 12, "sinks": True}, {"kv": "fp8_page"}),
    "sinks": ([(10, 40), (1, 33), (0, 5)], 4, 2, 32, 16, {"sinks": True}, {}),
    "softcap": ([(10, 40), (1, 33)], 4, 2, 32, 16, {"softcap": 3.0}, {}),
    "softcap_window_sinks": ([(10, 40)], 4, 2, 32, 16, {"softcap": 10.0, "window": 7, "sinks": True}, {}),
    "noncausal": ([(10, 40), (1, 33)], 4, 2, 32, 16, {"causal": False}, {}),
    "scale_explicit": ([(10, 40)], 4, 2, 32, 16, {"scale": 0.3}, {}),
    "head_dim_64": ([(6, 30), (1, 19)], 4, 2, 64, 16, {}, {}),
    "head_dim_80_padded": ([(6, 30), (1, 19)], 4, 2, 80, 16, {}, {}),
    "head_dim_96_padded": ([(6, 30), (1, 19)], 4, 2, 96, 16, {}, {}),
    "head_dim_128": ([(6, 30)], 2, 2, 128, 16, {}, {}),
    "head_dim_256": ([(6, 30)], 2, 2, 256, 16, {}, {}),
    "fp32_inputs": ([(9, 41), (1, 20)], 4, 2, 32, 16, {"window": 10, "sinks": True}, {"dtype": torch.float32}),
    "joint_kv_view": ([(9, 41), (1, 20)], 4, 2, 32, 16, {}, {"joint": True}),
    "mixed_batch": ([(1, 60), (25, 25), (0, 3), (7, 50), (1, 1)], 8, 2, 32, 16, {"window": 30, "sinks": True}, {}),
}

# Cases that need Triton's interpreter: collected only in the child process that
# test_interpreter_suite starts with TRITON_INTERPRET=1 (tests/conftest.py deselects them here).
interp_only = pytest.mark.triton_interpreter


def test_interpreter_suite():
    """The cases of this file, in a child process with Triton's interpreter switched on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", os.path.abspath(__file__)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout, tail


@interp_only
@pytest.mark.parametrize("name", list(CASES))
def test_case(name):
    seqs, hq, hk, d, page, opts, extra = CASES[name]
    dtype = extra.get("dtype", torch.float16)
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    B = make_batch(seqs, hq, hk, d, page, dtype=dtype, kv=extra.get("kv", "same"), gen=gen, joint=extra.get("joint", False))
    assert (B.block_table == B.k_cache.shape[0] - 1).any(), "the pool's last page must be in use"
    check_batch(B, dtype, splits=(1, 3), config=extra.get("config"), **dict(opts))


@interp_only
def test_split_partials_match_reference():
    """Each split's normalised partial and lse (empty splits: o = 0, lse = -inf)."""
    gen = torch.Generator().manual_seed(7)
    B = make_batch([(1, 50), (2, 9), (1, 1)], 4, 2, 32, 16, dtype=torch.float32, gen=gen)
    S = 4
    ws = torch.full((decode_workspace_numel(S, B.q.shape[0], 4, 32),), float("nan"))
    _, (o_p, l_p) = paged_decode(*B.args(), max_seqlen_q=2, num_splits=S, workspace=ws, window=20, return_partials=True)
    k, v, cu_k = ref.gather_vllm(B.k_cache, B.v_cache, B.block_table, B.seq_lens)
    ro, rl = ref.split_kv_partials(B.q, k, v, B.cu_seqlens_q, cu_k, S, window=20)
    assert_close(o_p, ro, torch.float32, "o_partial")
    assert_lse_close(l_p, rl, torch.float32, "lse_partial")
    assert torch.isinf(l_p[1:, 3:]).all() and (o_p[1:, 3:] == 0).all()  # sk == 1: splits 1.. are empty


@interp_only
@pytest.mark.parametrize("rule, used", [
    ((16,), (3, 1, 2)),  # clamp(sk // 16, 1, 4)
    # fill 2; 50 and 33 keys hold more than 10 a split: 3 splits fill the 3 slots (9 keys: 2)
    ((4, 2, 10, 1, 3, 95), (3, 2, 3)),
    # fill 1; 50 keys grow to 3 (one wave); 33 keys may grow to 2, which fills no wave: 1
    ((8, 1, 16, 1, 3, 90), (3, 1, 1)),
    ((0, 2), (2, 2, 2)),  # fill alone: no growth, no minimum
])
def test_split_partials_split_rule(rule, used):
    """The split rule (planner.SplitRule): a request of sk keys uses request_splits(sk, S, rule)
    splits, as planning.split_ranges; the answer is the same attention."""
    gen = torch.Generator().manual_seed(9)
    B = make_batch([(1, 50), (2, 9), (1, 33)], 4, 2, 32, 16, dtype=torch.float32, gen=gen)
    S = 4
    ws = torch.full((decode_workspace_numel(S, B.q.shape[0], 4, 32),), float("nan"))
    o, (o_p, l_p) = paged_decode(*B.args(), max_seqlen_q=2, num_splits=S, workspace=ws, return_partials=True,
                                 split_rule=rule)
    k, v, cu_k = ref.gather_vllm(B.k_cache, B.v_cache, B.block_table, B.seq_lens)
    ro, rl = ref.split_kv_partials(B.q, k, v, B.cu_seqlens_q, cu_k, S, split_rule=rule)
    assert_close(o_p, ro, torch.float32, "o_partial")
    assert_lse_close(l_p, rl, torch.float32, "lse_partial")
    for token, n in zip((0, 1, 2, 3), (used[0], used[1], used[1], used[2])):
        assert torch.isfinite(l_p[:n, token]).all() and torch.isinf(l_p[n:, token]).all(), (token, n)
    assert_close(o, B.reference(sinks=None)[0], torch.float32, "out")


@interp_only
def test_decode_workspace_pair_and_many_splits():
    gen = torch.Generator().manual_seed(8)
    B = make_batch([(1, 40), (1, 3)], 8, 2, 32, 16, gen=gen)
    S = 16  # more splits than keys of the short sequence
    o_p = torch.empty(S, 2, 8, 32)
    l_p = torch.empty(S, 2, 8)
    ro, _ = B.reference(sinks=None)
    o = paged_decode(*B.args(), max_seqlen_q=1, num_splits=S, workspace=(o_p, l_p))
    assert_close(o, ro, torch.float16)


@interp_only
def test_per_tensor_scale_as_tensor():
    gen = torch.Generator().manual_seed(9)
    B = make_batch([(5, 30)], 4, 2, 32, 16, kv="fp8_tensor", gen=gen)
    ro, _ = B.reference()
    ks, vs = torch.tensor([B.scales["k_scale"]]), torch.tensor([B.scales["v_scale"]])
    o = paged_attention(*B.args(), max_seqlen_q=5, k_scale=ks, v_scale=vs)
    assert_close(o, ro, torch.bfloat16)


# --- launch-time validation ------------------------------------------------------------------


def _valid():
    gen = torch.Generator().manual_seed(1)
    return make_batch([(3, 20), (1, 5)], 4, 2, 32, 16, gen=gen)


def _call(B, **kw):
    args = dict(zip(("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table"), B.args()))
    args.update({k: v for k, v in kw.items() if k in args})
    opts = {k: v for k, v in kw.items() if k not in args}
    fn = paged_decode if "num_splits" in opts else paged_attention
    return fn(*args.values(), max_seqlen_q=3, **opts)


BAD = {
    "kv_dtype_mismatch": (lambda B: dict(k_cache=B.k_cache.float(), v_cache=B.v_cache.float()), "KV cache dtype"),
    "k_v_dtype_differ": (lambda B: dict(v_cache=B.v_cache.to(FP8)), "v_cache dtype"),
    "q_dtype": (lambda B: dict(q=B.q.to(torch.int32)), "q dtype"),
    "head_size_512": (lambda B: dict(q=torch.randn(4, 4, 512).half(), k_cache=torch.randn(5, 16, 2, 512).half(),
                                     v_cache=torch.randn(5, 16, 2, 512).half()), "head size 512"),
    "head_size_12": (lambda B: dict(q=torch.randn(4, 4, 12).half(), k_cache=torch.randn(5, 16, 2, 12).half(),
                                    v_cache=torch.randn(5, 16, 2, 12).half()), "head size 12"),
    "head_dim_differs": (lambda B: dict(q=torch.randn(4, 4, 64).half()), "head_dim of q"),
    "gqa_not_multiple": (lambda B: dict(q=torch.randn(4, 3, 32).half()), "not a multiple"),
    "device_mismatch": (lambda B: dict(k_cache=B.k_cache.to("meta"), v_cache=B.v_cache.to("meta")), "is on meta"),
    "block_table_too_short": (lambda B: dict(block_table=B.block_table[:, :1]), "block table too short"),
    "block_table_int64": (lambda B: dict(block_table=B.block_table.long()), "block_table must be"),
    "q_strided_head_dim": (lambda B: dict(q=torch.randn(4, 4, 64).half()[..., ::2]), "unit stride"),
    "cache_strided_head_dim": (lambda B: dict(k_cache=torch.randn(5, 16, 2, 64).half()[..., ::2],
                                              v_cache=torch.randn(5, 16, 2, 64).half()[..., ::2]), "unit stride"),
    "cu_seqlens_len": (lambda B: dict(cu_seqlens_q=B.cu_seqlens_q[:2]), "cu_seqlens_q has"),
    "sinks_dtype": (lambda B: dict(sinks=torch.randn(4).half()), "sinks must be float32"),
    "both_scale_kinds": (lambda B: dict(k_scale=1.0, k_descale=torch.ones(5, 2), v_descale=torch.ones(5, 2)), "not both"),
    "descale_shape": (lambda B: dict(k_descale=torch.ones(3, 2), v_descale=torch.ones(3, 2)), "k_descale must be"),
    "out_dtype": (lambda B: dict(out=torch.empty_like(B.q).float()), "out must match q"),
    "num_splits_zero": (lambda B: dict(num_splits=0), "num_splits"),
    "workspace_small": (lambda B: dict(num_splits=4, workspace=torch.empty(10)), "workspace too small"),
    "negative_window": (lambda B: dict(window=-1), "must be >= 0"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_launch_validation(name):
    """Bad input: a clear ValueError before any launch (runs with or without the interpreter)."""
    make, msg = BAD[name]
    B = _valid()
    with pytest.raises(ValueError, match=msg):
        _call(B, **make(B))


@pytest.mark.skipif(INTERP, reason="checks the error given without the interpreter")
def test_cpu_tensors_without_interpreter_are_refused():
    B = _valid()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _call(B)


@interp_only
@pytest.mark.parametrize("facts", [
    dict(num_q_heads=8, num_kv_heads=2, head_dim=32, has_sinks=True, softcap=20.0, layer_windows=(0, 16)),
    dict(num_q_heads=4, num_kv_heads=1, head_dim=64, kv_dtype="fp8_e4m3", kv_scale_mode="per_page", page_size=1),
    dict(num_q_heads=4, num_kv_heads=2, head_dim=32, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor", sink_tokens=4,
         window=8),
], ids=["sinks_softcap_windows", "fp8_page_mqa_page1", "fp8_tensor_streaming"])
def test_warm_launches_every_variant_the_model_can_use(facts):
    """The builder's warm-up (unified.warm) launches each of aot.launch_plan's variants, with
    inputs the launch wrappers accept for every feature the model has."""
    from atom_backend.planning import ModelFacts
    from atom_backend.unified import aot, warm

    f = ModelFacts(**facts)
    names = warm.warm(f, "sm_90a", torch.device("cpu"), max_query_tokens=2)
    assert names == [v.name for v in aot.launch_variants("sm_90a", f, max_query_tokens=2)]
    assert any(n.startswith("unified.paged_decode") for n in names) and any("paged_attention" in n for n in names)
