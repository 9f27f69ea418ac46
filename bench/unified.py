"""Unified path benchmark: causal prefill vs torch SDPA (flash, cuDNN; dense KV) and FlexAttention,
decode KV bandwidth vs the measured copy bandwidth. All peers in one process, same shapes.

    PYTHONPATH=. python -m bench.unified [--sweep] [--quick] [--json PATH]

Prefill: batch x 4096-token causal sequences (sq == sk, the whole prompt new), paged KV with
page 16 in permuted pages for us, dense [B, H, S, D] for the peers. FLOPs per docs/design.md:
4 * visible pairs * head_dim * num_q_heads. Decode: batch 64 x 4096 context, page 16, one query
token each; bytes = K and V actually read + q + out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from atom_backend.planning.cost import visible_pairs
from atom_backend.unified import TileConfig, paged_attention, paged_decode
from bench.common import bench_ms, copy_bandwidth_gbs, device_name


DT = torch.bfloat16


def graph_ms(fn):
    """Median time of a CUDA-graph replay of fn: the GPU time, without Python launch overhead
    (which vLLM hides the same way for decode)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_ms(g.replay)


def _paged(seqs_k, hk, d, page, dtype, gen):
    n = [-(-sk // page) for sk in seqs_k]
    nb = sum(n) + 8
    perm = torch.randperm(nb, generator=gen)[: sum(n)].cuda()
    kc = torch.randn(nb, page, hk, d, device="cuda", dtype=dtype)
    vc = torch.randn(nb, page, hk, d, device="cuda", dtype=dtype)
    bt = torch.zeros(len(seqs_k), max(n), dtype=torch.int32, device="cuda")
    i = 0
    for b, m in enumerate(n):
        bt[b, :m] = perm[i:i + m]
        i += m
    return kc, vc, bt


def prefill(name, hq, hk, d, batch, seqlen, window, sinks, sweep, out_rows):
    gen = torch.Generator().manual_seed(0)
    page = 16
    kc, vc, bt = _paged([seqlen] * batch, hk, d, page, DT, gen)
    q = torch.randn(batch * seqlen, hq, d, device="cuda", dtype=DT)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen
    sl = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    s = torch.randn(hq, device="cuda") if sinks else None
    flops = 4 * batch * visible_pairs(seqlen, 0, window) * d * hq
    tag = f"{name} B={batch} S={seqlen} w={window or '-'}{' sinks' if sinks else ''}"

    def ours(cfg=None):
        return lambda: paged_attention(q, kc, vc, cu, sl, bt, max_seqlen_q=seqlen, max_seqlen_k=seqlen, window=window,
                                       sinks=s, _config=cfg)

    res = {}
    configs = [None]
    if sweep:
        configs += [TileConfig(bm, bn, w, st) for bm, bn, w, st in
                    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                     (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2)]]
    best = None
    for cfg in configs:
        try:
            ms = bench_ms(ours(cfg))
        except Exception as e:  # a config that does not fit (shared memory) is skipped, not fatal
            print(f"  config {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"  {tag} ours {cfg}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        if cfg is None:
            res["ours_default"] = ms
        if best is None or ms < best[0]:
            best = (ms, cfg)
    res["ours_best"] = best[0]
    res["ours_best_cfg"] = str(best[1])

    # dense peers: [B, H, S, D]; K/V expanded only where the backend lacks GQA
    qd = q.view(batch, seqlen, hq, d).transpose(1, 2)
    kd = torch.randn(batch, hk, seqlen, d, device="cuda", dtype=DT)
    vd = torch.randn(batch, hk, seqlen, d, device="cuda", dtype=DT)
    ke, ve = kd.repeat_interleave(hq // hk, 1), vd.repeat_interleave(hq // hk, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    full_flops = 4 * batch * visible_pairs(seqlen, 0, 0) * d * hq
    for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: sdpa(qd, ke, ve, is_causal=True)  # noqa: E731
                fn()
                res[label] = bench_ms(fn)
        except Exception as e:
            print(f"  {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        from bench.common import compiled_flex

        def mask_mod(b, h, qi, kj):
            m = kj <= qi
            if window:
                m = m & (kj > qi - window)
            return m

        bm = create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
        flex = compiled_flex()
        fn = lambda: flex(qd, kd, vd, block_mask=bm, enable_gqa=True)  # noqa: E731
        fn()
        res["flex"] = bench_ms(fn)
    except Exception as e:
        print(f"  flex: {type(e).__name__}: {str(e)[:160]}", flush=True)
    row = dict(kind="prefill", shape=tag, tflops_ours=flops / res["ours_best"] / 1e9, **res)
    # acceptance: throughput vs SDPA flash on full causal of the same shape (window layers: flash
    # cannot window, so its full-causal time is the upper reference it would spend)
    if "sdpa_flash" in res:
        row["tflops_flash"] = full_flops / res["sdpa_flash"] / 1e9
        row["ratio_vs_flash"] = (row["tflops_ours"] / row["tflops_flash"]) if not window else res["sdpa_flash"] / res["ours_best"]
    if "sdpa_cudnn" in res:
        row["ratio_vs_cudnn"] = res["sdpa_cudnn"] / res["ours_best"] if not window else None
    if "flex" in res:
        row["ratio_vs_flex"] = res["flex"] / res["ours_best"]
    out_rows.append(row)
    print(json.dumps(row), flush=True)


def decode(name, hq, hk, d, batch, ctx, window, sinks, sweep, copy_gbs, out_rows):
    gen = torch.Generator().manual_seed(1)
    page = 16
    kc, vc, bt = _paged([ctx] * batch, hk, d, page, DT, gen)
    q = torch.randn(batch, hq, d, device="cuda", dtype=DT)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    s = torch.randn(hq, device="cuda") if sinks else None
    keys = min(ctx, window) if window else ctx
    nbytes = 2 * batch * keys * hk * d * 2 + 2 * q.numel() * 2
    tag = f"{name} B={batch} ctx={ctx} w={window or '-'}{' sinks' if sinks else ''}"
    ws = torch.empty(16 * batch * hq * (d + 1), dtype=torch.float32, device="cuda")
    res = {}
    runs = [("unified", None, None)] + [(f"split{n}", n, None) for n in (2, 4, 8, 16)]
    if sweep:
        for bn, w, st in [(32, 4, 3), (64, 4, 4), (128, 4, 3), (64, 2, 3), (32, 2, 4)]:
            runs.append((f"unified_bn{bn}_w{w}_s{st}", None, TileConfig(16, bn, w, st)))
            runs.append((f"split2_bn{bn}_w{w}_s{st}", 2, TileConfig(16, bn, w, st)))
    for label, n, cfg in runs:
        if n is None:
            fn = lambda: paged_attention(q, kc, vc, cu, sl, bt, max_seqlen_q=1, max_seqlen_k=ctx, window=window,  # noqa: E731
                                         sinks=s, _config=cfg)
        else:
            fn = lambda: paged_decode(q, kc, vc, cu, sl, bt, max_seqlen_q=1, max_seqlen_k=ctx, window=window,  # noqa: E731
                                      sinks=s, num_splits=n, workspace=ws, _config=cfg)
        try:
            eager = bench_ms(fn)
            ms = graph_ms(fn)
        except Exception as e:
            print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        res[label] = ms
        print(f"  {tag} {label}: graph {ms * 1e3:.1f} us {nbytes / ms / 1e6:.0f} GB/s (eager {eager * 1e3:.1f} us)",
              flush=True)
    best = min(res, key=res.get)
    gbs = nbytes / res[best] / 1e6
    row = dict(kind="decode", shape=tag, best=best, us=res[best] * 1e3, gbs=gbs, copy_gbs=copy_gbs,
               frac_copy=gbs / copy_gbs, unified_us=res.get("unified", math.nan) * 1e3,
               splits_us={k: v * 1e3 for k, v in res.items() if k.startswith("split") and "_" not in k})
    out_rows.append(row)
    print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs")
    ap.add_argument("--quick", action="store_true", help="prefill batch 1 only, fewer rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="", help="prefill|decode")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {device_name()}  torch {torch.__version__}  copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    batch = 1 if a.quick else 4
    if a.only in ("", "prefill"):
        prefill("gptoss 64/8 d64", 64, 8, 64, batch, 4096, 0, True, a.sweep, rows)
        prefill("gptoss 64/8 d64", 64, 8, 64, batch, 4096, 128, True, a.sweep, rows)
        prefill("llama 32/8 d128", 32, 8, 128, batch, 4096, 0, False, a.sweep, rows)
    if a.only in ("", "decode"):
        decode("llama 32/8 d128", 32, 8, 128, 64, 4096, 0, False, a.sweep, copy_gbs, rows)
        if not a.quick:
            decode("llama 32/8 d128", 32, 8, 128, 8, 4096, 0, False, False, copy_gbs, rows)
        decode("gptoss 64/8 d64", 64, 8, 64, 64, 4096, 0, True, a.sweep, copy_gbs, rows)
        if not a.quick:
            decode("gptoss 64/8 d64", 64, 8, 64, 64, 4096, 128, True, False, copy_gbs, rows)
    print("\n| kind | shape | ours | peers | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if r["kind"] == "prefill":
            peers = " ".join(f"{k}={r[k]:.3f}ms" for k in ("sdpa_flash", "sdpa_cudnn", "flex") if k in r)
            print(f"| prefill | {r['shape']} | {r['ours_best']:.3f} ms ({r['tflops_ours']:.0f} TFLOP/s, default {r['ours_default']:.3f}) "
                  f"| {peers} | flash {r.get('ratio_vs_flash', float('nan')):.2f}x cudnn {r.get('ratio_vs_cudnn') or float('nan'):.2f}x "
                  f"flex {r.get('ratio_vs_flex', float('nan')):.2f}x |")
        else:
            print(f"| decode | {r['shape']} | {r['us']:.1f} us ({r['best']}) {r['gbs']:.0f} GB/s, unified {r['unified_us']:.1f} us "
                  f"| copy {r['copy_gbs']:.0f} GB/s | {r['frac_copy']:.2f} of copy |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=device_name(), torch=torch.__version__, copy_gbs=copy_gbs, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
