"""The launchers size dynamic shared memory in Python (hip_kernels.prefill.Config.smem_bytes,
hip_kernels.decode._mma_smem_bytes) from the same formulas the kernels state as SMEM_BYTES: the
planner needs the size before anything is compiled (which tile fits, CTAs per SM). Each case here
compiles the shipped kernel with one line added, `static_assert(SMEM_BYTES == <Python's size>)`, so
a kernel edit that moves its shared memory without the launcher fails here (NVRTC, sm_90a)."""

from __future__ import annotations

import pytest

from hip_kernels import decode, prefill, runtime

# Outside the Hopper kernel's SMEM_BYTES, inside what it is launched with: alignment slack for the
# 1024-byte swizzled tiles and the mbarriers (hopper_config.h).
HOPPER_SLACK = 1024 + 512


# The namespace each kernel source declares SMEM_BYTES in.
NAMESPACE = {decode.MMA_SOURCE: "atom_dmma", prefill.SOURCE: "atom_prefill", prefill.HOPPER_SOURCE: "atom_prefill"}


def _asserted(variant, expected: int):
    from bench import overlay

    src = variant.path.read_text()
    ns = NAMESPACE[variant.path.name]
    check = f'\nstatic_assert({ns}::SMEM_BYTES == {expected}, "launcher and kernel disagree on shared memory");\n'
    path = overlay.write_text(f"smem_{abs(hash((variant.name, expected)))}_{variant.path.name}", src + check)
    return runtime.Variant(path, variant.kernel, variant.defines)


def _prefill_cases():
    portable, hopper = prefill.tile_tables(None)
    cases = [(kind, d, c, 0) for kind in ("full", "small", "small_smem") for d, c in portable.of_kind(kind).items()]
    cases += [(kind, d, c, 0) for kind in ("full", "small") for d, c in hopper.of_kind(kind).items()]
    cases += [(name, d, c, mode) for name, mode in prefill.KV_FP8_MODES.items()
              for table in (hopper.of_kind(name), portable.of_kind("fp8")) for d, c in table.items()]
    seen, out = set(), []
    for kind, d, c, mode in cases:
        if (d, c, mode) not in seen:
            seen.add((d, c, mode))
            out.append(pytest.param(d, c, mode, id=f"{kind}-d{d}-{'wgmma' if c.wgmma else 'mma'}-fp8{mode}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,cfg,kv_fp8", _prefill_cases())
def test_prefill_launcher_sizes_shared_memory_like_the_kernel(head_dim, cfg, kv_fp8, sm90_cache):
    v = prefill._variant(head_dim, 0, False, cfg, kv_fp8)
    expected = cfg.smem_bytes(head_dim, kv_fp8) - (HOPPER_SLACK if cfg.wgmma else 0)
    runtime.compile_variant(_asserted(v, expected), "sm_90a")


@pytest.mark.parametrize("head_dim", decode.MMA_HEAD_DIMS)
@pytest.mark.parametrize("kv_code", [0, 2])
def test_decode_launcher_sizes_shared_memory_like_the_kernel(head_dim, kv_code, sm90_cache):
    v = decode._mma_variant(head_dim, 0, kv_code)
    runtime.compile_variant(_asserted(v, decode._mma_smem_bytes(v)), "sm_90a")


def test_a_wrong_size_fails_to_compile(sm90_cache):
    """The check itself can fail: one byte off is a compile error naming the disagreement."""
    v = decode._mma_variant(128, 0, 0)
    with pytest.raises(runtime.KernelCompileError, match="disagree on shared memory"):
        runtime.compile_variant(_asserted(v, decode._mma_smem_bytes(v) + 1), "sm_90a")
