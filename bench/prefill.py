"""Varlen prefill: hip_kernels.prefill vs torch SDPA (flash, cuDNN), FlexAttention and the Triton
unified path, on the same shapes in one process (docs/design.md "Performance accounting").

    PYTHONPATH=. python -m bench.prefill [--quick] [--no-flex] [--json PATH]

TFLOP/s = 4 * visible (i, j) pairs * head_dim * num_q_heads / time, for every implementation
(the dense peers are credited with the same causal pair count, not the full square).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from atom_backend.planning import cost
from bench.common import bench_ms, device_name, rotated, tflops
from hip_kernels import prefill


def visible_pairs(sq: int, sk: int, window: int = 0) -> int:
    """Visible (query, key) pairs of a causal request of sq new queries over sk keys (docs/design.md)."""
    return int(cost.visible_pairs(sq, sk - sq, window))


def make(seqs, hq, hk, d, dtype=torch.bfloat16, device="cuda"):
    tq, tk = sum(a for a, _ in seqs), sum(b for _, b in seqs)
    q = torch.randn(tq, hq, d, dtype=dtype, device=device)
    k = torch.randn(tk, hk, d, dtype=dtype, device=device)
    v = torch.randn(tk, hk, d, dtype=dtype, device=device)
    cq, ck = [0], [0]
    for a, b in seqs:
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    cu_q = torch.tensor(cq, dtype=torch.int32, device=device)
    cu_k = torch.tensor(ck, dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def kernel_options(kw: dict, hq: int) -> dict:
    """A shape's kernel options (SHAPES' kw), `sinks: True` made a float32 [hq] tensor."""
    okw = dict(kw)
    if okw.pop("sinks", False):
        okw["sinks"] = torch.randn(hq, dtype=torch.float32, device="cuda")
    return okw


def run_ours(seqs, q, k, v, cu_q, cu_k, *, use_work=True, build=None, order="request", **kw):
    """Our kernel on one shape: the tile serving uses, or a bench's explicit build (prefill.Build); work
    items in `order` (prefill.work_items)."""
    d = q.shape[2]
    work = None
    if use_work:
        work = prefill.work_items([a for a, _ in seqs], [b for _, b in seqs], head_dim=d,
                                  causal=kw.get("causal", True), window=kw.get("window", 0),
                                  sink_tokens=kw.get("sink_tokens", 0), tile=build.config if build else None,
                                  order=order).to(q.device)
    out = torch.empty_like(q)
    mq, mk = max(a for a, _ in seqs), max(b for _, b in seqs)
    fn = lambda: prefill.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=mq, max_seqlen_k=mk, out=out,
                                          work=work, build=build, **kw)
    return fn


def run_sdpa(seqs, q, k, v, backend):
    """Dense equivalent: equal-length batch [B, H, S, D], is_causal (top-left == bottom-right for sq == sk)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    (sq, sk), B = seqs[0], len(seqs)
    assert all(s == seqs[0] for s in seqs) and sq == sk
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    qd = q.view(B, sq, hq, d).transpose(1, 2)
    kd = k.view(B, sk, hk, d).transpose(1, 2)
    vd = v.view(B, sk, hk, d).transpose(1, 2)
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def gqa():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa
    except Exception:
        ke = kd.repeat_interleave(hq // hk, dim=1)
        ve = vd.repeat_interleave(hq // hk, dim=1)

        def expanded():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qd, ke, ve, is_causal=True)

        expanded()
        return expanded


def run_flex(seqs, q, k, v, sinks_free=True, softcap=0.0):
    from torch.nn.attention.flex_attention import create_block_mask

    from bench.common import compiled_flex

    (sq, sk), B = seqs[0], len(seqs)
    assert all(s == seqs[0] for s in seqs)
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    off = sk - sq
    qd = q.view(B, sq, hq, d).transpose(1, 2)
    kd = k.view(B, sk, hk, d).transpose(1, 2)
    vd = v.view(B, sk, hk, d).transpose(1, 2)

    def causal(b, h, qi, ki):
        return ki <= qi + off

    def capped(score, b, h, qi, ki):  # docs/design.md's soft-cap, as Gemma-2 runs it on FlexAttention
        return softcap * torch.tanh(score / softcap)

    bm = create_block_mask(causal, None, None, sq, sk, device=q.device)
    f = compiled_flex()
    mod = capped if softcap else None
    fn = lambda: f(qd, kd, vd, score_mod=mod, block_mask=bm, enable_gqa=hq != hk)
    fn()
    return fn


def run_unified(seqs, q, k, v, cu_q, **kw):
    from atom_backend import unified

    bs = 16
    assert all(b % bs == 0 for _, b in seqs)
    hk, d = k.shape[1], k.shape[2]
    k_cache = k.view(-1, bs, hk, d)
    v_cache = v.view(-1, bs, hk, d)
    nb = max(b for _, b in seqs) // bs
    bt = torch.zeros(len(seqs), nb, dtype=torch.int32)
    start = 0
    for i, (_, b) in enumerate(seqs):
        bt[i, : b // bs] = torch.arange(start, start + b // bs, dtype=torch.int32)
        start += b // bs
    bt = bt.to(q.device)
    seq_lens = torch.tensor([b for _, b in seqs], dtype=torch.int32, device=q.device)
    mq = max(a for a, _ in seqs)
    out = torch.empty_like(q)
    fn = lambda: unified.paged_attention(q, k_cache, v_cache, cu_q, seq_lens, bt, max_seqlen_q=mq, out=out,
                                         max_seqlen_k=max(b for _, b in seqs), **kw)
    fn()
    return fn


def fp8_paged(k, v, seqs, page_size=16, per_page=True, tensor_scale=1.0 / 64):
    """k, v quantized into a permuted e4m3 paged cache (scales per page per head, or per tensor:
    tensor_scale, whose 448 multiple must hold every value): (k_cache, v_cache, block_table,
    cu_seqlens_k, scale kwargs)."""
    hk, d = k.shape[1], k.shape[2]
    dev = k.device
    fp8 = torch.float8_e4m3fn
    need = [-(-b // page_size) for _, b in seqs]
    nb = sum(need)
    perm = torch.randperm(nb, device=dev)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=dev)
    k_cache = torch.zeros(nb, page_size, hk, d, dtype=fp8, device=dev)
    v_cache = torch.zeros_like(k_cache)
    kd = torch.empty(nb, hk, device=dev)
    vd = torch.empty(nb, hk, device=dev)
    at, t0 = 0, 0
    for i, (_, b) in enumerate(seqs):
        pages = perm[at: at + need[i]]
        table[i, : need[i]] = pages.to(torch.int32)
        for src, cache, desc in ((k, k_cache, kd), (v, v_cache, vd)):
            x = torch.zeros(need[i] * page_size, hk, d, device=dev)
            x[:b] = src[t0: t0 + b].float()
            x = x.view(need[i], page_size, hk, d)
            s = (x.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12) if per_page else None
            if s is None:
                s = torch.full((need[i], hk), tensor_scale, device=dev)  # randn fits 448 / 64 = 7 sigma
            cache[pages] = (x / s[:, None, :, None]).to(fp8)
            desc[pages] = s
        at += need[i]
        t0 += b
    cu_k = torch.tensor([0] + [sum(b for _, b in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32, device=dev)
    scales = {"k_descale": kd, "v_descale": vd} if per_page else {"k_scale": tensor_scale, "v_scale": tensor_scale}
    return k_cache, v_cache, table, cu_k, scales


def run_fp8(seqs, q, cache, *, with_gather: bool, build=None, **kw):
    """FP8 compute: (gather_kv_fp8 when with_gather) + the FP8 kernel, Q quantized inside; kw: the
    kernel's options (softcap); build: a bench's explicit build of the FP8 kernel (prefill.Build, or a
    function of the pack's scale mode that returns one)."""
    from hip_kernels import gather

    k_cache, v_cache, table, cu_k, scales = cache
    sk = [b for _, b in seqs]
    cu_kp_h = gather.fp8_padded_starts(sk)
    cu_kp = torch.tensor(cu_kp_h, dtype=torch.int32, device=q.device)
    pack = lambda: gather.gather_kv_fp8(k_cache, v_cache, cu_k, cu_kp, cu_kp_h[-1], block_table=table,
                                        max_seqlen_k=max(sk), **scales)
    packed = pack()
    cu_q = torch.tensor([0] + [sum(a for a, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                        device=q.device)
    if callable(build):
        build = build(packed.scale)
    work = prefill.work_items([a for a, _ in seqs], sk, head_dim=q.shape[2], fp8=packed.scale,
                              tile=build.config if build else None).to(q.device)
    out = torch.empty_like(q)
    mq, mk = max(a for a, _ in seqs), max(sk)
    attend = lambda p: prefill.varlen_attention(q, p, None, cu_q, cu_k, max_seqlen_q=mq, max_seqlen_k=mk, out=out,
                                                work=work, build=build, **kw)
    if with_gather:
        return lambda: attend(pack())
    return lambda: attend(packed)


def run_dequant(seqs, q, cache):
    """Today's FP8-KV prefill: the dequantising gather to bf16 + the bf16 kernel."""
    from hip_kernels import gather

    k_cache, v_cache, table, cu_k, scales = cache
    sk = [b for _, b in seqs]
    cu_q = torch.tensor([0] + [sum(a for a, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                        device=q.device)
    work = prefill.work_items([a for a, _ in seqs], sk, head_dim=q.shape[2]).to(q.device)
    out = torch.empty_like(q)
    mq, mk = max(a for a, _ in seqs), max(sk)

    def fn():
        k, v = gather.gather_kv(k_cache, v_cache, cu_k, sum(sk), block_table=table, out_dtype=q.dtype, **scales)
        return prefill.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=mq, max_seqlen_k=mk, out=out, work=work)

    return fn


def _dequant_torch(cache, table, seqs, scales, which):
    """Packed float32 [sum sk, H, D] of one fp8_paged cache (torch, for the reference)."""
    out = []
    for i, (_, b) in enumerate(seqs):
        pages = table[i, : -(-b // cache.shape[1])].long()
        x = cache[pages].float()
        if f"{which}_descale" in scales:
            x = x * scales[f"{which}_descale"][pages][:, None, :, None]
        else:
            x = x * scales[f"{which}_scale"]
        out.append(x.reshape(-1, *cache.shape[2:])[:b])
    return torch.cat(out)


def fp8_accuracy(rows):
    """FP8 compute's error against DESIGN's float32 reference on the dequantized cache (docs/fp8.md),
    next to the dequantize + bf16 path's, on causal 32/8 d128 2 x 2k, random normal Q/K/V."""
    from atom_backend import reference as ref
    from atom_backend.tolerances import errors

    seqs = [(2048, 2048)] * 2
    q, k, v, cu_q, cu_k = make(seqs, 32, 8, 128)
    for per_page in (True, False):
        mode = "per_page" if per_page else "per_tensor"
        cache = fp8_paged(k, v, seqs, per_page=per_page)
        kc, vc, table, cu_k, scales = cache
        kd, vd = (_dequant_torch(c, table, seqs, scales, which) for c, which in ((kc, "k"), (vc, "v")))
        o_ref, _ = ref.varlen_attention(q.float().cpu(), kd.cpu(), vd.cpu(), cu_q.cpu(), cu_k.cpu())  # CPU reference
        out8 = run_fp8(seqs, q, cache, with_gather=True)()
        out16 = run_dequant(seqs, q, cache)()
        for impl, o in (("fp8 compute", out8), ("dequant gather+bf16", out16)):
            rel, mx = errors(o.float(), o_ref)
            vmax = vd.abs().max().item()
            rows.append({"shape": "accuracy 32/8 d128 2x2k", "impl": f"{impl} {mode}", "rel_err": rel,
                         "max_err_over_vmax": mx / vmax})
            print(f"  accuracy {impl:<20} {mode:<10} rel {rel:.4f}  max|err|/max|V| {mx / vmax:.4f}", flush=True)


FP8_SHAPES = ("causal 32/8 d128 4x4k", "causal 32/8 d128 1x16k", "prefix sk=4sq 32/8 d128 16x1k/4k",
              "prefix sk=4sq 32/8 d128 4x4k/16k", "mixed 32/8 d128 16k tokens")


SWEEP_SHAPES = ("causal 32/8 d128 4x4k", "gpt-oss 64/8 d64 sinks 4x4k", "causal 32/8 d128 1x16k")
C = prefill.Config
# Portable tiles timed with --sweep (the Hopper kernel set aside).
SWEEP = {128: [C(8, 64, 2), C(8, 32, 3, 2)], 64: [C(8, 64, 2, 2), C(4, 64, 3, 2)]}


# (label, [(sq, sk)], hq, hk, d, kwargs): the table's shapes (bench.ab times the same ones)
SHAPES = [
    ("causal 32/8 d128 4x4k", [(4096, 4096)] * 4, 32, 8, 128, {}),
    ("causal 32/8 d128 1x16k", [(16384, 16384)], 32, 8, 128, {}),
    ("gpt-oss 64/8 d64 sinks 4x4k", [(4096, 4096)] * 4, 64, 8, 64, {"sinks": True}),
    ("gpt-oss 64/8 d64 sinks+win128 4x4k", [(4096, 4096)] * 4, 64, 8, 64, {"sinks": True, "window": 128}),
    ("gemma-2 softcap 50 32/16 d128 4x4k", [(4096, 4096)] * 4, 32, 16, 128, {"softcap": 50.0}),
    ("prefix sk=4sq 32/8 d128 16x1k/4k", [(1024, 4096)] * 16, 32, 8, 128, {}),
    ("prefix sk=4sq 32/8 d128 4x4k/16k", [(4096, 16384)] * 4, 32, 8, 128, {}),
    ("mixed 32/8 d128 16k tokens", [(8192, 8192), (4096, 6000), (2048, 2048), (1024, 3000), (512, 512)]
     + [(1, 1000)] * 64 + [(256, 4096)] * 2, 32, 8, 128, {}),
    # one tensor-parallel rank: Llama-3-70B (64 / 8) and gpt-oss-120b at TP 8 (8 / 1), at TP 4 (16 / 2)
    ("rank 8/1 d128 4x4k", [(4096, 4096)] * 4, 8, 1, 128, {}),
    ("rank 8/1 d128 1x16k", [(16384, 16384)], 8, 1, 128, {}),
    ("rank gpt-oss 8/1 d64 sinks 4x4k", [(4096, 4096)] * 4, 8, 1, 64, {"sinks": True}),
    ("rank gpt-oss 8/1 d64 sinks+win128 4x4k", [(4096, 4096)] * 4, 8, 1, 64, {"sinks": True, "window": 128}),
    ("rank 16/2 d128 4x4k", [(4096, 4096)] * 4, 16, 2, 128, {}),
]


# Hopper kernel variants timed with --wg-sweep on sm_90a: (config, GQA packing).
def _h(w, n, s, pack=True, **kw):
    return C(w, n, s, wgmma=True, **kw), pack


WG_SWEEP = {128: [_h(8, 128, 2, q_stages=1), _h(8, 128, 2, False), _h(8, 128, 2, pingpong=False), _h(8, 64, 2)],
            64: [_h(12, 128, 3, False), _h(12, 128, 2), _h(8, 128, 2), _h(4, 64, 3)]}


# Issue 27's bars (FP8 per page over our bf16 and cuDNN) timed again in rotated rounds, bench.ab's order:
# the kernel timed first after a pause gets the best clocks (an identical copy timed second read 0.96-1.01
# of the first, docs/perf/prefill.md 2026-11-25, "a per-unit timeline"), which the single pass above gives to `ours` on every shape.
ROTATED_SHAPES = ("causal 32/8 d128 4x4k", "causal 32/8 d128 1x16k")


def rotated_tflops(fns: dict, rounds: int, pairs, d, hq, time_ms=None) -> dict:
    """{name: [TFLOP/s per round]}: every round times each of fns once, the order rotated (bench.common.rotated)
    so that each leads equally often over len(fns) rounds."""
    time_ms = time_ms or (lambda fn: bench_ms(fn, rep_ms=100))
    out = {n: [] for n in fns}
    for rnd in range(rounds):
        for name in rotated(list(fns), rnd):
            out[name].append(tflops(pairs, d, hq, time_ms(fns[name])))
    return out


def measure_rotated(label, fns, rounds, pairs, d, hq, rows):
    for fn in fns.values():  # compiled and loaded before the first round
        fn()
    torch.cuda.synchronize()
    tf = rotated_tflops(fns, rounds, pairs, d, hq)
    rows += [{"shape": label, "impl": f"rotated {n}", "tflops": statistics.median(t), "rounds": t} for n, t in tf.items()]
    print(f"  rotated ({rounds} rounds, medians): " + ", ".join(f"{n} {statistics.median(t):.1f}" for n, t in tf.items()),
          flush=True)


def measure(label, fn, pairs, d, hq, rows, impl):
    try:
        fn()
        torch.cuda.synchronize()
        ms = bench_ms(fn)
        tf = tflops(pairs, d, hq, ms)
        rows.append({"shape": label, "impl": impl, "ms": ms, "tflops": tf})
        print(f"  {impl:<22} {ms:8.3f} ms  {tf:7.1f} TFLOP/s", flush=True)
    except Exception as e:  # a peer missing on this torch build is reported, not fatal
        rows.append({"shape": label, "impl": impl, "error": f"{type(e).__name__}: {e}"[:200]})
        print(f"  {impl:<22} unavailable: {type(e).__name__}: {str(e)[:120]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 4k shapes only")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8-compute rows")
    ap.add_argument("--only", default=None, help="only shapes whose label contains this text")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs of our kernels")
    ap.add_argument("--wg-sweep", action="store_true", help="only the wgmma tile configs of --sweep")
    ap.add_argument("--rounds", type=int, default=8,
                    help="rotated rounds of ours / FP8 / cuDNN on ROTATED_SHAPES (0: none)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"device: {device_name()}  torch {torch.__version__}")
    try:
        import atom_backend.unified  # noqa: F401
        have_unified = True
    except Exception:
        have_unified = False

    shapes = list(SHAPES)
    if args.quick:
        shapes = [s for s in shapes if "16k" not in s[0] or "prefix" in s[0]]
    if args.only:
        shapes = [s for s in shapes if args.only in s[0]]
    rows = []
    for label, seqs, hq, hk, d, kw in shapes:
        pairs = sum(visible_pairs(a, b, kw.get("window", 0)) for a, b in seqs)
        print(f"{label}: {sum(a for a, _ in seqs)} q tokens, {pairs / 1e6:.1f}M visible pairs per head", flush=True)
        q, k, v, cu_q, cu_k = make(seqs, hq, hk, d)
        okw = kernel_options(kw, hq)
        measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, **okw), pairs, d, hq, rows, "ours")
        measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, use_work=False, **okw), pairs, d, hq, rows, "ours(device order)")
        arch, window = prefill._default_arch(), kw.get("window", 0)
        tile = prefill.config_for(d, window, arch)
        if tile.wgmma:
            portable = prefill.Build(prefill.config_for(d, window))  # the portable mma.sync kernel
            measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, build=portable, **okw), pairs, d, hq, rows,
                    "ours(mma.sync)")
            measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, order="cost", **okw), pairs, d, hq, rows,
                    "ours(cost order)")
            static = prefill.Build(tile, scheduler="static")
            measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, build=static, **okw), pairs, d, hq, rows,
                    "ours(static schedule)")
            if (args.sweep or args.wg_sweep) and d in WG_SWEEP:
                for cfg, pack in WG_SWEEP[d]:
                    name = f"hopper w{cfg.num_warps} n{cfg.block_n} s{cfg.stages} q{cfg.q_stages}" + ("" if pack else " no-pack") \
                        + ("" if cfg.pingpong else " no-pingpong")
                    measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, build=prefill.Build(cfg, pack_gqa=pack), **okw),
                            pairs, d, hq, rows, name)
        if args.sweep and label in SWEEP_SHAPES:
            for cfg in SWEEP[d]:
                measure(label, run_ours(seqs, q, k, v, cu_q, cu_k, build=prefill.Build(cfg), **okw), pairs, d, hq, rows,
                        f"ours w{cfg.num_warps}m{cfg.warp_m_tiles} n{cfg.block_n} s{cfg.stages}")
        fp8_kw = {"softcap": kw["softcap"]} if "softcap" in kw else {}  # Gemma-2 with an FP8 KV cache
        fp8_here = prefill.fp8_compute_available(d, prefill._default_arch())
        if (label in FP8_SHAPES or fp8_kw) and not args.no_fp8 and fp8_here:
            for per_page in (True, False):
                mode = "per_page" if per_page else "per_tensor"
                cache = fp8_paged(k, v, seqs, per_page=per_page)
                measure(label, run_fp8(seqs, q, cache, with_gather=False, **fp8_kw), pairs, d, hq, rows, f"fp8 {mode}")
                if label in FP8_SHAPES:  # the prefix-hit path: gather from the paged cache, then the kernel
                    tag = "" if per_page else " per_tensor"  # per tensor: vLLM's FP8 cache
                    measure(label, run_fp8(seqs, q, cache, with_gather=True), pairs, d, hq, rows,
                            f"fp8{tag} gather+kernel")
                    measure(label, run_dequant(seqs, q, cache), pairs, d, hq, rows, f"dequant{tag} gather+bf16")
                del cache
            if label in ROTATED_SHAPES and args.rounds > 0:
                fns = {"ours": run_ours(seqs, q, k, v, cu_q, cu_k, **okw)}
                for per_page in (True, False):
                    fns[f"fp8 {'per_page' if per_page else 'per_tensor'}"] = run_fp8(
                        seqs, q, fp8_paged(k, v, seqs, per_page=per_page), with_gather=False)
                try:
                    fns["sdpa-cudnn"] = run_sdpa(seqs, q, k, v, "cudnn")
                except Exception as e:  # a peer missing on this torch build
                    print(f"  rotated: sdpa-cudnn unavailable ({type(e).__name__})", flush=True)
                measure_rotated(label, fns, args.rounds, pairs, d, hq, rows)
                del fns
        dense = all(s == seqs[0] for s in seqs)
        if dense and seqs[0][0] == seqs[0][1] and "window" not in kw and "softcap" not in kw:
            # Peers run without sinks (the flash/cuDNN backends have none): DESIGN's comparison. They have
            # no soft-cap either; FlexAttention's score_mod does (the soft-cap shape's peer).
            for be in ("flash", "cudnn"):
                _measure_built(label, lambda be=be: run_sdpa(seqs, q, k, v, be), pairs, d, hq, rows, f"sdpa-{be}")
        if dense and not args.no_flex and "window" not in kw:
            _measure_built(label, lambda: run_flex(seqs, q, k, v, softcap=kw.get("softcap", 0.0)), pairs, d, hq, rows, "flex")
        if have_unified and all(b % 16 == 0 for _, b in seqs):
            _measure_built(label, lambda: run_unified(seqs, q, k, v, cu_q, **okw), pairs, d, hq, rows, "triton-unified")
        del q, k, v
        torch.cuda.empty_cache()

    if not args.no_fp8 and prefill.fp8_compute_available(128, prefill._default_arch()):
        print("FP8 compute accuracy (vs the float32 reference on the dequantized cache; bound: rel 5e-2, "
              "max 2^-3 max|V|)", flush=True)
        fp8_accuracy(rows)

    # summary: ratios against flash on the same label, and prefix vs sq == sk
    print("\nsummary (TFLOP/s; ratio = ours / peer)")
    by = {}
    for r in rows:
        by.setdefault(r["shape"], {})[r["impl"]] = r.get("tflops")
    for label, impls in by.items():
        ours = impls.get("ours")
        parts = [f"ours {ours:.0f}" if ours else "ours n/a"]
        for peer in ("ours(device order)", "ours(mma.sync)", "sdpa-flash", "sdpa-cudnn", "flex", "triton-unified",
                     "dequant gather+bf16"):
            if impls.get(peer):
                parts.append(f"{peer} {impls[peer]:.0f} ({ours / impls[peer]:.2f}x)" if ours else f"{peer} {impls[peer]:.0f}")
        print(f"  {label:<38} " + ", ".join(parts))
    for label, impls in by.items():
        for mode, tag in (("per_page", ""), ("per_tensor", " per_tensor")):
            f8 = impls.get(f"fp8 {mode}")
            if not f8:
                continue
            peers = [(p, impls.get(p)) for p in ("ours", "sdpa-cudnn") if impls.get(p)]
            g8, g16 = impls.get(f"fp8{tag} gather+kernel"), impls.get(f"dequant{tag} gather+bf16")
            print(f"  fp8 {mode} [{label}]: {f8:.0f}, " + ", ".join(f"{f8 / t:.2f}x {p}" for p, t in peers)
                  + (f"; fp8 gather+kernel {g8 / g16:.2f}x dequant gather+bf16" if g8 and g16 else ""))
    for label, impls in by.items():
        f8, ours = impls.get("rotated fp8 per_page"), impls.get("rotated ours")
        if f8 and ours:
            cu, pt = impls.get("rotated sdpa-cudnn"), impls.get("rotated fp8 per_tensor")
            print(f"  rotated [{label}]: fp8 per_page {f8:.0f} = {f8 / ours:.2f}x ours ({ours:.0f})"
                  + (f", {f8 / cu:.2f}x cuDNN ({cu:.0f})" if cu else "")
                  + (f"; per_tensor {pt:.0f} = {pt / ours:.2f}x ours" if pt else ""))
    eq = by.get("causal 32/8 d128 4x4k", {}).get("ours")
    for label in by:
        if label.startswith("prefix") and eq and by[label].get("ours"):
            print(f"  prefix/sq==sk TFLOP/s ratio [{label}]: {by[label]['ours'] / eq:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


def _measure_built(label, build, pairs, d, hq, rows, impl):
    try:
        fn = build()
    except Exception as e:
        rows.append({"shape": label, "impl": impl, "error": f"{type(e).__name__}: {e}"[:200]})
        print(f"  {impl:<22} unavailable: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return
    measure(label, fn, pairs, d, hq, rows, impl)


if __name__ == "__main__":
    main(sys.argv[1:])
