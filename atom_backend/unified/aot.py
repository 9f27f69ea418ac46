"""Ahead-of-time compiles of the unified path for a build arch, without a GPU (torch-free).

``launch_variants(arch, facts)`` lists the (constexprs, TileConfig) pairs the launch wrappers
use for a model on that arch; ``compile_variant(arch, v)`` compiles one with the installed
Triton for the arch's target (its bundled ptxas for NVIDIA), so ``kernels build`` catches a
declared config the compiler rejects. The scalar arguments are typed as the JIT types a launch
of the model (contiguous caches, a few sequences); Triton's specialisation of a scalar equal to
1 (one sequence, one kv head) is one more variant at run time, with the same tiles.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from . import configs

# Triton targets of the build arches: (backend, arch, warp size)
TARGETS = {"sm_90a": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64)}
# Shared memory one program may use, in bytes: Triton checks it only when it loads the kernel
# on a device, so the build checks it here (H100/H200: 227 KiB; CDNA3: 64 KiB; CDNA4: 160 KiB).
SHARED_LIMIT = {"sm_90a": 232448, "gfx942": 65536, "gfx950": 163840}
_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "fp8_e4m3": "*fp8e4nv", "fp8_e4m3fnuz": "*fp8e4b8"}
# A value for the per-batch scalars (num_seqs, total_q, the block table's row stride, the split
# rule: _kernels.PER_BATCH_ARGS), which the JIT never specializes.
_GENERIC = 7


@dataclass(frozen=True)
class Variant:
    """One compile of unified_attn_kernel: the entry point that launches it, the tensors' dtypes
    and the constexprs (all of them, SPLIT and RETURN_LSE included) with their tile config."""

    entry: str  # paged_attention | paged_decode
    key: tuple  # its entry in the arch's table (configs.tile_key)
    q_dtype: str
    kv_dtype: str
    num_q_heads: int
    num_kv_heads: int
    window: int  # the layer's (its value is specialised on, like any int argument)
    sink_tokens: int
    cfg: configs.TileConfig
    constexprs: tuple  # sorted (name, value) pairs

    @property
    def name(self) -> str:
        """A readable id without spaces: unified.<entry>.<q>.<kv>.d<D>.g<group>.<tile>[.<feature>]."""
        c, t = dict(self.constexprs), self.cfg
        flags = [f for f, on in (("window", c["USE_WINDOW"]), ("softcap", c["USE_SOFTCAP"]), ("sinks", c["HAS_SINKS"]),
                                 ("per_tensor", c["PER_TENSOR"]), ("per_page", c["PER_PAGE"]), ("lse", c["RETURN_LSE"])) if on]
        return ".".join([f"unified.{self.entry}.{self.q_dtype}.{self.kv_dtype}.d{c['HEAD_DIM']}.g{c['GROUP']}",
                         f"{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"] + flags)

    @property
    def kernel(self) -> str:
        return f"unified {self.entry}"


def _windows(facts) -> list[int]:
    return sorted({int(w) for w in facts.layer_windows} or {facts.window})


def launch_plan(arch: str, facts, max_query_tokens: int = 1) -> list[tuple[int, Variant]]:
    """(query tokens, Variant): each unified-path compile a model (planner.ModelFacts) needs on
    ``arch`` with its declared tiles, and a query length whose launch selects it: paged_decode for
    decode rows (at most ``max_query_tokens`` query tokens) and paged_attention for the prefill
    rows routed unified (more), per layer window. [] when the arch has no table."""
    family = configs.arch_family(arch)
    if family is None:
        return []
    kv_fp8 = facts.kv_dtype.startswith("fp8")
    group = facts.num_q_heads // facts.num_kv_heads
    head_pad = max(16, configs.next_pow2(facts.head_dim))
    # past 64 // group + 1 query tokens every length gives the same key: the prefill one
    lengths = {"paged_decode": range(1, max_query_tokens + 1),
               "paged_attention": range(max_query_tokens + 1, max(max_query_tokens + 1, 64 // group + 1) + 1)}
    out, seen = [], set()
    for entry, qlens in lengths.items():
        for window in _windows(facts):
            for sq in qlens:
                key = configs.tile_key(head_pad, group, sq, window)
                cfg = configs.default_config(head_pad, group, sq, False, kv_fp8, window, family)
                const = configs.kernel_constexprs(
                    cfg, group=group, head_dim=facts.head_dim, page_size=facts.page_size, q_fp32=facts.dtype == "fp32",
                    kv_fp8=kv_fp8, window=window, sink_tokens=facts.sink_tokens, has_sinks=facts.has_sinks,
                    softcap=facts.softcap, per_tensor=facts.kv_scale_mode == "per_tensor",
                    per_page=facts.kv_scale_mode == "per_page", causal=True)
                const.update(SPLIT=entry == "paged_decode", RETURN_LSE=False)
                v = Variant(entry, key, facts.dtype, facts.kv_dtype, facts.num_q_heads, facts.num_kv_heads, window,
                            facts.sink_tokens, cfg, tuple(sorted(const.items())))
                if v not in seen:
                    seen.add(v)
                    out.append((sq, v))
    return out


def launch_variants(arch: str, facts, max_query_tokens: int = 1) -> list[Variant]:
    """The Variants of ``launch_plan``."""
    return [v for _, v in launch_plan(arch, facts, max_query_tokens)]


def _scalar(value):
    """The JIT's type of an int argument: 1 is a constexpr, multiples of 16 carry the hint."""
    if value == 1:
        return "constexpr", None
    return "i32", value % 16 == 0


