"""`python -m bench.decode_profile`: where the decode time goes, kernel by kernel.

`kernels`: torch.profiler device times of every kernel of one decode step (split kernel, combine)
and of SDPA cuDNN on dense KV, per issue-6 shape; the read-only bandwidth of a large reduction
as a second ceiling; pages in order vs shuffled. `one --case C --shape BxN`: run one case a few
times between cudaProfilerStart/Stop, for `ncu --profile-from-start off`. `tunes --tunes JSON`:
variants of the tensor-core kernel (extra defines, e.g. '[{"NUM_WARPS": 2}, {"dry": 1}]'; "dry": its copies
without the math, a bench overlay) beside the default, checked against its output (`--sequential`: pages in order, `--hnd`: head-major
pages). `variants`, `layout`: split counts, cache layouts. `capture_splits`: the split count a
vLLM decode graph keeps (sized for a long max_model_len) against the eager planner's, on short
contexts. `split_grid`: power-of-two split counts and the planner's over batch sizes x context
lengths (JSON rows, the planner's loss against the best count). `fused_combine`: balanced splits
combined by their last CTA against the combine kernel. Host cost per call: `bench.host`.

Size (over 500 lines): a lab bench of several profiles of one kernel; nothing here ships.
"""

from __future__ import annotations

import argparse
import collections
import os

import torch

from bench.decode import (HK, HQ, D, SHAPES, bench_ms, build, copy_bandwidth, facts_for, kv_bytes, platform_here,
                          run_ours, sdpa_fns)
from atom_backend.planning import PlannerConfig, decode_split_rule, decode_splits


# Short case names of the diagnostics -> bench.decode.build's KV kinds.
KV_KINDS = {"bf16": "bf16", "fp8t": "fp8_tensor", "fp8p": "fp8_page"}
# Keys of a tune that are launch options or a bench build, not kernel defines.
LAUNCH_KEYS = ("balanced", "splits", "dry")


def kernel_defines(tune) -> dict:
    return {k: v for k, v in (tune or {}).items() if k not in LAUNCH_KEYS}


# Bench builds of the tensor-core split kernel (hip_kernels/src/decode_mma.hip, bench/overlay.py).
_KERNEL_END = "        if (d == 0 && lse_out != nullptr) lse_out[row] = lse;\n      }\n    }\n  }\n}\n"
_STAMPS = """
ATOM_DEV unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
ATOM_DEV unsigned int sm_id() {
  unsigned int r;
  asm volatile("mov.u32 %0, %smid;" : "=r"(r));
  return r;
}
"""
_ENTRY = """  // [entry, first chunk landed, loop done, end, sm]: 8 u64 per CTA after the workspace.
  unsigned long long* tl = reinterpret_cast<unsigned long long*>(
      o_partial + (((long long)num_splits * total_q * num_q_heads * (D + 1) + 1) & ~1LL)) +
      8 * (((long long)s * atom::gdim_y() + b) * atom::gdim_x() + atom::bid_x());
  if (tid == 0) {
    tl[0] = now_ns();
    tl[4] = sm_id();
  }
"""


def mma_edits(dry: bool = False, timeline: bool = False) -> list:
    """dry: the copies without the math (timing only: results are wrong). timeline: per-CTA
    %globaltimer stamps after the workspace (results unchanged; NVIDIA only)."""
    from bench import overlay

    edits = [overlay.replace("      compute(c);\n", "      (void)c;  // dry: the copies without the math\n")] if dry else []
    if timeline:
        edits += [overlay.after('#include "splitkv_combine.h"\n', _STAMPS),
                  overlay.after("  const int warp = tid / WARP;\n", _ENTRY),
                  overlay.before("      if (FP8 && per_page && c == 0) {", "      if (c == 0 && tid == 0) tl[1] = now_ns();\n"),
                  overlay.after("  atom::sync_block();  // the ring becomes the merge buffer\n",
                                "  if (tid == 0) tl[2] = now_ns();\n"),
                  overlay.replace(_KERNEL_END, _KERNEL_END[:-2] + "  atom::sync_block();\n  if (tid == 0) tl[3] = now_ns();\n}\n")]
    return edits


