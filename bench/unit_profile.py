"""Where a work unit's time goes in the Hopper prefill kernel, per shape and compute path.

    python -m bench.unit_profile [--only TEXT] [--rounds]

Builds the Hopper kernel with profiling stamps (a bench overlay of hip_kernels/src/varlen_prefill_hopper.hip,
bench/overlay.py: `profile_source`): one thread of each consumer warpgroup adds clock64 deltas per
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
and `share`, the boundary's part of the warpgroup's time. With --rounds (level 2) a second table
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
removal buys at most its share (docs/perf/prefill.md, 2026-11-26, "where an FP8 work unit's cycles go"). Counters are per SM clock; the run is
the shape's, once, after a warm-up.
"""

from __future__ import annotations

import argparse

SEGMENTS = ("take", "q", "k0", "turn", "s0", "tiles", "epi")  # the kernel's prof_seg order
SPLIT = {"setup": 16, "qwait": 17, "quant": 18}  # the parts of a unit's start before `q` (P_SETUP, P_QWAIT, P_QUANT)
COLUMNS = ("take", "setup", "qwait", "quant", "q", "k0", "turn", "s0", "epi")  # the table's per-unit columns
UNITS, ITERS, END = 7, 8, 9  # its other slots: units, tiles, the tail after the last unit
ROUND = {"kv": 10, "rturn": 11, "issue": 12, "swait": 13, "soft": 14, "pvwait": 15, "rest": 5}  # a round's parts
ROW, WORDS = 23, 24  # the row-written flag; u64 per warpgroup row (the kernel's P_ROW, PROF_WORDS)


# The stamps: a struct after the kernel's includes, then marks at anchors of its skeleton (each anchor occurs
# once; bench/overlay.py). mark(seg) adds the cycles since the last mark to segment seg; rmark only at level 2
# (a round's parts: the marks cost a tile ~25%, so the split is relative).
PROFILE = """
#if ATOM_HAS_WGMMA
namespace atom_prefill {
// the kernel's segments in SEGMENTS' order, then the unit and tile counts, the round's parts, a unit's start
// and a flag that the warpgroup's row is written
enum prof_seg { P_TAKE, P_Q, P_K0, P_TURN, P_S0, P_TILES, P_EPI, P_UNITS, P_ITERS, P_END,
                R_KV, R_TURN, R_ISSUE, R_SWAIT, R_SOFT, R_PVWAIT, P_SETUP, P_QWAIT, P_QUANT, P_ROW = 23, PROF_WORDS };
// Segment seg of this warpgroup's row of lse (as [CTA][warpgroup][PROF_WORDS] u64; lse's values are not
// written), added to by its first thread: a reduction, no wait.
struct unit_profile {
  u64* row;
  bool on;
  u64 t;
  static ATOM_DEV u64 now() { u64 c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory"); return c; }
  ATOM_DEV unit_profile(float* lse, int grp) : row(reinterpret_cast<u64*>(lse) + ((i64)bid_x() * NWG + grp) * PROF_WORDS),
      on(lse != nullptr && tid_x() % 128 == 0), t(now()) {}
  ATOM_DEV void add(int seg, u64 v) { if (on) atomicAdd(row + seg, v); }
  ATOM_DEV void mark(int seg) { const u64 c = now(); add(seg, c - t); t = c; }
  ATOM_DEV void rmark(int seg) { if (LEVEL >= 2) mark(seg); }
};
}  // namespace atom_prefill
#endif
"""
# (anchor, text inserted after it) in the skeleton; "^" inserts before the anchor instead
MARKS = (
    ('#include "hopper_epilogue.h"   // normalise, lse, O out\n', PROFILE),
    ("    const float k_scale = KV_FP8 == 1 ? kv_scale[0] : 1.f, v_scale = KV_FP8 == 1 ? kv_scale[1] : 1.f;\n",
     "    unit_profile prof(lse, grp);\n"),
    ("    for (;; ++un) {\n", "      prof.mark(P_EPI);  // the last unit's epilogue, to here\n"),
    ("\n      if (!u.live) break;\n", "      prof.mark(P_TAKE);\n"),
    ("^      wg::mbar_wait(sh.fullQ + qs, (qn / QST) & 1);\n", "      prof.mark(P_SETUP);\n"),
    ("      wg::mbar_wait(sh.fullQ + qs, (qn / QST) & 1);\n", "      prof.mark(P_QWAIT);\n"),
    ("        if (h == 0) sh.sQsc[r] = qsc;\n", "        prof.mark(P_QUANT);\n"),
    ("^#pragma unroll\n      for (int s = 0; s < acc_t::row_slots; ++s) a_eff[s]",
     "      prof.mark(P_Q);\n      prof.add(P_UNITS, 1);\n      prof.add(P_ITERS, (u64)n_iter);\n"),
    ("        st.wait_k(0);\n", "        prof.mark(P_K0);\n"),
    ("        turn.wait();\n        wg::fence();\n        mma.s(0);\n        turn.pass();\n",
     "        prof.mark(P_S0);\n"),
    ("^        wg::fence();\n        mma.s(0);\n", "        prof.mark(P_TURN);\n"),
    ("        gs.load(0);\n        wg::wait<0>();\n", "        prof.rmark(R_SWAIT);\n"),
    ("^        finish(alpha, rs, vfac);\n        // Round it", "        prof.rmark(R_SOFT);\n"),
    ("^        // Round it: S(it)", "        prof.rmark(P_TILES);\n"),
    ("          st.wait_v(it - 1);\n", "          prof.rmark(R_KV);\n"),
    ("^          wg::fence();\n          mma.s(it);\n", "          prof.rmark(R_TURN);\n"),
    ("          mma.pv(it - 1, pa);\n          turn.pass();\n", "          prof.rmark(R_ISSUE);\n"),
    ("          wg::wait<1>();  // S(it) done; the softmax overlaps O += P V of tile it - 1\n", "          prof.rmark(R_SWAIT);\n"),
    ("^          wg::wait<0>();\n          st.free_v(it - 1);\n", "          prof.rmark(R_SOFT);\n"),
    ("^          st.free_v(it - 1);\n", "          prof.rmark(R_PVWAIT);\n"),
    ("          if (kHalfPart && mma.restart(it)) pro.promote();\n", "          prof.rmark(P_TILES);\n"),
    ("          st.wait_v(n_iter - 1);\n", "          prof.rmark(R_KV);\n"),
    ("^          wg::fence();\n          pro.before(n_iter - 1);\n", "          prof.rmark(R_TURN);\n"),
    ("          mma.pv(n_iter - 1, pa);\n          turn.pass();\n", "          prof.rmark(R_ISSUE);\n"),
    ("^        st.free_v(n_iter - 1);\n", "        prof.rmark(R_PVWAIT);\n"),
    ("      base += n_unit;\n", "      prof.mark(P_TILES);\n"),
    ("^    turn.finish();\n", "    prof.mark(P_END);\n    prof.add(P_ROW, 1);\n"),
)
# lse holds the rows: the epilogue does not write it
EPILOGUE = ("        if (lse != nullptr && acc_t::row_leader()", "        if (false && lse != nullptr && acc_t::row_leader()")


