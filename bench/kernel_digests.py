"""Digests of the compiled code of every declared kernel variant, to prove a source edit changes
no machine code (a move, a split into headers, a deleted switch that production never set).

    python -m bench.kernel_digests --out before.json                 # sm_90a, gfx942, gfx950
    python -m bench.kernel_digests --arch gfx942 --out amd.json
    python -m bench.kernel_digests --compare before.json after.json [--ignore-define EXP_POLY]

Every variant of hip_kernels.variants.all_variants() is compiled through
hip_kernels.runtime.compile_variant into a fresh, private kernel cache (ATOM_KERNEL_CACHE is set
to a new temporary directory for the run, so nothing comes from an earlier build), and the JSON
holds {arch: {variant name: digest}}:
- sm_90a: sha256 of the cubin NVRTC returns (the same source, defines and file name give the same
  bytes; a changed line count does not matter, but the set of namespace-scope constants does: NVRTC
  emits each as a device global, whose constant-bank offsets are in the code);
- gfx*: a sha256 of the code object clang-22 returns with its one run-to-run difference taken out
  (amd_code_digest): clang names a symbol __hip_cuid_<hash of the input file's path, 1-16 hex digits>,
  and the runtime compiles from a fresh temporary directory, so that name, the symbol hash tables
  derived from it and the file offsets after it differ between two builds of the same source. Beside
  it, under "<arch>:text", the sha256 of the `.text` section alone.

--compare matches variants by (kernel, defines): a define named in --ignore-define is dropped
from both sides first (a switch that left the kernel and the variant's name with it), and it
prints, per arch, how many are identical, differ, or exist on one side only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

ARCHS = ("sm_90a", "gfx942", "gfx950")


def _section_headers(binary: bytes) -> list:
    """[(name, type, flags, offset, size, link, entsize)] of an ELF64 little-endian object's sections."""
    shoff, = struct.unpack_from("<Q", binary, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", binary, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", binary, shoff + i * shentsize) for i in range(shnum)]
    str_off = heads[shstrndx][4]
    out = []
    for name, typ, flags, _addr, off, size, link, _info, _align, entsize in heads:
        end = binary.index(b"\0", str_off + name)
        out.append((binary[str_off + name:end].decode(), typ, flags, off, size, link, entsize))
    return out


def elf_sections(binary: bytes) -> dict:
    """{name: (offset, size)} of an ELF64 little-endian object's sections (size 0 for SHT_NOBITS)."""
    return {name: (off, size if typ != 8 else 0) for name, typ, _f, off, size, _l, _e in _section_headers(binary)}


# clang names a symbol after a hash of the input file's path (the runtime compiles from a fresh temporary
# directory), in up to 16 hex digits
_CUID = re.compile(rb"__hip_cuid_[0-9a-f]{1,16}")


def amd_code_digest(binary: bytes) -> str:
    """sha256 of a code object's sections, in order, with the __hip_cuid_ name taken out: each section's
    name, type, flags and bytes; string tables with that name replaced; symbol tables as (name, info,
    other, section, value, size) per symbol; .hash / .gnu.hash (derived from the names) and .dynamic's
    DT_STRSZ left out. File offsets are not in it: they move with the name's length."""
    h = hashlib.sha256()
    heads = _section_headers(binary)
    def strings(i):
        _n, _t, _f, off, size, _l, _e = heads[i]
        return binary[off:off + size]
    for name, typ, flags, off, size, link, entsize in heads:
        h.update(f"{name}:{typ}:{flags};".encode())
        if name in (".hash", ".gnu.hash") or typ == 8:  # derived from the names; SHT_NOBITS: no bytes
            h.update(str(size).encode() if typ == 8 else b"")
            continue
        data = binary[off:off + size]
        if typ in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            tab = strings(link)
            for i in range(0, size, entsize):
                st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", data, i)
                nm = _CUID.sub(b"__hip_cuid_", tab[st_name:tab.index(b"\0", st_name)])
                h.update(nm + struct.pack("<BBHQQ", st_info, st_other, st_shndx, st_value, st_size))
        elif typ == 3:  # SHT_STRTAB
            h.update(_CUID.sub(b"__hip_cuid_", data))
        elif typ == 6:  # SHT_DYNAMIC: (tag, value) pairs; DT_STRSZ (10) is .dynstr's size, which holds the name
            for i in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, i)
                h.update(struct.pack("<qQ", tag, 0 if tag == 10 else val))
        else:
            h.update(data)
    return h.hexdigest()


