"""The disk cache of compiled variants: keys, atomic entries under a file lock, ATOM_NO_COMPILE, and compile_variant."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path


from hip_kernels.runtime.arch import is_amd_arch
from hip_kernels.runtime.errors import CompileForbiddenError, KernelError
from hip_kernels.runtime.toolchains import _Toolchain, toolchain_for
from hip_kernels.runtime.variant import Compiled, Variant, header_files

log = logging.getLogger("hip_kernels")

_MAGIC = b"ATOMKC1\0"

def cache_dir() -> Path:
    return Path(os.environ.get("ATOM_KERNEL_CACHE") or Path.home() / ".cache" / "atom_backend" / "kernels")


@functools.lru_cache(maxsize=None)
def _package_version() -> str:
    # An installed release's kernels never share cache entries with another release's.
    try:
        return importlib.metadata.version("atom-backend")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0"


@functools.lru_cache(maxsize=64)
def _headers_hash_cached(stamp: tuple) -> str:
    h = hashlib.sha256()
    for p, _, _ in stamp:
        h.update(p.encode() + b"\0" + Path(p).read_bytes() + b"\0")
    return h.hexdigest()


def _headers_hash() -> str:
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in header_files())
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


# Callables told of every variant made ready: (name, seconds, cache_hit). A user of this package
# (atom_backend's metrics) subscribes with observe_compiles; this package imports none of its users.
_observers: list = []


def observe_compiles(fn) -> None:
    """Call ``fn(name, seconds, cache_hit)`` after each variant is compiled or read from the cache."""
    if fn not in _observers:
        _observers.append(fn)


def _record_compile(name: str, seconds: float, cache_hit: bool) -> None:
    for fn in _observers:
        try:
            fn(name, seconds, cache_hit)
        except Exception as e:  # an observer must never break kernel loading
            log.debug("compile observer %r failed: %s", fn, e)


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
