"""`python -m bench.fp8_long`: FP8 compute's accuracy on long requests (docs/fp8.md "Long requests").

The FP8 tensor cores keep ~14 bits when they add into their accumulator, so a sum over many key
tiles drops its small terms once it is large against them: O's when V has a mean (it then grows
like l; the Hopper kernel moves O to fp32 every 1024 keys, O_PROMOTE), l's when the tensor cores
sum P (per tile; the f16-score tiles do). One
request per shape, 32/8 heads, d128, causal bottom-right, random normal Q and K, V ~ N(offset, 1);
FP8 compute (gather_kv_fp8 + the kernel) per page and per tensor (scale from the data's largest
value; the tiles as declared), and per tensor on the two-warpgroup fp32-score tile with its row sums by
the tensor cores too (a bench build: ROWSUM_EDITS, bench/overlay.py); next to them, 16-bit compute over the same per-page cache (the dequantizing gather + the bf16 kernel). The
reference is float32 attention on the dequantized cache. Prints the relative error and max |err| /
max |V| of each; the bound of docs/fp8.md is rel 5e-2 (docs/design.md's 16-bit bound for the last row).

    PYTHONPATH=. python -m bench.fp8_long [--shapes 512x65536,16384x16384] [--offsets 0,2]
"""

from __future__ import annotations

import argparse

import torch

from bench import prefill as bp

# The Hopper kernel with P's row sums by the tensor cores on fp32 scores too (shipped: f16 scores only).
ROWSUM_EDITS = {"hopper_config.h": [("constexpr bool kRowsumMma = S_F16 && (KV_FP8 == 1 || kFoldV);",
                                     "constexpr bool kRowsumMma = KV_FP8 == 1 || kFoldV;  // bench.fp8_long")]}


def rowsum_source() -> str:
    """The path of that bench build of the Hopper kernel."""
    from bench import overlay

    return overlay.write("varlen_prefill_hopper.hip", [], "rowsum",
                         {h: [overlay.replace(a, b) for a, b in e] for h, e in ROWSUM_EDITS.items()})


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     chunk: int = 1024) -> torch.Tensor:
    """float32 causal attention (bottom-right) of one request: q [sq, hq, d], k / v [sk, hk, d],
    queries in chunks so that a 64k-key request fits (GQA: hq a multiple of hk)."""
    sq, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    kk = k.float().repeat_interleave(hq // hk, dim=1).permute(1, 0, 2)  # [hq, sk, d]
    vv = v.float().repeat_interleave(hq // hk, dim=1).permute(1, 0, 2)
    out = torch.empty(sq, hq, d, device=q.device)
    keys = torch.arange(sk, device=q.device)[None, :]
    for i0 in range(0, sq, chunk):
        qc = q[i0:i0 + chunk].float().permute(1, 0, 2)
        s = torch.matmul(qc, kk.transpose(1, 2)) * scale
        last = torch.arange(i0, i0 + qc.shape[1], device=q.device)[:, None] + (sk - sq)  # each row's last key
        s.masked_fill_(keys > last, float("-inf"))
        out[i0:i0 + qc.shape[1]] = torch.matmul(torch.softmax(s, dim=-1), vv).permute(1, 0, 2)
    return out


def main(argv=None) -> None:
    from atom_backend.tolerances import errors

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x65536,8192x32768,16384x16384", help="sq x sk, comma separated")
    ap.add_argument("--offsets", default="0,2", help="V's means (its standard deviation is 1)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    offsets = [float(x) for x in args.offsets.split(",")]
    from bench.common import serving_build

    torch.manual_seed(0)
    print(f"{'sq x sk':>13} {'V mean':>6}  {'mode':<24} {'rel':>7} {'max/maxV':>9}", flush=True)
    for sq, sk in shapes:
        for off in offsets:
            seqs = [(sq, sk)]
            q, k, v, _, _ = bp.make(seqs, 32, 8, 128)
            v = (v.float() + off).to(v.dtype)
            amax = max(k.abs().max().item(), v.abs().max().item())
            for mode in ("per_page", "per_tensor", "per_tensor fp32-score tile", "per_page dequant+bf16"):
                per_page = mode.startswith("per_page")
                cache = bp.fp8_paged(k, v, seqs, per_page=per_page, tensor_scale=amax / 448)
                kc, vc, table, _, scales = cache
                kd, vd = (bp._dequant_torch(c, table, seqs, scales, w) for c, w in ((kc, "k"), (vc, "v")))
                build = None
                if "fp32" in mode:  # the two-warpgroup fp32-score tile, its row sums by the tensor cores too
                    build = lambda sc: serving_build(128, 0, sc, source=rowsum_source(), num_warps=8, f16_scores=False)
                if mode.endswith("bf16"):
                    out = bp.run_dequant(seqs, q, cache)().float()
                else:
                    out = bp.run_fp8(seqs, q, cache, with_gather=True, build=build)().float()
                rel, mx = errors(out, causal_reference(q, kd, vd, 128 ** -0.5))
                print(f"{sq:>6}x{sk:<6} {off:>6.1f}  {mode:<24} {rel:>7.4f} {mx / vd.abs().max().item():>9.4f}",
                      flush=True)
                del cache, kc, vc, kd, vd, out
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
