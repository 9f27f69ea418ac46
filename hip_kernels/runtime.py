"""Run-time compilation, disk cache and launch of the HIP kernels in ``hip_kernels/src``.

API (small and stable; kernel modules build on exactly this):

``Variant(source, kernel, defines=())``
    One compiled specialisation: ``source`` is a file name under ``hip_kernels/src`` (or an
    absolute path), ``kernel`` the ``extern "C" __global__`` function to load, ``defines`` the
    ``-D`` options that specialise it (a dict or pairs; stored sorted, so equal variants hash
    equal). ``variant.name`` is a readable id used in errors, metrics and cache file names.

``compile_variant(variant, arch) -> Compiled``
    Code object for ``arch`` ("sm_90a", "sm_80", "gfx942", "gfx950", ...), from the disk cache
    or compiled now. Needs no GPU: NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels) for sm_*,
    hiprtc (hip-python on a ROCm install) or, without ROCm, clang-22 in ``-nogpuinc`` mode for
    gfx*. ``Compiled.binary`` is the cubin / AMDGPU code object, ``Compiled.log`` the compiler
    log, ``Compiled.cache_hit`` says where it came from.

``load(variant, device=None) -> Kernel``
    Compile-or-fetch for the current torch device's arch and load it; memoised per
    (variant, device), so a second ``load`` costs a dict lookup.

``Kernel(grid, block, *args, shared_mem=0)``
    Launch on ``torch.cuda.current_stream()`` (so CUDA-graph capture records it). ``grid`` and
    ``block`` are ints or tuples of up to 3 ints; a grid with a zero dimension launches nothing.
    Argument conventions (the kernel's parameter list must match):
    torch.Tensor or None -> pointer, Python int -> ``long long``, Python float -> ``float``;
    ``i32(x)``, ``i64(x)``, ``f32(x)``, ``f64(x)`` make the type explicit. No host sync.

``Packed(kernel, grid, block, args, shared_mem=0)``
    The same launch with its arguments packed once: ``put(i, tensor)`` swaps argument ``i``'s
    pointer (``put_f32(i, x)`` a float's value), ``launch()`` runs it. For callers that launch
    one configuration many times (plan once per batch, launch per layer).

Helpers: ``device_arch(device)``, ``current_stream(device_index)``, ``native_fp8_dtype(arch)``,
``warp_size(arch)``, ``resource_usage(compiled)`` (registers / spills when the toolchain reports
them), ``cache_dir()``.

Cache: ``$ATOM_KERNEL_CACHE`` (default ``~/.cache/atom_backend/kernels``). The key hashes the
source, every header in ``hip_kernels/include`` and ``hip_kernels/src/*.h``, the defines,
the kernel name, the arch, the toolchain and its version and options, and the package version.
Entries are written to a temporary file and renamed into place under an ``flock``, and carry a
checksum, so concurrent processes never see or leave a torn entry. ``ATOM_NO_COMPILE=1`` turns
a cache miss into ``CompileForbiddenError`` (deployments pre-warm the cache).

Errors: ``ToolchainMissingError`` names the extra to install, ``KernelCompileError`` carries
the variant name and the compiler log; both derive from ``KernelError`` (a RuntimeError).
Compiles and cache hits are reported through ``atom_backend.metrics.record_compile`` when that
module is importable.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger("hip_kernels")

PACKAGE_DIR = Path(__file__).resolve().parent
SRC_DIR = PACKAGE_DIR / "src"
INCLUDE_DIR = PACKAGE_DIR / "include"

_MAGIC = b"ATOMKC1\0"


# --- errors -------------------------------------------------------------------------------


class KernelError(RuntimeError):
    """Base class of every hip_kernels runtime error."""


class ToolchainMissingError(KernelError):
    """No compiler for the requested arch is installed."""


class KernelCompileError(KernelError):
    """The compiler rejected a variant; ``.log`` holds its output."""

    def __init__(self, variant: "Variant", arch: str, toolchain: str, log_text: str):
        self.variant, self.arch, self.toolchain, self.log = variant, arch, toolchain, log_text
        super().__init__(f"compiling {variant.name} for {arch} with {toolchain} failed:\n{log_text.strip()}")


class CompileForbiddenError(KernelError):
    """ATOM_NO_COMPILE=1 and the variant is not in the cache."""


# --- variants -----------------------------------------------------------------------------


def _norm_define(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


@dataclass(frozen=True)
class Variant:
    source: str
    kernel: str
    defines: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        d = self.defines.items() if isinstance(self.defines, Mapping) else self.defines
        norm = tuple(sorted((str(k), _norm_define(v)) for k, v in d))
        for k, _ in norm:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"Variant({self.kernel}): bad define name {k!r}")
        object.__setattr__(self, "defines", norm)

    @property
    def name(self) -> str:
        if not self.defines:
            return self.kernel
        return self.kernel + "[" + ",".join(f"{k}={v}" for k, v in self.defines) + "]"

    @property
    def path(self) -> Path:
        p = Path(self.source)
        return p if p.is_absolute() else SRC_DIR / p


@dataclass
class Compiled:
    variant: Variant
    arch: str
    binary: bytes
    toolchain: str
    log: str
    cache_hit: bool
    path: Path | None = None
    seconds: float = 0.0


# --- arch helpers -------------------------------------------------------------------------


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


def native_fp8_dtype(arch: str):
    """The e4m3 flavour the hardware converts natively (docs/design.md "FP8 KV cache")."""
    import torch

    return torch.float8_e4m3fnuz if arch in ("gfx940", "gfx941", "gfx942") else torch.float8_e4m3fn


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


def cache_dir() -> Path:
    return Path(os.environ.get("ATOM_KERNEL_CACHE") or Path.home() / ".cache" / "atom_backend" / "kernels")


def _package_version() -> str:
    try:
        from atom_backend import __version__

        return __version__
    except Exception:  # hip_kernels is usable without atom_backend
        return "0"


# --- toolchains ---------------------------------------------------------------------------


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
        files += [p for p in Path(base).glob(f"*/include/cuda_*.h") if p.is_file()]
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
        hdrs = [p for p in _header_files() if p.parent == INCLUDE_DIR]
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


# --- cache --------------------------------------------------------------------------------


def _header_files() -> list[Path]:
    return sorted([*INCLUDE_DIR.glob("*.h"), *INCLUDE_DIR.glob("*.cuh"), *SRC_DIR.glob("*.h")])


@functools.lru_cache(maxsize=64)
def _headers_hash_cached(stamp: tuple) -> str:
    h = hashlib.sha256()
    for p, _, _ in stamp:
        h.update(p.encode() + b"\0" + Path(p).read_bytes() + b"\0")
    return h.hexdigest()


def _headers_hash() -> str:
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in _header_files())
    return _headers_hash_cached(stamp)


def cache_key(variant: Variant, arch: str, src: str | None = None, tc: _Toolchain | None = None) -> str:
    """Hex key of (source, headers, defines, kernel, arch, toolchain+version+options, package)."""
    tc = tc or toolchain_for(arch)
    src = variant.path.read_text() if src is None else src
    material = json.dumps(
        {
            "package": _package_version(),
            "toolchain": tc.id,
            "options": tc.options(arch),
            "arch": arch,
            "kernel": variant.kernel,
            "defines": variant.defines,
            "source": hashlib.sha256(src.encode()).hexdigest(),
            "headers": _headers_hash(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()[:40]


def _entry_path(variant: Variant, arch: str, key: str) -> Path:
    return cache_dir() / f"{variant.kernel}-{arch}-{key}.bin"


def _read_entry(path: Path) -> tuple[bytes, dict] | None:
    """The entry's (binary, meta), or None if absent or damaged (then it is rebuilt)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        if not data.startswith(_MAGIC):
            return None
        (n,) = struct.unpack_from("<Q", data, len(_MAGIC))
        off = len(_MAGIC) + 8
        meta = json.loads(data[off : off + n])
        binary = data[off + n :]
        if hashlib.sha256(binary).hexdigest() != meta.get("sha256"):
            return None
        return binary, meta
    except Exception:
        return None


