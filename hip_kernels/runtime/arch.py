"""The target: arch names, their warp size, matrix units, shared memory and e4m3 flavour, and the arch of a torch device."""

from __future__ import annotations

import functools
import logging
import re

from hip_kernels.runtime.errors import KernelError

log = logging.getLogger("hip_kernels")

# CDNA3 converts the fnuz flavour of e4m3 natively; every other target, the OCP one.
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


def is_amd_arch(arch: str) -> bool:
    return arch.startswith("gfx")


def warp_size(arch: str) -> int:
    """Threads per warp/wavefront as the device header sees it (ATOM_WARP_SIZE)."""
    return 64 if re.fullmatch(r"gfx9\w*", arch) else 32


def is_mfma_arch(arch: str) -> bool:
    """The targets of atom_mma.h's MFMA back end (ATOM_MFMA: CDNA3 gfx940-942, CDNA4 gfx950)."""
    return arch.startswith(("gfx940", "gfx941", "gfx942", "gfx950"))


def max_dynamic_smem(arch: str) -> int:
    """Shared memory (LDS) one CTA / workgroup may use on `arch` (the opt-in maximum)."""
    if arch.startswith("gfx"):
        return 160 * 1024 if arch.startswith("gfx950") else 64 * 1024
    digits = "".join(ch for ch in arch[3:] if ch.isdigit())
    sm = int(digits) if digits else 0
    return {80: 163 * 1024, 87: 163 * 1024, 90: 227 * 1024}.get(sm, 99 * 1024)


def native_fp8_name(arch: str) -> str:
    """The e4m3 flavour the hardware converts natively (docs/design.md "FP8 KV cache"), by its
    planner name: "fp8_e4m3fnuz" or "fp8_e4m3"."""
    return "fp8_e4m3fnuz" if arch in FNUZ_ARCHS else "fp8_e4m3"


def native_fp8_dtype(arch: str):
    """The torch dtype of ``native_fp8_name``."""
    import torch

    return torch.float8_e4m3fnuz if arch in FNUZ_ARCHS else torch.float8_e4m3fn


def device_arch(device=None) -> str:
    """Compile target of a torch device: 'sm_90a' on H100 (exact-sm cubin), 'gfx942' on MI300."""
    import torch

    if isinstance(device, int):
        idx = device
    elif device is None or torch.device(device).index is None:
        if not torch.cuda.is_available():
            raise KernelError("hip_kernels.load needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
        idx = torch.cuda.current_device()
    else:
        idx = torch.device(device).index
    return _arch_of(idx)


@functools.lru_cache(maxsize=None)  # launches ask it every call; a device's arch never changes
def _arch_of(idx: int) -> str:
    import torch

    device = idx
    if not torch.cuda.is_available():
        raise KernelError("hip_kernels.load needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    major, minor = props.major, props.minor
    # Arch-specific ("a") targets unlock wgmma/setmaxnreg on sm_90+; a cubin runs on that sm only.
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
