"""Tile configurations from the per-arch tuning table (``bench.tune`` writes it).

Kernels with more than one tile configuration: ``varlen_prefill``, one tile per head dim and
window class: "full" and "small" sliding windows (the portable body's tiles of those kinds in
``prefill.PORTABLE_TILES``), and on sm_90a the Hopper kernel's tiles that replace them: "wgmma" and
"wgmma_small" (``prefill.HOPPER_TILES``' "full" and "small"). ``apply(arch)`` makes the arch's
tables from the declared ones with the table's winners in place (``TileTable.replace``: each tile
checked against its kernel) and hands them to ``prefill.use_tuned`` for that arch, so the
registry, ``build`` and the launcher (``prefill.config_for(..., arch)``) see one choice. No table
for the arch: the declared tables (the H100 sweep of docs/perf/prefill.md).

Table body (schema 2): ``{"kernels": {"varlen_prefill": [{"head_dim": 64, "window_class": "full" |
"small" | "wgmma" | "wgmma_small", "config": {num_warps, block_n, stages, warp_m_tiles, q_stages,
ctas, wgmma}, "candidates": [{"config": ..., "ms": ...}, ...]}, ...]}}``.
"""

from __future__ import annotations

import logging

from atom_backend.catalog import tables
from atom_backend.planning.rules import arch_family, compile_target

log = logging.getLogger("atom_backend")

CONFIG_FIELDS = ("num_warps", "block_n", "stages", "warp_m_tiles", "q_stages", "ctas")
# window class -> (kernel table, its kind of tile)
CLASS_TABLES = {"full": ("portable", "full"), "small": ("portable", "small"), "wgmma": ("hopper", "full"),
                "wgmma_small": ("hopper", "small")}


def _prefill():
    from hip_kernels import prefill

    return prefill


def _declared(which: str):
    p = _prefill()
    return p.PORTABLE_TILES if which == "portable" else p.HOPPER_TILES


def declared_table(cls: str) -> dict:
    """The declared {head_dim: Config} of one window class (a copy; {} if it has none)."""
    which, kind = CLASS_TABLES[cls]
    return _declared(which).of_kind(kind)


def defaults() -> dict:
    """The declared tiles: {(head_dim, class): Config}."""
    return {(d, cls): c for cls in CLASS_TABLES for d, c in declared_table(cls).items()}


def config_from_dict(cfg: dict):
    p = _prefill()
    return p.Config(**{k: int(cfg[k]) for k in CONFIG_FIELDS if k in cfg}, wgmma=bool(cfg.get("wgmma", False)))


def config_to_dict(cfg) -> dict:
    return {**{k: getattr(cfg, k) for k in CONFIG_FIELDS}, "wgmma": bool(cfg.wgmma)}


def apply(arch: str, device: str = "") -> dict:
    """Make the tuned tiles of `device` (its name; else the arch family's) current for launches on
    `arch`; returns {(head_dim, class): Config} that differ from the defaults (empty without a
    table). A row the kernel would reject is logged and its default kept."""
    p = _prefill()
    base = defaults()
    changed: dict = {}
    table = tables.tuning_table(arch, device)
    tuned = {"portable": p.PORTABLE_TILES, "hopper": p.HOPPER_TILES}
    for row in (table or {}).get("kernels", {}).get("varlen_prefill", []):
        try:
            key = (int(row["head_dim"]), row.get("window_class", "full"))
            cfg = config_from_dict(row["config"])
        except (KeyError, TypeError, ValueError) as e:
            log.warning("atom: tuning table row %s unusable (%s): default kept", row, e)
            continue
        if key not in base:
            continue  # a head dim / class the module does not declare
        which, kind = CLASS_TABLES[key[1]]
        try:
            tuned[which] = tuned[which].replace({(kind, key[0]): cfg})
        except ValueError as e:
            log.warning("atom: tuning table row %s unusable (%s): default kept", row, e)
            continue
        if cfg != base[key]:
            changed[key] = cfg
    target = compile_target(arch)
    if p.tile_tables(target) != (tuned["portable"], tuned["hopper"]):
        p.use_tuned(target, tuned["portable"], tuned["hopper"])
        from atom_backend.catalog import registry

        registry.entries_for.cache_clear()
        registry.path_caps.cache_clear()
    if changed:
        log.info("atom: %s tuning table %s changes tiles %s", arch_family(arch), (table or {}).get("_path"), changed)
    return changed
