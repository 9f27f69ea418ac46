"""Tile configurations from the per-arch tuning table (``bench.tune`` writes it).

Kernels with more than one tile configuration: ``varlen_prefill``, one tile per head dim and
window class: "full" (``prefill.CONFIGS``), "small" sliding windows (``prefill.WINDOW_CONFIGS``),
and on sm_90a the Hopper kernel's tiles that replace them: "wgmma" (``prefill.WGMMA_CONFIGS``)
and "wgmma_small" (``prefill.WGMMA_WINDOW_CONFIGS``).
``apply(arch)`` puts the table's winners into those module tables
(which ``prefill.config_for`` reads at every launch), after restoring the module's declared
defaults, so the registry, ``build`` and the launcher see one choice. No table for the arch:
the declared defaults stay (they are the H100 sweep of docs/perf/prefill.md).

Table body: ``{"kernels": {"varlen_prefill": [{"head_dim": 64, "window_class": "full" |
"small" | "wgmma" | "wgmma_small", "config": {num_warps, block_n, stages, warp_m_tiles, exp_poly, q_stages,
ctas, wgmma}, "candidates":
[{"config": ..., "ms": ...}, ...]}, ...]}}``.
"""

from __future__ import annotations

import logging

from atom_backend.catalog import tables
from atom_backend.planning.rules import arch_family

log = logging.getLogger("atom_backend")

_defaults: dict | None = None
_applied: str | None = None

CONFIG_FIELDS = ("num_warps", "block_n", "stages", "warp_m_tiles", "exp_poly", "q_stages", "ctas")
# window class -> the prefill module table that holds its tiles
CLASS_TABLES = {"full": "CONFIGS", "small": "WINDOW_CONFIGS", "wgmma": "WGMMA_CONFIGS",
                "wgmma_small": "WGMMA_WINDOW_CONFIGS"}


def _prefill():
    from hip_kernels import prefill

    return prefill


def defaults() -> dict:
    """The module's declared tiles, as first seen in this process: {(head_dim, class): Config}."""
    global _defaults
    if _defaults is None:
        p = _prefill()
        _defaults = {(d, cls): c for cls in CLASS_TABLES for d, c in module_table(cls).items()}
    return _defaults


def module_table(cls: str) -> dict:
    """The prefill module's {head_dim: Config} of one window class ({} if it has none)."""
    return getattr(_prefill(), CLASS_TABLES[cls], {})


def config_from_dict(cfg: dict):
    p = _prefill()
    return p.Config(**{k: int(cfg[k]) for k in CONFIG_FIELDS if k in cfg}, wgmma=bool(cfg.get("wgmma", False)))


def config_to_dict(cfg) -> dict:
    return {**{k: getattr(cfg, k) for k in CONFIG_FIELDS}, "wgmma": bool(cfg.wgmma)}


def apply(arch: str) -> dict:
    """Make `arch`'s tuned tiles current; returns {(head_dim, class): Config} that differ from
    the defaults (empty without a table)."""
    global _applied
    p = _prefill()
    base = defaults()
    changed: dict = {}
    table = tables.tuning_table(arch)
    chosen = dict(base)
    for row in (table or {}).get("kernels", {}).get("varlen_prefill", []):
        try:
            key = (int(row["head_dim"]), row.get("window_class", "full"))
            cfg = config_from_dict(row["config"])
        except (KeyError, TypeError, ValueError) as e:
            log.warning("atom: tuning table row %s unusable (%s): default kept", row, e)
            continue
        if key not in base:
            continue  # a head dim / class the module does not declare
        chosen[key] = cfg
        if cfg != base[key]:
            changed[key] = cfg
    family = arch_family(arch)
    if _applied == family and not changed and table is None:
        return changed
    for (d, cls), cfg in chosen.items():
        module_table(cls)[d] = cfg
    _applied = family
    from atom_backend.catalog import registry

    registry.entries_for.cache_clear()
    registry.path_caps.cache_clear()
    if changed:
        log.info("atom: %s tuning table %s changes tiles %s", family, (table or {}).get("_path"), changed)
    return changed
