"""`python -m bench.calibrate`: measure the cost model's inputs on this GPU and write this device's
table, ``atom_backend/catalog/tables/cost_<family>_<device>.json`` (``--family``: the family's,
``cost_<family>.json``); atom_backend/planning/cost.py and decode_cost.py read it.

    PYTHONPATH=. python -m bench.calibrate [--quick] [--out DIR] [--family]

Measured, in one process:
- gather bandwidth: hip gather of a paged cache into packed K/V (16-bit copy and fp8 dequant),
  bytes read + written per second;
- varlen prefill time (hip kernel over packed K/V, the launcher's work list) and unified prefill
  time (Triton over the pages) for a grid of (new tokens, cached tokens) per shape (query heads,
  kv heads, head dim, window). Each point runs a batch of B identical requests (B fills the GPU:
  ~8k query tokens, at most ~1.5M keys) and records time / B: the marginal cost of one request;
  and the first request of the batch alone, from a CUDA graph (its latency: a request that
  cannot fill the GPU takes that long whatever its marginal cost).

- whether the split-KV decode kernel's balanced slices pay on this device: three decode shapes
  that fill the GPU (32 / 8 heads, d 128, bf16, pages shuffled) at the planner's split counts,
  balanced by the kernel's rule against fixed ranges; the table's "decode" entry says
  ``balanced: false`` where balancing is slower (geomean), and the backend then keeps fixed ranges;
- decode streaming: the copy rate and one split-KV CTA's stream rate (one CTA per SM), whose
  ratio is how many CTAs a short decode batch needs to read at the copy rate (the fill target);
- decode routing: the split-KV kernel and the Triton path at the planner's split count over a
  grid of (requests, context) per shape (DECODE_GRID, DECODE_ROUTE_SHAPES).

--quick: one shape, a 3 x 3 grid (GPU smoke test). A full run takes about 2 minutes on H100.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import torch

from bench.common import bench_ms, device_name

DT = torch.bfloat16
PAGE = 16
FULL_GRID = {"new": [16, 64, 256, 1024, 4096, 16384], "cached": [0, 1024, 4096, 16384, 32768]}
QUICK_GRID = {"new": [64, 1024, 8192], "cached": [0, 4096, 32768]}
# (num_q_heads, num_kv_heads, head_dim, window): gpt-oss (full and sliding layers), Llama-style.
# whole models (gpt-oss, Llama-3-8B) and one tensor-parallel rank of gpt-oss-120b / Llama-3-70B at
# TP 8 (8 / 1): the cost model takes the calibrated shape nearest a layer's head counts
FULL_SHAPES = [(64, 8, 64, 0), (64, 8, 64, 128), (32, 8, 128, 0), (8, 1, 64, 0), (8, 1, 64, 128), (8, 1, 128, 0)]
QUICK_SHAPES = [(64, 8, 64, 0)]


def paged(seqs_k, hk, d, dtype=DT, page=PAGE, gen=None, device="cuda"):
    """(k_cache, v_cache, block_table, seq_lens) holding len sk keys per request, pages permuted."""
    n = [-(-sk // page) for sk in seqs_k]
    nb = sum(n) + 4
    perm = torch.randperm(nb, generator=gen)[: sum(n)].to(torch.int32)
    shape = (nb, page, hk, d)
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        kc = (torch.randn(shape, device=device) * 0.5).to(dtype)
        vc = (torch.randn(shape, device=device) * 0.5).to(dtype)
    else:
        kc = torch.randn(shape, device=device, dtype=dtype)
        vc = torch.randn(shape, device=device, dtype=dtype)
    bt = torch.zeros(len(seqs_k), max(n) if n else 1, dtype=torch.int32)
    i = 0
    for b, m in enumerate(n):
        bt[b, :m] = perm[i:i + m]
        i += m
    return kc, vc, bt.to(device), torch.tensor(seqs_k, dtype=torch.int32, device=device)


def cu(lens, device="cuda"):
    out = [0]
    for x in lens:
        out.append(out[-1] + int(x))
    return torch.tensor(out, dtype=torch.int32, device=device)


def batch_size(n: int, c: int) -> int:
    return max(1, min(32, -(-8192 // n), 1_500_000 // (n + c)))


def gather_bandwidth(kv: str, tokens: int, hk=8, d=64) -> float:
    from hip_kernels import gather as hg
    from hip_kernels import runtime

    dtype = runtime.native_fp8_dtype(runtime.device_arch()) if kv == "fp8" else DT
    reqs = 16
    per = tokens // reqs
    kc, vc, bt, _ = paged([per] * reqs, hk, d, dtype)
    cuk = cu([per] * reqs)
    kw = dict(block_table=bt)
    if kv == "fp8":
        kw.update(k_scale=0.5, v_scale=0.5, out_dtype=DT)
    k_out = torch.empty(per * reqs, hk, d, dtype=DT, device="cuda")
    v_out = torch.empty_like(k_out)
    fn = lambda: hg.gather_kv(kc, vc, cuk, per * reqs, k_out=k_out, v_out=v_out, **kw)
    ms = bench_ms(fn)
    moved = per * reqs * 2 * hk * d * (kc.element_size() + 2)
    return moved / (ms * 1e-3) / 1e9


def time_point(n: int, c: int, hq: int, hk: int, d: int, window: int, sinks: torch.Tensor, gen):
    """(varlen us, unified us) per request at (n new, c cached), the batch used, and (varlen us,
    unified us) of one such request alone (CUDA-graph replays: the kernels' latency, without the
    host's launch work, which launch_us holds)."""
    from atom_backend.unified import paged_attention
    from bench.common import graphed
    from hip_kernels import prefill

    B = batch_size(n, c)
    sk = n + c
    kc, vc, bt, seq_lens = paged([sk] * B, hk, d, gen=gen)
    q = torch.randn(B * n, hq, d, dtype=DT, device="cuda")
    cuq, cuk = cu([n] * B), cu([sk] * B)
    k = torch.randn(B * sk, hk, d, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    work = prefill.work_items([n] * B, [sk] * B, head_dim=d, window=window).to("cuda")
    out = torch.empty_like(q)
    fv = lambda: prefill.varlen_attention(q, k, v, cuq, cuk, max_seqlen_q=n, max_seqlen_k=sk, window=window,
                                          sinks=sinks, out=out, work=work)
    fu = lambda: paged_attention(q, kc, vc, cuq, seq_lens, bt, max_seqlen_q=n, max_seqlen_k=sk, window=window,
                                 sinks=sinks, out=out)
    reps = dict(warmup_ms=10, rep_ms=40)
    tv = bench_ms(fv, **reps) * 1e3 / B
    tu = bench_ms(fu, **reps) * 1e3 / B
    cuq1, cuk1 = cu([n]), cu([sk])
    work1 = prefill.work_items([n], [sk], head_dim=d, window=window).to("cuda")
    q1, out1, k1, v1 = q[:n], out[:n], k[:sk], v[:sk]
    fv1 = lambda: prefill.varlen_attention(q1, k1, v1, cuq1, cuk1, max_seqlen_q=n, max_seqlen_k=sk, window=window,
                                           sinks=sinks, out=out1, work=work1)
    fu1 = lambda: paged_attention(q1, kc, vc, cuq1, seq_lens[:1], bt[:1], max_seqlen_q=n, max_seqlen_k=sk,
                                  window=window, sinks=sinks, out=out1)
    lv = bench_ms(graphed(fv1), **reps) * 1e3
    lu = bench_ms(graphed(fu1), **reps) * 1e3
    del kc, vc, k, v, q, out
    return tv, tu, B, (lv, lu)


def launch_us(hq: int, hk: int, d: int, sinks: torch.Tensor, gen) -> dict[str, float]:
    """Per-layer time of each path for one small request alone (n = 16 after c = 16): the host's
    launch work and the kernels' latency floor, which a path costs whenever it gets a request.
    The varlen path's includes its gather."""
    from atom_backend.unified import paged_attention
    from hip_kernels import gather as hg
    from hip_kernels import prefill

    n, c = 16, 16
    kc, vc, bt, seq_lens = paged([n + c], hk, d, gen=gen)
    q = torch.randn(n, hq, d, dtype=DT, device="cuda")
    cuq, cuk = cu([n]), cu([n + c])
    out = torch.empty_like(q)
    work = prefill.work_items([n], [n + c], head_dim=d).to("cuda")  # once per batch, not per layer

    def varlen():
        k, v = hg.gather_kv(kc, vc, cuk, n + c, block_table=bt)
        prefill.varlen_attention(q, k, v, cuq, cuk, max_seqlen_q=n, max_seqlen_k=n + c, sinks=sinks, out=out,
                                 work=work)

    def unified():
        paged_attention(q, kc, vc, cuq, seq_lens, bt, max_seqlen_q=n, max_seqlen_k=n + c, sinks=sinks, out=out)

    reps = dict(warmup_ms=10, rep_ms=40)
    return {"varlen": round(bench_ms(varlen, **reps) * 1e3, 1), "unified": round(bench_ms(unified, **reps) * 1e3, 1),
            "shape": [hq, hk, d]}


DECODE_SHAPES = ((8, 32768), (1, 131072), (16, 8192))
# The decode routing grid (planning/decode_cost.py): requests x context, and the shapes (query
# heads, kv heads, head dim, window) of gpt-oss's two layer kinds, Llama-3-8B and a TP-8 rank.
DECODE_GRID = {"batch": [1, 8, 64], "ctx": [4096, 32768, 131072]}
DECODE_ROUTE_SHAPES = [(32, 8, 128, 0), (64, 8, 64, 0), (64, 8, 64, 128), (8, 1, 128, 0)]


def decode_balance() -> dict:
    """{"balanced": pays, "ratio": geomean balanced / fixed time, "rows": per shape}."""
    from atom_backend.planning import PlannerConfig, decode_splits
    from bench import decode as bd

    bd.set_heads(32, 8, 128)
    platform = bd.platform_here()
    rows, logs = [], []
    for b, ctx in DECODE_SHAPES:
        c = bd.build(b, ctx, "bf16")
        splits = decode_splits(b, ctx, bd.facts_for("bf16"), platform, PlannerConfig())
        t = {}
        for mode, balanced in (("balanced", None), ("fixed", False)):
            bd.BALANCED = balanced  # read when the step is captured
            t[mode] = bd.bench_ms(bd.run_ours(c, splits)) * 1e3
        bd.BALANCED = None
        rows.append({"batch": b, "ctx": ctx, "splits": splits, "balanced_us": round(t["balanced"], 1),
                     "fixed_us": round(t["fixed"], 1)})
        logs.append(math.log(t["balanced"] / t["fixed"]))
        c.clear()
        torch.cuda.empty_cache()
    ratio = math.exp(sum(logs) / len(logs))
    return {"balanced": ratio <= 0.99, "ratio": round(ratio, 4), "rows": rows}


def decode_stream() -> dict:
    """The device's copy rate and one split-KV CTA's stream rate (16-bit and FP8 KV): one CTA per
    SM (requests x kv heads = SMs, one split, fixed ranges), 32k keys each, bytes of K and V read
    per second per CTA. The planner's fill target for a short batch follows from their ratio."""
    from bench import decode as bd
    from bench.common import copy_bandwidth_gbs

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hk = next(h for h in (4, 2, 1) if sms % h == 0)
    bd.set_heads(4 * hk, hk, 128)
    ctx, out = 32768, {"copy_gbps": round(copy_bandwidth_gbs(), 1), "cta_gbps": {}}
    for kv, name in (("bf16", "16bit"), ("fp8_tensor", "fp8")):
        c = bd.build(sms // hk, ctx, kv)
        bd.BALANCED = False
        us = bd.bench_ms(bd.run_ours(c, 1)) * 1e3
        bd.BALANCED = None
        read = 2 * (sms // hk) * ctx * hk * 128 * (2 if kv == "bf16" else 1)
        out["cta_gbps"][name] = round(read / (us * 1e-6) / 1e9 / sms, 2)
        c.clear()
        torch.cuda.empty_cache()
    bd.set_heads(32, 8, 128)
    return out


def decode_paths(balanced: bool, quick: bool = False) -> dict:
    """The split kernel and the Triton path per (requests, context) of DECODE_GRID, at the
    planner's split count and rule (bf16, pages shuffled, sinks on the d 64 shapes): the
    "decode" entry's grid and shapes."""
    import dataclasses

    from atom_backend import unified
    from atom_backend.planning import PlannerConfig, decode_split_rule, decode_splits
    from bench import decode as bd
    from hip_kernels import decode as hd

    grid = {"batch": DECODE_GRID["batch"][:2], "ctx": DECODE_GRID["ctx"][:2]} if quick else DECODE_GRID
    shapes = []
    for hq, hk, d, w in DECODE_ROUTE_SHAPES[:1] if quick else DECODE_ROUTE_SHAPES:
        bd.set_heads(hq, hk, d)
        facts = dataclasses.replace(bd.facts_for("bf16"), window=w, has_sinks=d == 64)
        platform = bd.platform_here()
        sinks = torch.randn(hq, dtype=torch.float32, device="cuda") if d == 64 else None
        t = {"splitkv": [], "unified": []}
        for b in grid["batch"]:
            for path in t:
                t[path].append([])
            for ctx in grid["ctx"]:
                c = bd.build(b, ctx, "bf16")
                splits = decode_splits(b, ctx, facts, platform, PlannerConfig())
                rule = tuple(decode_split_rule(b, facts, platform, PlannerConfig()))
                out = torch.empty_like(c["q"])
                ws = torch.empty(hd.workspace_elems(splits, b, hq, d), dtype=torch.float32, device="cuda")
                kw = dict(num_splits=splits, split_rule=rule, window=w, sinks=sinks, out=out, workspace=ws)
                args = (c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"])
                ours = functools.partial(hd.splitkv_decode, *args, max_query_len=1, balanced=None if balanced else False,
                                         **kw)
                triton = functools.partial(unified.paged_decode, *args, max_seqlen_q=1, max_seqlen_k=ctx,
                                           **dict(kw, num_splits=min(splits, 256)))  # its bound, as the backend clamps
                t["splitkv"][-1].append(round(bd.bench_ms(ours) * 1e3, 2))
                t["unified"][-1].append(round(bd.bench_ms(triton) * 1e3, 2))
                c.clear()
                torch.cuda.empty_cache()
        print(f"decode {hq}/{hk} d{d} window {w}: split-KV us {t['splitkv']}, Triton us {t['unified']}", flush=True)
        shapes.append({"num_q_heads": hq, "num_kv_heads": hk, "head_dim": d, "window": w, "dtype": "bf16",
                       "splitkv_us": t["splitkv"], "unified_us": t["unified"]})
    bd.set_heads(32, 8, 128)
    return {"grid": grid, "shapes": shapes}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape, 3 x 3 grid (smoke test)")
    ap.add_argument("--out", help="directory for the table (default: atom_backend/catalog/tables)")
    ap.add_argument("--family", action="store_true",
                    help="write the arch family's table (cost_<family>.json, read by the family's cards without one "
                         "of their own) instead of this device's (cost_<family>_<device>.json)")
    ap.add_argument("--json", help="also write the raw table here")
    args = ap.parse_args(argv)
    from atom_backend.catalog import tables, tuning
    from hip_kernels import runtime

    arch = runtime.device_arch()
    tuning.apply(arch, device_name())  # the tiles serving will use
    t0 = time.perf_counter()
    grid = QUICK_GRID if args.quick else FULL_GRID
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    gen = torch.Generator().manual_seed(0)
    gbps = {kv: gather_bandwidth(kv, 1 << (18 if args.quick else 20)) for kv in ("16bit", "fp8")}
    print(f"{device_name()} ({arch}): gather " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in gbps.items()), flush=True)
    launch = launch_us(*shapes[0][:3], torch.randn(shapes[0][0], dtype=torch.float32, device="cuda"), gen)
    print(f"launch cost per layer (one small request alone): varlen {launch['varlen']} us (gather included), "
          f"unified {launch['unified']} us", flush=True)
    rows = []
    for hq, hk, d, w in shapes:
        sinks = torch.randn(hq, dtype=torch.float32, device="cuda")
        tv = [[0.0] * len(grid["cached"]) for _ in grid["new"]]
        tu = [[0.0] * len(grid["cached"]) for _ in grid["new"]]
        bs = [[0] * len(grid["cached"]) for _ in grid["new"]]
        lat_v = [[0.0] * len(grid["cached"]) for _ in grid["new"]]
        lat_u = [[0.0] * len(grid["cached"]) for _ in grid["new"]]
        print(f"shape {hq}/{hk} d{d} window {w}: new x cached -> varlen / unified us per request "
              f"(alone: varlen / unified)", flush=True)
        for i, n in enumerate(grid["new"]):
            line = []
            for j, c in enumerate(grid["cached"]):
                tv[i][j], tu[i][j], bs[i][j], (lat_v[i][j], lat_u[i][j]) = time_point(n, c, hq, hk, d, w, sinks, gen)
                line.append(f"{c}:{tv[i][j]:.0f}/{tu[i][j]:.0f} ({lat_v[i][j]:.0f}/{lat_u[i][j]:.0f})")
            torch.cuda.empty_cache()
            print(f"  new {n:6d}  " + "  ".join(line), flush=True)
        rows.append({"num_q_heads": hq, "num_kv_heads": hk, "head_dim": d, "window": w, "dtype": "bf16",
                     "varlen_us": tv, "unified_us": tu, "batch": bs,
                     "varlen_latency_us": lat_v, "unified_latency_us": lat_u})
    decode = decode_balance()
    decode.update(decode_stream())
    decode.update(decode_paths(decode["balanced"], quick=args.quick))
    print("decode: " + ", ".join(f"{r['batch']}x{r['ctx']} at {r['splits']} splits balanced {r['balanced_us']} us, "
                                 f"fixed {r['fixed_us']} us" for r in decode["rows"])
          + f": balanced slices {'pay' if decode['balanced'] else 'do not pay'} here", flush=True)
    body = {"kernels": tables.kernel_fingerprint(),
            "gather": {k: {"gbps": round(v, 1)} for k, v in gbps.items()}, "launch_us": launch, "grid": grid,
            "shapes": rows, "decode": decode,
            "seconds": round(time.perf_counter() - t0, 1)}
    cmd = "python -m bench.calibrate" + (" --quick" if args.quick else "")
    p = tables.write("cost", arch, body, cmd, device_name(), args.out, family=args.family)
    print(f"wrote {p} in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(body, f, indent=1)
    return body


if __name__ == "__main__":
    main(sys.argv[1:])
