"""Varlen prefill attention over packed KV (kernels: src/varlen_prefill.hip, the portable body;
src/varlen_prefill_hopper.hip on sm_90a), torch-facing.

`varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)` follows docs/design.md: bottom-right
causal alignment (query i of a request with sq queries and sk keys sits at sk - sq + i), GQA/MQA,
sliding window W (keys j > p - W), StreamingLLM sink tokens (keys j < S stay visible through the
window), soft-cap, per-head sink logits (fp32, in the denominator), optional lse (fp32
[total_q, hq], natural log, without sinks); rows with no visible key get o = 0 and lse = -inf.

No host synchronisation: every check reads shapes, dtypes, strides and Python numbers. Work
items are (request, q tile of BLOCK_M tokens) pairs; each has hq units of work (one per query
head). By default the items are ceil(max_seqlen_q / BLOCK_M) tiles for every request, last tile
first (with causal masking the last tiles see the most keys), and units past a request's end do
nothing. A caller that knows the lengths on the host (vLLM's metadata builder does) passes
`work=work_items(...)`: no empty items, each request's tiles together, longest first; copy it to
the device once per batch. The portable kernel runs one CTA per unit (heads on grid x, items on
grid y); the Hopper kernel is persistent (one CTA per SM claims units from per-stream counters)
and packs the query heads of one KV head into its row tiles (gqa_pack).

Variants (compile time): one declared tile table per kernel (PORTABLE_TILES, HOPPER_TILES: immutable,
each tile checked against its kernel's static requirements at import), by kind of launch: dtype (bf16,
fp16) x head dim (64, 128, 256) x soft-cap (on/off) on the portable body, plus a shorter row tile for
d = 64/128 under small sliding windows ("small"), plus 64-row tiles for d = 128/256 where the shared
memory (LDS) is short (gfx942's 64 KB: "small_smem"), plus the Hopper kernel for d = 64/128 ("full",
"small"; picked on sm_90a; config_for). FP8 compute (k = gather.PackedFp8, docs/fp8.md) x 3 scale modes:
the Hopper kernel for d = 128 on sm_90a (a tile per scale mode), the portable body for d = 64/128 on
gfx942 / gfx950 ("fp8", e4m3 MFMAs; on NVIDIA sm_89+ the same body runs mma.sync e4m3, which tests force
on the H100). An arch's tuning table replaces tiles through use_tuned (atom_backend.catalog.tuning); a
bench that times another tile, source or schedule passes it to varlen_attention (build=Build(...)).
Window, sink tokens, sinks, causal and lse are run-time arguments: they only change which tiles
are visited and which elements are masked, so they cost nothing when unused.

Size (over 500 lines, on purpose): both prefill bodies' declared tile tables with their compile-time
checks, the host work lists and the launcher share ``Config`` and the per-arch choice of body.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

SOURCE = "varlen_prefill.hip"
KERNEL = "varlen_prefill"
HOPPER_SOURCE = "varlen_prefill_hopper.hip"
HOPPER_KERNEL = "varlen_prefill_hopper"
HEAD_DIMS = (64, 128, 256)
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Config:
    """Tile shape of one kernel build (the kernel's defines; TileTable checks it against the kernel)."""

    num_warps: int
    block_n: int
    stages: int
    warp_m_tiles: int = 1  # 16-row tiles per warp: >1 reuses each K/V fragment for more rows
    # The Hopper kernel (src/varlen_prefill_hopper.hip, sm_90a only): num_warps / 4 consumer
    # warpgroups of 64 rows, plus a producer warpgroup; persistent grid.
    wgmma: bool = False
    pingpong: bool = True  # Hopper: consumer warpgroups take turns to issue their MMAs
    q_stages: int = 2  # Hopper: Q buffers (2: the next work unit's Q loads during this one)
    ctas: int = 0  # Hopper, one consumer warpgroup: CTAs per SM (0: 2); 3 fits d64 with 64-key tiles
    # FP8: O's sums leave the MMAs' accumulator every o_promote tiles in work units of more tiles
    # (Hopper: for fp32 shared memory, needs q_stages 1; portable body: for a second register copy;
    # 0: never; docs/fp8.md "Long requests")
    o_promote: int = 0
    # Hopper FP8 per tensor / per 16 keys (S_F16): S in an f16 accumulator and the softmax on f16
    # pairs (32 registers less per thread: room for three consumer warpgroups of 128-key tiles), O's
    # promoted partial f16 in units of the row sum, in the warpgroup's rows of sO (no area of its own)
    f16_scores: bool = False

    def f16_for(self, kv_fp8: int) -> bool:
        """The Hopper kernel builds this tile on f16 scores for that FP8 mode (S_F16: per tensor and per
        16 keys; a scale per key keeps fp32 scores)."""
        return self.f16_scores and self.wgmma and kv_fp8 in (1, 3)

    @property
    def block_m(self) -> int:
        return 16 * self.warp_m_tiles * self.num_warps

    def smem_bytes(self, head_dim: int, kv_fp8: int = 0) -> int:
        if self.wgmma:  # 16-bit Q ring and O staging, K and V rings (+ key scales; FP8: the e4m3 Q tile and
            # its row scales); 1024 bytes of slack for the swizzle, mbarriers
            eb = 1 if kv_fp8 else 2
            from hip_kernels.gather import FP8_ALIGN

            # the pack's 128-key blocks of key scales a stage holds: two where a tile may straddle blocks
            blocks = 1 if FP8_ALIGN % self.block_n == 0 or self.block_n == FP8_ALIGN else 2
            scales = 4 * self.stages * 2 * FP8_ALIGN * blocks if kv_fp8 >= 2 else 0
            q8 = (head_dim + 4) * self.block_m if kv_fp8 else 0
            # per tensor and per 16 keys: V^T's 8 rows of ones / group indicators (P's row sums by the
            # tensor cores), reserved whether or not a build uses them
            ones = 8 * self.stages * self.block_n if kv_fp8 in (1, 3) else 0
            # O's fp32 partials, with sO (f16 scores: f16 ones inside sO)
            promote = 2 * head_dim * self.block_m if kv_fp8 and self.o_promote and not self.f16_for(kv_fp8) else 0
            return 2 * head_dim * (self.q_stages + 1) * self.block_m + promote + eb * head_dim * 2 * self.stages * self.block_n \
                + q8 + scales + ones + 1024 + 512
        # 16-bit Q tile, K and V rings (FP8: of bytes)
        eb = 1 if kv_fp8 else 2
        return 2 * head_dim * self.block_m + eb * head_dim * 2 * self.stages * self.block_n

    @property
    def ctas_per_sm(self) -> int:  # the Hopper kernel with one consumer warpgroup fits two (or three) per SM
        return (self.ctas or 2) if self.wgmma and self.num_warps == 4 else 1

    def threads(self, warp_size: int) -> int:
        return (self.num_warps + (4 if self.wgmma else 0)) * warp_size


# KV_FP8 define by the pack's scale mode. per_page: a scale per key (pages of any size); per_page16: one
# per 16 keys (pages of a multiple of 16), the multiply leaves the path from S to the row max.
KV_FP8_MODES = {"per_tensor": 1, "per_page": 2, "per_page16": 3}
SMALL_WINDOW = 1024  # sliding windows up to this many keys take a table's "small" tiles


class _Rejected(ValueError):
    """A tile its kernel would reject."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Rejected(what)


def _check_portable(kind: str, d: int, c: Config) -> None:
    """src/varlen_prefill.hip's static requirements (its static_asserts), for both warp sizes (32 on
    NVIDIA, 64 on AMD: every declared tile compiles for every arch)."""
    kv_fp8 = 1 if kind == "fp8" else 0
    _need(not c.wgmma and d in HEAD_DIMS and c.block_n % 16 == 0 and c.stages >= 2 and c.warp_m_tiles >= 1,
          "head_dim 64 / 128 / 256, 16-key steps, two stages")
    for warp in (32, 64):
        threads, chunks = c.num_warps * warp, d // 8  # 16-byte chunks of a row
        _need((c.block_n * chunks) % threads == 0 and (c.block_m * chunks) % threads == 0, "copies spread evenly")
    _need(c.smem_bytes(d, kv_fp8) <= 227 * 1024, "shared memory")
    if kv_fp8:
        _need(d in (64, 128) and c.block_n in (64, 128), "FP8: head_dim 64 / 128, 64- or 128-key tiles")
    else:
        _need(not c.o_promote, "o_promote: FP8 only")


def _check_hopper(kind: str, d: int, c: Config) -> None:
    """src/varlen_prefill_hopper.hip's static requirements (its static_asserts)."""
    kv_fp8 = KV_FP8_MODES.get(kind, 0)
    nwg = c.num_warps // 4
    _need(c.wgmma and c.num_warps % 4 == 0 and 1 <= nwg <= 3 and c.warp_m_tiles == 1,
          "whole consumer warpgroups (1 to 3), one row tile per warp")
    _need(d in (64, 128) and c.stages >= 2 and c.q_stages in (1, 2), "head_dim 64 / 128, two stages, 1-2 Q stages")
    _need(c.block_n in (64, 128) or (kv_fp8 and c.block_n in (96, 192)), "BLOCK_N 64 or 128 (FP8: or 96, 192)")
    _need(c.ctas in (0, 2, 3) and (not c.ctas or nwg == 1), "several CTAs per SM: one consumer warpgroup")
    if kv_fp8:
        _need(d == 128, "FP8: head_dim 128")
        _need(not c.o_promote or c.q_stages == 1, "o_promote: Q_STAGES 1")
        _need(not c.f16_scores or kv_fp8 == 2 or c.block_n == 128, "f16 scores: 128-key tiles")
    else:
        _need(not (c.o_promote or c.f16_scores), "o_promote, f16_scores: FP8 only")
    smem = c.smem_bytes(d, kv_fp8)
    _need(smem <= 227 * 1024 and c.ctas_per_sm * (smem + 1024) <= 228 * 1024, "shared memory")


