"""What is compiled: a Variant (source, kernel, defines) and the Compiled code object."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


log = logging.getLogger("hip_kernels")

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = PACKAGE_DIR / "src"
INCLUDE_DIR = PACKAGE_DIR / "include"

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


def header_files() -> list[Path]:
    """Every header a kernel source may include: a change to any of them changes every cache key."""
    return sorted([*INCLUDE_DIR.glob("*.h"), *INCLUDE_DIR.glob("*.cuh"), *SRC_DIR.glob("*.h")])
