"""The compilers: NVRTC for sm_*, hiprtc on a ROCm install or clang-22 for gfx*, each with its version and options for the cache key."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path


from hip_kernels.runtime.arch import is_amd_arch
from hip_kernels.runtime.errors import KernelCompileError, KernelError, ToolchainMissingError
from hip_kernels.runtime.variant import INCLUDE_DIR, Variant, header_files

log = logging.getLogger("hip_kernels")

class _Toolchain:
    name = "?"

    def version(self) -> str:
        raise NotImplementedError

    def options(self, arch: str) -> list[str]:
        raise NotImplementedError

    def compile(self, variant: Variant, arch: str, src: str, defines: list[str]) -> tuple[bytes, str]:
        """(binary, log); raises KernelCompileError."""
        raise NotImplementedError

    @property
    def id(self) -> str:
        return f"{self.name}-{self.version()}"


class _Nvrtc(_Toolchain):
    name = "nvrtc"

    _MISSING = ("NVRTC is not available (cuda-bindings / nvidia-cuda-nvrtc missing): "
                "pip install atom-backend[cuda]")

    def __init__(self):
        # Only look: importing cuda.bindings.nvrtc costs ~90 ms on some machines, and a cache
        # hit never needs it.
        try:
            found = importlib.util.find_spec("cuda.bindings.nvrtc") is not None
        except (ImportError, ValueError, AttributeError):
            found = False
        if not found:
            raise ToolchainMissingError(self._MISSING)
        self.nvrtc = None
        self._version: str | None = None
        self._loaded = False
        self._inc: str | None = None

    def _load(self) -> str:
        """Import the bindings, load libnvrtc (~40 ms) and return its version; compiles need it."""
        if self.nvrtc is None:
            try:
                self.nvrtc = importlib.import_module("cuda.bindings.nvrtc")
            except ImportError as e:
                raise ToolchainMissingError(self._MISSING) from e
        nv = self.nvrtc
        try:
            err, major, minor = nv.nvrtcVersion()
        except Exception as e:  # cuda-bindings raises when libnvrtc cannot be found
            raise ToolchainMissingError(f"NVRTC failed to load ({e}): pip install atom-backend[cuda]") from e
        if err != nv.nvrtcResult.NVRTC_SUCCESS:
            raise ToolchainMissingError(f"NVRTC failed to load ({err}): pip install atom-backend[cuda]")
        self._loaded = True
        return f"{major}.{minor}"

    def version(self) -> str:
        # A cache hit must not pay for loading libnvrtc: when the library comes from the
        # nvidia-cuda-nvrtc wheel (which cuda-bindings loads first), its files identify it.
        if self._version is None:
            self._version = _wheel_fingerprint("libnvrtc.so*") or self._load()
        return self._version

    @staticmethod
    def _cuda_include_dir() -> str:
        try:
            from cuda.pathfinder import find_nvidia_header_directory

            d = find_nvidia_header_directory("cudart")
            if d and (Path(d) / "cuda_bf16.h").exists():
                return str(d)
        except Exception:
            pass
        for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
            if d and (Path(d) / "include" / "cuda_bf16.h").exists():
                return str(Path(d) / "include")
        raise ToolchainMissingError(
            "CUDA headers (cuda_bf16.h) not found for NVRTC: pip install atom-backend[cuda] "
            "(the nvidia-cuda-runtime wheel ships them)"
        )

    def options(self, arch: str) -> list[str]:
        return [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-default-device"]

    def compile(self, variant, arch, src, defines):
        if not self._loaded:
            self._load()
        if self._inc is None:
            self._inc = self._cuda_include_dir()
        nv = self.nvrtc
        ok = nv.nvrtcResult.NVRTC_SUCCESS
        err, prog = nv.nvrtcCreateProgram(src.encode(), variant.path.name.encode(), 0, [], [])
        if err != ok:
            raise KernelError(f"nvrtcCreateProgram({variant.name}): {err}")
        try:
            opts = self.options(arch) + [f"-I{INCLUDE_DIR}", f"-I{variant.path.parent}", f"-I{self._inc}"] + defines
            opts_b = [o.encode() for o in opts]
            (cerr,) = nv.nvrtcCompileProgram(prog, len(opts_b), opts_b)
            _, n = nv.nvrtcGetProgramLogSize(prog)
            buf = b" " * n
            nv.nvrtcGetProgramLog(prog, buf)
            text = buf.rstrip(b"\0 ").decode(errors="replace")
            if cerr != ok:
                raise KernelCompileError(variant, arch, self.id, text or str(cerr))
            _, n = nv.nvrtcGetCUBINSize(prog)
            cubin = b" " * n
            (gerr,) = nv.nvrtcGetCUBIN(prog, cubin)
            if gerr != ok or n == 0:
                raise KernelCompileError(variant, arch, self.id, f"no cubin for {arch} ({gerr}); log:\n{text}")
            return bytes(cubin), text
        finally:
            nv.nvrtcDestroyProgram(prog)


class _Clang(_Toolchain):
    """Offline AMD build (CI without ROCm): clang -x hip, no HIP headers, no device libraries."""

    name = "clang"

    def __init__(self):
        exe = os.environ.get("ATOM_CLANG") or shutil.which("clang++-22") or shutil.which("clang++")
        if not exe:
            raise ToolchainMissingError(
                "no HIP compiler for AMD targets: pip install atom-backend[rocm] on a ROCm install "
                "(hiprtc), or apt-get install clang-22 lld-22 for offline builds"
            )
        self.exe = exe
        self._version = _clang_version(exe)

    def version(self) -> str:
        return self._version

    def options(self, arch: str) -> list[str]:
        return ["-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "--no-gpu-bundle-output",
                "-nogpulib", "-nogpuinc", "-O3", "-std=c++17", "-DATOM_NOGPUINC=1"]

    def compile(self, variant, arch, src, defines):
        with tempfile.TemporaryDirectory(prefix="atom_hip_") as tmp:
            srcf, out = Path(tmp) / variant.path.name, Path(tmp) / "k.co"
            srcf.write_text(src)
            cmd = [self.exe, *self.options(arch), f"-I{INCLUDE_DIR}", f"-I{variant.path.parent}", *defines,
                   str(srcf), "-o", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            text = (r.stdout + r.stderr).replace(str(srcf), variant.path.name)
            if r.returncode != 0 or not out.exists():
                raise KernelCompileError(variant, arch, self.id, text)
            return out.read_bytes(), text


@functools.lru_cache(maxsize=None)
def _wheel_fingerprint(pattern: str) -> str | None:
    """'wheel-<hash>' of the NVIDIA wheel libraries matching `pattern` (name, size, mtime) and of
    the CUDA headers NVRTC compiles against; None when no such wheel is installed."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    files = []
    for base in spec.submodule_search_locations:
        files += [p for p in Path(base).glob(f"*/lib/{pattern}") if p.is_file()]
        files += [p for p in Path(base).glob("*/include/cuda_*.h") if p.is_file()]
    if not any(p.name.startswith(pattern.rstrip("*")) for p in files):
        return None
    h = hashlib.sha256()
    for p in sorted(files):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return "wheel-" + h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _clang_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"clang version (\S+)", out)
    return m.group(1) if m else out.splitlines()[0] if out else "unknown"


