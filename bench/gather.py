"""`python -m bench.gather`: paged-KV gather bandwidth vs the device's measured copy bandwidth.

Bytes counted: every K and V element read from the cache once and written once to the packed
output (fp8: 1 byte read, 2 written). Pages are a random permutation of the pool. The peer is
torch's own index gather (`index_select` over a precomputed slot index, index build excluded).
Acceptance (issue #4): >= 80% of copy bandwidth for 32 x 8k tokens, 8 kv heads, d=128, page 16, bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import bench_ms, copy_bandwidth_gbs, device_name
from hip_kernels import runtime
from hip_kernels import gather as gmod
from hip_kernels.gather import gather_kv

SHAPES = [
    # name, requests, tokens each, kv heads, head dim, page size, layout, kv dtype ("bf16" | "fp8_page" | "fp8_tensor")
    ("32x8k h8 d128 p16 bf16 vllm", 32, 8192, 8, 128, 16, "vllm", "bf16"),
    ("32x8k h8 d128 p1 bf16 sglang", 32, 8192, 8, 128, 1, "sglang", "bf16"),
    ("32x8k h8 d128 p16 fp8/page->bf16", 32, 8192, 8, 128, 16, "vllm", "fp8_page"),
    ("32x8k h8 d128 p16 fp8/tensor->bf16", 32, 8192, 8, 128, 16, "vllm", "fp8_tensor"),
    ("32x8k h1 d64 p16 bf16 vllm", 32, 8192, 1, 64, 16, "vllm", "bf16"),
    ("8x2k h8 d128 p16 bf16 vllm", 8, 2048, 8, 128, 16, "vllm", "bf16"),
    ("4x32k h8 d128 p1024 bf16 vllm", 4, 32768, 8, 128, 1024, "vllm", "bf16"),
]


def run_shape(name, nreq, ntok, h, d, ps, layout, kvd, check=True):
    dev = "cuda"
    pages_per = -(-ntok // ps)
    nb = nreq * pages_per + 7
    fp8 = kvd.startswith("fp8")
    f8 = runtime.native_fp8_dtype(runtime.device_arch(0))
    cache_dtype = f8 if fp8 else torch.bfloat16
    kv = torch.randn(2, nb, ps, h, d, device=dev).to(cache_dtype)
    k_cache, v_cache = kv[0], kv[1]
    perm = torch.randperm(nb, device=dev)[: nreq * pages_per].to(torch.int32)
    table = perm.view(nreq, pages_per).contiguous()
    cu = torch.arange(nreq + 1, device=dev, dtype=torch.int32) * ntok
    total = nreq * ntok
    tables = (dict(block_table=table) if layout == "vllm"
              else dict(kv_indptr=torch.arange(nreq + 1, device=dev, dtype=torch.int32) * pages_per,
                        kv_page_indices=perm.contiguous()))
    scales = {}
    if kvd == "fp8_page":
        scales = dict(k_descale=torch.rand(nb, h, device=dev) + 0.5, v_descale=torch.rand(nb, h, device=dev) + 0.5)
    elif kvd == "fp8_tensor":
        scales = dict(k_scale=torch.tensor([0.7], device=dev), v_scale=torch.tensor([1.3], device=dev))
    k_out = torch.empty(total, h, d, dtype=torch.bfloat16, device=dev)
    v_out = torch.empty_like(k_out)

    def ours():
        gather_kv(k_cache, v_cache, cu, total, k_out=k_out, v_out=v_out, **tables, **scales)

    # Peer: torch index gather of the same rows (no dequant: it only moves the bytes).
    t = torch.arange(ntok, device=dev)
    slots = (table.long()[:, t // ps] * ps + (t % ps)[None]).reshape(-1)
    kflat, vflat = k_cache.reshape(nb * ps, h, d), v_cache.reshape(nb * ps, h, d)
    pk, pv = torch.empty(total, h, d, dtype=cache_dtype, device=dev), torch.empty(total, h, d, dtype=cache_dtype, device=dev)

    def peer():
        torch.index_select(kflat, 0, slots, out=pk)
        torch.index_select(vflat, 0, slots, out=pv)

    ours()
    torch.cuda.synchronize()
    if check:
        peer()
        if fp8:
            if kvd == "fp8_page":
                pg = table.long()[:, t // ps].reshape(-1)
                ks = scales["k_descale"][pg][:, :, None]
                want = (pk.float() * ks).to(torch.bfloat16)
            else:
                want = (pk.float() * 0.7).to(torch.bfloat16)
            ok = torch.equal(k_out, want)
        else:
            ok = torch.equal(k_out, pk) and torch.equal(v_out, pv)
        if not ok:
            raise AssertionError(f"{name}: gather output differs from torch's index gather")
    in_b = kv.element_size()
    nbytes = 2 * total * h * d * (in_b + 2)  # K and V: read + write
    ms = bench_ms(ours)
    peer_ms = bench_ms(peer)
    peer_bytes = 2 * total * h * d * 2 * in_b
    return dict(shape=name, ms=ms, gbs=nbytes / ms / 1e6, bytes=nbytes, peer_ms=peer_ms,
                peer_gbs=peer_bytes / peer_ms / 1e6)


_CHILD = '''
import time, torch
torch.zeros(1, device="cuda")
from hip_kernels import runtime, gather
t = time.perf_counter()
import cuda.bindings.driver  # once per process, like importing torch
t1 = time.perf_counter()
runtime.load(gather.variant("vllm", False))
print(t1 - t, time.perf_counter() - t1)
'''


def load_times() -> dict:
    """Seconds to get a launchable kernel: cold compile, disk-cache hit (same process, memo
    cleared), in-process memo, and disk hit from a fresh process with ATOM_NO_COMPILE=1."""
    old = os.environ.get("ATOM_KERNEL_CACHE")
    with tempfile.TemporaryDirectory() as d:
        os.environ["ATOM_KERNEL_CACHE"] = d
        try:
            v = gmod.variant("vllm", False)
            runtime.clear_memo()
            t = time.perf_counter(); runtime.load(v); cold = time.perf_counter() - t
            runtime.clear_memo()
            t = time.perf_counter(); runtime.load(v); disk = time.perf_counter() - t
            t = time.perf_counter(); runtime.load(v); memo = time.perf_counter() - t
            env = {**os.environ, "ATOM_NO_COMPILE": "1", "PYTHONPATH": os.getcwd()}
            r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
            imp, fresh = (map(float, r.stdout.split()[-2:]) if r.returncode == 0 else (float("nan"),) * 2)
            if r.returncode:
                print(r.stderr[-2000:])
        finally:
            if old is None:
                os.environ.pop("ATOM_KERNEL_CACHE", None)
            else:
                os.environ["ATOM_KERNEL_CACHE"] = old
            runtime.clear_memo()
    return dict(cold_s=cold, disk_hit_s=disk, memo_s=memo, new_process_disk_hit_s=fresh,
                new_process_cuda_bindings_import_s=imp)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--only", default=None, help="substring filter on shape names")
    args = ap.parse_args(argv)
    lt = load_times()
    copy = copy_bandwidth_gbs()
    rows = []
    for s in SHAPES:
        if args.only and args.only not in s[0]:
            continue
        r = run_shape(*s)
        r["frac_copy"] = r["gbs"] / copy
        r["peer_frac_copy"] = r["peer_gbs"] / copy
        rows.append(r)
        torch.cuda.empty_cache()
    print(f"device: {device_name()}   measured copy bandwidth: {copy:.0f} GB/s (read + write)")
    print(f"{'shape':38s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} | {'torch idx ms':>12s} {'GB/s':>7s} {'%copy':>6s}")
    for r in rows:
        print(f"{r['shape']:38s} {r['ms']:8.3f} {r['gbs']:7.0f} {100 * r['frac_copy']:5.1f}% | "
              f"{r['peer_ms']:12.3f} {r['peer_gbs']:7.0f} {100 * r['peer_frac_copy']:5.1f}%")
    print(f"kernel load: cold compile {lt['cold_s'] * 1e3:.1f} ms, disk-cache hit {lt['disk_hit_s'] * 1e3:.2f} ms, "
          f"new process disk hit {lt['new_process_disk_hit_s'] * 1e3:.2f} ms (+ one-time cuda-bindings import "
          f"{lt['new_process_cuda_bindings_import_s'] * 1e3:.1f} ms), memo {lt['memo_s'] * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(), "copy_gbs": copy, "load": lt, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