@dataclass(frozen=True)
class TileTable:
    """One kernel's tiles: {(kind, head_dim): Config}, immutable; every entry is checked against the
    kernel's static requirements when a table is made (at import for the declared ones, when a tuning
    table is applied for the others), so a tile the kernel would reject never reaches the compiler."""

    kernel: str
    entries: Mapping

    def __post_init__(self):
        check = {KERNEL: _check_portable, HOPPER_KERNEL: _check_hopper}[self.kernel]
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))
        for (kind, d), cfg in self.entries.items():
            if kind not in TILE_KINDS[self.kernel]:
                raise ValueError(f"{self.kernel}: tile kind {kind!r} is not one of {TILE_KINDS[self.kernel]}")
            try:
                check(kind, d, cfg)
            except _Rejected as e:
                raise ValueError(f"{self.kernel} tile ({kind}, d{d}) {cfg}: {e}") from None

    def get(self, kind: str, head_dim: int) -> Config | None:
        return self.entries.get((kind, head_dim))

    def of_kind(self, kind: str) -> dict:
        """{head_dim: Config} of one kind (a copy)."""
        return {d: c for (k, d), c in self.entries.items() if k == kind}

    def replace(self, changes: Mapping) -> "TileTable":
        """A table with `changes` ({(kind, head_dim): Config}) in place of these entries (checked)."""
        return TileTable(self.kernel, {**self.entries, **changes})