def _write_entry(path: Path, binary: bytes, meta: dict) -> None:
    meta = dict(meta, sha256=hashlib.sha256(binary).hexdigest())
    mb = json.dumps(meta).encode()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(mb)) + mb + binary)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class _FileLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _record_compile(name: str, seconds: float, cache_hit: bool) -> None:
    try:
        from atom_backend import metrics
    except ImportError:
        return
    try:
        metrics.record_compile(name, seconds, cache_hit)
    except Exception as e:  # metrics must never break kernel loading
        log.debug("metrics.record_compile failed: %s", e)


def _no_compile() -> bool:
    raw = os.environ.get("ATOM_NO_COMPILE", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"ATOM_NO_COMPILE={raw!r} is not a flag (1/0, true/false, yes/no, on/off)")


def compile_variant(variant: Variant, arch: str) -> Compiled:
    """Code object of `variant` for `arch`: from the disk cache, else compiled now and cached."""
    t0 = time.perf_counter()
    tc = toolchain_for(arch)
    try:
        src = variant.path.read_text()
    except FileNotFoundError:
        raise KernelError(f"{variant.name}: source {variant.path} not found") from None
    key = cache_key(variant, arch, src, tc)
    path = _entry_path(variant, arch, key)

    def hit(entry):
        binary, meta = entry
        dt = time.perf_counter() - t0
        _record_compile(variant.name, dt, True)
        return Compiled(variant, arch, binary, meta.get("toolchain", tc.id), meta.get("log", ""), True, path, dt)

    entry = _read_entry(path)
    if entry is not None:
        return hit(entry)
    if _no_compile():
        raise CompileForbiddenError(
            f"{variant.name} for {arch} is not in the kernel cache {cache_dir()} and ATOM_NO_COMPILE=1 "
            "forbids compiling; pre-warm the cache (hip_kernels.runtime.compile_variant) or unset ATOM_NO_COMPILE"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(path.with_suffix(".lock")):
        entry = _read_entry(path)  # another process may have finished it while we waited
        if entry is not None:
            return hit(entry)
        defines = [f"-D{k}={v}" for k, v in variant.defines]
        binary, text = tc.compile(variant, arch, src, defines)
        _write_entry(path, binary, {"variant": variant.name, "arch": arch, "toolchain": tc.id, "log": text})
    dt = time.perf_counter() - t0
    _record_compile(variant.name, dt, False)
    log.info("compiled %s for %s in %.2fs", variant.name, arch, dt)
    return Compiled(variant, arch, binary, tc.id, text, False, path, dt)


def resource_usage(c: Compiled) -> dict:
    """{'registers', 'spill_stores', 'spill_loads'} (NVIDIA, from ptxas -v) or
    {'vgprs', 'sgprs', 'vgpr_spills', 'sgpr_spills', 'lds', 'wavefront'} (AMD, from
    llvm-readobj --notes); {} when the toolchain gives nothing."""
    if not is_amd_arch(c.arch):
        out = {}
        m = re.search(r"Used (\d+) registers", c.log)
        if m:
            out["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", c.log)
        if m:
            out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
        return out
    exe = shutil.which("llvm-readobj-22") or shutil.which("llvm-readobj")
    if not exe:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".co") as f:
        f.write(c.binary)
        f.flush()
        text = subprocess.run([exe, "--notes", f.name], capture_output=True, text=True).stdout
    fields = {".vgpr_count": "vgprs", ".sgpr_count": "sgprs", ".vgpr_spill_count": "vgpr_spills",
              ".sgpr_spill_count": "sgpr_spills", ".group_segment_fixed_size": "lds",
              ".wavefront_size": "wavefront", ".private_segment_fixed_size": "scratch"}
    out = {}
    for k, name in fields.items():
        m = re.search(re.escape(k) + r":\s+(\d+)", text)
        if m:
            out[name] = int(m.group(1))
    return out


