"""SM clock, board power and throttle reasons while one prefill path runs without pause, per shape.

    python -m bench.clocks [--only TEXT] [--seconds 4]

For each bench.prefill shape that has FP8 rows (or --only's), times our bf16 kernel and the FP8 kernel
(per page, per tensor; no gather) back to back for --seconds each while `nvidia-smi` samples the GPU
every 50 ms, and prints the medians of the samples taken under load with the sustained TFLOP/s.
Under a power cap (throttle reason `sw_power_cap`), a path's clock is set by its energy per cycle: the
ratio of two paths' TFLOP/s is then their cycles-per-row ratio times their clock ratio (H100 at 700 W:
docs/perf/prefill.md, 2026-11-26, "both kernels run at the 700 W power cap"). Needs nvidia-smi (NVIDIA
only).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

# newer drivers name the reasons clocks_event_reasons (the older name is deprecated there)
REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")
# NVML's clocksThrottleReasons bits
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def reasons(mask: int) -> list:
    """Names of the throttle reasons set in an NVML mask (unknown bits as hex)."""
    names = [n for bit, n in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize(lines: list) -> dict:
    """Medians of `nvidia-smi --query-gpu=<query()> --format=csv,noheader,nounits` sample lines, and every
    throttle reason seen; lines that do not parse (a partial last line, [N/A]) are skipped."""
    clk, pw, temp, mask = [], [], [], 0
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) != 4:
            continue
        try:
            c, p, m, t = float(f[0]), float(f[1]), int(f[2], 16), float(f[3])
        except ValueError:
            continue
        clk.append(c)
        pw.append(p)
        temp.append(t)
        mask |= m
    if not clk:
        raise ValueError("no nvidia-smi sample parsed")
    return {"mhz": statistics.median(clk), "watts": statistics.median(pw), "celsius": statistics.median(temp),
            "reasons": reasons(mask), "samples": len(clk)}


def query() -> str:
    """The --query-gpu fields: clock, power, throttle reasons (the name this driver takes), temperature."""
    for field in REASON_FIELDS:
        q = f"clocks.sm,power.draw,{field},temperature.gpu"
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True,
                           text=True)
        if r.returncode == 0:
            return q
    raise SystemExit(f"nvidia-smi takes none of {REASON_FIELDS}: {r.stdout.strip() or r.stderr.strip()}")


def sustained(fn, seconds: float, fields: str) -> tuple:
    """(summary of the samples taken while fn ran, ms per call) over `seconds` of back-to-back calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    # the first samples may predate the load's power state, the last one its end
    return summarize(lines[4:-1] if len(lines) > 8 else lines), start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="only shapes whose label contains this text")
    ap.add_argument("--seconds", type=float, default=4.0, help="run time of each path")
    args = ap.parse_args()
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("bench.clocks needs nvidia-smi")
    fields = query()

    import torch

    from atom_backend.catalog import tuning
    from bench import prefill as bp
    from bench.common import device_name, tflops
    from hip_kernels import prefill

    tuning.apply(prefill._default_arch())
    torch.manual_seed(0)
    print(f"device: {device_name()}; medians of nvidia-smi samples under {args.seconds:g} s of back-to-back calls\n")
    print("| shape | path | TFLOP/s | SM MHz | W | C | throttle reasons |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for label, seqs, hq, hk, d, kw in bp.SHAPES:
        if (args.only and args.only not in label) or (not args.only and label not in bp.FP8_SHAPES):
            continue
        q, k, v, cu_q, cu_k = bp.make(seqs, hq, hk, d)
        pairs = sum(bp.visible_pairs(a, b, kw.get("window", 0)) for a, b in seqs)
        paths = [("bf16", bp.run_ours(seqs, q, k, v, cu_q, cu_k, **bp.kernel_options(kw, hq)))]
        if label in bp.FP8_SHAPES or "softcap" in kw:
            for per_page, tag in ((True, "fp8 per page"), (False, "fp8 per tensor")):
                paths.append((tag, bp.run_fp8(seqs, q, bp.fp8_paged(k, v, seqs, per_page=per_page), with_gather=False, **kw)))
        for tag, fn in paths:
            s, ms = sustained(fn, args.seconds, fields)
            print(f"| {label} | {tag} | {tflops(pairs, d, hq, ms):.1f} | {s['mhz']:.0f} | {s['watts']:.0f} | "
                  f"{s['celsius']:.0f} | {', '.join(s['reasons']) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
