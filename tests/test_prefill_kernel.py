"""hip_kernels.prefill (varlen prefill over packed KV) against atom_backend.reference.

GPU tests (-m gpu) cover every must-have case of docs/design.md that applies to packed KV: sq == sk,
prefix hits (sq < sk) and sq == 1 rows inside a prefill batch, GQA ratios 1/4/8 and MQA, windows
smaller than / equal to / larger than sk, StreamingLLM sink tokens 0/1/8, per-head sink logits,
soft-cap, empty sequences, lengths on and one past a KV tile boundary, non-causal, head dims
64/128/256, bf16 and fp16, both work orders (device default and the host-sorted list), and both
kernels on Hopper: the wgmma one (forced for small windows too) and the portable mma.sync one.
CPU tests: launch validation, the host work list, and an NVRTC/clang compile of the variants.
"""

from __future__ import annotations

import pytest
import torch

from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close
from hip_kernels import prefill

# name: (seqs [(sq, sk)], hq, hk, d, kwargs)
CASES = {
    "sq_eq_sk_mha": ([(300, 300), (128, 128), (1, 1), (77, 77)], 4, 4, 128, {}),
    "prefix_hit_gqa4": ([(100, 400), (64, 1000), (129, 129), (1, 513)], 8, 2, 128, {}),
    "sq1_rows_gqa8": ([(1, 1), (1, 50), (200, 200), (1, 1000), (17, 300)], 8, 1, 64, {}),
    # q_per_kv 3: the Hopper d64 tile (192 rows) packs 3 heads, so a warpgroup's 64 rows are not
    # whole tokens and O leaves by 16-byte stores instead of TMA stores.
    "gqa3_d64": ([(300, 300), (50, 200), (1, 64), (64, 64)], 12, 4, 64, {}),
    "tile_edges_d64": ([(64, 64), (65, 65), (128, 128), (129, 129), (63, 127), (1, 64), (1, 65)], 4, 2, 64, {}),
    "empty_seqs": ([(0, 0), (50, 50), (0, 10), (30, 100), (0, 0)], 4, 4, 64, {}),
    "window_lt_sk": ([(300, 300), (50, 400), (1, 700)], 8, 2, 128, {"window": 64}),
    "window_large_tile": ([(3000, 3000), (100, 2000)], 4, 2, 64, {"window": 1500, "sink_tokens": 4}),
    "window_eq_sk": ([(256, 256), (100, 256), (1, 256)], 4, 1, 64, {"window": 256}),
    "window_gt_sk": ([(200, 200), (30, 300)], 4, 2, 128, {"window": 1000}),
    "window_int32_max": ([(200, 200), (30, 300)], 4, 2, 128, {"window": 2**31 - 1, "sink_tokens": 4}),
    "sink_tokens_1": ([(300, 300), (40, 500)], 4, 2, 64, {"window": 64, "sink_tokens": 1}),
    "sink_tokens_8": ([(300, 300), (40, 500), (1, 129)], 4, 2, 128, {"window": 100, "sink_tokens": 8}),
    "sink_tokens_no_window": ([(200, 200)], 4, 2, 64, {"sink_tokens": 8}),
    "sinks_gptoss": ([(300, 300), (64, 256), (1, 80)], 16, 2, 64, {"sinks": True, "window": 128}),
    "sinks_full": ([(250, 250), (10, 333)], 8, 1, 128, {"sinks": True}),
    "softcap": ([(200, 200), (50, 300), (1, 99)], 4, 2, 128, {"softcap": 30.0}),
    "softcap_window_sinks": ([(200, 200), (3, 250)], 8, 2, 64, {"softcap": 20.0, "window": 48, "sinks": True}),
    # logits ~ N(0, 64) against a cap of 2: tanh saturated, not the near-linear part the caps above see
    "softcap_saturated": ([(200, 200), (40, 300), (1, 77)], 8, 2, 64, {"softcap": 2.0, "scale": 1.0, "sinks": True}),
    "non_causal": ([(100, 100), (40, 300), (1, 70)], 4, 2, 128, {"causal": False}),
    "non_causal_window": ([(150, 150), (20, 200)], 4, 4, 64, {"causal": False, "window": 50}),
    "scale": ([(130, 200)], 4, 2, 64, {"scale": 0.3}),
    "d256": ([(150, 150), (40, 200), (1, 33)], 4, 2, 256, {}),
    "d256_window_sinks": ([(150, 150), (1, 99)], 4, 1, 256, {"window": 40, "sinks": True}),
}