# Kinds of tile per kernel. Portable: "full" (no or a long window), "small" (windows up to SMALL_WINDOW),
# "small_smem" (where "full" / "small" needs more shared memory than the arch gives a CTA), "fp8" (FP8
# compute on PORTABLE_FP8_ARCHS). Hopper: "full", "small", and FP8 compute per KV_FP8_MODES scale.
TILE_KINDS = {KERNEL: ("full", "small", "small_smem", "fp8"),
              HOPPER_KERNEL: ("full", "small", *KV_FP8_MODES)}

# The portable body (every arch; on sm_90a for d = 256 and FP8 tests). Measured on H100
# (docs/perf/prefill.md, bench.prefill --sweep); sm_90a registers: ~245 (d=64, two row tiles per warp),
# ~222 (d=128), ~250 (d=256, Q re-read from shared memory); no spills, but for the soft-cap at d=64
# (28 bytes; untimed).
# small: a CTA's rows see about BLOCK_M + W keys, so shorter row tiles waste fewer masked pairs
# (gpt-oss W=128, d=64: 90 vs 64 TFLOP/s on H100).
# small_smem: gfx942 has 64 KB of LDS per workgroup, the d = 128 tiles need 112-128 KB, d = 256 128 KB.
# These take 48 and 64 KB (64 rows, shorter key tiles); config_for picks them there. Not tuned (no AMD
# device here): the shapes that fit and compile without spills on gfx942.
# fp8 (KV_FP8 in src/varlen_prefill.hip, on PORTABLE_FP8_ARCHS): 64 rows (4 waves of 16 on AMD), 64-key
# tiles, two stages: 48 KB of shared memory, inside gfx942's 64 KB LDS. Not tuned (no AMD device
# here): the shape that compiles without spills on gfx942 / gfx950. O's sums leave the MMAs'
# accumulators for a second fp32 register copy every 16 tiles (1024 keys), as on Hopper (o_promote:
# MFMA e4m3's accumulation is unmeasured; NVIDIA mma.sync e4m3, which the tests run this body on,
# reads the same with and without it: docs/fp8.md "Long requests").
PORTABLE_TILES = TileTable(KERNEL, {
    ("full", 64): Config(4, 64, 2, 2), ("full", 128): Config(8, 64, 3), ("full", 256): Config(8, 32, 2),
    ("small", 64): Config(4, 64, 3), ("small", 128): Config(4, 64, 3),
    ("small_smem", 128): Config(4, 32, 2), ("small_smem", 256): Config(4, 16, 2),
    ("fp8", 64): Config(4, 64, 2, o_promote=16), ("fp8", 128): Config(4, 64, 2, o_promote=16),
})
PORTABLE_FP8_ARCHS = ("gfx942", "gfx950")

# The Hopper kernel (sm_90a): warp-specialized, TMA (docs/perf/prefill.md). full: d128 two consumer
# warpgroups x 64 rows (BLOCK_M 128), d64 three (192 rows); work_items builds a work list for the
# device's arch (its tile's BLOCK_M). small: K/V tiles of 64 keys (a row tile sees about BLOCK_M / G + W
# keys); d64 one consumer warpgroup, three CTAs per SM (three units' latencies overlap: 1.01-1.02x the
# three-consumer tile at 4 x 4k, 1.05x at 16 x 512 new / 2k keys on H100, docs/perf/prefill.md).
# FP8 compute (e4m3 Q, K, V^T; k = PackedFp8 from gather.gather_kv_fp8), every window, by scale mode. O
# leaves the tensor cores' accumulator every 8 tiles (1024 keys) in work units of more keys (o_promote:
# the FP8 accumulator keeps ~14 bits, docs/fp8.md "Long requests"). Per tensor and per 16 keys
# (per_page16, pages of a multiple of 16): three consumer warpgroups of 128-key tiles (BLOCK_M 192) on
# f16 scores (f16_scores: S in an f16 accumulator, O's partial f16 in the O staging buffer, which frees
# the registers and shared memory a third warpgroup needs): 1.08-1.14x the two-warpgroup fp32 tile per
# tensor, 1.01-1.12x per 16 keys on H100 (a third warp per scheduler fills the softmax's dependency
# waits). A scale per key (per_page, pages of 1-8 keys) keeps two consumer warpgroups of 128-key fp32
# tiles whose partial is fp32 in a shared-memory area of its own (the promotions cost it 2-4%).
HOPPER_TILES = TileTable(HOPPER_KERNEL, {
    ("full", 64): Config(12, 128, 3, wgmma=True), ("full", 128): Config(8, 128, 2, wgmma=True),
    ("small", 64): Config(4, 64, 3, wgmma=True, q_stages=1, ctas=3), ("small", 128): Config(8, 64, 2, wgmma=True),
    ("per_tensor", 128): Config(12, 128, 3, wgmma=True, q_stages=1, o_promote=8, f16_scores=True),
    ("per_page", 128): Config(8, 128, 3, wgmma=True, q_stages=1, o_promote=8),
    ("per_page16", 128): Config(12, 128, 3, wgmma=True, q_stages=1, o_promote=8, f16_scores=True),
})
WGMMA_ARCHS = ("sm_90a",)

