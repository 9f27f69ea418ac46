"""Per-arch JSON tables: tuning (``tuning_<arch>.json``) and cost (``cost_<arch>.json``). Torch-free.

Where: ``atom_backend/catalog/tables/`` (package data), after ``$ATOM_TABLES_DIR`` when set (a
directory searched first: tables from a fresh ``bench.tune`` / ``bench.calibrate`` run, tried
before they are committed). Key: the device, then the arch family. Cards of one family differ in
what decides a route (an H200 streams 1.4x an H100's bytes with the same SMs), so a table
measured on one card is ``<kind>_<family>_<device>.json`` (``device_key``: "NVIDIA H200" ->
h200) and is read on that card only; ``<kind>_<family>.json`` (``rules.arch_family``: sm_90a ->
sm_90) serves the family's other cards.

Every table carries ``schema`` (this version reads ``SCHEMAS[kind]``), ``arch`` and ``produced_by``
(command, date, device, software). A missing table, another schema or a table that does not
parse means the documented defaults: the kernel modules' own tile tables
(``hip_kernels.prefill.PORTABLE_TILES`` / ``HOPPER_TILES``) and the planner's threshold rules. A
table that exists but cannot be used is logged once, never fatal.

A cost table also carries ``kernels``: the fingerprint (``kernel_fingerprint``) of the sources
whose speed it measured (varlen prefill, gather, the Triton unified path, the device headers,
the tile tables). When those sources change, the table describes other kernels: it is not used
(threshold routing, logged) until ``bench.calibrate`` runs again on the device.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import io
import json
import logging
import os
import platform as _platform
import re
import sys
import tokenize
from pathlib import Path

from atom_backend.planning.rules import arch_family

log = logging.getLogger("atom_backend")

# Table layout versions by kind. tuning 2: config rows without exp_poly.
SCHEMAS = {"tuning": 2, "cost": 1}
PACKAGE_DIR = Path(__file__).resolve().parent / "tables"
KINDS = ("tuning", "cost")
_ROOT = Path(__file__).resolve().parents[2]
# What the cost table's timings depend on (paths from the repository / site-packages root).
COSTED_SOURCES = ("hip_kernels/src/varlen_prefill.hip", "hip_kernels/src/varlen_prefill_hopper.hip",
                  "hip_kernels/src/hopper_config.h", "hip_kernels/src/hopper_f16x2.h", "hip_kernels/src/hopper_smem.h",
                  "hip_kernels/src/hopper_scheduler.h", "hip_kernels/src/hopper_producer.h",
                  "hip_kernels/src/hopper_consumer.h", "hip_kernels/src/hopper_softmax.h",
                  "hip_kernels/src/hopper_softmax16.h", "hip_kernels/src/hopper_promotion.h",
                  "hip_kernels/src/hopper_epilogue.h",
                  "hip_kernels/src/prefill_tiles.h", "hip_kernels/src/fp8_pack.h", "hip_kernels/tma.py",
                  "hip_kernels/src/gather.hip", "hip_kernels/prefill.py", "hip_kernels/gather.py",
                  "hip_kernels/include/atom_mma.h", "hip_kernels/include/atom_device.h",
                  "atom_backend/unified/_kernels.py", "atom_backend/unified/api.py",
                  "atom_backend/unified/configs.py")


# C/C++/HIP tokens that matter for a fingerprint: literals kept whole (a "//" inside a string is
# no comment), comments dropped, any other run of non-blank characters kept.
_C_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'|//[^\n]*|/\*.*?\*/"
                       + r"""|(?:[^\s"'/]|/(?![/*]))+""", re.S)


def _c_code(text: str) -> str:
    return " ".join(t for t in _C_TOKENS.findall(text) if not t.startswith(("//", "/*")))


def _whole_fstrings(tokens, text: str):
    """Python 3.12+ tokenizes an f-string as FSTRING_START, its parts and FSTRING_END; earlier
    releases as one STRING. The same source must give the same code on every Python a deployment
    runs, so each outermost f-string becomes one STRING of its source text here too."""
    start_type, end_type = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    if start_type is None:
        yield from tokens
        return
    lines = text.splitlines(keepends=True)

    def source(a, b):
        (r0, c0), (r1, c1) = a, b
        if r0 == r1:
            return lines[r0 - 1][c0:c1]
        return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]

    depth, begin = 0, None
    for t in tokens:
        if t.type == start_type:
            depth += 1
            begin = t.start if depth == 1 else begin
        elif depth:
            if t.type == end_type:
                depth -= 1
                if depth == 0:
                    yield tokenize.TokenInfo(tokenize.STRING, source(begin, t.end), begin, t.end, t.line)
        else:
            yield t


def _python_code(text: str) -> str:
    """The token stream less comments, blank lines and statement-strings (docstrings)."""
    toks = [t for t in _whole_fstrings(tokenize.generate_tokens(io.StringIO(text).readline), text)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]
    keep = []
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for i, t in enumerate(toks):
        lone = (t.type == tokenize.STRING and (i == 0 or toks[i - 1].type in starts)
                and i + 1 < len(toks) and toks[i + 1].type == tokenize.NEWLINE)
        if not lone and not (t.type == tokenize.NEWLINE and keep and keep[-1] == "NEWLINE"):
            keep.append(tokenize.tok_name[t.type] if t.type in starts else t.string)
    return " ".join(keep)