def make_inputs(seqs, hq, hk, d, dtype, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tq = sum(sq for sq, _ in seqs)
    tk = sum(sk for _, sk in seqs)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tk, hk, d, generator=g).to(dtype)
    v = torch.randn(tk, hk, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + [sum(s for s, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(s for _, s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    sinks = torch.randn(hq, generator=g, dtype=torch.float32)
    return q, k, v, cu_q, cu_k, sinks


def _run_case(seqs, hq, hk, d, kw, dtype, use_work, seed=0):
    q, k, v, cu_q, cu_k, sinks = make_inputs(seqs, hq, hk, d, dtype, seed)
    kw = dict(kw)
    use_sinks = kw.pop("sinks", False)
    o_ref, lse_ref = ref.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k,
                                          sinks=sinks if use_sinks else None, **kw)
    dev = "cuda"
    qd, kd, vd = q.to(dev), k.to(dev), v.to(dev)
    out = torch.full_like(qd, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device=dev)
    work = None
    if use_work:
        work = prefill.work_items([a for a, _ in seqs], [b for _, b in seqs], head_dim=d,
                                  causal=kw.get("causal", True), window=kw.get("window", 0),
                                  sink_tokens=kw.get("sink_tokens", 0)).to(dev)
    prefill.varlen_attention(qd, kd, vd, cu_q.to(dev), cu_k.to(dev),
                             max_seqlen_q=max(a for a, _ in seqs), max_seqlen_k=max(b for _, b in seqs),
                             sinks=sinks.to(dev) if use_sinks else None, out=out, lse_out=lse, work=work, **kw)
    torch.cuda.synchronize()
    assert_close(out.float().cpu(), o_ref, dtype, "out")
    assert_lse_close(lse.cpu(), lse_ref, dtype, "lse")


def _use_tiles(monkeypatch, portable=None, hopper=None):
    """The device arch's tile tables for this test (as an arch's tuning table installs them,
    prefill.use_tuned): config_for, work_items and varlen_attention take them."""
    arch = prefill._default_arch()
    monkeypatch.setitem(prefill._tuned, arch, (portable or prefill.PORTABLE_TILES, hopper or prefill.HOPPER_TILES))


def _force_path(path, monkeypatch):
    """'wgmma': the Hopper kernel wherever the device has it (small windows take its full tile);
    'portable': the mma.sync / MFMA kernel everywhere."""
    h = prefill.HOPPER_TILES
    if path == "wgmma":
        _use_tiles(monkeypatch, hopper=h.replace({("small", d): c for d, c in h.of_kind("full").items()}))
    else:
        _use_tiles(monkeypatch, hopper=prefill.TileTable(h.kernel, {}))


def _is_wgmma(d, window=0) -> bool:
    return prefill.config_for(d, window, prefill._default_arch()).wgmma


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_vs_reference(name, dtype, path, monkeypatch):
    seqs, hq, hk, d, kw = CASES[name]
    _force_path(path, monkeypatch)
    if path == "wgmma" and not _is_wgmma(d, kw.get("window", 0)):
        pytest.skip(f"no wgmma kernel for d={d} on this device")
    _run_case(seqs, hq, hk, d, kw, dtype, use_work=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "sink_tokens_8", "softcap", "non_causal", "d256",
                                  "d256_window_sinks", "window_lt_sk"])
def test_small_shared_memory_tiles(name, monkeypatch):
    # The tiles gfx942 gets for d128 / d256 ("small_smem": 64 KB of LDS), on this device's portable body.
    seqs, hq, hk, d, kw = CASES[name]
    t = prefill.PORTABLE_TILES
    small = t.of_kind("small_smem")
    _use_tiles(monkeypatch, portable=t.replace({(k, d): c for d, c in small.items() for k in ("full", "small")}),
               hopper=prefill.TileTable(prefill.HOPPER_TILES.kernel, {}))
    assert prefill.config_for(d, kw.get("window", 0), prefill._default_arch()) == small[d]
    _run_case(seqs, hq, hk, d, kw, torch.bfloat16, use_work=True, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(8, 128, 2, True), (8, 128, 2, False), (8, 64, 2, True), (8, 64, 3, True),
                                 (12, 128, 2, True), (12, 64, 3, True), (4, 64, 3, False), (4, 64, 2, False)],
                         ids=lambda c: "w{}n{}s{}".format(*c[:3]) + ("" if c[3] else "-nopingpong"))
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "sq1_rows_gqa8", "sink_tokens_8", "softcap_window_sinks",
                                  "empty_seqs", "tile_edges_d64", "window_large_tile"])