# --- launch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Typed:
    value: Any
    fmt: str  # struct format


def i32(x: int) -> _Typed:
    return _Typed(int(x), "<i")


def i64(x: int) -> _Typed:
    return _Typed(int(x), "<q")


def f32(x: float) -> _Typed:
    return _Typed(float(x), "<f")


def f64(x: float) -> _Typed:
    return _Typed(float(x), "<d")


_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


_MASK64 = 0xFFFFFFFFFFFFFFFF
_arg_buffers = threading.local()


@functools.lru_cache(maxsize=None)
def _array_types(n: int):
    """ctypes array types of n slots and of n pointers, and a struct packing n 64-bit words
    (filling an array through its constructor costs ~8 us for 46 arguments, pack_into ~1)."""
    return ctypes.c_uint64 * max(n, 1), ctypes.c_void_p * max(n, 1), struct.Struct(f"<{n}Q")


def _new_arg_arrays(n: int):
    """(slots, pointer array to them, packer) for n arguments: every argument its own 8-byte slot."""
    slots_t, ptrs_t, packer = _array_types(n)
    slots, ptrs = slots_t(), ptrs_t()
    if n:
        base = ctypes.addressof(slots)
        packer.pack_into(ptrs, 0, *range(base, base + 8 * n, 8))
    return slots, ptrs, packer