def _arguments(v: Variant) -> dict:
    """Every argument of unified_attn_kernel: a pointer's type, None, or an int / float value."""
    c = dict(v.constexprs)
    d, hq, hk, page = c["HEAD_DIM"], v.num_q_heads, v.num_kv_heads, c["PAGE_SIZE"]
    f32 = _PTR["fp32"]
    split = c["SPLIT"]
    args = dict(
        q_ptr=_PTR[v.q_dtype], k_ptr=_PTR[v.kv_dtype], v_ptr=_PTR[v.kv_dtype],
        out_ptr=f32 if split else _PTR[v.q_dtype], lse_ptr=f32 if split or c["RETURN_LSE"] else None,
        cu_q_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32",
        sinks_ptr=f32 if c["HAS_SINKS"] else None, kscale_ptr=f32 if c["PER_TENSOR"] else None,
        vscale_ptr=f32 if c["PER_TENSOR"] else None, kds_ptr=f32 if c["PER_PAGE"] else None,
        vds_ptr=f32 if c["PER_PAGE"] else None,
        num_seqs=_GENERIC, num_kv_heads=hk, total_q=_GENERIC, num_q_heads=hq,
        stride_qt=hq * d, stride_qh=d, stride_ot=0 if split else hq * d, stride_oh=0 if split else d,
        stride_kb=page * hk * d, stride_kt=hk * d, stride_kh=d, stride_vb=page * hk * d, stride_vt=hk * d,
        stride_vh=d, stride_bt=_GENERIC,
        qk_scale=0.5, cap_in=0.5, cap_out=0.5, window=v.window, sink_tokens=v.sink_tokens,
    )
    rule = ("min_split_keys", "fill_splits", "long_split_keys", "split_ctas", "split_slots", "wave_fill")
    args.update({n: _GENERIC if split else 0 for n in rule})
    return args


def _source(v: Variant):
    """The ASTSource the JIT would build for a launch of ``v``."""
    from triton.compiler import ASTSource

    from . import _kernels

    fn = _kernels.unified_attn_kernel
    c = dict(v.constexprs)
    args = _arguments(v)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in c:
            signature[name], constexprs[name] = "constexpr", c[name]
            continue
        a = args[name]
        if a is None or isinstance(a, str):
            signature[name] = "constexpr" if a is None else a
            if a is None:
                constexprs[name] = None
            else:
                attrs[(i,)] = [["tt.divisibility", 16]]  # the caches' allocations are aligned
        elif isinstance(a, float):
            signature[name] = "fp32"
        elif name in _kernels.PER_BATCH_ARGS:
            signature[name] = "i32"  # never specialized: one form for every batch
        else:
            ty, div16 = _scalar(a)
            signature[name] = ty
            if ty == "constexpr":
                constexprs[name] = a
            elif div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def target(arch: str):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGETS[arch])


def _options(tgt, num_warps: int, num_stages: int) -> dict:
    from triton.compiler import make_backend

    return make_backend(tgt).parse_options({"num_warps": num_warps, "num_stages": num_stages}).__dict__


@dataclass
class Compiled:
    seconds: float
    cache_hit: bool
    shared: int


def compile_variant(arch: str, v: Variant) -> Compiled:
    """Compile ``v`` for ``arch`` with the installed Triton (its on-disk cache included); raises
    what Triton raises (PTXASError for a ptxas crash), or ValueError when the program needs more
    shared memory than the arch has."""
    import triton

    tgt = target(arch)
    hits = []
    knobs = getattr(triton, "knobs", None)
    prev = knobs.compilation.listener if knobs else None
    if knobs:
        knobs.compilation.listener = lambda **kw: hits.append(kw.get("cache_hit", False))
    t0 = time.perf_counter()
    try:
        k = triton.compile(_source(v), target=tgt, options=_options(tgt, v.cfg.num_warps, v.cfg.num_stages))
    finally:
        if knobs:
            knobs.compilation.listener = prev
    shared = int(k.metadata.shared)
    if shared > SHARED_LIMIT[arch]:
        raise ValueError(f"needs {shared} bytes of shared memory, {arch} has {SHARED_LIMIT[arch]}")
    return Compiled(time.perf_counter() - t0, bool(hits and hits[-1]), shared)


def declared_facts(arch: str) -> list:
    """Models whose launches cover every key of the table: each head pad, decode rows 16 / 32 /
    64 (8 query heads per kv head, 1..8 query tokens) and prefill, full and short windows,
    16-bit and FP8 (per-tensor) caches, with sinks. What a build without a model compiles."""
    from atom_backend.planning import ModelFacts

    fp8 = "fp8_e4m3fnuz" if arch == "gfx942" else "fp8_e4m3"
    return [ModelFacts(64, 8, hp, kv_dtype=kv, kv_scale_mode=scale, has_sinks=True, layer_windows=(0, 128))
            for hp in configs.HEAD_PADS for kv, scale in (("bf16", "none"), (fp8, "per_tensor"))]


@functools.lru_cache(maxsize=None)
def cannot_compile(arch: str) -> str:
    """Why the installed Triton cannot compile for ``arch`` here ("" when it can): no Triton, no
    backend for the target, or no toolchain for it (a tiny kernel is compiled to find out)."""
    if arch not in TARGETS:
        return f"no Triton target declared for {arch}"
    try:
        import triton
        from triton.compiler import ASTSource

        tgt = target(arch)
        src = ASTSource(fn=_probe_kernel(), signature={"x": "*fp32"}, constexprs={})
        triton.compile(src, target=tgt, options=_options(tgt, 4, 1))
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        return f"Triton cannot compile for {arch} here ({type(e).__name__}: {str(e).strip()[:160]})"
    return ""


def _probe_kernel():
    import triton

    @triton.jit
    def probe(x):
        pass

    return probe
