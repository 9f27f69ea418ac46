"""`python -m bench.decode`: split-KV decode, KV bytes read per second against the measured copy
bandwidth and against peers on the same shapes, in one process (docs/design.md "Performance accounting").

Shapes (issue 6): bf16, 8 kv heads / 32 q heads, head_dim 128, page 16: batch 64 x 4k,
8 x 32k, 1 x 128k context; and the same with an FP8 e4m3 cache (per-tensor and per-page scales).
Peers: torch SDPA decode on dense KV (cuDNN and flash backends), FlexAttention on the same dense KV
(torch.compile'd, its decoding kernel for one query token) and the Triton unified decode
(`atom_backend.unified.paged_decode`) when it exists. Pages are shuffled (the worst placement a
long-running block pool can produce); bf16 is also timed with each request's pages in order (the
placement closest to the peers' dense KV) and as vLLM's block pool leaves them after churn
(`bench.placement`, "served"), reported beside it. Splits: the planner's choice, plus a sweep
(`--sweep`) to check the planner's rule. Every KV set is far larger than L2 (>= 512 MiB), so no
rotation is needed; timings are medians of triton.testing.do_bench over CUDA-graph replays of
one decode step (how vLLM runs decode; every peer gets the same treatment), so they hold kernel
time, not Python launch overhead (`python -m bench.decode_profile variants` measures that).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from atom_backend.catalog import platform_for
from atom_backend.planning import ModelFacts, PlannerConfig, decode_splits
from hip_kernels import decode

# The whole model's heads (Llama-3-8B / -70B: 32 or 64 / 8); --heads gives a tensor-parallel
# rank's share (8/1: Llama-3-70B or gpt-oss-120b at TP 8; 16/2 at TP 4).
HQ, HK, D, BS = 32, 8, 128, 16
SHAPES = ((64, 4096), (8, 32768), (1, 131072), (128, 2048), (16, 8192), (1, 32768))


def bench_ms(fn, rep_ms: float = 200) -> float:
    """Median time of one call of fn, as a CUDA-graph replay."""
    from triton.testing import do_bench

    from bench.common import graphed

    return float(do_bench(graphed(fn), warmup=25, rep=rep_ms, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (bench.common)."""
    from bench.common import copy_bandwidth_gbs

    return copy_bandwidth_gbs() * 1e9