def _arg_buffer(n: int):
    """This thread's (slots, pointer array, packer) for n arguments: the driver copies the
    parameters at launch, so one buffer per size serves every launch."""
    cache = _arg_buffers.__dict__.setdefault("by_n", {})
    buf = cache.get(n)
    if buf is None:
        buf = cache[n] = _new_arg_arrays(n)
    return buf


def _f32_bits(x: float) -> int:
    return _U32.unpack(_F32.pack(x))[0]


class Blob:
    """A by-value kernel parameter wider than a slot (a CUDA tensor map: 128 bytes, 64-byte
    aligned). The driver copies it at launch from this object's aligned buffer."""

    __slots__ = ("_raw", "addr", "data")

    def __init__(self, data: bytes, align: int = 64):
        self._raw = ctypes.create_string_buffer(len(data) + align)
        self.addr = (ctypes.addressof(self._raw) + align - 1) & ~(align - 1)
        ctypes.memmove(self.addr, data, len(data))
        self.data = bytes(data)


def _pack_args(args: Iterable[Any], kernel_name: str):
    """ctypes (slots, pointer array): every argument gets its own 8-byte slot, in this thread's
    buffer for that many arguments; a Blob's pointer goes to the Blob's own bytes (in a fresh
    pointer array, so the shared one keeps pointing at its slots)."""
    blobs: list = []
    vals = _arg_values(args, kernel_name, blobs)
    slots, ptrs, packer = _arg_buffer(len(vals))
    packer.pack_into(slots, 0, *vals)
    if blobs:
        own = _array_types(len(vals))[1]()
        ctypes.memmove(own, ptrs, ctypes.sizeof(own))
        for i, b in blobs:
            own[i] = b.addr
        ptrs = own
    return slots, ptrs


def _arg_values(args: Iterable[Any], kernel_name: str, blobs: list | None = None) -> list[int]:
    """Each argument as the 64-bit slot value the kernel reads. Exact types are checked first:
    a decode step packs ~45 arguments per layer. Blobs are collected into `blobs` as
    (index, Blob); their slot holds 0."""
    import torch

    vals = []
    for i, a in enumerate(args):
        t = type(a)
        if t is int:
            vals.append(a & _MASK64)
        elif a is None:
            vals.append(0)
        elif t is float:
            vals.append(_f32_bits(a))
        elif isinstance(a, torch.Tensor):
            vals.append(a.data_ptr())
        elif t is Blob:
            if blobs is None:
                raise TypeError(f"{kernel_name}: argument {i} is a Blob; this launch path packs slots only")
            blobs.append((i, a))
            vals.append(0)
        elif isinstance(a, bool):
            raise TypeError(f"{kernel_name}: argument {i} is a bool; pass i32(...) explicitly")
        elif isinstance(a, int):
            vals.append(int(a) & _MASK64)
        elif isinstance(a, float):
            vals.append(_f32_bits(float(a)))
        elif isinstance(a, _Typed):
            raw = struct.pack(a.fmt, a.value).ljust(8, b"\0")
            vals.append(struct.unpack("<Q", raw)[0])
        else:
            raise TypeError(f"{kernel_name}: argument {i} has unsupported type {type(a).__name__}")
    return vals


