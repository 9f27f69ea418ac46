"""The Hopper prefill kernel of the working tree against the one of a git revision, in one process.

    python -m bench.ab --base REV_OR_FILE [--rounds 6] [--only d128] [--define NAME=VALUE] [--fp8]
                       [--fp8-config num_warps=8,f16_scores=0] [--base-fp8-config num_warps=8,f16_scores=0]

The base kernel (`varlen_prefill_hopper.hip` at git revision REV with that revision's
hip_kernels/src headers, or the source file FILE with the working tree's) is written to a private
overlay directory (bench/overlay.py), removed at exit; it builds with the working tree's
hip_kernels/include and launcher, so its kernel must take the same parameters (checked). The device
machine's copy of the repository may carry an older .git than this one: there, pass a file (`git show
REV:hip_kernels/src/varlen_prefill_hopper.hip > ab_base.hip` here; untracked files travel), whose
headers are then the working tree's.
Three variants time the bench.prefill shapes: `base`, `base'` (the same source again: the
harness's own noise) and `work` (the working tree, with --define, and the FP8 tile of --fp8-config).
Both bases build the working tree's FP8 tiles, or those of --base-fp8-config: a base from before the
f16-score tiles (docs/perf/prefill.md 2026-11-26, "FP8 on f16 scores") needs `--base-fp8-config num_warps=8,f16_scores=0`, its own tile.
Every round times each shape with the variants in a rotated order: the variant timed first after
a pause gets the best clocks (an identical copy timed second read 0.96-1.01 of the first; docs/perf/
prefill.md 2026-11-25, "a per-unit timeline"), so a fixed order would favour it. Reported: the median TFLOP/s over rounds
and the ratios to `base`; read `work / base` against `base' / base`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
from pathlib import Path

from bench.common import parse_defines, rotated, tflops

SRC_DIR = Path(__file__).resolve().parents[1] / "hip_kernels" / "src"
KERNEL = "varlen_prefill_hopper.hip"


def summary(tflops: dict, names: list) -> dict:
    """{shape: {name: (median TFLOP/s, ratio to names[0])}} from {(shape, name): [TFLOP/s per round]},
    over the shapes every variant timed (one a variant cannot build is left out)."""
    out = {}
    for shape in dict.fromkeys(s for s, _ in tflops):
        if any((shape, n) not in tflops for n in names):
            continue
        med = {n: statistics.median(tflops[(shape, n)]) for n in names}
        out[shape] = {n: (med[n], med[n] / med[names[0]]) for n in names}
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=SRC_DIR.parents[1], check=True, capture_output=True, text=True).stdout


def base_source(rev_or_file: str) -> str:
    """The Hopper kernel's source: the file at this path, or at this git revision."""
    if Path(rev_or_file).is_file():
        return Path(rev_or_file).read_text()
    return _git("show", f"{rev_or_file}:hip_kernels/src/{KERNEL}")


def base_headers(rev_or_file: str) -> dict:
    """{name: text} of hip_kernels/src's headers at that git revision ({} for a file: the working tree's)."""
    if Path(rev_or_file).is_file():
        return {}
    names = _git("ls-tree", "--name-only", f"{rev_or_file}:hip_kernels/src").split()
    return {n: _git("show", f"{rev_or_file}:hip_kernels/src/{n}") for n in names if n.endswith(".h")}


def parameters(src: str) -> str:
    """The kernel's parameter list, whitespace-normalised (the launcher passes the working tree's)."""
    head = src[src.index("varlen_prefill_hopper(") + len("varlen_prefill_hopper("):]
    return " ".join(head[: head.index(")")].split())