def profile_source(level: int = 1) -> str:
    """The path of the Hopper kernel with the stamps (level 2: a round's parts too)."""
    from bench import overlay

    edits = [overlay.before(a[1:], t) if a.startswith("^") else overlay.after(a, t.replace("LEVEL", str(level)))
             for a, t in MARKS]
    return overlay.write("varlen_prefill_hopper.hip", edits, f"profile{level}",
                         {"hopper_epilogue.h": [overlay.replace(*EPILOGUE)]})


def summarize(rows: list) -> dict:
    """Per-unit cycles of each segment, `tile`, `boundary` and `share`, from the kernel's rows
    ([WORDS] ints each; rows it did not write, flag 0, and warpgroups without units are left out)."""
    rows = [r for r in rows if r[ROW] and r[UNITS]]
    if not rows:
        raise ValueError("no warpgroup row written: was the kernel built from profile_source?")
    units = sum(r[UNITS] for r in rows)
    out = {s: sum(r[i] for r in rows) / units for i, s in enumerate(SEGMENTS)}
    out.update({s: sum(r[i] for r in rows) / units for s, i in SPLIT.items()})
    iters = sum(r[ITERS] for r in rows)
    for name, i in ROUND.items():  # level 1: all in `rest`
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
    ap.add_argument("--rounds", action="store_true", help="also split a tile into its parts (level 2)")
    args = ap.parse_args()

    import torch

    from atom_backend.catalog import tuning
    from bench import prefill as bp
    from bench.common import device_name, serving_build
    from hip_kernels import prefill

    tuning.apply(prefill._default_arch())
    source = profile_source(2 if args.rounds else 1)

    def build(d, window=0, fp8=None):  # the tile serving uses, from the stamped source
        return serving_build(d, window, fp8, source=source)

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
        paths = [("bf16", lambda lse: bp.run_ours(seqs, q, k, v, cu_q, cu_k, lse_out=lse, build=build(d, kw.get("window", 0)),
                                                  **okw))]
        if label in bp.FP8_SHAPES or "softcap" in kw:
            for per_page, tag in ((True, "fp8 per page"), (False, "fp8 per tensor")):
                cache = bp.fp8_paged(k, v, seqs, per_page=per_page)
                paths.append((tag, lambda lse, c=cache: bp.run_fp8(seqs, q, c, with_gather=False, lse_out=lse,
                                                                 build=lambda sc: build(d, 0, sc), **kw)))
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


if __name__ == "__main__":
    main()