def current_stream(device_index: int) -> int:
    """The current torch stream of a device, as the raw handle launches take."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~10x cheaper, as Triton's launcher
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def _dims(x, what: str) -> tuple[int, int, int]:
    t = (x,) if isinstance(x, int) else tuple(int(v) for v in x)
    if not 1 <= len(t) <= 3 or any(v < 0 for v in t):
        raise ValueError(f"{what} must be 1-3 non-negative ints, got {x!r}")
    return t + (1,) * (3 - len(t))


class Kernel:
    """A loaded kernel; call it to launch on the current torch stream."""

    def __init__(self, variant: Variant, compiled: Compiled, device_index: int, module, func, api):
        self.variant, self.compiled, self.device_index = variant, compiled, device_index
        self._module, self._func, self._api = module, func, api
        self._max_smem = 48 * 1024

    def __repr__(self):
        return f"Kernel({self.variant.name}, {self.compiled.arch})"

    def __call__(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        g, b = _dims(grid, "grid"), _dims(block, "block")
        _slots, ptrs = _pack_args(args, self.variant.name)
        self._launch(g, b, shared_mem, ctypes.addressof(ptrs), stream)

    def _launch(self, g, b, shared_mem: int, params: int, stream) -> None:
        if 0 in g:
            return
        if shared_mem > self._max_smem:
            self._api.set_max_smem(self._func, shared_mem, self.variant.name)
            self._max_smem = shared_mem
        if stream is None:
            stream = current_stream(self.device_index)
        elif not isinstance(stream, int):
            stream = stream.cuda_stream
        self._api.launch(self._func, g, b, shared_mem, stream, params, self)


class Packed:
    """One launch of a kernel with its arguments packed once (FlashInfer's plan / run split): a
    caller that launches the same configuration many times (every layer of a batch) replaces
    only the pointers that change with `put`, then `launch`es; ~1 us instead of packing ~45
    arguments again. The slots are this object's own, so it may be kept across calls."""

    __slots__ = ("kernel", "grid", "block", "shared_mem", "_slots", "_ptrs")

    def __init__(self, kernel: "Kernel", grid, block, args, shared_mem: int = 0):
        self.kernel, self.shared_mem = kernel, int(shared_mem)
        self.grid, self.block = _dims(grid, "grid"), _dims(block, "block")
        vals = _arg_values(args, kernel.variant.name)
        self._slots, self._ptrs, packer = _new_arg_arrays(len(vals))
        packer.pack_into(self._slots, 0, *vals)

    def put(self, index: int, tensor) -> None:
        """Argument `index` becomes this tensor's data pointer (None: a null pointer)."""
        self._slots[index] = 0 if tensor is None else tensor.data_ptr()

    def put_f32(self, index: int, value: float) -> None:
        """Argument `index` (a float parameter) becomes `value`."""
        self._slots[index] = _f32_bits(value)

    def launch(self, stream=None) -> None:
        """On the current torch stream (or `stream`), as Kernel.__call__."""
        self.kernel._launch(self.grid, self.block, self.shared_mem, ctypes.addressof(self._ptrs), stream)


class _CudaApi:
    def __init__(self):
        from cuda.bindings import driver

        self.d = driver
        self._ctx: dict[int, Any] = {}
        self._check(driver.cuInit(0)[0], "cuInit")

    def _check(self, err, what: str, name: str = ""):
        if err != self.d.CUresult.CUDA_SUCCESS:
            _, s = self.d.cuGetErrorString(err)
            msg = s.decode() if isinstance(s, bytes) else str(err)
            raise KernelError(f"{what}{' (' + name + ')' if name else ''}: {msg}")

    def make_current(self, dev: int):
        # torch uses the primary context; make it current on this thread for driver calls.
        d = self.d
        if dev not in self._ctx:
            err, cudev = d.cuDeviceGet(dev)
            self._check(err, "cuDeviceGet")
            err, ctx = d.cuDevicePrimaryCtxRetain(cudev)
            self._check(err, "cuDevicePrimaryCtxRetain")
            self._ctx[dev] = ctx
        self._check(d.cuCtxSetCurrent(self._ctx[dev])[0], "cuCtxSetCurrent")

    def load(self, binary: bytes, kernel: str, dev: int, name: str):
        self.make_current(dev)
        err, mod = self.d.cuModuleLoadData(binary)
        self._check(err, "cuModuleLoadData", name)
        err, func = self.d.cuModuleGetFunction(mod, kernel.encode())
        self._check(err, f"cuModuleGetFunction({kernel})", name)
        return mod, func

    def set_max_smem(self, func, nbytes: int, name: str):
        attr = self.d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.d.cuFuncSetAttribute(func, attr, nbytes)[0], f"dynamic shared memory {nbytes} B", name)

    def launch(self, func, g, b, smem, stream, params, k: Kernel):
        d = self.d
        s = d.CUstream(stream)
        (err,) = d.cuLaunchKernel(func, *g, *b, smem, s, params, 0)
        if err == d.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # first launch from another thread
            self.make_current(k.device_index)
            (err,) = d.cuLaunchKernel(func, *g, *b, smem, s, params, 0)
        self._check(err, "cuLaunchKernel", k.variant.name)