def _config_fields(text: str | None) -> dict:
    """'num_warps=12,block_n=64' -> {'num_warps': 12, 'block_n': 64} (prefill.Config fields)."""
    pairs = parse_defines(text.split(",") if text else [])
    if not all(v.lstrip("-").isdigit() for _, v in pairs):
        raise SystemExit(f"--fp8-config {text!r}: FIELD=INT,... expected")
    return {name: int(v) for name, v in pairs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision or source file of the base kernel (default HEAD)")
    ap.add_argument("--rounds", type=int, default=6, help="a multiple of 3: each variant leads equally often")
    ap.add_argument("--only", default=None, help="only shapes whose label contains this text")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the work variant")
    ap.add_argument("--fp8", action="store_true",
                    help="also the FP8-compute rows (per page, per tensor) of the FP8 shapes and the soft-cap one")
    ap.add_argument("--fp8-config", default=None, help="FIELD=INT,... of the work variant's FP8 tile (prefill.Config)")
    ap.add_argument("--base-fp8-config", default=None, help="FIELD=INT,... of the base variants' FP8 tile")
    args = ap.parse_args(argv)

    import torch

    from atom_backend.catalog import tuning
    from bench import prefill as bp
    from bench import overlay
    from bench.common import bench_ms, device_name, serving_build
    from hip_kernels import prefill
    from hip_kernels.runtime import KernelCompileError

    tuning.apply(prefill._default_arch())  # the tiles a serving process uses
    base = base_source(args.base)
    if parameters(base) != parameters((SRC_DIR / KERNEL).read_text()):
        raise SystemExit(f"the base kernel ({args.base}) takes other parameters than the working tree's")
    headers = base_headers(args.base)
    sources = {"base": overlay.write_text("ab_base.hip", base, headers, "ab_base"),
               "base'": overlay.write_text("ab_base_again.hip", base, headers, "ab_base"), "work": None}
    work_defines = parse_defines(args.define)
    work_fp8 = _config_fields(args.fp8_config)
    base_fp8 = _config_fields(args.base_fp8_config)
    variants = list(sources)

    def build(name, d, window=0, fp8=None):
        """The tile serving uses for the shape, from variant `name`'s source (and defines, FP8 tile)."""
        fields = (work_fp8 if name == "work" else base_fp8) if fp8 else {}
        b = serving_build(d, window, fp8, defines=work_defines if name == "work" else (), **fields)
        return dataclasses.replace(b, source=sources[name]) if b.config.wgmma else b

    torch.manual_seed(0)
    print(f"device: {device_name()}  base {args.base}  work defines {dict(parse_defines(args.define))}  "
          f"work FP8 tile {work_fp8 or 'as declared'}  base FP8 tile {base_fp8 or 'as declared'}", flush=True)
    runs = []  # (label, make_fn(name), pairs, d, hq)
    for label, seqs, hq, hk, d, kw in bp.SHAPES:
        if args.only and args.only not in label:
            continue
        q, k, v, cu_q, cu_k = bp.make(seqs, hq, hk, d)
        okw = bp.kernel_options(kw, hq)
        pairs = sum(bp.visible_pairs(a, b, kw.get("window", 0)) for a, b in seqs)
        runs.append((label, lambda n, s=seqs, t=(q, k, v, cu_q, cu_k), o=okw, w=kw.get("window", 0):
                     bp.run_ours(s, *t, build=build(n, t[0].shape[2], w), **o), pairs, d, hq))
        if args.fp8 and (label in bp.FP8_SHAPES or "softcap" in kw):
            for per_page, tag in ((True, "fp8"), (False, "fp8 per tensor")):
                cache = bp.fp8_paged(k, v, seqs, per_page=per_page)
                runs.append((f"{label} {tag}", lambda n, s=seqs, c=cache, qq=q, o=dict(kw):
                             bp.run_fp8(s, qq, c, with_gather=False, build=lambda sc: build(n, qq.shape[2], 0, sc),
                                        **o), pairs, d, hq))
    names = variants
    tf, dropped = {}, set()
    for rnd in range(args.rounds):
        for label, make_fn, pairs, d, hq in runs:
            for name in rotated(names, rnd):
                if label in dropped:
                    break
                fn = make_fn(name)
                try:
                    fn()
                except KernelCompileError as e:
                    # The tile tables and hip_kernels/include are the working tree's for every variant: a
                    # base from before a declared tile or a change there cannot build some shapes. They
                    # are left out.
                    print(f"{name} cannot build {label!r}; the shape is left out: {str(e)[:300]}", flush=True)
                    dropped.add(label)
                    break
                except RuntimeError as e:  # a launch failure leaves the device unusable
                    raise SystemExit(f"{name} failed on {label!r}: {e}")
                torch.cuda.synchronize()
                tf.setdefault((label, name), []).append(tflops(pairs, d, hq, bench_ms(fn, rep_ms=100)))
    print(f"\n| shape | {' | '.join(names)} | base' / base | work / base |")
    print("| --- |" + " ---: |" * (len(names) + 2))
    for label, row in summary(tf, names).items():
        print(f"| {label} | " + " | ".join(f"{row[n][0]:.1f}" for n in names)
              + f" | {row[names[1]][1]:.3f} | {row['work'][1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
