"""Where a work unit's time goes in the Hopper prefill kernel, per shape and compute path.

    python -m bench.unit_profile [--only TEXT] [--rounds] [--define NAME=VALUE ...]

Builds the kernel with UNIT_PROFILE=1 (2 with --rounds): one thread of each consumer warpgroup adds clock64 deltas per
segment of its unit loop into the lse buffer (its values are then not written; O is). Per unit of a
warpgroup, in cycles:

    take   the unit's slot from the scheduler ring
    setup  the unit's setup (its key walk, its rows' positions), to Q's wait
    qwait  Q's wait
    quant  FP8: Q's quantization to e4m3 in shared memory
    q      the rest of Q's part (FP8: the quantization's barrier, the rows' scales)
    k0     K(0)'s wait
    turn   the ping-pong turn before S(0)
    s0     S(0)'s issue
    epi    the epilogue (O, lse), to the next unit's start
and `tile`, the cycles of one of the unit's rounds (S, softmax, P V), `boundary` (all but the tiles)
and `share`, the boundary's part of the warpgroup's time. With --rounds (UNIT_PROFILE=2) a second table
splits a tile, per tile:

    kv      the round's K and V waits
    rturn   its ping-pong turn
    issue   its MMAs' issue (S(i), P V(i - 1))
    swait   S(i)'s wait
    soft    the softmax (and P's operand with two P buffers)
    pvwait  P V(i - 1)'s wait
    rest    O's rescale, P's operand, the promotion
(tile 0's S wait and softmax count here too). Its seven marks a round slow a tile by about a quarter
(FP8 per page 4x4k: 2731 -> 3486 cycles): the split says where a round waits, not what it costs.
These are one warpgroup's latencies: the other warpgroups' MMAs may run under them, so a segment's
removal buys at most its share (docs/perf/prefill.md, stop 45). Counters are per SM clock; the run is
the shape's, once, after a warm-up. --define adds a timing-only switch to the builds (DIAG_ENERGY).
"""

from __future__ import annotations

import argparse
import dataclasses

SEGMENTS = ("take", "q", "k0", "turn", "s0", "tiles", "epi")  # the kernel's prof_seg order
SPLIT = {"setup": 16, "qwait": 17, "quant": 18}  # the parts of a unit's start before `q` (P_SETUP, P_QWAIT, P_QUANT)
COLUMNS = ("take", "setup", "qwait", "quant", "q", "k0", "turn", "s0", "epi")  # the table's per-unit columns
UNITS, ITERS, END = 7, 8, 9  # its other slots: units, tiles, the tail after the last unit
ROUND = {"kv": 10, "rturn": 11, "issue": 12, "swait": 13, "soft": 14, "pvwait": 15, "rest": 5}  # a round's parts
ROW, WORDS = 23, 24  # the row-written flag; u64 per warpgroup row (the kernel's P_ROW, PROF_WORDS)


