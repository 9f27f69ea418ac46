"""Every kernel variant the package can request compiles for NVIDIA (NVRTC, sm_90a and sm_80) and AMD
(clang-22, gfx942/gfx950) on a machine without a GPU; spills are read back and reported."""

from __future__ import annotations

import shutil

import pytest

from hip_kernels import runtime, variants as all_variants

# Kernels of this helper must not spill; other modules' spills are reported, not failed here.
NO_SPILL = {"gather", "combine"}


def _must_not_spill(modname: str, v, arch: str) -> bool:
    """NO_SPILL's modules, and on AMD the portable prefill's FP8 compute (the FP8 prefill there;
    on sm_90a it is a validation path whose e4m3 mma.sync ptxas emulates, docs/fp8.md)."""
    return modname in NO_SPILL or (arch.startswith("gfx") and v.kernel == "varlen_prefill"
                                   and "KV_FP8" in dict(v.defines))


def _have_nvrtc() -> bool:
    try:
        runtime.toolchain_for("sm_90a")
        return True
    except runtime.ToolchainMissingError:
        return False


def _have_clang() -> bool:
    try:
        runtime.toolchain_for("gfx942")
        return True
    except runtime.ToolchainMissingError:
        return False


ARCHS = [
    pytest.param("sm_90a", marks=pytest.mark.skipif(not _have_nvrtc(), reason="NVRTC not installed")),
    # Ampere (A100): the portable bodies' mma.sync target without e4m3 or wgmma, whose unused FP8 and
    # Hopper paths must still compile (they once called a trap NVRTC does not know)
    pytest.param("sm_80", marks=pytest.mark.skipif(not _have_nvrtc(), reason="NVRTC not installed")),
    pytest.param("gfx942", marks=pytest.mark.skipif(not _have_clang(), reason="clang-22 not installed")),
    pytest.param("gfx950", marks=pytest.mark.skipif(not _have_clang(), reason="clang-22 not installed")),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("kcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("ATOM_KERNEL_CACHE", str(d))
    mp.delenv("ATOM_NO_COMPILE", raising=False)
    yield d
    mp.undo()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("modname", list(all_variants.kernel_modules()))
def test_all_variants_compile(modname, arch, cache):
    variants = all_variants.kernel_modules()[modname].variants()
    assert variants, f"hip_kernels.{modname}.variants() is empty"
    assert len(set(variants)) == len(variants), "duplicate variants"
    spilled, fatal, regs = [], [], [0]
    for v in variants:
        c = runtime.compile_variant(v, arch)
        assert c.binary, v.name
        if arch.startswith("sm_"):
            assert c.binary[:4] == b"\x7fELF", f"{v.name}: NVRTC did not return a cubin"
        else:
            assert c.binary[:4] == b"\x7fELF", f"{v.name}: not an AMDGPU code object"
        use = runtime.resource_usage(c)
        regs.append(max(use.get("registers", 0), use.get("vgprs", 0)))
        spills = use.get("spill_stores", 0) + use.get("vgpr_spills", 0) + use.get("sgpr_spills", 0)
        if spills:
            spilled.append(f"{v.name}: {use}")
            if _must_not_spill(modname, v, arch):
                fatal.append(spilled[-1])
    # Spills the variant table accepts (_must_not_spill) pass quietly; `python -m
    # hip_kernels.variants --arch A` prints every variant's registers and spills.
    assert not fatal, f"spills on {arch} (max registers {max(regs)}):\n" + "\n".join(fatal)


CAPS_SRC = r"""
#include "atom_device.h"
static_assert(ATOM_WARP_SIZE == EXPECT_WARP, "warp size");
static_assert(ATOM_FP8_FNUZ == EXPECT_FNUZ, "fp8 flavour");
extern "C" __global__ void caps_probe(float* o) { o[atom::tid_x()] = atom::fp8_to_f32((atom::u8)atom::tid_x()); }
"""


@pytest.mark.parametrize("arch,warp,fnuz", [("sm_90a", 32, 0), ("gfx942", 64, 1), ("gfx950", 64, 0)])
def test_device_header_capabilities(arch, warp, fnuz, cache, tmp_path):
    """The header's warp size and e4m3 flavour match the host's view (warp_size, native_fp8_dtype)."""
    import torch

    if (arch.startswith("sm_") and not _have_nvrtc()) or (arch.startswith("gfx") and not _have_clang()):
        pytest.skip("toolchain missing")
    src = tmp_path / "caps.hip"
    src.write_text(CAPS_SRC)
    c = runtime.compile_variant(runtime.Variant(str(src), "caps_probe", {"EXPECT_WARP": warp, "EXPECT_FNUZ": fnuz}), arch)
    assert c.binary
    assert runtime.warp_size(arch) == warp
    assert runtime.native_fp8_dtype(arch) == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    if arch.startswith("gfx") and shutil.which("llvm-readobj-22"):
        assert runtime.resource_usage(c).get("wavefront") == warp
    # The opposite expectation must fail to compile: the static_asserts are live.
    with pytest.raises(runtime.KernelCompileError):
        runtime.compile_variant(runtime.Variant(str(src), "caps_probe", {"EXPECT_WARP": warp, "EXPECT_FNUZ": 1 - fnuz}), arch)
