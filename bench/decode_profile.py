"""`python -m bench.decode_profile`: where the decode time goes, kernel by kernel.

`kernels`: torch.profiler device times of every kernel of one decode step (split kernel, combine)
and of SDPA cuDNN on dense KV, per issue-6 shape; the read-only bandwidth of a large reduction
as a second ceiling; pages in order vs shuffled. `one --case C --shape BxN`: run one case a few
times between cudaProfilerStart/Stop, for `ncu --profile-from-start off`. `tunes --tunes JSON`:
variants of the tensor-core kernel (extra defines, e.g. '[{"NUM_WARPS": 2}, {"DRY": 1}]') beside
the default, checked against its output (`--sequential`: pages in order, `--hnd`: head-major
pages). `variants`, `layout`: split counts, cache layouts. `capture_splits`: the split count a
vLLM decode graph keeps (sized for a long max_model_len) against the eager planner's, on short
contexts. `split_bounds`: the per-request split bound m swept in a graph's grid, and the eager
planner's splits against the bound's at small batches. `fused_combine`: balanced splits combined
by their last CTA against the combine kernel. Host cost per call: `bench.host`.
"""

from __future__ import annotations

import argparse
import collections
import os

import torch

from bench.decode import HK, HQ, D, SHAPES, bench_ms, build, kv_bytes, run_ours, sdpa_fns, copy_bandwidth
from atom_backend.kernels import platform_for
from atom_backend.planner import ModelFacts, PlannerConfig, decode_splits


# Short case names of the diagnostics -> bench.decode.build's KV kinds.
KV_KINDS = {"bf16": "bf16", "fp8t": "fp8_tensor", "fp8p": "fp8_page"}
# Keys of a tune that are launch options, not kernel defines.
LAUNCH_KEYS = ("balanced", "splits")


def kernel_defines(tune) -> dict:
    return {k: v for k, v in (tune or {}).items() if k not in LAUNCH_KEYS}