def summarize(rows: list) -> dict:
    """Per-unit cycles of each segment, `tile`, `boundary` and `share`, from the kernel's rows
    ([WORDS] ints each; rows it did not write, flag 0, and warpgroups without units are left out)."""
    rows = [r for r in rows if r[ROW] and r[UNITS]]
    if not rows:
        raise ValueError("no warpgroup row written: was the kernel built with UNIT_PROFILE=1?")
    units = sum(r[UNITS] for r in rows)
    out = {s: sum(r[i] for r in rows) / units for i, s in enumerate(SEGMENTS)}
    out.update({s: sum(r[i] for r in rows) / units for s, i in SPLIT.items()})
    iters = sum(r[ITERS] for r in rows)
    for name, i in ROUND.items():  # UNIT_PROFILE=1: all in `rest`
        out[name] = sum(r[i] for r in rows) / max(iters, 1)
    out["tile"] = sum(out[n] for n in ROUND)
    out["tiles"] = out["tile"] * iters / units
    out["tiles_per_unit"] = iters / units
    out["units_per_wg"] = units / len(rows)
    out["boundary"] = sum(out[s] for s in COLUMNS)
    out["share"] = out["boundary"] / (out["boundary"] + out["tiles"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="only shapes whose label contains this text")
    ap.add_argument("--rounds", action="store_true", help="also split a tile into its parts (UNIT_PROFILE=2)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the builds (a timing-only switch)")
    args = ap.parse_args()

    import torch

    from atom_backend.catalog import tuning
    from bench import prefill as bp
    from bench.common import device_name, hopper_tables, parse_defines
    from hip_kernels import prefill

    tuning.apply(prefill._default_arch())
    tables = hopper_tables()
    declared = [dict(t) for t in tables]
    for t, d in zip(tables, declared):
        for hd, cfg in d.items():
            t[hd] = dataclasses.replace(cfg, extra=cfg.extra + (("UNIT_PROFILE", 2 if args.rounds else 1),)
                                        + parse_defines(args.define))
    prefill._variant.cache_clear()
    try:
        torch.manual_seed(0)
        # every CTA's warpgroup rows: CTAs per SM x consumer warpgroups <= 3 x 3 (hip_kernels/prefill.py)
        need = torch.cuda.get_device_properties(0).multi_processor_count * 9 * WORDS * 8
        print(f"device: {device_name()}; cycles per unit of a warpgroup\n")
        print("| shape | path | units / WG | tiles / unit | " + " | ".join(COLUMNS) + " | boundary | tile | share |")
        print("| --- | --- |" + " ---: |" * (len(COLUMNS) + 5))
        rounds = []
        for label, seqs, hq, hk, d, kw in bp.SHAPES:
            if args.only and args.only not in label:
                continue
            q, k, v, cu_q, cu_k = bp.make(seqs, hq, hk, d)
            okw = bp.kernel_options(kw, hq)
            paths = [("bf16", lambda lse: bp.run_ours(seqs, q, k, v, cu_q, cu_k, lse_out=lse, **okw))]
            if label in bp.FP8_SHAPES or "softcap" in kw:
                for per_page, tag in ((True, "fp8 per page"), (False, "fp8 per tensor")):
                    cache = bp.fp8_paged(k, v, seqs, per_page=per_page)
                    paths.append((tag, lambda lse, c=cache: bp.run_fp8(seqs, q, c, with_gather=False, lse_out=lse, **kw)))
            for tag, make_fn in paths:
                lse = torch.zeros(q.shape[0], hq, dtype=torch.float32, device="cuda")
                if lse.numel() * 4 < need:
                    raise SystemExit(f"{label}: lse holds {lse.numel() * 4} bytes, the profile rows {need}")
                fn = make_fn(lse)
                fn()  # build, load, warm
                lse.zero_()
                fn()
                torch.cuda.synchronize()
                words = lse.view(torch.int64).flatten()
                rows = words[: words.numel() // WORDS * WORDS].view(-1, WORDS).tolist()
                r = summarize(rows)
                print(f"| {label} | {tag} | {r['units_per_wg']:.1f} | {r['tiles_per_unit']:.1f} | "
                      + " | ".join(f"{r[s]:.0f}" for s in COLUMNS)
                      + f" | {r['boundary']:.0f} | {r['tile']:.0f} | {r['share']:.3f} |", flush=True)
                rounds.append(f"| {label} | {tag} | " + " | ".join(f"{r[n]:.0f}" for n in ROUND) + f" | {r['tile']:.0f} |")
        if args.rounds:
            print("\ncycles per tile of a warpgroup\n")
            print("| shape | path | " + " | ".join(ROUND) + " | tile |")
            print("| --- | --- |" + " ---: |" * (len(ROUND) + 1))
            print("\n".join(rounds), flush=True)
    finally:
        for t, d in zip(tables, declared):
            t.clear()
            t.update(d)
        prefill._variant.cache_clear()


if __name__ == "__main__":
    main()