# An arch's tuned tables (its tuning table's winners, atom_backend.catalog.tuning.apply): made from the
# declared ones by TileTable.replace, so checked the same way. An arch without: the declared tables.
_tuned: dict[str, tuple[TileTable, TileTable]] = {}


def use_tuned(arch: str, portable: TileTable | None = None, hopper: TileTable | None = None) -> None:
    """`arch`'s tiles from now on (None: the declared table of that kernel)."""
    for t, kernel in ((portable, KERNEL), (hopper, HOPPER_KERNEL)):
        if t is not None and (not isinstance(t, TileTable) or t.kernel != kernel):
            raise TypeError(f"use_tuned: a TileTable of {kernel} expected, got {t!r}")
    _tuned[arch] = (portable or PORTABLE_TILES, hopper or HOPPER_TILES)
    _variant.cache_clear()


def tile_tables(arch: str | None) -> tuple[TileTable, TileTable]:
    """(portable, Hopper) tables that launches on `arch` use (None: the declared ones)."""
    return _tuned.get(arch, (PORTABLE_TILES, HOPPER_TILES))


def _fp8_table(arch: str | None, scale: str) -> dict:
    """The FP8-compute tiles {head_dim: Config} of `arch` for a KV_FP8_MODES scale: the Hopper kernel's on
    sm_90a, the portable body's on PORTABLE_FP8_ARCHS, none elsewhere."""
    portable, hopper = tile_tables(arch)
    if arch in WGMMA_ARCHS:
        return hopper.of_kind(scale)
    return portable.of_kind("fp8") if arch in PORTABLE_FP8_ARCHS else {}


def _fp8_scale(fp8) -> str | None:
    """A config_for / work_items `fp8` argument: None (16-bit compute) or a KV_FP8_MODES name (the
    scale mode of the pack: the tile depends on it)."""
    if fp8 is None:
        return None
    if fp8 not in KV_FP8_MODES:
        raise ValueError(f"fp8 must be None or the pack's scale mode, one of {tuple(KV_FP8_MODES)}; got {fp8!r}")
    return fp8


def fp8_compute_available(head_dim: int, arch: str | None) -> bool:
    """An FP8-compute prefill kernel exists for this head dim on `arch`."""
    return head_dim in _fp8_table(arch, "per_page")


# Keys per request that FP8 compute was measured accurate at with O summed in the tensor cores'
# accumulator across the request (H100, V with a mean: docs/fp8.md "Long requests").
FP8_ACCUMULATED_KEYS = 1024


def fp8_accurate_keys(arch: str | None) -> int:
    """The longest request (keys) FP8 compute on `arch` is known accurate for; 0: any. Every FP8 tile
    moves O out of the e4m3 MMAs' accumulator every 1024 keys (o_promote: fp32 shared memory on
    Hopper, a second fp32 register copy in the portable body); a tile without it would be limited
    to the length measured accurate without it."""
    cfgs = [c for scale in KV_FP8_MODES for c in _fp8_table(arch, scale).values()]
    return 0 if cfgs and all(c.o_promote for c in cfgs) else FP8_ACCUMULATED_KEYS


def config_for(head_dim: int, window: int = 0, arch: str | None = None, fp8: str | None = None) -> Config:
    """The tile shape a launch with this head dim and window uses on `arch` (None: portable);
    fp8: the FP8-compute kernel's for that scale mode (a KV_FP8_MODES name; fp8_compute_available).
    A tile that needs more shared memory than `arch` gives a CTA is replaced by the "small_smem" one."""
    scale = _fp8_scale(fp8)
    cfg = _declared_config(head_dim, window, arch, scale)
    small_smem = tile_tables(arch)[0].get("small_smem", head_dim)
    if arch is not None and not cfg.wgmma and small_smem is not None:
        from hip_kernels.runtime import max_dynamic_smem

        if cfg.smem_bytes(head_dim, KV_FP8_MODES[scale] if scale else 0) > max_dynamic_smem(arch):
            return small_smem
    return cfg