def planned_splits(b, ctx, case="bf16"):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv, mode = {"bf16": ("bf16", "none"), "fp8t": ("fp8_e4m3", "per_tensor"), "fp8p": ("fp8_e4m3", "per_page")}[case]
    facts = ModelFacts(num_q_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=16, kv_dtype=kv, kv_scale_mode=mode)
    return decode_splits(b, ctx, facts, platform_for("sm_90a", num_sms=sms, use_tables=False), PlannerConfig())


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
                                     "split_bounds", "fused_combine"))
    ap.add_argument("--tunes", default="", help='tunes / timeline: JSON list of defines (tunes: default [{"NUM_WARPS": 2}])')
    ap.add_argument("--kv", default="bf16,fp8t", help="tunes: bf16,fp8t,fp8p")
    ap.add_argument("--shapes", default="", help="tunes: subset, e.g. 64x4096,1x131072")
    ap.add_argument("--hnd", action="store_true", help="tunes: head-major pages")
    ap.add_argument("--case", default="bf16")
    ap.add_argument("--shape", default="64x4096")
    ap.add_argument("--splits", type=int, default=0)
    ap.add_argument("--sequential", action="store_true")
    args = ap.parse_args(argv)
    if args.mode == "variants":
        return variants()
    if args.mode == "capture_splits":
        return capture_splits()
    if args.mode == "split_bounds":
        return split_bounds()
    if args.mode == "fused_combine":
        return fused_combine()
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
    the grid's splits for every request ("m0") and with the backend's per-request bound ("m<m>",
    planner.request_split_tokens: a request uses clamp(keys // m, 1, S) of them). Last rows: a
    ragged batch, one long request beside short ones, eager."""
    from atom_backend.planner import request_split_tokens

    times = {}
    for b in (1, 4, 16, 64):
        m = request_split_tokens(b, PlannerConfig())
        for ctx in (64, 128, 256, 512, 1024, 2048, 8192):
            c = build(b, ctx, "bf16")
            times.clear()
            cols = []
            for label, s in (("eager", planned_splits(b, ctx)), ("graph 32k", planned_splits(b, 32768)),
                             ("graph 128k", planned_splits(b, 131072))):
                for mm in ((0,) if label == "eager" else (0, m)):
                    if (s, mm) not in times:
                        times[s, mm] = plan_us(c, s, mm)
                    cols.append(f"{label} S{s} m{mm} {times[s, mm]:6.1f} us")
            print(f"{b:3d} x {ctx:5d}: " + " | ".join(cols), flush=True)
            del c
            torch.cuda.empty_cache()
    for b, long_ctx, short in ((2, 131072, 512), (8, 32768, 512)):
        c = build(b, long_ctx, "bf16")
        c["sl"] = torch.tensor([long_ctx] + [short] * (b - 1), dtype=torch.int32, device="cuda")
        s = planned_splits(b, long_ctx)
        m = request_split_tokens(b, PlannerConfig())
        print(f"ragged 1 x {long_ctx} + {b - 1} x {short}, eager S{s}: m0 {plan_us(c, s, 0):6.1f} us | "
              f"m{m} {plan_us(c, s, m):6.1f} us", flush=True)
        del c
        torch.cuda.empty_cache()


def plan_us(c, s, m) -> float:
    """One bf16 decode (SplitKVPlan.run: S splits, per-request bound m), graph replay, us."""
    from hip_kernels import decode

    out = torch.empty_like(c["q"])
    plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, min_split_tokens=m)
    return bench_ms(lambda: plan.run(c["q"], c["k"], c["v"], out=out)) * 1e3


def split_bounds():
    """Which per-request bound m (planner.request_split_tokens) at 1 / 4 / 16 requests: a graph's
    grid for 128k with m swept, beside the eager planner's splits. Then the eager planner at 1-8
    requests against the same rule with the bound as its key count per split (`new`)."""
    from atom_backend.planner import request_split_tokens

    for b in (1, 4, 16):
        for ctx in (64, 128, 256, 512, 1024, 2048):
            c = build(b, ctx, "bf16")
            se, sg = planned_splits(b, ctx), planned_splits(b, 131072)
            cols = [f"eager S{se} {plan_us(c, se, 0):5.1f}"] + [
                f"S{sg} m{m} {plan_us(c, sg, m):5.1f}" for m in (0, 16, 32, 64, 128, 256)]
            print(f"{b:3d} x {ctx:5d}: " + " | ".join(cols), flush=True)
            del c
            torch.cuda.empty_cache()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    facts = ModelFacts(num_q_heads=HQ, num_kv_heads=HK, head_dim=D)
    platform = platform_for("sm_90a", num_sms=sms, use_tables=False)
    for b in (1, 2, 4, 8):
        m = request_split_tokens(b, PlannerConfig())
        for ctx in (128, 256, 512, 1024, 2048, 4096, 8192):
            c = build(b, ctx, "bf16")
            old = decode_splits(b, ctx, facts, platform, PlannerConfig())
            new = decode_splits(b, ctx, facts, platform, PlannerConfig(min_split_tokens=m))
            cols = []
            for s in sorted({old, new, 2 * new, max(1, new // 2)}):
                tag = ("old" if s == old else "") + ("new" if s == new else "")
                cols.append(f"S{s}{'(' + tag + ')' if tag else ''} {plan_us(c, s, m):5.1f}")
            print(f"eager {b:3d} x {ctx:5d} m{m}: " + " | ".join(cols), flush=True)
            del c
            torch.cuda.empty_cache()


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
    compared with the default kernel's on the same inputs (NaN-poisoned first); two keys are not
    defines: "balanced" (slices claimed at run time) and "splits" (instead of the wave rule). A ragged batch
    (random lengths, partial chunks) checks the same agreement off the benchmark shapes."""
    import json

    from atom_backend.planner import whole_wave_splits
    from hip_kernels import decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
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
                s = 3 if ragged else whole_wave_splits(b * HK, sms * per_sm, max(1, min(64, ctx // 256)))
                s = int((tune or {}).get("splits", s))
                out = torch.empty_like(c["q"])
                ws = torch.empty(decode.workspace_elems(s, b, HQ, D), dtype=torch.float32, device="cuda")

                plan = decode.SplitKVPlan(c["cu"], c["sl"], c["bt"], max_query_len=1, num_splits=s, workspace=ws,
                                          impl="mma", _tune=defines, balanced=bal)

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
    (`TIMELINE=1`: %globaltimer stamps after the workspace), per shape: the start-up, tail and
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
                                          impl="mma", _tune={"TIMELINE": 1, **kernel_defines(tune)},
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
