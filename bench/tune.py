"""`python -m bench.tune`: time the candidate tile configurations of every kernel that has more
than one, over a shape grid, and write ``atom_backend/catalog/tables/tuning_<arch>.json``.

    PYTHONPATH=. python -m bench.tune [--quick] [--out DIR]

Kernels with candidates: ``varlen_prefill`` per (head dim, window class): "full" (causal, no or
a long window) and "small" (sliding window <= ``prefill.SMALL_WINDOW``), the portable body's tiles of
those kinds in ``prefill.PORTABLE_TILES``, and on Hopper "wgmma" / "wgmma_small" (``HOPPER_TILES``'
"full" / "small": the Hopper kernel, which replaces "full" / "small" there). Each candidate runs as
an explicit build (``varlen_attention(build=prefill.Build(tile))``). Every candidate is compiled first (one that does not compile is listed
with its error and skipped), checked against the declared default's output on the first shape
(max abs difference <= 2e-2 on bf16: a wrong-but-fast tile never wins), then timed on every
shape of its class; the winner has the least total time, and replaces the declared default
only when it is at least ``MIN_GAIN`` (3%) faster (run-to-run noise on H100 is 1-3%: a table
must not churn tiles on noise). The registry applies the table at run
time (atom_backend/catalog/tuning.py); an arch without one keeps the declared defaults.

--quick: head dim 64 only, one shape per class (GPU smoke test). Full run: about a minute on H100.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import bench_ms, device_name

DT = torch.bfloat16
MIN_GAIN = 1.03


def candidates(prefill, d: int, cls: str) -> list:
    C = prefill.Config
    if cls in ("wgmma", "wgmma_small"):  # consumer warpgroups x K/V tile x stages x Q buffers
        declared = prefill.HOPPER_TILES.get("full" if cls == "wgmma" else "small", d)
        grid = [C(w, n, s, wgmma=True, q_stages=qs, ctas=ct) for w in ((8, 12) if cls == "wgmma" else (4, 8, 12))
                for n in ((64, 128) if cls == "wgmma" else (64,)) for s in (2, 3) for qs in (1, 2)
                for ct in ((0, 3) if w == 4 else (0,))]
        fits = [c for c in grid if c.smem_bytes(d) <= 227 * 1024 and c.ctas_per_sm * (c.smem_bytes(d) + 1024) <= 228 * 1024]
        return list(dict.fromkeys([declared] + fits))
    declared = [prefill.PORTABLE_TILES.get("full", d), prefill.PORTABLE_TILES.get("small", d)]
    extra = {64: [C(4, 64, 2, 2), C(4, 64, 3, 1), C(8, 64, 2, 2), C(4, 64, 3, 2), C(4, 64, 2, 1), C(4, 32, 3, 2)],
             128: [C(8, 64, 3), C(4, 64, 3), C(8, 64, 2), C(8, 32, 3, 2), C(4, 32, 3, 2)],
             256: [C(8, 32, 2), C(4, 32, 2)]}.get(d, [])
    out = []
    for c in declared + extra:
        if c is not None and c not in out:
            out.append(c)
    return out


def shapes(cls: str, d: int, quick: bool):
    """(label, [(sq, sk)...], hq, hk, window) of one class."""
    hq, hk = (64, 8) if d == 64 else (32, 8)
    if cls in ("full", "wgmma"):
        s = [("4x4k causal", [(4096, 4096)] * 4, hq, hk, 0), ("8x1k new / 4k cached", [(1024, 4096)] * 8, hq, hk, 0)]
    else:
        s = [("4x4k window 128", [(4096, 4096)] * 4, hq, hk, 128), ("16x512 new / 2k cached w128", [(512, 2048)] * 16, hq, hk, 128)]
    return s[:1] if quick else s


def choose(d: int, cls: str, measured: list, default: dict, shape_labels: list) -> dict:
    """The table row of one (head dim, class): the fastest candidate if it beats the declared
    default by MIN_GAIN, else the default."""
    ok = [e for e in measured if "total_ms" in e]
    best = min(ok, key=lambda e: e["total_ms"])
    dflt = next((e for e in ok if e["config"] == default), None)
    gain = dflt["total_ms"] / best["total_ms"] if dflt else None
    chosen = best["config"] if gain is None or gain >= MIN_GAIN else default
    return {"head_dim": d, "window_class": cls, "dtype": "bf16", "config": chosen, "default": default,
            "fastest": best["config"], "speedup_vs_default": round(gain, 3) if gain else None,
            "min_gain": MIN_GAIN, "shapes": shape_labels, "candidates": measured}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="directory for the table (default: atom_backend/catalog/tables)")
    ap.add_argument("--family", action="store_true",
                    help="write the arch family's table (tuning_<family>.json, read by the family's cards without "
                         "one of their own) instead of this device's (tuning_<family>_<device>.json)")
    args = ap.parse_args(argv)
    from atom_backend.catalog import build, tables, tuning
    from bench.prefill import make
    from hip_kernels import prefill, runtime

    arch = runtime.device_arch()
    t0 = time.perf_counter()
    head_dims = [64] if args.quick else [64, 128]
    base = tuning.defaults()  # the table is measured against the declared tiles, not against itself
    hopper = arch in prefill.WGMMA_ARCHS
    classes = ("full", "small") + (("wgmma", "wgmma_small") if hopper else ())
    # on Hopper the Hopper tiles replace "full" / "small" where they exist: those would not run
    replaced = {"full": tuning.declared_table("wgmma"), "small": tuning.declared_table("wgmma_small")}
    plan = [(d, cls) for d in head_dims for cls in classes
            if (d, cls) in base and not (hopper and d in replaced.get(cls, {}))]
    # compile every candidate first, in parallel (both dtypes are not needed: bf16 only)
    jobs = {}
    for d, cls in plan:
        for c in candidates(prefill, d, cls):
            jobs[(d, c)] = prefill._variant(d, 0, False, c)
    res = build.run([build.Job(arch, list(dict.fromkeys(jobs.values())))], progress=False)
    failed = {r.name: r.error for r in res if r.error}
    print(f"{device_name()} ({arch}): {len(res)} candidate variants compiled, {len(failed)} failed", flush=True)
    rows = []
    for d, cls in plan:
        sh = shapes(cls, d, args.quick)
        tables_ms = []
        ref = None
        for cfg in candidates(prefill, d, cls):
            name = jobs[(d, cfg)].name
            entry = {"config": tuning.config_to_dict(cfg)}
            if name in failed:
                entry["error"] = failed[name].splitlines()[0][:200]
                tables_ms.append(entry)
                continue
            tile = prefill.Build(cfg)
            total = 0.0
            try:
                for i, (label, seqs, hq, hk, w) in enumerate(sh):
                    q, k, v, cu_q, cu_k = make(seqs, hq, hk, d)
                    sinks = torch.randn(hq, dtype=torch.float32, device="cuda")
                    work = prefill.work_items([a for a, _ in seqs], [b for _, b in seqs], head_dim=d, window=w,
                                              tile=cfg).cuda()
                    mq, mk = max(a for a, _ in seqs), max(b for _, b in seqs)
                    out = torch.empty_like(q)
                    fn = lambda: prefill.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
                                                          window=w, sinks=sinks, out=out, work=work, build=tile)
                    if i == 0:
                        torch.manual_seed(1)
                        fn()
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = (q.clone(), k.clone(), v.clone(), sinks.clone(), out.clone())
                        else:
                            q.copy_(ref[0]), k.copy_(ref[1]), v.copy_(ref[2]), sinks.copy_(ref[3])
                            fn()
                            err = (out.float() - ref[4].float()).abs().max().item()
                            if not err <= 2e-2:
                                raise RuntimeError(f"output differs from the default tile's by {err:.3g}")
                    ms = bench_ms(fn, warmup_ms=10, rep_ms=60)
                    entry.setdefault("ms", {})[label] = round(ms, 4)
                    total += ms
                entry["total_ms"] = round(total, 4)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:200]
            tables_ms.append(entry)
            print(f"  d{d} {cls:5s} {entry['config']}: " + (f"{total:.3f} ms" if "error" not in entry else entry["error"]),
                  flush=True)
        ok = [e for e in tables_ms if "total_ms" in e]
        if not ok:
            continue
        rows.append(choose(d, cls, tables_ms, tuning.config_to_dict(base[(d, cls)]), [s[0] for s in sh]))
        print(f"d{d} {cls}: fastest {rows[-1]['fastest']} ({rows[-1]['speedup_vs_default']}x the default), "
              f"chosen {rows[-1]['config']}", flush=True)
    body = {"kernels": {"varlen_prefill": rows}, "seconds": round(time.perf_counter() - t0, 1)}
    cmd = "python -m bench.tune" + (" --quick" if args.quick else "")
    p = tables.write("tuning", arch, body, cmd, device_name(), args.out, family=args.family)
    print(f"wrote {p} in {time.perf_counter() - t0:.0f} s")
    return body


if __name__ == "__main__":
    main(sys.argv[1:])
