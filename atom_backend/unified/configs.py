"""Tile configurations of the unified path, declared per target family, and the kernel's
constexprs for a launch (torch-free and triton-free: ``kernels build`` reads both).

A family's table holds only configs that compile there with the deployment's Triton:
``python -m atom_backend.catalog build --arch A`` compiles every entry a model needs for A, so
a config the compiler rejects fails the build, not the first request that uses it. Targets
without a table (no build arch covers them) take the H100 sweep's tiles, and the launcher's
run-time fallback (``api._launch``) stays armed for them only.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every HEAD_PAD the launcher can produce: max(16, next power of two of head_dim <= 256).
HEAD_PADS = (16, 32, 64, 128, 256)
# Block rows of the decode form (group x query tokens <= 64, rounded up to a power of two).
DECODE_ROWS = (16, 32, 64)


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one launch. block_m rows = block_q tokens x hg heads of one kv head."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_key(head_pad: int, group: int, max_seqlen_q: int, window: int = 0) -> tuple:
    """The table key of a launch: ("decode", head_pad, block rows) when group x query tokens
    fit 64 rows, else ("prefill", head_pad, short window)."""
    if max_seqlen_q * group <= 64:
        return ("decode", head_pad, max(16, next_pow2(min(group, 64) * max(1, max_seqlen_q))))
    return ("prefill", head_pad, 0 < window <= 256)


def _sweep(key: tuple) -> TileConfig:
    """The H100 sweep's tiles (docs/perf/unified.md), before any target's compiler has a say."""
    form, head_pad, arg = key
    if form == "decode":
        # memory bound, few rows: K/V streaming dominates
        bn = {64: 64, 128: 128}.get(head_pad, 64 if head_pad < 128 else 32)
        return TileConfig(block_m=arg, block_n=bn, num_warps=4, num_stages=3)
    if head_pad <= 64:
        # a short window leaves few key tiles per q tile: narrower tiles waste less on masks
        return TileConfig(block_m=128, block_n=32 if arg else 64, num_warps=4, num_stages=3)
    if head_pad <= 128:
        return TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
    return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


KEYS = tuple([("decode", hp, bm) for hp in HEAD_PADS for bm in DECODE_ROWS]
             + [("prefill", hp, short) for hp in HEAD_PADS for short in (False, True)])
SWEEP = {k: _sweep(k) for k in KEYS}

# gfx942 has 64 KiB of LDS: the decode tiles of head_pad 128 (block_n 128, 3 stages) need 65 to
# 80 KiB (triton 3.6 and 3.9, docs/perf/unified.md). Each entry here is the config the launcher's
# run-time fallback lands on there: the rows (the grid) kept, the pipeline and then the key tile
# made lighter until the tiles fit.
_GFX942 = {
    ("decode", 128, 16): TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=2),
    ("decode", 128, 32): TileConfig(block_m=32, block_n=128, num_warps=4, num_stages=2),
    ("decode", 128, 64): TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
}

# Per family (a build arch, or several that compile alike): every key's tiles.
TABLES = {
    "sm_90": dict(SWEEP),
    "gfx942": {**SWEEP, **_GFX942},
    "gfx950": dict(SWEEP),
}

# The compile targets ``kernels build`` checks each family's table on.
FAMILY_ARCHS = {"sm_90": ("sm_90a",), "gfx942": ("gfx942",), "gfx950": ("gfx950",)}


def family_of(backend: str, arch) -> str | None:
    """The table of a Triton target (GPUTarget's backend and arch), or None: no table."""
    if backend == "cuda" and arch == 90:
        return "sm_90"
    if backend == "hip" and arch in FAMILY_ARCHS:
        return arch
    return None


def arch_family(arch: str) -> str | None:
    """The table of a build arch name ('sm_90a', 'gfx942'), or None."""
    return next((f for f, archs in FAMILY_ARCHS.items() if arch in archs), None)


def interpreter_config(group: int, max_seqlen_q: int) -> TileConfig:
    # fewer, larger programs: the interpreter's cost is per program and per tile
    return TileConfig(block_m=max(16, min(64, next_pow2(group * max(1, max_seqlen_q)))), block_n=32,
                      num_warps=4, num_stages=1)


def default_config(head_pad: int, group: int, max_seqlen_q: int, interpret: bool, kv_fp8: bool,
                   window: int = 0, family: str | None = "sm_90") -> TileConfig:
    """The declared tiles of a launch on ``family`` (None: a target without a table)."""
    if interpret:
        return interpreter_config(group, max_seqlen_q)
    key = tile_key(head_pad, group, max_seqlen_q, window)
    return TABLES[family][key] if family in TABLES else SWEEP[key]


def kernel_constexprs(cfg: TileConfig, *, group: int, head_dim: int, page_size: int, q_fp32: bool, kv_fp8: bool,
                      window: int, sink_tokens: int, has_sinks: bool, softcap: float, per_tensor: bool,
                      per_page: bool, causal: bool) -> dict:
    """unified_attn_kernel's constexprs but SPLIT and RETURN_LSE (the entry point's): the one
    derivation of the launcher (``api._prepare``) and of the ahead-of-time build."""
    head_pad = max(16, next_pow2(head_dim))
    hg = min(group, cfg.block_m)
    return dict(
        GROUP=group, HG=hg, BLOCK_Q=cfg.block_m // hg, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, PAD_D=head_pad != head_dim, PAGE_SIZE=page_size,
        CAUSAL=bool(causal), USE_WINDOW=window > 0, USE_SINK_TOKENS=window > 0 and sink_tokens > 0,
        USE_SOFTCAP=softcap > 0, HAS_SINKS=bool(has_sinks), PER_TENSOR=per_tensor, PER_PAGE=per_page,
        DOT_IEEE=q_fp32, PV_FP16=kv_fp8 and not q_fp32,
    )
