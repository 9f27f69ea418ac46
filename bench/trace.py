"""`python -m bench.trace`: replay a synthetic trace of mixed batches through the real metadata
builder and executors with three routings, and compare total attention time per batch class.

    PYTHONPATH=. python -m bench.trace [--quick] [--json PATH] [--batches N]

Model: gpt-oss-like (64 q / 8 kv heads, head dim 64, sinks, bf16 KV, page 16; `--heads 8/1` or
16/2 for a tensor-parallel rank at TP 8 or 4), two layers per step: one full attention, one
sliding window of 128 (gpt-oss alternates them). Routings:
- cost:    the planner with this arch's cost table (threshold rules when there is none),
- varlen:  ATOM_FORCE_PATH=varlen (every prefill gathered + varlen kernel),
- unified: ATOM_FORCE_PATH=unified (every prefill on the Triton path over the pages).
Decodes take the split-KV kernel in all three. Batch classes: decode (decodes only), fresh
(fresh prefills of 512..16k tokens + decodes), prefix (prefix hits: 32..2k new after 1k..32k
cached + decodes), mixed (one fresh, three prefix hits, 64 decodes). Times: medians of the two
layers' executor calls (gather included), CUDA events, the three modes interleaved and
repeated (median of --repeats), per batch; totals per class. --profile adds, per mode, the
host time to enqueue a step and the kernels' device time (a step whose host time exceeds its
kernels' is launch bound: the events then time the host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

from bench.common import bench_ms, device_name

MODES = ("cost", "varlen", "unified")
CLASSES = ("decode", "fresh", "prefix", "mixed")
HQ, HK, D, PAGE, WINDOW = 64, 8, 64, 16, 128


def _logu(rng, lo, hi):
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_batch(cls: str, rng) -> list[tuple[int, int]]:
    """(new, cached) per request, decodes first (vLLM's order)."""
    dec = lambda k: [(1, _logu(rng, 1024, 32768)) for _ in range(k)]
    if cls == "decode":
        return dec(96)
    if cls == "fresh":
        pre = [(_logu(rng, 512, 16384), 0) for _ in range(int(rng.integers(1, 4)))]
        return dec(32) + pre
    if cls == "prefix":
        pre = [(_logu(rng, 32, 2048), _logu(rng, 1024, 32768)) for _ in range(int(rng.integers(2, 7)))]
        return dec(32) + pre
    pre = [(_logu(rng, 512, 8192), 0)] + [(_logu(rng, 32, 2048), _logu(rng, 1024, 32768)) for _ in range(3)]
    return dec(64) + pre


def host_and_kernels(fn, steps: int = 10) -> tuple[float, dict[str, float]]:
    """(median host ms to enqueue one fn() call, device ms per call by kernel name). When the
    host time exceeds the kernels' sum, the step is launch bound and CUDA events time the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    if os.environ.get("ATOM_TRACE_CPROFILE"):  # where the host time goes, by function
        import cProfile
        import pstats

        with cProfile.Profile() as cp:
            for _ in range(steps):
                fn()
        torch.cuda.synchronize()
        pstats.Stats(cp).sort_stats("tottime").print_stats(12)
    host = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        if t > 0:
            kernels[e.key[:40]] = kernels.get(e.key[:40], 0.0) + t / 1e3 / steps
    return sorted(host)[steps // 2], kernels


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one batch per class (smoke test)")
    ap.add_argument("--batches", type=int, default=4, help="batches per class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings per mode and batch (median)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="also report per mode the host time to enqueue one step and the kernels' device time")
    ap.add_argument("--heads", default=f"{HQ}/{HK}", help="query / kv heads of one rank, e.g. 8/1 (gpt-oss-120b at TP 8)")
    args = ap.parse_args(argv)
    global HQ, HK
    HQ, HK = (int(x) for x in args.heads.split("/"))
    os.environ.setdefault("ATOM_METRICS", "0")
    from bench import _vllm

    _vllm.install()
    from atom_backend.execution import routes as executors
    from atom_backend.execution.health import detect_platform
    from atom_backend.vllm.metadata import AtomMetadataBuilder
    from atom_backend.planning import ModelFacts, PlannerConfig
    from bench.calibrate import cu, paged
    from vllm.v1.attention.backend import CommonAttentionMetadata

    dev = torch.device("cuda")
    platform = detect_platform(dev)
    facts = ModelFacts(HQ, HK, D, has_sinks=True, window=0, layer_windows=(0, WINDOW), page_size=PAGE)
    builders = {}
    for mode in MODES:
        builders[mode] = AtomMetadataBuilder.for_model(
            facts, PlannerConfig(force_path="" if mode == "cost" else mode), dev, platform)
    cost_src = getattr(platform.cost, "source", None)
    print(f"{device_name()} ({platform.arch}): cost table {cost_src or 'none (threshold routing)'}", flush=True)
    sinks = torch.randn(HQ, dtype=torch.float32, device=dev)
    layers = [executors.LayerParams(D ** -0.5, w, 0.0, sinks, None, None, torch.bfloat16) for w in (0, WINDOW)]
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    n_batches = 1 if args.quick else args.batches
    results = []
    t0 = time.perf_counter()
    for cls in CLASSES:
        for bi in range(n_batches):
            reqs = make_batch(cls, rng)
            new = [n for n, _ in reqs]
            total = [n + c for n, c in reqs]
            kc, vc, bt, seq_lens = paged(total, HK, D, gen=gen)
            qsl = cu(new)
            q = torch.randn(sum(new), HQ, D, dtype=torch.bfloat16, device=dev)
            out = torch.empty_like(q)
            cm = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens, num_reqs=len(reqs),
                num_actual_tokens=sum(new), max_query_len=max(new), max_seq_len=max(total), block_table_tensor=bt,
                slot_mapping=torch.zeros(sum(new), dtype=torch.int64, device=dev),
                seq_lens_cpu_upper_bound=seq_lens.cpu())
            row = {"class": cls, "batch": bi, "requests": len(reqs), "prefills": [r for r in reqs if r[0] > 1]}
            fns = {}
            for mode in MODES:
                md = builders[mode].build(0, cm)
                fns[mode] = lambda md=md: [executors.run(md, q, out, kc, vc, p) for p in layers]
                if mode == "cost":
                    row["cost_varlen"] = [reqs[i] for i in md.plan.varlen.tolist()]
                    row["cost_unified"] = [reqs[i] for i in md.plan.unified.tolist()]
                    row["cost_reason"] = md.plan.varlen_reason.value
            # modes interleaved, median of the repeats: small batches are launch bound, and a
            # host hiccup during one mode's timing must not decide the comparison
            times = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for mode in MODES:
                    times[mode].append(bench_ms(fns[mode], warmup_ms=10, rep_ms=40))
            for mode in MODES:
                row[mode + "_ms"] = float(np.median(times[mode]))
                if args.profile:
                    row[mode + "_host_ms"], row[mode + "_kernels"] = host_and_kernels(fns[mode])
            best = min(row["varlen_ms"], row["unified_ms"])
            row["ratio"] = row["cost_ms"] / best
            results.append(row)
            if args.profile:
                for mode in MODES:
                    ks = row[mode + "_kernels"]
                    print(f"  {mode:7s} host {row[mode + '_host_ms']:.3f} ms/step, kernels {sum(ks.values()):.3f} ms: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1])[:6]))
            print(f"{cls:7s} #{bi} {len(reqs):3d} req, prefills {row['prefills']}: cost {row['cost_ms']:.3f} ms, "
                  f"varlen {row['varlen_ms']:.3f}, unified {row['unified_ms']:.3f} (cost/best {row['ratio']:.3f}); "
                  f"cost sent {len(row['cost_varlen'])} varlen / {len(row['cost_unified'])} unified", flush=True)
            del kc, vc, q, out
            torch.cuda.empty_cache()
    summary = []
    for cls in CLASSES:
        rs = [r for r in results if r["class"] == cls]
        tot = {m: sum(r[m + "_ms"] for r in rs) for m in MODES}
        best = min(tot["varlen"], tot["unified"])
        summary.append({"class": cls, "batches": len(rs), **{f"{m}_ms": round(tot[m], 3) for m in MODES},
                        "cost_over_best": round(tot["cost"] / best, 3),
                        "gain_vs_varlen": round(tot["varlen"] / tot["cost"], 3),
                        "gain_vs_unified": round(tot["unified"] / tot["cost"], 3),
                        "worst_batch_ratio": round(max(r["ratio"] for r in rs), 3)})
    print("\n| class | batches | cost routing ms | always varlen ms | always unified ms | cost / best | "
          "varlen / cost | unified / cost | worst batch cost / best |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summary:
        print(f"| {s['class']} | {s['batches']} | {s['cost_ms']:.2f} | {s['varlen_ms']:.2f} | {s['unified_ms']:.2f} | "
              f"{s['cost_over_best']:.3f} | {s['gain_vs_varlen']:.2f}x | {s['gain_vs_unified']:.2f}x | "
              f"{s['worst_batch_ratio']:.3f} |")
    ok = all(s["cost_over_best"] <= 1.05 for s in summary)
    print(f"\ncost routing within 1.05x of the better fixed path on every class: {ok} "
          f"({time.perf_counter() - t0:.0f} s)")
    data = {"device": device_name(), "arch": platform.arch, "cost_table": cost_src, "summary": summary,
            "batches": results, "within_1_05": ok}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