def test_wgmma_tile_configs(name, cfg, monkeypatch):
    # Every Hopper tile shape that bench --sweep times stays correct (K/V tiles of 64 or 128 keys,
    # rings of 2-3 stages, 1 (two CTAs per SM), 2 or 3 consumer warpgroups, with and without
    # ping-pong turns).
    seqs, hq, hk, d, kw = CASES[name]
    c = prefill.Config(*cfg[:3], wgmma=True, pingpong=cfg[3])
    if c.smem_bytes(d) > 227 * 1024 or c.ctas_per_sm * (c.smem_bytes(d) + 1024) > 228 * 1024:
        pytest.skip(f"{c} needs {c.smem_bytes(d)} bytes of shared memory per CTA at d={d}")
    _use_tiles(monkeypatch, hopper=prefill.HOPPER_TILES.replace({("full", d): c, ("small", d): c}))
    if not _is_wgmma(d, kw.get("window", 0)):
        pytest.skip("no wgmma on this device")
    _run_case(seqs, hq, hk, d, kw, torch.bfloat16, use_work=True, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "sink_tokens_8", "empty_seqs", "sinks_gptoss"])
def test_host_work_list(name, path, monkeypatch):
    seqs, hq, hk, d, kw = CASES[name]
    _force_path(path, monkeypatch)
    _run_case(seqs, hq, hk, d, kw, torch.bfloat16, use_work=True, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
def test_long_prefix_and_fresh_inputs(path, monkeypatch):
    # Several hundred KV tiles per CTA and a fresh seed: the ring's stage reuse over a long walk.
    _force_path(path, monkeypatch)
    _run_case([(256, 4096), (1000, 1000)], 8, 1, 128, {}, torch.bfloat16, use_work=False, seed=7)


def _direction_case(seqs, d, seed):
    """A generator, a unit direction u of the head dim, and the batch's query / key token counts."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    return g, u, sum(a for a, _ in seqs), sum(b for _, b in seqs)


def _check_bf16(q, k, v, seqs):
    """The kernel on bf16 q, k, v of these (sq, sk) requests against the reference (out, lse poisoned)."""
    cu_q = torch.tensor([0] + [a for a, _ in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    o_ref, lse_ref = ref.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k)
    out = torch.full_like(q, float("nan"), device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    prefill.varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), max_seqlen_q=max(a for a, _ in seqs),
                             max_seqlen_k=max(b for _, b in seqs), out=out, lse_out=lse)
    torch.cuda.synchronize()
    assert_close(out.float().cpu(), o_ref, torch.bfloat16, "out")
    assert_lse_close(lse.cpu(), lse_ref, torch.bfloat16, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
def test_row_max_that_keeps_growing(path, monkeypatch):
    """Logits that rise along the keys (0.02 per key, +20 at key 600): a row's max grows a little on
    most tiles and by a lot at one. The Hopper kernel moves its reference max only when the new one
    is more than 2^8 in P past it, so P > 1 between moves, and the big step must rescale O."""
    _force_path(path, monkeypatch)
    seqs, hq, hk, d = [(300, 1000), (64, 64)], 4, 2, 128
    g, u, tq, tk = _direction_case(seqs, d, seed=3)
    j = torch.cat([torch.arange(b, dtype=torch.float32) for _, b in seqs])
    coef = 0.02 * j + 20.0 * (j >= 600)
    q = (u * d ** 0.5 + 0.1 * torch.randn(tq, hq, d, generator=g)).to(torch.bfloat16)
    k = (coef[:, None, None] * u + 0.1 * torch.randn(tk, hk, d, generator=g)).to(torch.bfloat16)
    v = torch.randn(tk, hk, d, generator=g).to(torch.bfloat16)
    _check_bf16(q, k, v, seqs)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
@pytest.mark.parametrize("d,hq,hk", [(128, 8, 2), (64, 16, 2)])
def test_row_max_jumps_in_some_rows(path, d, hq, hk, monkeypatch):
    """Two keys far along a direction u that only every third query row points to: those rows'
    maxes jump by ~40 (log2 units) at a late tile, the other rows' do not. The Hopper kernel skips
    the rows' maxes when a warp vote says no row may move its reference; here some warps' rows
    must move it and their neighbours' must not."""
    _force_path(path, monkeypatch)
    seqs = [(200, 900), (130, 130)]
    g, u, tq, tk = _direction_case(seqs, d, seed=5)
    q = torch.randn(tq, hq, d, generator=g)
    q[0::3] = q[0::3] * 0.1 + u * d ** 0.5
    k = torch.randn(tk, hk, d, generator=g)
    k[[450, 820, 1000]] = 30.0 * u
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    v = torch.randn(tk, hk, d, generator=g).to(torch.bfloat16)
    _check_bf16(q, k, v, seqs)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "portable"])