def mma_source(dry: bool = False, timeline: bool = False) -> str | None:
    """The path of that bench build of decode_mma.hip (None: the shipped source)."""
    from bench import overlay

    if not (dry or timeline):
        return None
    return overlay.write("decode_mma.hip", mma_edits(dry, timeline), ("dry" if dry else "") + ("timeline" if timeline else ""))


def planned_splits(b, ctx, case="bf16"):
    return decode_splits(b, ctx, facts_for(KV_KINDS[case]), platform_here(), PlannerConfig())


def case_fn(case, b, ctx, splits=None, sequential=False):
    if case == "cudnn":
        return sdpa_fns(b, ctx)["sdpa_cudnn"], None
    kv = KV_KINDS[case]
    c = build(b, ctx, kv, placement="in_order" if sequential else "shuffled")
    s = splits or planned_splits(b, ctx, case)
    return run_ours(c, s), c


def kernel_times(fn, reps=20):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            acc[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / reps for k, v in acc.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("kernels", "one", "variants", "layout", "tunes", "timeline", "capture_splits",
                                     "fused_combine", "split_grid"))
    ap.add_argument("--tunes", default="", help='tunes / timeline: JSON list of defines (tunes: default [{"NUM_WARPS": 2}])')
    ap.add_argument("--kv", default="bf16,fp8t", help="tunes: bf16,fp8t,fp8p")
    ap.add_argument("--shapes", default="", help="tunes: subset, e.g. 64x4096,1x131072")
    ap.add_argument("--hnd", action="store_true", help="tunes: head-major pages")
    ap.add_argument("--case", default="bf16")
    ap.add_argument("--shape", default="64x4096")
    ap.add_argument("--splits", type=int, default=0)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--json", default="", help="split_grid: where the rows go")
    args = ap.parse_args(argv)
    if args.mode == "variants":
        return variants()
    if args.mode == "capture_splits":
        return capture_splits()
    if args.mode == "fused_combine":
        return fused_combine()
    if args.mode == "split_grid":
        return split_grid(args.json or "split_grid.json")
    if args.mode == "layout":
        return layout()
    if args.mode == "timeline":
        return timeline(args.kv, args.shapes, args.splits or None, args.tunes)
    if args.mode == "tunes":
        return tunes(args.tunes or '[{"NUM_WARPS": 2}]', args.kv, args.sequential, args.shapes, args.hnd)
    if args.mode == "one":
        b, ctx = (int(x) for x in args.shape.split("x"))
        fn, _ = case_fn(args.case, b, ctx, args.splits or None, args.sequential)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    bw = copy_bandwidth()
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: x.sum())
    print(f"# copy {bw / 1e9:.0f} GB/s; read-only (bf16 sum of 2 GiB) {2 * x.numel() / ms / 1e6:.0f} GB/s")
    del x
    for b, ctx in SHAPES:
        s = planned_splits(b, ctx)
        for case in ("cudnn", "bf16", "fp8t", "fp8p"):
            fn, c = case_fn(case, b, ctx)
            t = bench_ms(fn)
            ks = kernel_times(fn)
            ks_s = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(ks.items(), key=lambda kv: -kv[1]))
            nbytes = kv_bytes(b, ctx, 2 if case in ("cudnn", "bf16") else 1)
            print(f"{b}x{ctx} {case:6s} S={s:<3d} do_bench {t * 1e3:7.1f} us ({nbytes / t / 1e6 / (bw / 1e9) * 100:5.1f}% copy) | kernels us: {ks_s}", flush=True)
            del fn, c
            torch.cuda.empty_cache()
        fn, c = case_fn("bf16", b, ctx, sequential=True)
        print(f"{b}x{ctx} bf16 pages in order: {bench_ms(fn) * 1e3:7.1f} us", flush=True)
        del fn, c
        torch.cuda.empty_cache()