def _declared_config(head_dim: int, window: int, arch: str | None, scale: str | None) -> Config:
    if scale:
        if not fp8_compute_available(head_dim, arch):
            raise ValueError(f"no FP8-compute prefill kernel for head_dim {head_dim} on {arch}")
        return _fp8_table(arch, scale)[head_dim]
    portable, hopper = tile_tables(arch)
    kind = "small" if 0 < window <= SMALL_WINDOW else "full"
    if arch in WGMMA_ARCHS and hopper.get(kind, head_dim) is not None:
        return hopper.get(kind, head_dim)
    if portable.get(kind, head_dim) is not None:
        return portable.get(kind, head_dim)
    return portable.entries[("full", head_dim)]


@functools.lru_cache(maxsize=None)
def _device_arch(device) -> str:
    from hip_kernels import runtime

    return runtime.device_arch(device)


def _default_arch() -> str | None:
    """Arch of the current torch device, or None without a GPU (host-only callers)."""
    try:
        if torch.cuda.is_available():
            return _device_arch(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # no usable device: the portable tile shape
        pass
    return None


@functools.lru_cache(maxsize=None)  # per launch: a Variant costs ~10 us to build
def _variant(head_dim: int, dtype_code: int, softcap: bool, cfg: Config | None = None, kv_fp8: int = 0):
    """kv_fp8: 0, or KV_FP8_MODES[scale] (FP8 compute, on either body)."""
    from hip_kernels.runtime import Variant

    cfg = cfg or PORTABLE_TILES.entries[("full", head_dim)]
    fp8 = {"KV_FP8": kv_fp8, **({"O_PROMOTE": cfg.o_promote} if cfg.o_promote else {}),
           **({"S_F16": 1} if cfg.f16_for(kv_fp8) else {})} if kv_fp8 else {}
    if cfg.wgmma:
        if cfg.num_warps % 4 or cfg.warp_m_tiles != 1:
            raise ValueError(f"Hopper prefill config {cfg}: whole warpgroups, one row tile per warp")
        return Variant(HOPPER_SOURCE, HOPPER_KERNEL,
                       {"DTYPE": dtype_code, "HEAD_DIM": head_dim, "SOFTCAP": int(softcap),
                        "CONSUMERS": cfg.num_warps // 4, "BLOCK_N": cfg.block_n, "STAGES": cfg.stages,
                        "PINGPONG": int(cfg.pingpong and cfg.num_warps >= 8), "Q_STAGES": cfg.q_stages,
                        **({"CTAS": cfg.ctas} if cfg.ctas else {}), **fp8})
    defines = {"DTYPE": dtype_code, "HEAD_DIM": head_dim, "SOFTCAP": int(softcap),
               "NUM_WARPS": cfg.num_warps, "BLOCK_N": cfg.block_n, "STAGES": cfg.stages,
               "WARP_M_TILES": cfg.warp_m_tiles, **fp8}
    return Variant(SOURCE, KERNEL, defines)


@dataclass(frozen=True)
class Build:
    """A bench's explicit build and launch of varlen_attention (its `build` argument; production
    launches pass none and take config_for's tile, the shipped source, GQA packing and the dynamic
    scheduler): the tile (wgmma: the Hopper kernel), a source file to build instead of the shipped one
    (a bench overlay, bench/overlay.py; same kernel name and parameters), extra defines, GQA packing
    on the Hopper kernel, and its scheduler ("dynamic": units claimed from a counter as CTAs free up;
    "static": round robin)."""

    config: Config
    source: str | None = None
    defines: tuple = ()
    pack_gqa: bool = True
    scheduler: str = "dynamic"

    def __post_init__(self):
        if self.scheduler not in ("dynamic", "static"):
            raise ValueError(f"Build.scheduler: 'dynamic' or 'static', got {self.scheduler!r}")
        object.__setattr__(self, "defines", tuple(dict(self.defines).items()))

    def variant(self, head_dim: int, dtype_code: int, softcap: bool, kv_fp8: int = 0):
        from hip_kernels.runtime import Variant

        v = _variant(head_dim, dtype_code, softcap, self.config, kv_fp8)
        if self.source is None and not self.defines:
            return v
        return Variant(self.source or v.source, v.kernel, {**dict(v.defines), **dict(self.defines)})


def gqa_pack(cfg: Config, q_per_kv: int, pack_gqa: bool = True) -> int:
    """Query heads per KV head that the Hopper kernel packs into one row tile (1: none). Packing
    turns a work item's tile of BLOCK_M tokens x 1 head into q_per_kv sub-tiles of
    BLOCK_M / q_per_kv tokens x q_per_kv heads: the same work items, but a request with few new
    tokens fills q_per_kv times more MMA rows. pack_gqa=False: one query head per tile (a bench's
    comparison, Build.pack_gqa)."""
    if cfg.wgmma and pack_gqa and 1 < q_per_kv <= 16 and cfg.block_m % q_per_kv == 0:
        return q_per_kv
    return 1


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def variants(arch: str | None = None) -> list:
    """Every variant varlen_attention can request (CI compiles them all for every arch): the declared
    tables' (arch None), or those `arch` launches (its tuned tables, tile_tables)."""
    portable, hopper = tile_tables(arch)
    cfgs = [(d, c) for kind in ("full", "small", "small_smem") for d, c in portable.of_kind(kind).items()] \
        + [(d, c) for kind in ("full", "small") for d, c in hopper.of_kind(kind).items()]
    fp8 = [_variant(d, code, sc, cfg, mode) for name, mode in KV_FP8_MODES.items()
           for table in (hopper.of_kind(name), portable.of_kind("fp8")) for d, cfg in table.items()
           for code in (0, 1) for sc in (False, True)]
    return [_variant(d, code, sc, cfg) for d, cfg in cfgs for code in (0, 1) for sc in (False, True)] + fp8


def work_items(seqlens_q, seqlens_k, *, head_dim: int, causal: bool = True, window: int = 0,
               sink_tokens: int = 0, arch: str | None = None, fp8: str | None = None, tile: Config | None = None,
               order: str = "request") -> torch.Tensor:
    """Host-built work list: int32 [n, 2] of (request, q tile), most visible keys first.

    `seqlens_q` / `seqlens_k` are per-request lengths known on the host (Python ints). The
    result is a CPU tensor; move it to the device (ideally from pinned memory, non_blocking).
    `arch`: the device the list is for (default: the current torch device, if any); q tiles
    are BLOCK_M rows of the tile shape that device launches (fp8: for the FP8-compute kernel of
    that scale mode, the pack's `scale`); `tile`: the tile of a bench's Build instead. order: "request"
    (each request's tiles together, requests longest first: L2-friendly) or "cost" (longest first overall,
    a bench's comparison)."""
    if order not in ("request", "cost"):
        raise ValueError(f"work_items: order 'request' or 'cost', got {order!r}")
    bm = (tile or config_for(head_dim, window, arch or _default_arch(), fp8)).block_m
    items = []
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        sq, sk = int(sq), int(sk)
        off = sk - sq
        for t in range(-(-sq // bm)):
            p_first, p_last = off + t * bm, off + min((t + 1) * bm, sq) - 1
            hi = min(sk, p_last + 1) if causal else sk
            lo = max(0, p_first - window + 1) if window > 0 else 0
            keys = max(0, hi - lo) + (min(sink_tokens, lo) if window > 0 else 0)
            items.append((keys, b, t))
    if order == "request":
        # Requests longest first, each request's tiles together (longest first): the CTAs running
        # at one time read one request's K/V, which stays in L2.
        top = {}
        for keys, b, _ in items:
            top[b] = max(top.get(b, 0), keys)
        items.sort(key=lambda x: (-top[x[1]], x[1], -x[0]))
    else:
        items.sort(key=lambda x: -x[0])
    out = torch.tensor([(b, t) for _, b, t in items], dtype=torch.int32)
    return out.reshape(-1, 2)


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    es = t.element_size()
    if any((st * es) % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name}: the kernel copies 16-byte vectors; strides {t.stride()} x {es} bytes "
                         "and the data pointer must be multiples of 16")


def _check_fp8_pack(kv, q, cu_seqlens_k, arch: str | None) -> None:
    """The PackedFp8 of gather_kv_fp8 fits q and the FP8 body of `arch`: shapes, dtypes, device,
    scales of its mode, V^T's key order."""
    from hip_kernels import runtime
    from hip_kernels.gather import FP8_ALIGN, FP8_KEY_ORDERS, fp8_key_order

    k8, vt = kv.k, kv.vt
    if k8.dim() != 3 or vt.dim() != 3 or tuple(vt.shape) != (k8.shape[1], k8.shape[2], k8.shape[0]):
        raise ValueError(f"PackedFp8: k [total_pad, H, D] and vt [H, D, total_pad] disagree: {tuple(k8.shape)}, "
                         f"{tuple(vt.shape)}")
    e4m3 = (runtime.native_fp8_dtype(arch), torch.uint8) if arch else (torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                                                      torch.uint8)
    if k8.dtype not in e4m3 or vt.dtype != k8.dtype or k8.shape[0] % FP8_ALIGN:
        raise ValueError(f"PackedFp8: k / vt of {e4m3[0]} (or uint8) with a multiple of {FP8_ALIGN} rows expected, "
                         f"got {k8.dtype} / {vt.dtype}, {k8.shape[0]} rows")
    if k8.device != q.device or vt.device != q.device or not (k8.is_contiguous() and vt.is_contiguous()):
        raise ValueError("PackedFp8: k and vt must be contiguous, on q's device")
    if not isinstance(kv.cu_kp, torch.Tensor) or kv.cu_kp.shape != cu_seqlens_k.shape or kv.cu_kp.dtype != torch.int32 \
            or kv.cu_kp.device != q.device or not kv.cu_kp.is_contiguous():
        raise ValueError("PackedFp8: cu_kp must be contiguous int32 on q's device and match cu_seqlens_k")

    def fp32(t, shape) -> bool:  # the kernel reads it through a raw pointer
        return isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == torch.float32 \
            and t.device == q.device and t.is_contiguous()

    if kv.scale == "per_tensor":
        if not fp32(kv.kv_scale, (2,)):
            raise ValueError("PackedFp8: per_tensor needs kv_scale: contiguous fp32 [2] on q's device")
    elif kv.scale in ("per_page", "per_page16"):
        blocks = k8.shape[0] // FP8_ALIGN
        if not (fp32(kv.key_scales, (k8.shape[1], blocks, 2, FP8_ALIGN)) and fp32(kv.v_max, (k8.shape[1], blocks))):
            raise ValueError("PackedFp8: per_page needs key_scales [H, blocks, 2, 128] and v_max [H, blocks]: "
                             "contiguous fp32 on q's device")
    else:
        raise ValueError(f"PackedFp8: scale {kv.scale!r} is not one of {tuple(KV_FP8_MODES)}")
    if kv.order not in FP8_KEY_ORDERS or (arch is not None and kv.order != fp8_key_order(arch)):
        raise ValueError(f"PackedFp8: V^T in key order {kv.order!r}, the FP8 prefill on {arch} reads "
                         f"{fp8_key_order(arch) if arch else tuple(FP8_KEY_ORDERS)!r} (pack on the device that runs it)")


def _check_cu(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")
    if t.shape[0] < 1:
        raise ValueError(f"{name} needs batch + 1 entries")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
                     scale: float | None = None, causal: bool = True, window: int = 0, sink_tokens: int = 0,
                     sinks: torch.Tensor | None = None, softcap: float = 0.0, out: torch.Tensor | None = None,
                     return_lse: bool = False, work: torch.Tensor | None = None,
                     lse_out: torch.Tensor | None = None, build: Build | None = None):
    """Attention of packed varlen queries q [total_q, hq, d] over packed k, v [total_kv, hk, d].

    k may instead be a ``gather.PackedFp8`` (``gather.gather_kv_fp8`` on the same device; v = None):
    FP8 compute, Q quantized per (token, head) inside the kernel (max|q| / the e4m3 maximum), where
    fp8_compute_available (sm_90a: d = 128; gfx942 / gfx950: d = 64 / 128).
    Returns out (q's dtype, [total_q, hq, d]), or (out, lse) with return_lse (lse fp32
    [total_q, hq]). max_seqlen_q / max_seqlen_k are host ints, upper bounds of the lengths (not
    checked: that would read cu_seqlens on the host); rows past max_seqlen_q are not written.
    work: optional device int32 [n, 2] from work_items() (host lengths, longest first).
    lse_out: optional preallocated fp32 [total_q, hq] for the lse (implies return_lse).
    build: a bench's explicit build (Build: its tile instead of config_for's, its source, defines, GQA
    packing, scheduler; a work list for it takes work_items(tile=build.config))."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [total_q, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} is unsupported (bfloat16 or float16)")
    total_q, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is unsupported by the varlen prefill kernel ({HEAD_DIMS})")
    from hip_kernels.gather import PackedFp8

    fp8 = k if isinstance(k, PackedFp8) else None
    arch = _device_arch(q.device) if q.is_cuda else None
    if fp8 is not None:
        if v is not None:
            raise ValueError("with k = PackedFp8 (FP8 compute) v must be None: the pack holds V")
        _check_fp8_pack(fp8, q, cu_seqlens_k, arch)
        k = fp8.k
    else:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be [total_kv, num_kv_heads, head_dim], got {getattr(t, 'shape', t)}")
            if t.dtype != q.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from q's {q.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    total_kv, hk, dk = k.shape
    if dk != d:
        raise ValueError(f"k/v head_dim {dk} != q head_dim {d}")
    if hk <= 0 or hq % hk:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hk}")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, cu_seqlens_k {cu_seqlens_k.shape[0]}")
    batch = cu_seqlens_q.shape[0] - 1
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name} must be a non-negative Python int, got {x!r}")
    if max(total_q, total_kv, max_seqlen_k) >= 2**31:
        raise ValueError("token counts must stay below 2**31 (row indices are int32; offsets are 64-bit)")
    for name, x in (("window", window), ("sink_tokens", sink_tokens)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name} must be a non-negative int, got {x!r}")
    softcap = float(softcap)
    if not softcap >= 0.0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not scale > 0.0 or math.isinf(scale):
        raise ValueError(f"scale must be a finite float > 0, got {scale}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,) \
                or not sinks.is_contiguous():
            raise ValueError(f"sinks must be contiguous float32 [num_q_heads={hq}], got "
                             f"{getattr(sinks, 'dtype', type(sinks))} {tuple(getattr(sinks, 'shape', ()))}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device}, q is on {q.device}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    for name, t in (("q", q), ("k", k), ("v", v if fp8 is None else fp8.vt), ("out", out)):
        _check_aligned(name, t)
    if lse_out is not None:
        if lse_out.dtype != torch.float32 or tuple(lse_out.shape) != (total_q, hq) or not lse_out.is_contiguous() \
                or lse_out.device != q.device:
            raise ValueError(f"lse_out must be contiguous float32 [{total_q}, {hq}] on {q.device}")
        return_lse = True
    lse = lse_out if lse_out is not None else \
        torch.empty((total_q, hq), dtype=torch.float32, device=q.device) if return_lse else None
    cfg = build.config if build is not None else config_for(d, window, arch, fp8.scale if fp8 is not None else None)
    if work is not None:
        if not isinstance(work, torch.Tensor) or work.dtype != torch.int32 or work.dim() != 2 \
                or work.shape[1] != 2 or not work.is_contiguous():
            raise ValueError("work must be a contiguous int32 [n, 2] tensor from work_items()")
        if work.device != q.device:
            raise ValueError(f"work is on {work.device}, q is on {q.device}; copy it to the device once per batch")
        n_y, max_tiles = work.shape[0], 0
    else:
        max_tiles = -(-max_seqlen_q // cfg.block_m)
        n_y = max_tiles * batch
    if n_y * hq > 2**31 - 1 or n_y > 65535:
        raise ValueError(f"{n_y} work items exceed the grid's y limit (65535): pass work=work_items(...) "
                         "(no empty items) or split the batch")
    if total_q == 0 or batch == 0 or n_y == 0:
        return (out, lse.fill_(float("-inf"))) if return_lse else out
    if total_kv == 0:  # no request has a key: every row is fully masked (o = 0, lse = -inf)
        out.zero_()
        return (out, lse.fill_(float("-inf"))) if return_lse else out

    from hip_kernels import runtime

    kv_fp8 = KV_FP8_MODES[fp8.scale] if fp8 is not None else 0
    variant = build.variant(d, _DTYPES[q.dtype], softcap > 0, kv_fp8) if build is not None \
        else _variant(d, _DTYPES[q.dtype], softcap > 0, cfg, kv_fp8)
    kern = runtime.load(variant, q.device)
    wsize = runtime.warp_size(kern.compiled.arch)
    if softcap > 0:
        a, c = scale / softcap, softcap * _LOG2E
    else:
        a, c = scale * _LOG2E, 0.0
    if cfg.wgmma:
        from hip_kernels import tma
        from hip_kernels.runtime.workspace import semaphores  # per-stream zeroed counters, left zeroed

        # Persistent: one CTA per SM walks the hq units of every work item.
        grid = min(n_y * hq, _num_sms(q.device) * cfg.ctas_per_sm)
        pack = gqa_pack(cfg, hq // hk, build is None or build.pack_gqa)
        tm_q = tma.packed_rows_map(q, cfg.block_m // pack, pack)  # FP8: the kernel quantizes Q per (token, head)
        if fp8 is not None:
            # V^T in panels of one swizzle span: 128 keys, or 64 / 32 where the tile is not 128
            panel = 128 if cfg.block_n == 128 else 64 if cfg.block_n % 64 == 0 else 32
            tm_v = tma.transposed_map(fp8.vt, panel)
            per_page = fp8.scale != "per_tensor"  # a K tile's stage takes its 128-key blocks' scales
            tm_s = tma.rows_map(fp8.key_scales.view(hk, -1), fp8.key_scales[0, 0].numel()) if per_page else tm_v
            fp8_args = (fp8.kv_scale, fp8.v_max, fp8.v_max.shape[1] if per_page else 0, fp8.cu_kp)
        else:
            tm_v = tma.packed_rows_map(v, cfg.block_n)
            tm_s, fp8_args = tm_v, (None, None, 0, None)
        # O leaves by TMA stores of 64 rows (a consumer warpgroup's) when they are whole tokens.
        tm_o = tma.packed_rows_map(out, 64 // pack, pack) if 64 % pack == 0 else tm_v
        kern(grid, cfg.threads(wsize),
             tm_q, tma.packed_rows_map(k, cfg.block_n), tm_v, tm_s, tm_o, out, lse, cu_seqlens_q, cu_seqlens_k, work,
             *fp8_args, None if build is not None and build.scheduler == "static" else semaphores(q.device, 2), sinks,
             out.stride(0), out.stride(1), n_y, hq, batch, hq // hk, max_tiles, int(causal), window, sink_tokens,
             pack, runtime.f32(a), runtime.f32(c), shared_mem=cfg.smem_bytes(d, kv_fp8))
        return (out, lse) if return_lse else out
    if fp8 is not None:  # the pack's K8 and V^T; V^T's strides: between dims, between heads
        vt = fp8.vt
        kv = (k, vt, k.stride(0), k.stride(1), vt.stride(1), vt.stride(0))
        per_page = fp8.scale != "per_tensor"
        fp8_args = (fp8.kv_scale, fp8.key_scales, fp8.v_max, fp8.v_max.shape[1] if per_page else 0, fp8.cu_kp)
    else:
        kv = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        fp8_args = (None, None, None, 0, None)
    kern((hq, n_y), cfg.threads(wsize),
         q, *kv[:2], out, lse, cu_seqlens_q, cu_seqlens_k, work, sinks,
         q.stride(0), q.stride(1), *kv[2:], out.stride(0), out.stride(1),
         batch, hq // hk, max_tiles, int(causal), window, sink_tokens, runtime.f32(a), runtime.f32(c), *fp8_args,
         shared_mem=cfg.smem_bytes(d, kv_fp8))
    return (out, lse) if return_lse else out


__all__ = ["varlen_attention", "variants", "work_items", "config_for", "Config", "Build", "TileTable", "PORTABLE_TILES",
           "HOPPER_TILES", "HEAD_DIMS"]