class _HipApi:
    def __init__(self):
        try:
            from hip import hip
        except Exception as e:
            raise ToolchainMissingError("HIP runtime bindings missing: pip install atom-backend[rocm]") from e
        self.h = hip

    def _check(self, err, what: str, name: str = ""):
        if err != self.h.hipError_t.hipSuccess:
            raise KernelError(f"{what}{' (' + name + ')' if name else ''}: {err}")

    def load(self, binary: bytes, kernel: str, dev: int, name: str):
        self._check(self.h.hipSetDevice(dev)[0], "hipSetDevice")
        err, mod = self.h.hipModuleLoadData(binary)
        self._check(err, "hipModuleLoadData", name)
        err, func = self.h.hipModuleGetFunction(mod, kernel.encode())
        self._check(err, f"hipModuleGetFunction({kernel})", name)
        return mod, func

    def set_max_smem(self, func, nbytes: int, name: str):
        attr = self.h.hipFunction_attribute.HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.h.hipFuncSetAttribute(func, attr, nbytes)[0], f"dynamic shared memory {nbytes} B", name)

    def launch(self, func, g, b, smem, stream, params, k: Kernel):
        (err,) = self.h.hipModuleLaunchKernel(func, *g, *b, smem, stream, params, None)
        self._check(err, "hipModuleLaunchKernel", k.variant.name)


_api = None
_loaded: dict[tuple[Variant, int], Kernel] = {}
_load_lock = threading.Lock()


def _device_api():
    global _api
    if _api is None:
        import torch

        _api = _HipApi() if getattr(torch.version, "hip", None) else _CudaApi()
    return _api


def load(variant: Variant, device=None) -> Kernel:
    """Compile-or-fetch `variant` for `device` (default: current torch device) and load it."""
    import torch

    if isinstance(device, int):
        idx = device
    else:
        idx = None if device is None else torch.device(device).index
        if idx is None:
            idx = torch.cuda.current_device()
    k = _loaded.get((variant, idx))
    if k is not None:
        return k
    with _load_lock:
        k = _loaded.get((variant, idx))
        if k is not None:
            return k
        arch = device_arch(idx)
        compiled = compile_variant(variant, arch)
        api = _device_api()
        mod, func = api.load(compiled.binary, variant.kernel, idx, variant.name)
        k = Kernel(variant, compiled, idx, mod, func, api)
        _loaded[(variant, idx)] = k
        return k


def clear_memo() -> None:
    """Forget in-process loads/toolchains (tests: force the disk-cache path)."""
    _loaded.clear()
    _toolchains.clear()


__all__ = [
    "Variant", "Compiled", "Kernel", "Packed", "current_stream", "compile_variant", "load", "cache_key", "cache_dir", "device_arch",
    "native_fp8_dtype", "warp_size", "resource_usage", "toolchain_for", "i32", "i64", "f32", "f64",
    "KernelError", "ToolchainMissingError", "KernelCompileError", "CompileForbiddenError", "clear_memo",
]
