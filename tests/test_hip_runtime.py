"""hip_kernels.runtime without a GPU: disk cache (hits, restarts, concurrency, keys, damage),
ATOM_NO_COMPILE, compile errors, missing toolchains, launch-argument packing, wrapper checks."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hip_kernels import runtime
from hip_kernels.runtime import Variant
from hip_kernels.runtime import cache as rt_cache
from hip_kernels.runtime import launch as rt_launch
from hip_kernels.runtime import toolchains as rt_toolchains
from hip_kernels.runtime import variant as rt_variant

REPO = Path(__file__).resolve().parents[1]

GOOD = r"""
#include "atom_device.h"
#ifndef SCALE
#define SCALE 1
#endif
extern "C" __global__ void probe(float* o, long long n) {
  long long i = (long long)atom::bid_x() * atom::bdim_x() + atom::tid_x();
  if (i < n) o[i] = SCALE * atom::exp2_((float)i);
}
"""


def _nvrtc_or_skip():
    try:
        runtime.toolchain_for("sm_90a")
    except runtime.ToolchainMissingError:
        pytest.skip("NVRTC not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(d))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    runtime.clear_memo()
    yield d
    runtime.clear_memo()


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "probe.hip"
    p.write_text(GOOD)
    return p


def test_variant_normalises_defines():
    a = Variant("x.hip", "k", {"B": 2, "A": True})
    b = Variant("x.hip", "k", [("A", 1), ("B", "2")])
    assert a == b and hash(a) == hash(b)
    assert a.name == "k[A=1,B=2]"
    with pytest.raises(ValueError, match="bad define name"):
        Variant("x.hip", "k", {"A-B": 1})


def test_second_load_hits_disk_cache_fast(cache, src):
    _nvrtc_or_skip()
    v = Variant(str(src), "probe", {"SCALE": 3})
    first = runtime.compile_variant(v, "sm_90a")
    assert not first.cache_hit and first.path.exists()
    runtime.clear_memo()  # only the disk cache is left
    t0 = time.perf_counter()
    second = runtime.compile_variant(v, "sm_90a")
    dt = time.perf_counter() - t0
    assert second.cache_hit and second.binary == first.binary
    # Acceptance bound of issue #4 (generous against a cold compile of ~100 ms+).
    assert dt < 0.05, f"cache hit took {dt * 1e3:.1f} ms"


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=300,
    )


def test_cache_survives_process_restart(cache, src):
    _nvrtc_or_skip()
    v = Variant(str(src), "probe", {"SCALE": 5})
    runtime.compile_variant(v, "sm_90a")
    # A new process that may not compile must find the entry.
    r = _child(
        f"""
        from hip_kernels import runtime
        c = runtime.compile_variant(runtime.Variant({str(src)!r}, "probe", {{"SCALE": 5}}), "sm_90a")
        assert c.cache_hit
        print("HIT", len(c.binary))
        """,
        {"ATOM_KERNEL_CACHE": str(cache), "ATOM_NO_COMPILE": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "HIT" in r.stdout


def test_concurrent_compiles_leave_one_valid_entry(cache, src):
    _nvrtc_or_skip()
    code = f"""
        from hip_kernels import runtime
        c = runtime.compile_variant(runtime.Variant({str(src)!r}, "probe", {{"SCALE": 7}}), "sm_90a")
        import hashlib; print(hashlib.sha256(c.binary).hexdigest())
        """
    env = {**os.environ, "PYTHONPATH": str(REPO), "ATOM_KERNEL_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    digests = {o.strip() for o, _ in outs}
    assert len(digests) == 1
    entries = list(cache.glob("probe-sm_90a-*.bin"))
    assert len(entries) == 1
    assert rt_cache._read_entry(entries[0]) is not None
    assert not list(cache.glob("*.tmp")), "temporary files left behind"


def test_cache_key_tracks_source_defines_arch(cache, src):
    _nvrtc_or_skip()
    v = Variant(str(src), "probe", {"SCALE": 2})
    k0 = runtime.cache_key(v, "sm_90a")
    assert runtime.cache_key(Variant(str(src), "probe", {"SCALE": 2}), "sm_90a") == k0
    assert runtime.cache_key(Variant(str(src), "probe", {"SCALE": 3}), "sm_90a") != k0
    assert runtime.cache_key(v, "sm_80") != k0
    src.write_text(GOOD + "\n// edited\n")
    assert runtime.cache_key(v, "sm_90a") != k0
    # An edited source really recompiles (no stale hit).
    assert not runtime.compile_variant(v, "sm_90a").cache_hit


def test_cache_key_tracks_headers(cache, src, monkeypatch, tmp_path):
    _nvrtc_or_skip()
    v = Variant(str(src), "probe")
    k0 = runtime.cache_key(v, "sm_90a")
    extra = tmp_path / "extra.h"
    extra.write_text("// a header\n")
    files = rt_variant.header_files()
    monkeypatch.setattr(rt_cache, "header_files", lambda: files + [extra])
    k1 = runtime.cache_key(v, "sm_90a")
    assert k1 != k0
    extra.write_text("// a changed header\n")
    os.utime(extra, ns=(time.time_ns() + 10**9,) * 2)
    assert runtime.cache_key(v, "sm_90a") not in (k0, k1)


def test_damaged_entry_is_rebuilt(cache, src):
    _nvrtc_or_skip()
    v = Variant(str(src), "probe", {"SCALE": 9})
    c = runtime.compile_variant(v, "sm_90a")
    data = c.path.read_bytes()
    c.path.write_bytes(data[: len(data) // 2])  # torn write from a crashed, pre-rename writer
    again = runtime.compile_variant(v, "sm_90a")
    assert not again.cache_hit and again.binary == c.binary


def test_no_compile_env_forbids_miss(cache, src, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("ATOM_NO_COMPILE", "1")
    with pytest.raises(runtime.CompileForbiddenError, match=r"probe\[SCALE=11\].*ATOM_NO_COMPILE"):
        runtime.compile_variant(Variant(str(src), "probe", {"SCALE": 11}), "sm_90a")


@pytest.mark.parametrize("arch", ["sm_90a", "gfx942"])
def test_compile_error_names_variant_and_log(cache, tmp_path, arch):
    try:
        runtime.toolchain_for(arch)
    except runtime.ToolchainMissingError:
        pytest.skip(f"no toolchain for {arch}")
    bad = tmp_path / "bad.hip"
    bad.write_text(GOOD.replace("atom::exp2_((float)i)", "undefined_function_xyz(i)"))
    with pytest.raises(runtime.KernelCompileError) as ei:
        runtime.compile_variant(Variant(str(bad), "probe", {"SCALE": 1}), arch)
    msg = str(ei.value)
    assert "probe[SCALE=1]" in msg and arch in msg
    assert "undefined_function_xyz" in msg and "undefined_function_xyz" in ei.value.log
    assert not list(cache.glob("probe-*.bin")), "a failed compile must not leave a cache entry"


def test_missing_nvrtc_names_cuda_extra(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import now raises ImportError
    runtime.clear_memo()
    with pytest.raises(runtime.ToolchainMissingError, match=r"pip install atom-backend\[cuda\]"):
        runtime.compile_variant(Variant("gather.hip", "atom_gather_kv"), "sm_90a")


def test_missing_amd_compiler_names_rocm_extra(cache, monkeypatch):
    monkeypatch.delenv("ATOM_CLANG", raising=False)
    monkeypatch.setenv("ATOM_AMD_COMPILER", "clang")
    monkeypatch.setattr(rt_toolchains.shutil, "which", lambda name: None)
    runtime.clear_memo()
    with pytest.raises(runtime.ToolchainMissingError, match=r"pip install atom-backend\[rocm\]"):
        runtime.compile_variant(Variant("gather.hip", "atom_gather_kv"), "gfx942")
    monkeypatch.setenv("ATOM_AMD_COMPILER", "hiprtc")
    monkeypatch.setitem(sys.modules, "hip", None)
    runtime.clear_memo()
    with pytest.raises(runtime.ToolchainMissingError, match=r"pip install atom-backend\[rocm\]"):
        runtime.compile_variant(Variant("gather.hip", "atom_gather_kv"), "gfx942")


def test_unknown_arch_and_missing_source(cache):
    with pytest.raises(ValueError, match="unknown arch"):
        runtime.compile_variant(Variant("gather.hip", "atom_gather_kv"), "tpu_v5")
    _nvrtc_or_skip()
    with pytest.raises(runtime.KernelError, match="not found"):
        runtime.compile_variant(Variant("no_such_file.hip", "k"), "sm_90a")


def test_compiles_reach_their_observers(cache, src, monkeypatch):
    _nvrtc_or_skip()
    calls = []
    monkeypatch.setattr(rt_cache, "_observers", [])
    runtime.observe_compiles(lambda k, s, hit: calls.append((k, s, hit)))
    v = Variant(str(src), "probe", {"SCALE": 13})
    runtime.compile_variant(v, "sm_90a")
    runtime.compile_variant(v, "sm_90a")
    assert [(k, hit) for k, _, hit in calls] == [(v.name, False), (v.name, True)]
    assert all(s >= 0 for _, s, _ in calls)


def test_pack_args_layout():
    t = torch.empty(4)
    slots, ptrs = rt_launch._pack_args(
        [t, None, 7, -1, 1.5, runtime.i32(-2), runtime.f64(0.25), runtime.i64(2**40)], "k")
    base = ctypes.addressof(slots)
    assert [ptrs[i] for i in range(8)] == [base + 8 * i for i in range(8)]
    raw = bytes(slots)
    assert struct.unpack_from("<Q", raw, 0)[0] == t.data_ptr()
    assert struct.unpack_from("<Q", raw, 8)[0] == 0
    assert struct.unpack_from("<q", raw, 16)[0] == 7
    assert struct.unpack_from("<q", raw, 24)[0] == -1
    assert struct.unpack_from("<f", raw, 32)[0] == 1.5
    assert struct.unpack_from("<i", raw, 40)[0] == -2
    assert struct.unpack_from("<d", raw, 48)[0] == 0.25
    assert struct.unpack_from("<q", raw, 56)[0] == 2**40
    with pytest.raises(TypeError, match="bool"):
        rt_launch._pack_args([True], "k")
    with pytest.raises(TypeError, match="unsupported type"):
        rt_launch._pack_args(["x"], "k")


# --- wrapper validation (runs before anything touches a GPU) ------------------------------


def _caches(dtype=torch.bfloat16, nb=8, ps=16, h=2, d=64):
    kv = torch.randn(2, nb, ps, h, d).to(dtype)
    return kv[0], kv[1]


def test_gather_rejects_bad_inputs():
    from hip_kernels.gather import gather_kv

    k, v = _caches()
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_blocks, page_size"):
        gather_kv(k[0], v[0], cu, 20, block_table=bt)
    with pytest.raises(TypeError, match="int32"):
        gather_kv(k, v, cu, 20, block_table=bt.long())
    with pytest.raises(ValueError, match="not both"):
        gather_kv(k, v, cu, 20, block_table=bt, kv_indptr=cu, kv_page_indices=bt[0])
    with pytest.raises(ValueError, match="need block_table"):
        gather_kv(k, v, cu, 20)
    with pytest.raises(ValueError, match="scales are only meaningful"):
        gather_kv(k, v, cu, 20, block_table=bt, k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="copied as is"):
        gather_kv(k, v, cu, 20, block_table=bt, out_dtype=torch.float16)
    k3, v3 = _caches(d=12)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gather_kv(k3, v3, cu, 20, block_table=bt)
    with pytest.raises(ValueError, match="seq_ids has 3"):
        gather_kv(k, v, cu, 20, block_table=bt, seq_ids=torch.zeros(3, dtype=torch.int32))
    k8, v8 = _caches(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_descale must be"):
        gather_kv(k8, v8, cu, 20, block_table=bt, k_descale=torch.ones(3, 2), v_descale=torch.ones(3, 2))
    with pytest.raises(ValueError, match="both k_descale and v_descale"):
        gather_kv(k8, v8, cu, 20, block_table=bt, k_descale=torch.ones(8, 2))
    with pytest.raises(TypeError, match="bf16 or fp16"):
        gather_kv(k8, v8, cu, 20, block_table=bt, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="on a GPU"):
        gather_kv(k, v, cu, 20, block_table=bt)
    for bad in (float("nan"), float("inf"), -1.0):  # a host scale that would reach every logit
        with pytest.raises(ValueError, match="finite scale"):
            gather_kv(k8, v8, cu, 20, block_table=bt, k_scale=bad, v_scale=1.0)
    with pytest.raises(ValueError, match="kv_indptr has 2 entries for 2"):  # SGLang: one offset short
        gather_kv(k, v, cu, 20, kv_indptr=torch.tensor([0, 2], dtype=torch.int32),
                  kv_page_indices=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="0 without requests"):
        gather_kv(k, v, torch.zeros(1, dtype=torch.int32), 20, block_table=bt)


def test_page_checks_catch_what_the_kernel_would_misread():
    """check_pages (host sync, debug): a page list overrun in SGLang's layout, a seq_id outside the
    table, and an FP8 pack's row starts that leave a request too little room."""
    from hip_kernels import gather

    cu = torch.tensor([0, 3], dtype=torch.int32)
    ptr, pages = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_page_indices has 2"):
        gather._check_pages_on_device("sglang", pages, ptr, cu, None, 1, 10, 3)
    gather._check_pages_on_device("sglang", torch.tensor([3, 4, 5], dtype=torch.int32), ptr, cu, None, 1, 10, 3)
    bt = torch.tensor([[1], [2]], dtype=torch.int32)
    for sid in (-1, 2):
        with pytest.raises(ValueError, match="not a row"):
            gather._check_pages_on_device("vllm", bt, None, cu, torch.tensor([sid], dtype=torch.int32), 16, 10, 3)
    gather._check_pages_on_device("vllm", bt, None, cu, torch.tensor([1], dtype=torch.int32), 16, 10, 3)
    gather._check_fp8_starts([0, 100, 300], [0, 128, 384], 384)
    for starts, total in (([0, 64, 384], 384), ([0, 128, 256], 256), ([0, 128, 384], 512)):
        with pytest.raises(ValueError, match="cu_kp must start at 0"):
            gather._check_fp8_starts([0, 100, 300], starts, total)