def build(batch: int, ctx: int, kv: str, seed: int = 0, placement: str = "shuffled"):
    """Paged cache whose pages sit as `placement` says (bench.placement: shuffled, in_order, served);
    q random; FP8 values spread over e4m3's range."""
    from bench.placement import page_tables

    g = torch.Generator(device="cuda").manual_seed(seed)
    npages = -(-ctx // BS)
    tables, nb = page_tables(placement, batch, npages, BS, seed)
    kv_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    k = torch.randn((nb, BS, HK, D), generator=g, device="cuda").to(kv_dtype)
    v = torch.randn((nb, BS, HK, D), generator=g, device="cuda").to(kv_dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scales = {}
    if kv == "fp8_tensor":
        scales = dict(k_scale=0.5, v_scale=0.5)
    elif kv == "fp8_page":
        scales = dict(k_descale=torch.rand((nb, HK), generator=g, device="cuda") + 0.5,
                      v_descale=torch.rand((nb, HK), generator=g, device="cuda") + 0.5)
    return dict(q=q, k=k, v=v, bt=bt, cu=cu, sl=sl, scales=scales)


def facts_for(kv: str) -> ModelFacts:
    """The benchmark model with `build`'s KV kind (bf16, fp8_tensor, fp8_page)."""
    fp8 = kv != "bf16"
    return ModelFacts(num_q_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=BS,
                      kv_dtype="fp8_e4m3" if fp8 else "bf16",
                      kv_scale_mode={"bf16": "none", "fp8_tensor": "per_tensor", "fp8_page": "per_page"}[kv])


def platform_here():
    return platform_for("sm_90a", num_sms=torch.cuda.get_device_properties(0).multi_processor_count, use_tables=False)


def wave_splits(batch: int, ctx: int, ctas_per_sm: int) -> int:
    """Most splits (<= 64, >= 256 keys each) whose CTAs all run at once at `ctas_per_sm`: the
    split count a kernel variant of other CTAs per SM than the planner's is timed at."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(64, ctx // 256, sms * ctas_per_sm // (batch * HK)))


def kv_bytes(batch: int, ctx: int, elem: int) -> int:
    return 2 * batch * ctx * HK * D * elem + 2 * batch * HQ * D * 2  # K + V, plus q and out


# The FMA split kernel's keys per chunk (U) and ring depth (NST) as shipped; --tune times others.
FMA_U = "constexpr int U = ROWS == 8 ? 2 : (ROWS == 4 && KV_BYTES == 2) ? 3 : 4;"
FMA_NST = "constexpr int NST = KV_BYTES == 1 ? (ROWS <= 2 ? 5 : 4) : (ROWS >= 4 ? 4 : 3);"


def fma_tuned(t: dict) -> str:
    """An overlay of decode.hip with U = t["UNROLL"] and NST = t["STAGES"]."""
    from bench import overlay

    edits = [overlay.replace(FMA_U, f"constexpr int U = {t['UNROLL']};"),
             overlay.replace(FMA_NST, f"constexpr int NST = {t['STAGES']};")]
    return str(overlay.write("decode.hip", edits, f"u{t['UNROLL']}_s{t['STAGES']}"))


BALANCED = None  # --balanced: None = where it pays (hip_kernels.decode.balance_pays), True / False forced


def run_ours(c, splits, tune=None, with_combine=True, impl=None, source=None):
    """One decode step over `splits` splits, every request on all of them: what the backend
    launches at the planner's own count for a batch of one length (its SplitRule then keeps every
    split, tests/test_planner.py), and exactly the count asked for otherwise (sweeps). tune / source: the split
    kernel's extra defines and source file (a bench overlay), for the partials alone."""
    ws = torch.empty(decode.workspace_elems(splits, c["q"].shape[0], HQ, D), dtype=torch.float32, device="cuda")
    out = torch.empty_like(c["q"])

    def fn():
        if with_combine:
            decode.splitkv_decode(c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"], max_query_len=1,
                                  num_splits=splits, out=out, workspace=ws, impl=impl, balanced=BALANCED,
                                  **c["scales"])
        else:
            decode.splitkv_partials(c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"], max_query_len=1,
                                    num_splits=splits, workspace=ws, _tune=tune, _source=source, impl=impl,
                                    **c["scales"])

    return fn


def sdpa_fns(batch: int, ctx: int, flex: bool = False):
    """Decode on dense bf16 KV of the same shape by SDPA's cuDNN and flash backends (and
    FlexAttention with `flex`): {name: fn} for those that run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((batch, HQ, 1, D), generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((batch, HK, ctx, D), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn((batch, HK, ctx, D), generator=g, device="cuda", dtype=torch.bfloat16)
    fns = {}
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        for gqa_mode in ("enable_gqa", "expanded"):
            if gqa_mode == "enable_gqa":
                kk, vv, kw = k, v, {"enable_gqa": True}
            else:  # reads 4x the bytes: reported only if the GQA form does not run
                kk = k.repeat_interleave(HQ // HK, dim=1)
                vv = v.repeat_interleave(HQ // HK, dim=1)
                kw = {}

            def fn(kk=kk, vv=vv, kw=kw, be=be):
                with sdpa_kernel([be]):
                    return sdpa(q, kk, vv, **kw)

            try:
                fn()
                torch.cuda.synchronize()
                fns[name if gqa_mode == "enable_gqa" else name + "_expanded"] = fn
                break
            except Exception as e:  # backend unavailable for this shape
                print(f"# {name} ({gqa_mode}) unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if not flex:
        return fns
    try:
        from bench.common import compiled_flex

        flex_attention = compiled_flex()

        def fn():
            return flex_attention(q, k, v, enable_gqa=True)

        fn()
        torch.cuda.synchronize()
        fns["flex"] = fn
    except Exception as e:  # FlexAttention needs triton and a working inductor
        print(f"# flex unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return fns


def triton_fn(c, splits):
    try:
        from atom_backend import unified
    except ImportError:
        return None
    if not hasattr(unified, "paged_decode"):
        return None
    try:
        out = torch.empty_like(c["q"])
        ws = torch.empty(decode.workspace_elems(splits, c["q"].shape[0], HQ, D), dtype=torch.float32, device="cuda")

        def fn():
            return unified.paged_decode(c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"], max_seqlen_q=1,
                                        num_splits=splits, workspace=ws, out=out, **c["scales"])

        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as e:
        print(f"# triton unified decode failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None


def set_heads(hq: int, hk: int, d: int) -> None:
    """The bench's shape of one layer (the builders and peers read these module values)."""
    global HQ, HK, D
    if hq % hk:
        raise SystemExit(f"--heads {hq}/{hk}: query heads must be a multiple of kv heads")
    HQ, HK, D = hq, hk, d


# Batches beyond one length and one query token (--cases): the gpt-oss layer pair (64 / 8 heads,
# d 64, sink logits; a full layer and a window-128 one over a 32k context, beside the full layer
# at a 128-key context that a window layer should cost about), speculative decode (1 + 3 query
# tokens), and a batch of lengths 1k .. 128k (each request takes its own split count).
CASES = {
    "gptoss_full_8x32k": dict(heads=(64, 8, 64), lengths=(32768,) * 8, sinks=True),
    "gptoss_window128_8x32k": dict(heads=(64, 8, 64), lengths=(32768,) * 8, sinks=True, window=128),
    "gptoss_full_8x128": dict(heads=(64, 8, 64), lengths=(128,) * 8, sinks=True),
    "spec4_8x32k": dict(lengths=(32768,) * 8, query_tokens=4),
    "mixed_1k_128k": dict(lengths=tuple(1024 << i for i in range(8))),
}


def run_case(name: str, spec: dict, platform, cfg, record) -> None:
    """Ours (planner's splits and split rule), the Triton path, and cuDNN on dense KV where it can
    run the case (no sinks or window, one length; 4 query tokens then attend to every key, a
    timing proxy) for one CASES entry, bf16 and FP8 per tensor."""
    from atom_backend.planning import decode_split_rule

    set_heads(*spec.get("heads", (32, 8, 128)))
    lengths, qt, window = spec["lengths"], spec.get("query_tokens", 1), spec.get("window", 0)
    b, longest = len(lengths), max(lengths)
    shape = (b, longest)
    g = torch.Generator(device="cuda").manual_seed(3)
    extra = dict(window=window)
    if spec.get("sinks"):
        extra["sinks"] = torch.randn((HQ,), generator=g, device="cuda", dtype=torch.float32)
    if spec.get("sinks") is None and window == 0 and len(set(lengths)) == 1:
        for peer, fn in sdpa_fns(b, longest).items():
            record(peer, shape, "bf16", 0, bench_ms(fn), kv_bytes(b, longest, 2), name)
    for kv in ("bf16", "fp8_tensor"):
        c = build(b, longest, kv)
        c["sl"] = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        c["q"] = torch.randn((b * qt, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
        c["cu"] = torch.arange(b + 1, dtype=torch.int32, device="cuda") * qt
        facts = dataclasses.replace(facts_for(kv), window=window, has_sinks=bool(spec.get("sinks")))
        splits = decode_splits(b, longest, facts, platform, cfg)
        rule = tuple(decode_split_rule(b, facts, platform, cfg))
        read = sum(min(n, window + qt - 1) if window else n for n in lengths)
        nbytes = 2 * read * HK * D * (2 if kv == "bf16" else 1) + 2 * b * qt * HQ * D * 2
        out = torch.empty_like(c["q"])
        ws = torch.empty(decode.workspace_elems(splits, b * qt, HQ, D), dtype=torch.float32, device="cuda")
        kw = dict(max_query_len=qt, num_splits=splits, split_rule=rule, out=out, workspace=ws, **c["scales"], **extra)

        def ours():
            decode.splitkv_decode(c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"], **kw)

        record("ours", shape, kv, splits, bench_ms(ours), nbytes, name)
        try:
            from atom_backend import unified

            tkw = {k: v for k, v in kw.items() if k != "max_query_len"}
            tkw.update(max_seqlen_q=qt, num_splits=min(splits, 256))  # the Triton path's bound

            def triton():
                unified.paged_decode(c["q"], c["k"], c["v"], c["cu"], c["sl"], c["bt"], **tkw)

            triton()
            record("triton_unified", shape, kv, splits, bench_ms(triton), nbytes, name)
        except Exception as e:  # the Triton path refuses the case: say so, keep going
            print(f"# {name} {kv}: triton unified failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        c.clear()
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time a range of split counts")
    ap.add_argument("--tune", action="store_true", help="also time UNROLL / STAGES alternatives")
    ap.add_argument("--json", default="", help="write all rows to this file")
    ap.add_argument("--compare", action="store_true",
                    help="also time the other kernel (CUDA-core 'fma' vs tensor-core 'mma') at its own suggested splits")
    ap.add_argument("--mma-tune", action="store_true", help="time KTILES / STAGES alternatives of the mma kernel")
    ap.add_argument("--shapes", default="", help="subset, e.g. 64x4096,1x131072 (none: only --cases)")
    ap.add_argument("--heads", default=f"{HQ}/{HK}", help="query / kv heads of one rank, e.g. 8/1")
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--balanced", choices=("auto", "on", "off"), default="auto",
                    help="the tensor-core kernel's balanced splits: where they pay (auto), always, never")
    ap.add_argument("--cases", default="", help=f"also time these CASES (comma-separated, or all): {', '.join(CASES)}")
    args = ap.parse_args(argv)
    set_heads(*(int(x) for x in args.heads.split("/")), args.head_dim)
    global BALANCED
    BALANCED = {"auto": None, "on": True, "off": False}[args.balanced]

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = copy_bandwidth()
    print(f"# device {props.name}, {sms} SMs; copy bandwidth (read + write) {bw / 1e9:.0f} GB/s; heads {HQ}/{HK}, d {D}")
    platform = platform_here()
    cfg = PlannerConfig()
    rows = []

    def record(kind, shape, kv, splits, ms, nbytes, extra=""):
        gbs = nbytes / (ms * 1e-3) / 1e9
        r = dict(kind=kind, batch=shape[0], ctx=shape[1], kv=kv, splits=splits, ms=ms, gbs=gbs,
                 frac_copy=gbs * 1e9 / bw, extra=extra)
        rows.append(r)
        print(f"{kind:22s} {shape[0]:3d}x{shape[1]:<6d} {kv:10s} splits={splits:<3d} {ms * 1e3:9.1f} us "
              f"{gbs:7.0f} GB/s {100 * r['frac_copy']:5.1f}% copy {extra}", flush=True)
        return r

    summary = []
    shapes = SHAPES
    if args.shapes == "none":
        shapes = ()
    elif args.shapes:
        shapes = tuple(tuple(int(x) for x in t.split("x")) for t in args.shapes.split(","))
    arch = "sm_%d%d" % (props.major, props.minor) + ("a" if props.major == 9 else "")
    default_impl = decode.choose_impl(arch, D, 0)

    def sug(b, ctx, impl, elem):
        return wave_splits(b, ctx, decode.MMA_CTAS_PER_SM[elem] if impl == "mma" else decode._CTAS_PER_SM[4])

    for shape in shapes:
        b, ctx = shape
        peers = {}
        for name, fn in sdpa_fns(b, ctx, flex=True).items():
            peers[name] = record(name, shape, "bf16", 0, bench_ms(fn), kv_bytes(b, ctx, 2))
        torch.cuda.empty_cache()
        ours = {}
        for kv in ("bf16", "fp8_tensor", "fp8_page"):
            c = build(b, ctx, kv)
            elem = 2 if kv == "bf16" else 1
            nbytes = kv_bytes(b, ctx, elem)
            if kv == "fp8_page":
                nbytes += 2 * b * -(-ctx // BS) * HK * 4
            planned = decode_splits(b, ctx, facts_for(kv), platform, cfg)
            ours[kv] = record("ours", shape, kv, planned, bench_ms(run_ours(c, planned)), nbytes, "planned")
            if args.compare:
                other = "fma" if default_impl == "mma" else "mma"
                so = sug(b, ctx, other, elem)
                ours[kv + "_" + other] = record("ours_" + other, shape, kv, so, bench_ms(run_ours(c, so, impl=other)),
                                                nbytes, "suggested for " + other)
            if args.mma_tune:
                tunes = [{"KTILES": 1, "STAGES": 2}, {"KTILES": 1, "STAGES": 3}, {"KTILES": 1, "STAGES": 4},
                         {"KTILES": 2, "STAGES": 2}]
                sm = sug(b, ctx, "mma", elem)
                for t in tunes:
                    if kv == "bf16" and t["KTILES"] * t["STAGES"] > 4:
                        continue  # over the shared memory of one SM at 2 CTAs
                    for s_ in sorted({sm, max(1, sm // 2), 2 * sm} if b * HK < 132 * 4 else {sm, 2 * sm}):
                        record("mma_partials", shape, kv, s_,
                               bench_ms(run_ours(c, s_, tune=t, with_combine=False, impl="mma")), nbytes, json.dumps(t))
            if args.sweep:
                for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                    if s != planned and b * HK * s <= 16 * sms * 8:
                        record("ours_sweep", shape, kv, s, bench_ms(run_ours(c, s)), nbytes)
            if args.tune:
                tunes = ([{"UNROLL": 2, "STAGES": 4}, {"UNROLL": 4, "STAGES": 3}, {"UNROLL": 3, "STAGES": 3}] if kv == "bf16"
                         else [{"UNROLL": 4, "STAGES": 3}, {"UNROLL": 2, "STAGES": 6}])
                for t in tunes:
                    record("ours_partials", shape, kv, planned,
                           bench_ms(run_ours(c, planned, source=fma_tuned(t), with_combine=False)), nbytes, json.dumps(t))
                record("ours_partials", shape, kv, planned, bench_ms(run_ours(c, planned, with_combine=False)),
                       nbytes, "default")
            if kv == "bf16":
                # The same batch with its pages placed as a fresh pool (in order) and as vLLM's block
                # pool leaves them after churn (served): what of the gap to the peers' dense KV is
                # page placement (reported beside the shuffled pages, never instead).
                for placement in ("in_order", "served"):
                    co = build(b, ctx, kv, placement=placement)
                    ours["bf16_" + placement] = record("ours_pages_" + placement, shape, kv, planned,
                                                       bench_ms(run_ours(co, planned)), nbytes, "planned")
                    del co
                tf = triton_fn(c, planned)
                if tf is not None:
                    peers["triton_unified"] = record("triton_unified", shape, kv, planned, bench_ms(tf), nbytes)
            del c
            torch.cuda.empty_cache()
        summary.append((shape, ours, peers))

    def placed(ours, peers):
        cols = ""
        for placement in ("in_order", "served"):
            r = ours.get("bf16_" + placement)
            vs = f"{peers['sdpa_cudnn']['ms'] / r['ms']:.3f}x" if r and "sdpa_cudnn" in peers else "-"
            cols += f" {r['ms'] * 1e3 if r else 0:11.1f} {vs:>9}"
        return cols

    print("\n# summary (planner's splits per KV dtype; pages shuffled unless the column says in order or served): time ratios are peer time / our time; "
          "fp8 x = bf16 time / fp8 time")
    print(f"{'shape':>12} {'S':>3} {'bf16 us':>8} {'%copy':>6} {'S8':>3} {'fp8 us':>7} {'fp8 x':>6} {'fp8pg us':>8} "
          f"{'fp8pg x':>7} {'vs cudnn':>9} {'vs flash':>9} {'vs flex':>9} {'vs triton':>9} {'in order us':>11} {'vs cudnn':>9} {'served us':>11} {'vs cudnn':>9}")
    for shape, ours, peers in summary:
        bp, ft, fp = ours["bf16"], ours["fp8_tensor"], ours["fp8_page"]
        ratio = []
        for n in ("sdpa_cudnn", "sdpa_flash", "flex", "triton_unified"):
            key = n if n in peers else (n + "_expanded" if n + "_expanded" in peers else None)
            ratio.append(f"{peers[key]['ms'] / bp['ms']:.3f}x{'(e)' if key.endswith('expanded') else ''}" if key else "-")
        print(f"{shape[0]:>4}x{shape[1]:<7} {bp['splits']:>3} {bp['ms'] * 1e3:8.1f} {100 * bp['frac_copy']:6.1f} "
              f"{ft['splits']:>3} {ft['ms'] * 1e3:7.1f} {bp['ms'] / ft['ms']:6.2f} {fp['ms'] * 1e3:8.1f} "
              f"{bp['ms'] / fp['ms']:7.2f} " + " ".join(f"{r:>9}" for r in ratio) + placed(ours, peers))
    names = list(CASES) if args.cases == "all" else [n for n in args.cases.split(",") if n]
    if names:
        print("\n# cases (extra column: the case)")
    for name in names:
        run_case(name, CASES[name], platform, cfg, record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bw=bw, device=props.name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
