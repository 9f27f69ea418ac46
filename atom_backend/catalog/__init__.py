"""The catalog of compiled kernels: the registry (every declared variant and what it serves),
the ahead-of-time build, and the per-arch tuning and cost tables (docs/kernels.md).

    python -m atom_backend.catalog list [--json] [--arch A]
    python -m atom_backend.catalog build --arch A [--model CONFIG | flags]

Import cost: ``tables`` is torch-free; ``registry``, ``build`` and ``tuning`` import the kernel
modules (torch) and load lazily through the names below.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "entries": "registry", "entries_for": "registry", "path_caps": "registry", "platform_for": "registry",
    "select": "registry", "Selection": "registry",
    "cost_model": "tables", "tuning_table": "tables",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


__all__ = sorted(_LAZY)