@pytest.mark.parametrize("d,hq,hk", [(128, 8, 2), (64, 16, 2)])
def test_last_request_ends_at_allocation_end(path, d, hq, hk, monkeypatch):
    # q, k, v, out and lse each exactly as long as the batch, so the last request's rows end at
    # the end of their allocation (run under `compute-sanitizer --tool memcheck` with
    # PYTORCH_NO_CUDA_MEMORY_CACHING=1 on the device: every tensor its own allocation). The TMA
    # boxes of the last tiles reach past the end: those rows must read as zero and never be
    # stored. Out and lse are also checked through a poisoned margin in a larger buffer.
    _force_path(path, monkeypatch)
    seqs = [(70, 70), (33, 200), (130, 130)]
    q, k, v, cu_q, cu_k, sinks = make_inputs(seqs, hq, hk, d, torch.bfloat16, seed=11)
    o_ref, lse_ref = ref.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, sinks=sinks)
    dev = "cuda"
    qd, kd, vd, sd = q.to(dev), k.to(dev), v.to(dev), sinks.to(dev)
    cq, ck = cu_q.to(dev), cu_k.to(dev)
    kw = dict(max_seqlen_q=130, max_seqlen_k=200, sinks=sd)
    out = torch.full_like(qd, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device=dev)
    prefill.varlen_attention(qd, kd, vd, cq, ck, out=out, lse_out=lse, **kw)
    margin = 64
    out_big = torch.full((q.shape[0] + margin, hq, d), float("nan"), dtype=qd.dtype, device=dev)
    lse_big = torch.full((q.shape[0] + margin, hq), float("nan"), dtype=torch.float32, device=dev)
    q_big = torch.cat([qd, torch.randn(margin, hq, d, device=dev, dtype=qd.dtype)])
    prefill.varlen_attention(q_big, kd, vd, cq, ck, out=out_big, lse_out=lse_big, **kw)
    torch.cuda.synchronize()
    for o, l in ((out, lse), (out_big[: q.shape[0]], lse_big[: q.shape[0]])):
        assert_close(o.float().cpu(), o_ref, torch.bfloat16, "out")
        assert_lse_close(l.cpu(), lse_ref, torch.bfloat16, "lse")
    assert torch.isnan(out_big[q.shape[0]:]).all() and torch.isnan(lse_big[q.shape[0]:]).all(), \
        "rows past the batch were written"