class _Hiprtc(_Toolchain):
    """hiprtc through hip-python on a ROCm install (same options as the clang path)."""

    name = "hiprtc"

    def __init__(self):
        try:
            hiprtc = importlib.import_module("hip.hiprtc")
        except Exception as e:
            raise ToolchainMissingError(
                "hiprtc is not available: pip install atom-backend[rocm] (needs a ROCm install)"
            ) from e
        self.hiprtc = hiprtc
        err, major, minor = hiprtc.hiprtcVersion()
        self._version = f"{major}.{minor}"

    def version(self) -> str:
        return self._version

    def options(self, arch: str) -> list[str]:
        return [f"--offload-arch={arch}", "-O3", "-std=c++17"]

    def compile(self, variant, arch, src, defines):
        rtc = self.hiprtc
        ok = rtc.hiprtcResult.HIPRTC_SUCCESS
        # Headers go in by content as well as by -I: older hiprtc only sees headers it is given.
        hdrs = [p for p in header_files() if p.parent == INCLUDE_DIR]
        err, prog = rtc.hiprtcCreateProgram(src.encode(), variant.path.name.encode(), len(hdrs),
                                            [p.read_bytes() for p in hdrs], [p.name.encode() for p in hdrs])
        if err != ok:
            raise KernelError(f"hiprtcCreateProgram({variant.name}): {err}")
        try:
            opts = [o.encode() for o in self.options(arch) + [f"-I{INCLUDE_DIR}", f"-I{variant.path.parent}"] + defines]
            (cerr,) = rtc.hiprtcCompileProgram(prog, len(opts), opts)
            _, n = rtc.hiprtcGetProgramLogSize(prog)
            buf = bytearray(n)
            rtc.hiprtcGetProgramLog(prog, buf)
            text = bytes(buf).rstrip(b"\0 ").decode(errors="replace")
            if cerr != ok:
                raise KernelCompileError(variant, arch, self.id, text or str(cerr))
            _, n = rtc.hiprtcGetCodeSize(prog)
            code = bytearray(n)
            rtc.hiprtcGetCode(prog, code)
            return bytes(code), text
        finally:
            rtc.hiprtcDestroyProgram(prog.createRef() if hasattr(prog, "createRef") else prog)


_toolchains: dict[str, _Toolchain] = {}
_tc_lock = threading.Lock()


def toolchain_for(arch: str) -> _Toolchain:
    """NVRTC for sm_*; for gfx*: hiprtc when running on ROCm (or ATOM_AMD_COMPILER=hiprtc), else clang."""
    if is_amd_arch(arch):
        want = os.environ.get("ATOM_AMD_COMPILER")
        if want is None:
            try:
                import torch

                want = "hiprtc" if getattr(torch.version, "hip", None) else "clang"
            except ImportError:
                want = "clang"
        kind = "hiprtc" if want == "hiprtc" else "clang"
    elif arch.startswith("sm_"):
        kind = "nvrtc"
    else:
        raise ValueError(f"unknown arch {arch!r} (expected sm_NN[a] or gfxNNN)")
    with _tc_lock:
        if kind not in _toolchains:
            _toolchains[kind] = {"nvrtc": _Nvrtc, "clang": _Clang, "hiprtc": _Hiprtc}[kind]()
        return _toolchains[kind]