def code_digest(name: str, text: str) -> str:
    """sha256 of a source's code: comments, docstrings and layout left out, so that only an edit
    that can change the compiled kernel (or the launch it gets) changes it."""
    code = _python_code(text) if name.endswith(".py") else _c_code(text)
    return hashlib.sha256(code.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def kernel_fingerprint() -> str:
    """16 hex digits over the code of the sources a cost table's timings depend on ("" when one
    is missing: then no table matches and the planner routes by thresholds). Neither the files'
    paths nor their order enter it, so moving a source keeps it."""
    digests = []
    for rel in COSTED_SOURCES:
        try:
            digests.append(code_digest(rel, (_ROOT / rel).read_text()))
        except (OSError, UnicodeDecodeError, tokenize.TokenError, SyntaxError) as e:
            log.warning("atom: cannot fingerprint %s (%s): cost tables are not used", rel, e)
            return ""
    return hashlib.sha256("".join(sorted(digests)).encode()).hexdigest()[:16]


def search_dirs() -> list[Path]:
    env = os.environ.get("ATOM_TABLES_DIR")
    return ([Path(env)] if env else []) + [PACKAGE_DIR]


_VENDOR_WORDS = {"nvidia", "amd", "instinct", "radeon", "geforce", "tesla"}


def device_key(name: str) -> str:
    """A device name as a table key: lower case, vendor words dropped, other runs of letters and
    digits joined by "_" ("NVIDIA H100 80GB HBM3" -> h100_80gb_hbm3, "AMD Instinct MI300X" ->
    mi300x); "" for no name."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    return "_".join(w for w in words if w not in _VENDOR_WORDS)


def table_name(kind: str, arch: str, device: str = "") -> str:
    key = device_key(device)
    return f"{kind}_{arch_family(arch)}{'_' + key if key else ''}.json"


def table_path(kind: str, arch: str, device: str = "") -> Path | None:
    """The file a table of `kind` for `arch` on `device` (its name; "" for none) is read from:
    the device's own table, else the family's, in each search dir; None when there is none."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r} is not one of {KINDS}")
    names = [table_name(kind, arch, device)] + ([table_name(kind, arch)] if device_key(device) else [])
    for name in names:
        for d in search_dirs():
            p = d / name
            if p.is_file():
                return p
    return None


def load(kind: str, arch: str, device: str = "") -> dict | None:
    """The parsed table, or None (no table, unreadable, or another schema: logged)."""
    return _load_cached(kind, arch_family(arch), device_key(device), tuple(str(d) for d in search_dirs()))


@functools.lru_cache(maxsize=None)
def _load_cached(kind: str, family: str, device: str, _dirs: tuple) -> dict | None:
    p = table_path(kind, family, device)
    if p is None:
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        log.warning("atom: %s table %s unreadable (%s): using the defaults", kind, p, e)
        return None
    if data.get("schema") != SCHEMAS[kind] or data.get("kind", kind) != kind:
        log.warning("atom: %s table %s has schema %r (this version reads %d): using the defaults", kind, p,
                    data.get("schema"), SCHEMAS[kind])
        return None
    data["_path"] = str(p)
    return data


def cost_model(arch: str, device: str = ""):
    """The CostModel of `device` (its name) or else of the arch family, or None (the planner then
    routes by thresholds)."""
    return _cost_cached(arch_family(arch), device_key(device), tuple(str(d) for d in search_dirs()))


@functools.lru_cache(maxsize=None)
def _cost_cached(family: str, device: str, _dirs: tuple):
    data = load("cost", family, device)
    if data is None:
        return None
    if not kernel_fingerprint() or data.get("kernels") != kernel_fingerprint():
        log.warning("atom: cost table %s was measured on other kernels (fingerprint %s, these are %s): threshold "
                    "routing until `python -m bench.calibrate` runs again", data["_path"], data.get("kernels"),
                    kernel_fingerprint())
        return None
    from atom_backend.planning.cost import CostModel

    try:
        return CostModel(data, data["_path"])
    except (KeyError, ValueError, TypeError) as e:
        log.warning("atom: cost table %s is unusable (%s): threshold routing", data["_path"], e)
        return None


def tuning_table(arch: str, device: str = "") -> dict | None:
    return load("tuning", arch, device)


def clear_cache() -> None:
    _load_cached.cache_clear()
    _cost_cached.cache_clear()


def produced_by(command: str, device: str = "", **extra) -> dict:
    """The provenance block every table writer stores."""
    info = {"command": command, "date": datetime.date.today().isoformat(), "device": device,
            "python": sys.version.split()[0], "host": _platform.node()}
    for mod in ("torch", "triton", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    info.update(extra)
    return info


def write(kind: str, arch: str, body: dict, command: str, device: str, out_dir: str | Path | None = None,
          family: bool = False) -> Path:
    """Write a table (schema, kind, arch, produced_by + body) measured on `device` (its name) and
    return its path: the device's own table, or with `family` the arch family's (what the
    family's cards without a table of their own read)."""
    out = Path(out_dir) if out_dir else PACKAGE_DIR
    out.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMAS[kind], "kind": kind, "arch": arch_family(arch),
            "produced_by": produced_by(command, device), **body}
    p = out / table_name(kind, arch, "" if family else device)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, p)
    clear_cache()
    return p