def text_section(binary: bytes) -> bytes:
    """The `.text` section of an ELF code object."""
    off, size = elf_sections(binary)[".text"]
    return binary[off:off + size]


def digests(archs, only: str | None = None, verbose: bool = True) -> dict:
    cache = tempfile.mkdtemp(prefix="atom_digest_cache_")
    os.environ["ATOM_KERNEL_CACHE"] = cache  # runtime.cache_dir() reads it at every compile
    os.environ.pop("ATOM_NO_COMPILE", None)
    from hip_kernels import runtime, variants

    out: dict = {}
    try:
        for arch in archs:
            full, text = out.setdefault(arch, {}), {}
            for _, v in variants.all_variants():
                if only and only not in v.name:
                    continue
                t0 = time.perf_counter()
                c = runtime.compile_variant(v, arch)
                if c.cache_hit:  # a variant declared twice; the cache was empty at the start
                    raise SystemExit(f"{v.name} for {arch}: came from the cache (declared twice?)")
                if runtime.is_amd_arch(arch):
                    full[v.name] = amd_code_digest(c.binary)
                    text[v.name] = hashlib.sha256(text_section(c.binary)).hexdigest()
                else:
                    full[v.name] = hashlib.sha256(c.binary).hexdigest()
                if verbose:
                    print(f"{arch:7s} {time.perf_counter() - t0:6.1f} s  {full[v.name][:16]}  {v.name}",
                          file=sys.stderr, flush=True)
            if text:
                out[f"{arch}:text"] = text
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


_NAME = re.compile(r"^([^\[]+)(?:\[(.*)\])?$")


def _key(name: str, ignore: set) -> tuple:
    """(kernel, defines without the ignored ones) of a variant name 'kernel[A=1,B=2]'."""
    kernel, defs = _NAME.match(name).groups()
    pairs = tuple(sorted(p for p in (defs.split(",") if defs else []) if p.partition("=")[0] not in ignore))
    return kernel, pairs


def compare(old: dict, new: dict, ignore: set) -> int:
    """Prints the comparison; returns the number of differing or unmatched variants."""
    bad = 0
    for arch in sorted(set(old) | set(new)):
        a = {_key(n, ignore): d for n, d in old.get(arch, {}).items()}
        b = {_key(n, ignore): d for n, d in new.get(arch, {}).items()}
        same = [k for k in a if k in b and a[k] == b[k]]
        diff = [k for k in a if k in b and a[k] != b[k]]
        only_old, only_new = [k for k in a if k not in b], [k for k in b if k not in a]
        print(f"{arch:12s} identical {len(same):4d}  differing {len(diff):3d}  only before {len(only_old):3d}  "
              f"only after {len(only_new):3d}")
        for tag, keys in (("differs", diff), ("only before", only_old), ("only after", only_new)):
            for kernel, pairs in keys:
                print(f"    {tag}: {kernel}[{','.join(pairs)}]")
        if not arch.endswith(":text"):
            bad += len(diff) + len(only_old) + len(only_new)
    return bad


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", default=[], help=f"repeatable; default {', '.join(ARCHS)}")
    ap.add_argument("--only", default=None, help="only variants whose name contains this text")
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two digest files")
    ap.add_argument("--ignore-define", action="append", default=[], help="with --compare (repeatable)")
    args = ap.parse_args(argv)
    if args.compare:
        old, new = (json.loads(Path(p).read_text()) for p in args.compare)
        sys.exit(1 if compare(old, new, set(args.ignore_define)) else 0)
    t0 = time.perf_counter()
    out = digests(args.arch or ARCHS, args.only)
    text = json.dumps(out, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    n = sum(len(v) for k, v in out.items() if ":" not in k)
    print(f"{n} compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
