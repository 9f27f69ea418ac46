"""`python -m bench.stream_probe`: which read engine moves paged KV at the memory's speed.

The decode kernel's copies alone (its dry build, bench.decode_profile.mma_source) are 1.5-2.6% slower than SDPA cuDNN's whole
decode (docs/perf/decode.md, 2026-11-23, "FP8 in 2-warp CTAs ... what the copies cost"), so no change to the math can reach cuDNN. This probe
times the kernels of bench/stream_probe.cu (the same K + V bytes of the 64 x 4k acceptance shape,
one CTA per kv head and request, no math) beside cuDNN's decode and our own kernel (full and
dry), all as CUDA-graph replays in one process. NVIDIA Hopper only (tensor maps, nvcc on PATH).
It times data movement only: the engines keep no result (the register engine folds a checksum so
that its loads stay), so it proves nothing about attention and is no test.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import subprocess
import tempfile

import numpy as np
import torch

from bench.common import bench_ms, copy_bandwidth_gbs, graphed
from bench.decode import D, HK, build, run_ours, sdpa_fns
from bench.decode_profile import mma_source, planned_splits

SRC = pathlib.Path(__file__).with_name("stream_probe.cu")
PAGE = 16
KERNELS = ("warp_ring", "page_heads", "cta_ring", "tma_nhd", "tma_hnd", "bulk_hnd", "regs")


@functools.lru_cache(maxsize=None)
def _build_dir() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="stream_probe_"))


def load(nst: int, chunk_pages: int, mimic: int = 0):
    """The probe module for one (stages, pages per stage), built by nvcc for sm_90a."""
    import cupy as cp

    out = _build_dir() / f"probe_{nst}_{chunk_pages}_{mimic}.cubin"
    cmd = ["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", f"-DNST={nst}",
           f"-DCHUNK_PAGES={chunk_pages}", f"-DMIMIC={mimic}", f"-DPAGE={PAGE}", f"-DROWB={2 * D}", "-o", str(out), str(SRC)]
    subprocess.run(cmd, check=True)
    return cp.RawModule(path=str(out))


def tensor_map(t: torch.Tensor, dims, strides, box) -> torch.Tensor:
    """A bf16 tiled tensor map over t (cuTensorMapEncodeTiled), copied to device memory."""
    from cuda.bindings import driver as cu

    err, m = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), t.data_ptr(), [cu.cuuint64_t(x) for x in dims],
        [cu.cuuint64_t(x) for x in strides], [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * len(dims), cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
    words = np.array([int(w) for w in m.opaque], dtype=np.uint64).view(np.int64)
    return torch.from_numpy(words).cuda()


def caches(batch: int, ctx: int, sequential: bool):
    """K and V pools in both page layouts (random bf16), a page table and the tensor maps."""
    pages = ctx // PAGE
    n = batch * pages
    g = torch.Generator(device="cuda").manual_seed(0)
    nhd = [torch.randn((n, PAGE, HK, D), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    hnd = [x.permute(0, 2, 1, 3).contiguous() for x in nhd]  # [n, HK, PAGE, D]
    perm = torch.arange(n, device="cuda") if sequential else torch.randperm(n, generator=g, device="cuda")
    table = perm.to(torch.int32).view(batch, pages)
    try:
        maps = {
            "nhd": [tensor_map(x, (D, HK, n * PAGE), (2 * D, 2 * D * HK), (D, 1, PAGE)) for x in nhd],
            "hnd": [tensor_map(x, (D, n * HK * PAGE), (2 * D,), (D, PAGE)) for x in hnd],
        }
    except Exception as e:  # the copy engines without tensor maps still run
        print(f"# tensor maps unavailable: {type(e).__name__}: {e}", flush=True)
        maps = None
    return {"nhd": nhd, "hnd": hnd, "table": table, "pages": pages, "maps": maps}


def launcher(mod, name: str, c, layout: str, nst: int, chunk_pages: int, min_smem: int = 0):
    import cupy as cp

    fn = mod.get_function(name)
    k, v = c[layout]
    km, vm = c["maps"][layout] if c["maps"] else (k, v)  # unused by the engines without maps
    if layout == "nhd":
        page_b, tok_b, head_b = PAGE * HK * 2 * D, HK * 2 * D, 2 * D
    else:
        page_b, tok_b, head_b = HK * PAGE * 2 * D, 2 * D, PAGE * 2 * D
    pageb = PAGE * 2 * D
    if name in ("warp_ring", "page_heads"):
        smem = 4 * nst * 2 * pageb
    elif name == "regs":
        smem = 0
    else:
        smem = nst * 2 * chunk_pages * pageb + (8 * nst if name != "cta_ring" else 0)
    smem = max(smem, min_smem)  # padding caps the CTAs per SM (e.g. at decode_mma's 2)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = c["table"]
    args = (np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), np.uint64(table.data_ptr()), np.int32(table.shape[1]),
            np.int32(c["pages"]), np.int64(page_b), np.int64(tok_b), np.int64(head_b), np.uint64(km.data_ptr()),
            np.uint64(vm.data_ptr()), np.int32(HK), np.uint64(sink.data_ptr()))
    grid = (HK, table.shape[0])

    def run():
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn(grid, (128,), args, shared_mem=smem)

    run._keep = (sink,)
    return run, smem


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64x4096")
    ap.add_argument("--configs", default="2x1,3x1,2x2,3x2,2x4,3x4", help="stages x pages per stage, comma-separated")
    ap.add_argument("--sequential", action="store_true", help="pages in order")
    args = ap.parse_args(argv)
    batch, ctx = (int(x) for x in args.shape.split("x"))
    nbytes = 2 * batch * ctx * HK * D * 2
    bw = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name()}, copy {bw:.0f} GB/s; {args.shape}, K+V {nbytes / 2**20:.0f} MiB, "
          f"pages {'in order' if args.sequential else 'shuffled'}", flush=True)

    def report(label, t_ms, ref=None):
        gbs = nbytes / (t_ms * 1e-3) / 1e9
        vs = f"  x cuDNN {ref / t_ms:5.3f}" if ref else ""
        print(f"{label:34s} {t_ms * 1e3:7.1f} us  {gbs:6.0f} GB/s  {gbs / bw * 100:5.1f}% copy{vs}", flush=True)

    t_cudnn = bench_ms(graphed(sdpa_fns(batch, ctx)["sdpa_cudnn"]))
    report("sdpa_cudnn (dense)", t_cudnn)
    torch.cuda.empty_cache()
    c = build(batch, ctx, "bf16", placement="in_order" if args.sequential else "shuffled")
    s = planned_splits(batch, ctx)
    report(f"ours, decode (S={s})", bench_ms(graphed(run_ours(c, s))), t_cudnn)
    report(f"ours, partials (S={s})", bench_ms(graphed(run_ours(c, s, with_combine=False))), t_cudnn)
    report(f"ours, partials dry mma (S={s})", bench_ms(graphed(run_ours(c, s, with_combine=False, impl="mma",
                                                                   source=mma_source(dry=True)))), t_cudnn)
    del c
    torch.cuda.empty_cache()

    c = caches(batch, ctx, args.sequential)
    for cfg in args.configs.split(","):
        nst, cp_ = (int(x) for x in cfg.split("x"))
        mod = load(nst, cp_)
        for name in KERNELS:
            if name in ("warp_ring", "page_heads", "regs") and cp_ != 1:
                continue  # these take one page per warp per stage
            if name == "page_heads" and (HK != 8 or c["pages"] % HK):
                continue  # two heads per warp of four, whole pages split over HK CTAs
            for layout in (("nhd",) if name == "page_heads" else ("nhd", "hnd") if name in ("warp_ring", "cta_ring", "regs") else
                           (("nhd",) if name == "tma_nhd" else ("hnd",))):
                if (name == "regs" and nst != 2) or (name.startswith("tma") and c["maps"] is None):
                    continue
                try:
                    run, smem = launcher(mod, name, c, layout, nst, cp_)
                    t = bench_ms(graphed(run))
                except Exception as e:  # one engine failing must not hide the others
                    print(f"{name} {layout} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                report(f"{name:9s} {layout} st{nst} x{cp_}p {smem // 1024}KB", t, t_cudnn)
        if cp_ == 1:  # the current kernel's addressing on the same ring
            run, smem = launcher(load(nst, 1, mimic=1), "warp_ring", c, "nhd", nst, 1)
            report(f"warp_ring nhd st{nst} MIMIC {smem // 1024}KB", bench_ms(graphed(run)), t_cudnn)
            for name in ("warp_ring", "page_heads"):
                run, smem = launcher(mod, name, c, "nhd", nst, 1, min_smem=100 * 1024)
                report(f"{name} nhd st{nst} 2 CTAs/SM {smem // 1024}KB", bench_ms(graphed(run)), t_cudnn)


if __name__ == "__main__":
    main()