def page_order(order: str, nb: int, per_2m: int, g) -> torch.Tensor:
    """Page ids: "shuffled", "in order", "in 2M" (shuffled inside each 2 MiB of the pool, the
    2 MiB groups in order) or "2M shuf" (groups in random order, pages in order inside): the last
    two tell address-translation reach (GPU pages of 2 MiB) from finer placement effects."""
    if order == "shuffled":
        return torch.randperm(nb, device="cuda", generator=g)
    if order == "in order" or per_2m <= 1:
        return torch.arange(nb, device="cuda")
    groups = -(-nb // per_2m)
    ids = torch.arange(groups * per_2m, device="cuda").view(groups, per_2m)
    if order == "in 2M":
        ids = torch.gather(ids, 1, torch.argsort(torch.rand(ids.shape, device="cuda", generator=g), dim=1))
    else:
        ids = ids[torch.randperm(groups, device="cuda", generator=g)]
    ids = ids.flatten()
    return ids[ids < nb]


def layout():
    """The same decode (bf16, planner splits) over differently laid-out caches: page size, pages
    shuffled or in order, token-major (NHD) or head-major (HND) pages, K and V as two tensors or
    adjacent per token and head (`kv`: vLLM 0.32's layer-compact caches, LBNHC / LBHNC, which
    this backend is served). The last row of each shape is one page per request, head-major: the
    dense [B, H, S, D] layout SDPA reads."""
    from hip_kernels import decode

    bw = copy_bandwidth()
    for b, ctx in ((64, 4096), (1, 131072)):
        s = planned_splits(b, ctx)
        t_cudnn = bench_ms(sdpa_fns(b, ctx)["sdpa_cudnn"])
        print(f"{b}x{ctx} S={s} cudnn {t_cudnn * 1e3:.1f} us", flush=True)
        torch.cuda.empty_cache()
        for bs, order, hnd, kv in ((16, "shuffled", False, False), (16, "shuffled", True, False),
                                   (16, "in order", False, False), (16, "in 2M", False, False),
                                   (16, "2M shuf", False, False), (16, "in order", True, False),
                                   (16, "shuffled", False, True), (16, "shuffled", True, True),
                                   (16, "in order", False, True), (16, "in order", True, True),
                                   (64, "shuffled", True, False), (256, "shuffled", True, False),
                                   (ctx, "in order", True, False)):
            g = torch.Generator(device="cuda").manual_seed(0)
            npages = -(-ctx // bs)
            nb = b * npages + 1
            shape = (nb, HK, bs, D) if hnd else (nb, bs, HK, D)
            if kv:  # one tensor, K in the first half of the last axis, V in the second
                raw = torch.randn(shape[:-1] + (2 * D,), generator=g, device="cuda", dtype=torch.bfloat16)
                k, v = raw[..., :D], raw[..., D:]
            else:
                raw = None
                k = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
            if hnd:
                k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
            ids = page_order(order, nb, 2 * 1024 * 1024 // (bs * HK * D * 2), g)
            bt = ids[: b * npages].to(torch.int32).view(b, npages)
            q = torch.randn((b, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
            cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
            sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            ws = torch.empty(decode.workspace_elems(s, b, HQ, D), dtype=torch.float32, device="cuda")
            fn = lambda: decode.splitkv_decode(q, k, v, cu, sl, bt, max_query_len=1, num_splits=s, out=out,
                                               workspace=ws)
            t = bench_ms(fn)
            name = ("LBHNC" if hnd else "LBNHC") if kv else ("HND" if hnd else "NHD")
            print(f"{b}x{ctx} page {bs:6d} {order:8s} {name:5s} {t * 1e3:7.1f} us"
                  f"  {kv_bytes(b, ctx, 2) / t / 1e6 / (bw / 1e9) * 100:5.1f}% copy  vs cudnn {t_cudnn / t:5.3f}x",
                  flush=True)
            del k, v, fn, raw
            torch.cuda.empty_cache()


def ctas_per_sm(tune, kv_code) -> int:
    """The planner's CTAs per SM for the KV dtype (decode.MMA_CTAS_PER_SM), scaled by the
    variant's warps against the default's."""
    from hip_kernels import decode

    base = decode._mma_variant(D, 0, kv_code)
    warps = decode._mma_warps(decode._mma_variant(D, 0, kv_code, tune))
    per_sm = decode.MMA_CTAS_PER_SM[1 if kv_code >= 2 else 2]
    return max(1, per_sm * decode._mma_warps(base) // warps)


def capture_splits():
    """bf16 decode (SplitKVPlan, output written by the split kernel or its last CTA), CUDA-graph
    replays: the eager planner's splits for the batch's context against those a graph captured
    for a max_model_len of 32k / 128k keeps (metadata.build_for_cudagraph_capture), each with
    every request on all the grid's splits ("all") and with the backend's split rule ("rule",
    planner.SplitRule: a request uses the splits its own length is worth). Last rows: a ragged
    batch, one long request beside short ones, eager."""
    times = {}
    for b in (1, 4, 16, 64):
        rule = split_rule(b)
        for ctx in (64, 128, 256, 512, 1024, 2048, 8192, 32768):
            c = build(b, ctx, "bf16")
            times.clear()
            cols = []
            for label, s in (("eager", planned_splits(b, ctx)), ("graph 32k", planned_splits(b, 32768)),
                             ("graph 128k", planned_splits(b, 131072))):
                for name, r in ((("rule", rule),) if label == "eager" else (("all", None), ("rule", rule))):
                    if (s, name) not in times:
                        times[s, name] = plan_us(c, s, r)
                    cols.append(f"{label} S{s} {name} {times[s, name]:6.1f} us")
            print(f"{b:3d} x {ctx:5d}: " + " | ".join(cols), flush=True)
            del c
            torch.cuda.empty_cache()
    for b, long_ctx, short in ((2, 131072, 512), (8, 32768, 512)):
        c = build(b, long_ctx, "bf16")
        c["sl"] = torch.tensor([long_ctx] + [short] * (b - 1), dtype=torch.int32, device="cuda")
        s = planned_splits(b, long_ctx)
        print(f"ragged 1 x {long_ctx} + {b - 1} x {short}, eager S{s}: all {plan_us(c, s):6.1f} us | "
              f"rule {plan_us(c, s, split_rule(b)):6.1f} us", flush=True)
        del c
        torch.cuda.empty_cache()


def split_rule(b, case="bf16"):
    """The backend's SplitRule for b decode requests of the benchmark model."""
    return decode_split_rule(b, facts_for(KV_KINDS[case]), platform_here(), PlannerConfig())


def plan_us(c, s, rule=None, rep_ms=200) -> float:
    """One decode of `build`'s case c (SplitKVPlan.run: S splits, every request on all of them
    or as the SplitRule `rule` says), graph replay, us."""
    from hip_kernels import decode

    out = torch.empty_like(c["q"])
    plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, split_rule=rule or ())
    return bench_ms(lambda: plan.run(c["q"], c["k"], c["v"], out=out, **c["scales"]), rep_ms) * 1e3


def split_grid(path: str):
    """Power-of-two split counts (1..64, at least 64 keys per split) and the planner's own over
    batch sizes x context lengths (up to 2^20 keys in all), bf16 and FP8 per-tensor, pages
    shuffled, CUDA-graph replays: the data the split rule is judged against. Rows (kv, batch,
    ctx, splits, us, planner's splits) go to `path` (JSON); the summary gives the planner's time
    against the best count measured for each shape."""
    import json
    import math

    rows = []
    for case in ("bf16", "fp8t"):
        for b in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96):
            for ctx in (512, 1000, 2048, 4096, 7000, 16384, 32768, 65536, 131072):
                if b * ctx > (1 << 20):
                    continue
                c = build(b, ctx, KV_KINDS[case])
                planned = planned_splits(b, ctx, case)
                splits = {planned}
                s = 1
                while s <= 64 and (s == 1 or ctx // s >= 64) and b * HK * s <= 4096:
                    splits.add(s)
                    s *= 2
                times = {s: plan_us(c, s, rep_ms=100) for s in sorted(splits)}
                rows += [dict(kv=case, batch=b, ctx=ctx, splits=s, us=t, planned=planned) for s, t in times.items()]
                print(f"{case} {b:3d} x {ctx:6d}: " + " | ".join(
                    f"S{s}{'*' if s == planned else ''} {t:6.1f}" for s, t in times.items()), flush=True)
                del c
                torch.cuda.empty_cache()
                with open(path, "w") as f:
                    json.dump(rows, f)
    for case in ("bf16", "fp8t"):
        shapes = collections.defaultdict(dict)
        for r in rows:
            if r["kv"] == case:
                shapes[r["batch"], r["ctx"]][r["splits"]] = (r["us"], r["planned"])
        loss = sorted(((d[next(iter(d.values()))[1]][0] / min(t for t, _ in d.values()) - 1, key)
                       for key, d in shapes.items()), reverse=True)
        print(f"# {case}: planner's splits vs the best measured over {len(loss)} shapes: mean "
              f"+{100 * sum(x for x, _ in loss) / len(loss):.2f}%, geomean "
              f"+{100 * (math.exp(sum(math.log1p(x) for x, _ in loss) / len(loss)) - 1):.2f}%, "
              f"{sum(x > 0.02 for x, _ in loss)} over 2%, {sum(x > 0.05 for x, _ in loss)} over 5%, worst: "
              + ", ".join(f"{b}x{ctx} +{100 * x:.1f}%" for x, (b, ctx) in loss[:5]), flush=True)


def fused_combine():
    """Balanced splits: the group's last CTA combines (SplitKVPlan.run) against the split kernel's
    partials then the combine kernel, alternated three times in one process, pages shuffled and
    in order, beside SDPA cuDNN. Up to FUSE_MAX_BALANCED_SPLITS splits: past it `run` takes the
    combine kernel too."""
    from hip_kernels import combine, decode

    for b, ctx, s in ((1, 131072, None), (1, 65536, None), (2, 65536, None)):
        s = s or planned_splits(b, ctx)
        t_cudnn = bench_ms(sdpa_fns(b, ctx)["sdpa_cudnn"]) * 1e3
        for placement in ("shuffled", "in_order"):
            c = build(b, ctx, "bf16", placement=placement)
            out = torch.empty_like(c["q"])
            fused_plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, balanced=True)
            split_plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, balanced=True)

            def fused():
                fused_plan.run(c["q"], c["k"], c["v"], out=out)

            def unfused():
                o, lse = split_plan.partials(c["q"], c["k"], c["v"])
                combine.combine(o, lse, out)

            res = {"last CTA": [], "combine kernel": []}
            for _ in range(3):
                res["last CTA"].append(bench_ms(fused) * 1e3)
                res["combine kernel"].append(bench_ms(unfused) * 1e3)
            print(f"{b}x{ctx} S{s} {placement:8s} cudnn {t_cudnn:6.1f} | " + " | ".join(
                f"{k} " + " ".join(f"{x:6.1f}" for x in v) for k, v in res.items()), flush=True)
            del c
            torch.cuda.empty_cache()


def tunes(spec: str, kvs: str, sequential: bool = False, shapes_arg: str = "", hnd: bool = False):
    """Variants of the tensor-core kernel (`_tune` defines, JSON list) at the splits that fill
    their own waves, split + combine as CUDA-graph replays, beside SDPA cuDNN; each output is
    compared with the default kernel's on the same inputs (NaN-poisoned first); three keys are not
    defines: "balanced" (slices claimed at run time), "splits" (instead of the wave rule) and "dry" (the
    copies without the math, mma_source). A ragged batch
    (random lengths, partial chunks) checks the same agreement off the benchmark shapes."""
    import json

    from bench.decode import wave_splits
    from hip_kernels import decode

    variants = [None] + json.loads(spec)
    codes = {"bf16": 0, "fp8t": 2, "fp8p": 2}
    shapes = [tuple(int(x) for x in t.split("x")) for t in shapes_arg.split(",")] if shapes_arg else list(SHAPES) + [(6, 3001)]
    for b, ctx in shapes:
        ragged = (b, ctx) == (6, 3001)
        t_cudnn = None if ragged else bench_ms(sdpa_fns(b, ctx)["sdpa_cudnn"])
        print(f"{b}x{ctx} cudnn {t_cudnn * 1e3 if t_cudnn else 0:.1f} us", flush=True)
        torch.cuda.empty_cache()
        for kv in kvs.split(","):
            c = build(b, ctx, KV_KINDS[kv], placement="in_order" if sequential else "shuffled")
            if ragged:
                c["sl"] = torch.tensor([1, 16, 17, 700, 2048, ctx], dtype=torch.int32, device="cuda")
            if hnd:  # head-major pages: a head's tokens of a page are one contiguous block
                for name in ("k", "v"):
                    c[name] = c[name].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            ref_out = None
            for tune in variants:
                defines = kernel_defines(tune)
                bal = bool((tune or {}).get("balanced"))
                per_sm = ctas_per_sm(defines, codes[kv])
                s = 3 if ragged else wave_splits(b, ctx, per_sm)
                s = int((tune or {}).get("splits", s))
                out = torch.empty_like(c["q"])
                ws = torch.empty(decode.workspace_elems(s, b, HQ, D), dtype=torch.float32, device="cuda")

                plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, workspace=ws,
                                          impl="mma", _tune=defines, balanced=bal,
                                          _source=mma_source(dry=bool((tune or {}).get("dry"))))

                def fn(plan=plan):
                    from hip_kernels.combine import combine

                    o, l = plan.partials(c["q"], c["k"], c["v"], **c["scales"])
                    combine(o, l, out)
                t = bench_ms(fn)
                out.fill_(float("nan"))
                ws.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                if ref_out is None:
                    ref_out = out.clone()
                err = float((out.float() - ref_out.float()).abs().nan_to_num(float("inf")).max())
                vs = f"vs cudnn {t_cudnn / t:5.3f}x" if t_cudnn else ""
                print(f"{b}x{ctx} {kv:5s} {json.dumps(tune or {}):40s} {per_sm}/SM S={s:<3d} {t * 1e3:7.1f} us  {vs}"
                      f"  maxdiff vs default {err:.3g}", flush=True)
            del c
            torch.cuda.empty_cache()


def timeline(kvs: str, shapes_arg: str = "", splits=None, spec: str = "[]"):
    """When each CTA of the split kernel starts, gets its first chunk, leaves its loop and ends
    (mma_source(timeline=True): %globaltimer stamps after the workspace), per shape: the start-up, tail and
    epilogue that make the fixed cost of a decode. Times in us from the first CTA's entry."""
    import json

    from hip_kernels import decode

    shapes = [tuple(int(x) for x in t.split("x")) for t in shapes_arg.split(",")] if shapes_arg else list(SHAPES)
    extra = [{}] + (json.loads(spec) if spec else [])
    for b, ctx in shapes:
        for kv in kvs.split(","):
            c = build(b, ctx, KV_KINDS[kv])
            s = splits or planned_splits(b, ctx, kv)
            for tune in extra:
                need = decode.workspace_elems(s, b, HQ, D)
                nct = HK * b * s
                ws = torch.zeros(need + 2 + 16 * nct, dtype=torch.float32, device="cuda")
                out = torch.empty_like(c["q"])
                plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, workspace=ws,
                                          impl="mma", _tune=kernel_defines(tune),
                                          _source=mma_source(dry=bool(tune.get("dry")), timeline=True),
                                          balanced=bool(tune.get("balanced")))
                for _ in range(3):
                    plan.run(c["q"], c["k"], c["v"], out=out, **c["scales"])
                torch.cuda.synchronize()
                start = (need + 1) & ~1
                raw = ws[start:start + 16 * nct].view(torch.int64).view(nct, 8)[:, :5].cpu()
                if os.environ.get("ATOM_TIMELINE_DIR"):  # raw stamps for offline analysis
                    torch.save(raw, os.path.join(os.environ["ATOM_TIMELINE_DIR"], f"tl_{b}x{ctx}_{kv}_{len(json.dumps(tune))}.pt"))
                st = raw.double()
                t0 = st[:, 0].min()
                e, f, lp, en = ((st[:, i] - t0) / 1e3 for i in range(4))
                span = float(en.max())
                q = lambda x, p: float(torch.quantile(x, p))
                first = e < 5.0  # the first wave's CTAs start together
                ends = torch.sort(en).values
                print(f"{b}x{ctx} {kv} S={s} {json.dumps(tune)} CTAs {nct} span {span:.1f} us | entry wave1 "
                      f"p50/max {q(e[first], 0.5):.1f}/{float(e[first].max()):.1f} | first chunk after entry "
                      f"p50/p90 {q(f - e, 0.5):.2f}/{q(f - e, 0.9):.2f} | loop p10/p50/p90 {q(lp - f, 0.1):.1f}/"
                      f"{q(lp - f, 0.5):.1f}/{q(lp - f, 0.9):.1f} | epilogue p50/max {q(en - lp, 0.5):.2f}/"
                      f"{float((en - lp).max()):.2f} | ends: first {float(ends[0]):.1f}, 50% {q(en, 0.5):.1f}, "
                      f"90% {q(en, 0.9):.1f}, 99% {q(en, 0.99):.1f}, last {span:.1f}", flush=True)
                late = ~first
                if bool(late.any()):
                    print(f"   wave 2: {int(late.sum())} CTAs, entry first/p50/last {float(e[late].min()):.1f}/"
                          f"{q(e[late], 0.5):.1f}/{float(e[late].max()):.1f}, first chunk after entry p50 "
                          f"{q((f - e)[late], 0.5):.2f}", flush=True)
            del c
            torch.cuda.empty_cache()


def variants():
    """The default kernel at several split counts per shape (CUDA-graph replays, combine included
    where S > 1), beside SDPA cuDNN; then where the host time of one splitkv_decode call goes."""
    import cProfile
    import pstats

    from hip_kernels import decode

    bw = copy_bandwidth()
    print(f"# copy {bw / 1e9:.0f} GB/s; times: CUDA-graph replays, do_bench medians (us)")
    sweep = {(64, 4096): (1, 2, 3), (8, 32768): (4, 5, 33), (1, 131072): (32, 33)}
    for b, ctx in SHAPES:
        t_cudnn = bench_ms(sdpa_fns(b, ctx)["sdpa_cudnn"])
        print(f"{b}x{ctx} cudnn {t_cudnn * 1e3:.1f}", flush=True)
        torch.cuda.empty_cache()
        for kv in ("bf16", "fp8t", "fp8p"):
            c = build(b, ctx, KV_KINDS[kv])
            for s in sweep[(b, ctx)]:
                t = bench_ms(run_ours(c, s))
                nbytes = kv_bytes(b, ctx, 2 if kv == "bf16" else 1)
                print(f"{b}x{ctx} {kv:5s} S={s:<3d} {t * 1e3:7.1f} us {nbytes / t / 1e6 / (bw / 1e9) * 100:5.1f}% copy"
                      f"  vs cudnn {t_cudnn / t:5.3f}x", flush=True)
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
