"""Bench builds of the shipped kernels: a shipped source with a bench's edits, compiled from a
private directory.

The sources under hip_kernels/src are production code: no switch that only a bench sets. A bench
that needs another form of a kernel (profiling stamps, a timing-only cut, an A/B form) writes an
overlay: the shipped text with its edits applied, into a directory of this process beside copies
of hip_kernels/src/*.h (the kernel's own headers; hip_kernels/include comes with every build), and
builds that file as the variant's source (``runtime.Variant(path, kernel, defines)``). Each edit
names text that must occur exactly once in the source, so an edit that no longer fits the kernel
fails at once, naming itself, instead of building something else; tests compile every overlay the
benches write (tests/test_bench_*.py).

    from bench import overlay
    path = overlay.write("decode_mma.hip", [overlay.replace("compute(c);", "(void)c;")], "dry")
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parents[1] / "hip_kernels" / "src"

_dir: Path | None = None


@dataclass(frozen=True)
class Edit:
    """Text `old` (exactly once in the source) becomes `new`."""

    old: str
    new: str


def replace(old: str, new: str) -> Edit:
    return Edit(old, new)


def after(anchor: str, text: str) -> Edit:
    """`text` inserted right after `anchor`."""
    return Edit(anchor, anchor + text)


def before(anchor: str, text: str) -> Edit:
    """`text` inserted right before `anchor`."""
    return Edit(anchor, text + anchor)


class OverlayError(ValueError):
    """An edit's text is not in the source exactly once."""


def apply(text: str, edits, what: str = "source") -> str:
    for e in edits:
        n = text.count(e.old)
        if n != 1:
            raise OverlayError(f"overlay of {what}: {n} occurrences (want 1) of {e.old[:120]!r}")
        text = text.replace(e.old, e.new)
    return text


def directory(sub: str = "") -> Path:
    """A directory of this process's overlays (all removed at exit), holding copies of
    hip_kernels/src/*.h; `sub` names a separate one (a kernel with headers of its own)."""
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="atom_overlay_"))
        atexit.register(shutil.rmtree, _dir, True)
    d = _dir / sub
    d.mkdir(parents=True, exist_ok=True)
    for h in SRC_DIR.glob("*.h"):
        shutil.copyfile(h, d / h.name)
    return d


def write_text(name: str, text: str, headers: dict | None = None, sub: str = "") -> str:
    """Write a kernel source `name` into an overlay directory (`sub`, as `directory`); `headers`
    ({file name: text}) replace the copies of hip_kernels/src's headers there (a kernel of another
    revision with its own). Returns the file's absolute path."""
    d = directory(sub)
    for h, t in (headers or {}).items():
        (d / h).write_text(t)
    p = d / name
    p.write_text(text)
    return str(p)


def write(source: str, edits, tag: str, headers: dict | None = None) -> str:
    """hip_kernels/src/`source` with `edits` applied, as `<stem>_<tag><suffix>` in the overlay
    directory; `headers` ({header name: edits}) edit those of hip_kernels/src's headers too (the build
    then has a directory of its own, `tag`). Returns its absolute path (a Variant's source)."""
    src = SRC_DIR / source
    hdrs = {h: apply((SRC_DIR / h).read_text(), e, h) for h, e in (headers or {}).items()}
    return write_text(f"{src.stem}_{tag}{src.suffix}", apply(src.read_text(), edits, source), hdrs,
                      tag if hdrs else "")
