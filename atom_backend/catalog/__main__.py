"""python -m atom_backend.catalog {list, check, build, tables}

    list   [--json] [--arch A]                  every declared variant (the registry)
    check  --arch A (--model CONFIG | flags)     per path: the variants a model needs, or the reason
    build  --arch A [--arch B ...] [--model CONFIG | flags] [-j N] [--dry-run]
                                                 compile them into $ATOM_KERNEL_CACHE, and the
                                                 unified path's declared Triton tiles for A
    tables [--arch A] [--device NAME]            which tuning / cost tables apply (or the defaults)

CONFIG: a Hugging Face config.json (or its directory). Flags instead: --heads, --kv-heads,
--head-dim, --dtype, --kv-dtype (comma list: auto,fp8), --sinks, --window W or
--layer-windows 0,128 (a repeating per-layer pattern), --page-size, --softcap. With neither,
build compiles every declared variant of the arch (what the container images do when no model
is given at image build time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model (a config.json, or flags)")
    g.add_argument("--model", help="Hugging Face config.json or model directory")
    g.add_argument("--heads", type=int, help="query heads (per tensor-parallel rank)")
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--dtype", help="query dtype: bf16 | fp16 (default: the config's, else bf16)")
    g.add_argument("--kv-dtype", default="auto", help="KV cache dtypes to serve, comma list: auto,fp8 (default auto)")
    g.add_argument("--kv-scale", default="per_tensor", choices=("per_tensor", "per_page"))
    g.add_argument("--sinks", action="store_true", default=None, help="per-head sink logits (gpt-oss)")
    g.add_argument("--window", type=int, help="sliding window of every layer")
    g.add_argument("--layer-windows", help="per-layer windows, a repeating pattern: 0,128")
    g.add_argument("--page-size", type=int)
    g.add_argument("--softcap", type=float)
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size: heads per rank = heads / tp")
    g.add_argument("--max-query-tokens", type=int, default=None,
                   help="decode query tokens (speculative decoding; default ATOM_DECODE_MAX_QUERY_TOKENS or 1)")


def _spec(args):
    from atom_backend.catalog import model

    if args.model:
        spec = model.from_hf_config(args.model)
    elif args.heads and args.head_dim:
        spec = model.ModelSpec(args.heads, args.kv_heads or args.heads, args.head_dim, name="flags")
    elif any(getattr(args, k) for k in ("heads", "kv_heads", "head_dim")):
        raise SystemExit("flags need at least --heads and --head-dim (or give --model CONFIG)")
    else:
        return None
    if args.heads and args.model:
        spec.num_q_heads = args.heads
    if args.kv_heads and args.model:
        spec.num_kv_heads = args.kv_heads
    if args.tp > 1:
        spec.num_q_heads //= args.tp
        spec.num_kv_heads = max(1, spec.num_kv_heads // args.tp)
    if args.dtype:
        spec.dtype = model._DTYPES.get(args.dtype, args.dtype)
    spec.kv_dtypes = tuple(x.strip() for x in args.kv_dtype.split(",") if x.strip())
    spec.kv_scale_mode = args.kv_scale
    if args.sinks:
        spec.has_sinks = True
    if args.layer_windows:
        n = len(spec.layer_windows) if args.model else None
        spec.layer_windows = model.parse_layer_windows(args.layer_windows, n)
    elif args.window is not None:
        spec.layer_windows = (args.window,) * max(1, len(spec.layer_windows))
    if args.page_size:
        spec.page_size = args.page_size
    if args.softcap is not None:
        spec.softcap = args.softcap
    return spec


def _max_q(args) -> int:
    if args.max_query_tokens:
        return args.max_query_tokens
    from atom_backend.planning import PlannerConfig

    return PlannerConfig.from_env().decode_max_query_tokens


def cmd_list(args) -> int:
    from atom_backend.catalog import registry

    rows = registry.entries(args.arch)
    if args.json:
        print(json.dumps([e.as_dict() for e in rows], indent=1))
        return 0
    hdr = f"{'kernel':15s} {'q':5s} {'kv':13s} {'scale':20s} {'d':>4s} {'pages':8s} {'features':36s} {'role':16s} {'archs':30s} tile"
    print(hdr)
    print("-" * len(hdr))
    for e in rows:
        pages = "packed" if e.page_sizes == (0, 0) else f"{e.page_sizes[0]}..{e.page_sizes[1]}"
        tile = ",".join(f"{k}={v}" for k, v in e.tile)
        print(f"{e.kernel:15s} {e.q_dtype:5s} {e.kv_dtype:13s} {'/'.join(e.scale_modes):20s} {e.head_dim or 'any':>4} "
              f"{pages:8s} {','.join(sorted(e.features)):36s} {e.role:16s} {','.join(e.archs):30s} {tile}")
    variants = len({(e.variant, a) for e in rows for a in e.archs})
    print(f"\n{len(rows)} rows, {variants} (variant, arch) builds; validation rules in order: "
          + ", ".join(f"{r.what} -> {r.reason}" for r in __import__('atom_backend.planning.rules', fromlist=['RULES']).RULES))
    return 0


def cmd_check(args) -> int:
    from atom_backend.catalog import registry, tuning

    spec = _spec(args)
    if spec is None:
        raise SystemExit("check needs --model CONFIG or --heads/--head-dim flags")
    print(spec.describe())
    for arch in args.arch or ["sm_90a"]:
        tuning.apply(arch)
        for facts in spec.facts(arch):
            sel = registry.select(facts, arch, max_query_tokens=_max_q(args))
            print(f"[{sel.arch}] kv {facts.kv_dtype} ({facts.kv_scale_mode}):")
            for path in ("varlen", "splitkv"):
                if path in sel.refusals:
                    print(f"  {path:8s} -> unified, reason {sel.refusals[path]}")
                else:
                    print(f"  {path:8s} " + ", ".join(v.name for v in sel.variants[path]))
    return 0


def cmd_build(args) -> int:
    from atom_backend.catalog import build

    if not args.arch:
        raise SystemExit("build needs --arch (sm_90a, gfx942, gfx950, gfx1250; repeatable)")
    spec = _spec(args)
    if spec is not None:
        print(spec.describe(), file=sys.stderr)
    jobs = build.plan_build(args.arch, None if spec is None else spec.facts, _max_q(args))
    for j in jobs:
        for what, path, r in j.refusals:
            print(f"[{j.arch}] {what}: {path} not built here ({r}); those requests run on the Triton path",
                  file=sys.stderr)
    for j in jobs:
        if j.triton_skip:
            print(f"[{j.arch}] unified (triton): skipped, {j.triton_skip}", file=sys.stderr)
    if args.dry_run:
        for j in jobs:
            for v in j.variants + j.triton:
                print(f"{j.arch:8s} {j.why.get(v.name, ''):24s} {v.name}")
        return 0
    t0 = time.perf_counter()
    workers = args.jobs or None
    try:
        results = build.run(jobs, workers, progress=not args.quiet)
    except Exception as e:  # ToolchainMissingError names what to install
        print(f"atom build: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    import os

    used = max(1, min(workers or os.cpu_count() or 1, len(results) or 1))
    print(build.summary(results, time.perf_counter() - t0, used))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return 1 if any(r.error for r in results) else 0


def cmd_tables(args) -> int:
    from atom_backend.planning import rules

    from atom_backend.catalog import tables
    for arch in args.arch or list(rules.ARCHS):
        for kind in tables.KINDS:
            data = tables.load(kind, arch, args.device)
            if data is None:
                what = ("defaults: hip_kernels.prefill PORTABLE_TILES / HOPPER_TILES" if kind == "tuning"
                        else "none: threshold routing (ATOM_VARLEN_MIN_NEW_TOKENS, ATOM_MAX_GATHER_RATIO)")
                print(f"{rules.arch_family(arch):8s} {kind:7s} {what}")
            else:
                pb = data.get("produced_by", {})
                print(f"{rules.arch_family(arch):8s} {kind:7s} {data['_path']} ({pb.get('date', '?')}, "
                      f"{pb.get('device', '?')}: {pb.get('command', '?')})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atom_backend.catalog", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="print the registry")
    p.add_argument("--json", action="store_true")
    p.add_argument("--arch")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("check", help="what a model needs per path, or the reason")
    p.add_argument("--arch", action="append", default=[])
    _model_args(p)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("build", help="compile into the kernel cache")
    p.add_argument("--arch", action="append", default=[])
    p.add_argument("-j", "--jobs", type=int, default=0, help="processes (default: all cores)")
    p.add_argument("--dry-run", action="store_true", help="list what would be compiled")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", help="write per-variant results here")
    _model_args(p)
    p.set_defaults(fn=cmd_build)
    p = sub.add_parser("tables", help="which tuning / cost tables apply")
    p.add_argument("--arch", action="append", default=[])
    p.add_argument("--device", default="", help="a device's name, e.g. \"NVIDIA H200\" (its own tables first)")
    p.set_defaults(fn=cmd_tables)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