@pytest.mark.gpu
def test_strided_qkv_views():
    # q, k, v as views of one fused qkv projection (vLLM's layout): row strides > hq * d.
    seqs, hq, hk, d = [(90, 90), (33, 33)], 8, 2, 64
    tq = sum(s for s, _ in seqs)
    qkv = torch.randn(tq, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, : hq * d].view(tq, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tq, hk, d)
    v = qkv[:, (hq + hk) * d :].view(tq, hk, d)
    cu = torch.tensor([0, 90, 123], dtype=torch.int32, device="cuda")
    o_ref, _ = ref.varlen_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu.cpu(), cu.cpu())
    out = prefill.varlen_attention(q, k, v, cu, cu, max_seqlen_q=90, max_seqlen_k=90)
    assert_close(out.float().cpu(), o_ref, torch.bfloat16)
    # out as a view with a row stride of hq + 2 heads (the Hopper kernel's TMA stores of O follow
    # its strides): the two heads between rows stay as they were.
    buf = torch.full((tq, hq + 2, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    prefill.varlen_attention(q, k, v, cu, cu, max_seqlen_q=90, max_seqlen_k=90, out=buf[:, 1 : hq + 1])
    assert_close(buf[:, 1 : hq + 1].float().cpu(), o_ref, torch.bfloat16)
    assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[:, hq + 1]).all(), "O written outside its view"


# --- CPU ---------------------------------------------------------------------------------------


def _cpu_args(hq=8, hk=2, d=128, dtype=torch.bfloat16, tq=10, tk=20):
    q = torch.randn(tq, hq, d).to(dtype)
    k = torch.randn(tk, hk, d).to(dtype)
    v = torch.randn(tk, hk, d).to(dtype)
    cu_q = torch.tensor([0, 4, tq], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, tk], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(
    "over, match",
    [
        ({"dtype": torch.float32}, "dtype"),
        ({"d": 96}, "head_dim 96"),
        ({"hq": 6, "hk": 4}, "multiple"),
        ({"k": "fp16"}, "differs"),
        ({"cu_q": "int64"}, "int32"),
        ({"window": -1}, "window"),
        ({"softcap": -1.0}, "softcap"),
        ({"scale": 0.0}, "scale"),
        ({"sinks": "bad"}, "sinks"),
        ({"max_seqlen_q": 1.5}, "max_seqlen_q"),
        ({"q": "strided"}, "contiguous"),
        ({"work": "bad"}, "work"),
    ],
)
def test_launch_validation(over, match):
    q, k, v, cu_q, cu_k = _cpu_args(hq=over.get("hq", 8), hk=over.get("hk", 2), d=over.get("d", 128),
                                    dtype=over.get("dtype", torch.bfloat16))
    kw = dict(max_seqlen_q=6, max_seqlen_k=12)
    if over.get("k") == "fp16":
        k = k.half()
    if over.get("cu_q") == "int64":
        cu_q = cu_q.long()
    if over.get("q") == "strided":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    for key in ("window", "softcap", "scale", "max_seqlen_q"):
        if key in over:
            kw[key] = over[key]
    if over.get("sinks") == "bad":
        kw["sinks"] = torch.zeros(3)
    if over.get("work") == "bad":
        kw["work"] = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        prefill.varlen_attention(q, k, v, cu_q, cu_k, **kw)


def test_work_items_longest_first_and_complete():
    sq, sk = [300, 1, 0, 129], [300, 900, 0, 1000]
    w = prefill.work_items(sq, sk, head_dim=128)
    bm = prefill.PORTABLE_TILES.get("full", 128).block_m
    assert w.dtype == torch.int32 and w.shape[1] == 2
    expect = {(b, t) for b, n in enumerate(sq) for t in range(-(-n // bm))}
    assert {tuple(x) for x in w.tolist()} == expect
    # the prefix-hit request (129 queries over 1000 keys) sees the most keys: it comes first
    assert w[0].tolist()[0] == 3
    # the causal request's last tile before its first
    order = [t for b, t in w.tolist() if b == 0]
    assert order == sorted(order, reverse=True)


def test_variants_cover_every_launch():
    """Every launch's variant is one `variants(arch)` lists (with the arch's tuned tiles when a
    build or a builder applied its tuning table in this process)."""
    for arch in (None, "sm_80", "sm_90a", "gfx942", "gfx950"):
        names = {v.name for v in prefill.variants(arch)}
        for d in prefill.HEAD_DIMS:
            for window in (0, 128, prefill.SMALL_WINDOW, prefill.SMALL_WINDOW + 1):
                for code in (0, 1):
                    for sc in (False, True):
                        assert prefill._variant(d, code, sc, prefill.config_for(d, window, arch)).name in names
                        if prefill.fp8_compute_available(d, arch):
                            for name, mode in prefill.KV_FP8_MODES.items():
                                cfg = prefill.config_for(d, window, arch, fp8=name)
                                assert prefill._variant(d, code, sc, cfg, mode).name in names
    # 36 bf16/fp16 bodies + 8 small-shared-memory ones (d128, d256) + the FP8-compute ones (2 dtypes x
    # 2 soft-cap x 3 scale modes): the Hopper kernel's for d128, the portable body's for d64 and d128
    assert len(names) == len(prefill.variants()) == 36 + 8 + 12 + 24


def test_every_tile_fits_the_shared_memory_of_its_arch():
    """gfx942 gives a workgroup 64 KB of LDS: the portable d128 / d256 tiles (112-128 KB) may not
    launch there; config_for hands out the small-shared-memory tiles instead."""
    from hip_kernels.runtime import max_dynamic_smem

    for arch in ("sm_80", "sm_90a", "gfx942", "gfx950"):
        for d in prefill.HEAD_DIMS:
            for window in (0, 128, prefill.SMALL_WINDOW + 1):
                for fp8 in (None, *prefill.KV_FP8_MODES):
                    if fp8 and not prefill.fp8_compute_available(d, arch):
                        continue
                    cfg = prefill.config_for(d, window, arch, fp8=fp8)
                    mode = prefill.KV_FP8_MODES[fp8] if fp8 else 0
                    assert cfg.smem_bytes(d, mode) <= max_dynamic_smem(arch), (arch, d, window, cfg, mode)
    assert prefill.config_for(128, 0, "gfx942") == prefill.PORTABLE_TILES.get("small_smem", 128)
    assert prefill.config_for(128, 0, "gfx950") == prefill.PORTABLE_TILES.get("full", 128)  # 160 KB of LDS


def test_hopper_kernel_only_on_sm90a_and_work_lists_follow_its_tile():
    for d in (64, 128):
        for w in (0, 128, prefill.SMALL_WINDOW + 1):
            assert prefill.config_for(d, w, "sm_90a").wgmma
            assert not prefill.config_for(d, w, "sm_80").wgmma and not prefill.config_for(d, w, "gfx942").wgmma
        # the host work list is cut in the BLOCK_M of the device it is built for
        for arch in ("sm_90a", "sm_80"):
            bm = prefill.config_for(d, 0, arch).block_m
            items = prefill.work_items([1000], [1000], head_dim=d, arch=arch)
            assert items.shape[0] == -(-1000 // bm) and sorted(items[:, 1].tolist()) == list(range(-(-1000 // bm)))
    assert not prefill.config_for(256, 0, "sm_90a").wgmma
    for (kind, d), c in prefill.HOPPER_TILES.entries.items():
        mode = prefill.KV_FP8_MODES.get(kind, 0)
        assert c.smem_bytes(d, mode) <= 227 * 1024 and c.ctas_per_sm * (c.smem_bytes(d, mode) + 1024) <= 228 * 1024


def test_no_keys_at_all_gives_zero_rows_without_a_launch():
    # Every request has sk = 0 (a packed K/V of no rows: nothing to build a tensor map from):
    # every row is fully masked, o = 0 and lse = -inf (docs/design.md), decided on the host.
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill.varlen_attention(q, k, k.clone(), cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=0, causal=False,
                                        out=out, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()


def test_gqa_pack_and_request_order():
    c = prefill.HOPPER_TILES.get("full", 128)
    assert prefill.gqa_pack(c, 4) == 4 and prefill.gqa_pack(c, 1) == 1
    assert prefill.gqa_pack(c, 4, pack_gqa=False) == 1  # a bench's comparison (Build.pack_gqa)
    assert prefill.gqa_pack(c, 3) == 1  # BLOCK_M 128 is not a multiple of 3: no packing
    assert prefill.gqa_pack(prefill.PORTABLE_TILES.get("full", 128), 4) == 1  # the portable kernel never packs
    # request order: each request's tiles together, requests by their longest tile
    items = prefill.work_items([256, 512, 128], [256, 4096, 128], head_dim=128, arch="sm_80").tolist()
    assert [b for b, _ in items] == [1, 1, 1, 1, 0, 0, 2]
    assert [t for b, t in items if b == 1] == [3, 2, 1, 0]
    # a bench's cost order: longest tiles first, whatever their request; its tile's BLOCK_M
    items = prefill.work_items([256, 512, 128], [256, 4096, 128], head_dim=128, arch="sm_80", order="cost").tolist()
    assert items[0] == [1, 3] and sorted(map(tuple, items)) == sorted((b, t) for b, n in enumerate([256, 512, 128])
                                                                      for t in range(-(-n // 128)))
    assert len(prefill.work_items([256], [256], head_dim=128, tile=prefill.Config(4, 64, 2))) == 256 // 64
    with pytest.raises(ValueError, match="order"):
        prefill.work_items([1], [1], head_dim=128, order="random")


def _compile_or_skip(arch, variant):
    from hip_kernels import runtime

    try:
        return runtime.compile_variant(variant, arch)
    except runtime.ToolchainMissingError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("wgmma", [False, True], ids=["portable", "wgmma"])
@pytest.mark.parametrize("arch", ["sm_90a", "gfx942"])
def test_compiles_without_spills(arch, wgmma, tmp_path, monkeypatch):
    from hip_kernels import runtime

    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    c = _compile_or_skip(arch, prefill._variant(128, 0, False, prefill.HOPPER_TILES.get("full", 128) if wgmma else None))
    assert c.binary[:4] == b"\x7fELF"
    use = runtime.resource_usage(c)
    if arch.startswith("sm_"):
        assert use.get("spill_stores", 0) == 0 and use.get("spill_loads", 0) == 0, use
        # ptxas serialises wgmma it cannot prove warpgroup-uniform (warning C7519/C7520...)
        assert "serialized" not in c.log, c.log
    else:
        assert use.get("vgpr_spills", 0) == 0, use


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(4, 32, 3, 2), (4, 64, 2, 2), (8, 64, 2, 2), (8, 64, 3, 1), (4, 64, 3, 1)],
                         ids=lambda c: "w{}n{}s{}m{}".format(*c))
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "sq1_rows_gqa8", "sink_tokens_8", "softcap_window_sinks", "empty_seqs"])
def test_other_tile_configs(name, cfg, monkeypatch):
    # Tuning knobs stay correct: two 16-row tiles per warp, Q re-read from shared memory, etc.
    seqs, hq, hk, d, kw = CASES[name]
    c = prefill.Config(*cfg)
    _use_tiles(monkeypatch, portable=prefill.PORTABLE_TILES.replace({("full", d): c, ("small", d): c}),
               hopper=prefill.TileTable(prefill.HOPPER_TILES.kernel, {}))
    _run_case(seqs, hq, hk, d, kw, torch.bfloat16, use_work=True, seed=3)


def test_tile_tables_are_declared_immutable_and_checked():
    """One declared table per kernel, read-only, each tile checked against the kernel's static
    requirements when a table is made; no module global selects tiles, packing, schedule or order."""
    import dataclasses

    for t in (prefill.PORTABLE_TILES, prefill.HOPPER_TILES):
        with pytest.raises(TypeError):
            t.entries[("full", 128)] = prefill.Config(4, 64, 2)
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.kernel = "x"
    C = prefill.Config
    for kernel, kind, d, bad in (
            ("portable", "full", 128, C(4, 24, 2)),  # BLOCK_N not a multiple of 16
            ("portable", "full", 128, C(3, 64, 2)),  # copies do not spread over 3 warps
            ("portable", "full", 256, C(8, 128, 4)),  # shared memory
            ("portable", "full", 64, C(4, 64, 2, wgmma=True)),  # a Hopper tile
            ("portable", "wide", 64, C(4, 64, 2)),  # no such kind
            ("hopper", "full", 128, C(6, 128, 2, wgmma=True)),  # not whole warpgroups
            ("hopper", "full", 128, C(16, 128, 2, wgmma=True)),  # 4 consumer warpgroups
            ("hopper", "full", 128, C(8, 96, 2, wgmma=True)),  # 96 keys: FP8 only
            ("hopper", "full", 128, C(8, 128, 2, wgmma=True, ctas=3)),  # several CTAs: one warpgroup
            ("hopper", "per_page", 64, C(8, 128, 2, wgmma=True)),  # FP8: d128
            ("hopper", "per_page", 128, C(8, 128, 3, wgmma=True, o_promote=8)),  # promotion: one Q stage
            ("hopper", "full", 128, C(8, 128, 4, wgmma=True, q_stages=2))):  # shared memory
        table = prefill.PORTABLE_TILES if kernel == "portable" else prefill.HOPPER_TILES
        with pytest.raises(ValueError):
            table.replace({(kind, d): bad})
    for name in ("CONFIGS", "WINDOW_CONFIGS", "SMALL_SMEM_CONFIGS", "WGMMA_CONFIGS", "WGMMA_WINDOW_CONFIGS",
                 "FP8_CONFIGS", "FP8_TENSOR_CONFIGS", "FP8_KEY_CONFIGS", "PORTABLE_FP8_CONFIGS", "PACK_GQA",
                 "SCHEDULER", "WORK_ORDER"):
        assert not hasattr(prefill, name), name
    assert {f.name for f in dataclasses.fields(prefill.Config)}.isdisjoint({"exp_poly", "extra"})


def test_build_is_explicit():
    """A bench's build: its tile, source, defines, packing and scheduler reach the variant and the
    launch only through varlen_attention's `build` argument."""
    c = prefill.HOPPER_TILES.get("full", 128)
    b = prefill.Build(c)
    assert b.variant(128, 0, False) == prefill._variant(128, 0, False, c)
    v = prefill.Build(c, source="/tmp/x.hip", defines={"X": 1}).variant(128, 0, False)
    assert v.source == "/tmp/x.hip" and ("X", "1") in v.defines and v.kernel == prefill.HOPPER_KERNEL
    with pytest.raises(ValueError, match="scheduler"):
        prefill.Build(c, scheduler="greedy")