def test_combine_rejects_bad_inputs():
    from hip_kernels.combine import combine

    o = torch.randn(3, 5, 4, 64)
    lse = torch.randn(3, 5, 4)
    out = torch.empty(5, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="o_partial must be contiguous fp32"):
        combine(o.to(torch.bfloat16), lse, out)
    with pytest.raises(ValueError, match="lse_partial"):
        combine(o, lse[:, :4], out)
    with pytest.raises(ValueError, match="out must be"):
        combine(o, lse, out[:4])
    with pytest.raises(TypeError, match="out dtype"):
        combine(o, lse, out.to(torch.float64))
    with pytest.raises(ValueError, match="sinks must be"):
        combine(o, lse, out, sinks=torch.randn(3))
    with pytest.raises(ValueError, match="lse_out must be"):
        combine(o, lse, out, lse_out=torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="head_dim 6"):
        combine(torch.randn(3, 5, 4, 6), lse, torch.empty(5, 4, 6))
    with pytest.raises(ValueError, match="on a GPU"):
        combine(o, lse, out)


def test_variants_registry_lists_gather_and_combine(capsys):
    from hip_kernels import variants

    names = [n for n, _ in variants.all_variants()]
    # 10 into packed 16-bit K/V, 4 into the FP8 prefill's layout (2 page-table layouts x 2 scale modes),
    # 2 per-request V references of per-page scales (one per page-table layout)
    assert names.count("gather") == 16 and names.count("combine") == 3
    vs = [v for _, v in variants.all_variants()]
    assert len(set(vs)) == len(vs)
    variants.main(["--list"])
    assert "atom_gather_kv[" in capsys.readouterr().out


@pytest.mark.parametrize("S, D, want", [(1, 128, 1), (3, 128, 4), (8, 128, 8), (32, 128, 8), (32, 64, 16),
                                        (5, 256, 4), (40, 256, 4)])
def test_combine_split_groups(S, D, want):
    """Groups per (token, head): the power of two covering the splits, as many as one block holds."""
    from hip_kernels.combine import THREADS, split_groups

    g = split_groups(S, D)
    assert g == want
    assert g * (D // 4) <= THREADS


def test_blob_argument_points_at_its_bytes():
    # A by-value parameter wider than a slot (a 128-byte tensor map) travels as its own bytes; the
    # per-thread pointer array that ordinary launches share keeps pointing at its slots.
    data = bytes(range(128))
    b = runtime.Blob(data)
    assert b.addr % 64 == 0
    _slots, ptrs = rt_launch._pack_args([7, b, None], "k")
    assert ctypes.string_at(ptrs[1], 128) == data
    assert ctypes.c_uint64.from_address(ptrs[0]).value == 7
    _slots2, ptrs2 = rt_launch._pack_args([1, 2, 3], "k")
    assert ctypes.c_uint64.from_address(ptrs2[1]).value == 2
    with pytest.raises(TypeError, match="Blob"):
        rt_launch._arg_values([b], "k")


def test_tensor_map_shape_checks():
    from hip_kernels import tma

    with pytest.raises(ValueError, match="multiple of 64"):
        tma.packed_rows_map(torch.empty(10, 2, 96, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="box heads"):
        tma.packed_rows_map(torch.empty(10, 2, 64, dtype=torch.bfloat16), 64, box_heads=4)
