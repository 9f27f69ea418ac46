"""The kernel registry: every compiled variant the backend can request, derived from the kernel
modules' own declarations, and the selection the executors make.

Entries come from ``hip_kernels.<module>.variants()`` (the lists CI compiles), read through
their ``-D`` defines: a variant added to a module appears here without an edit. Per-arch
facts the defines do not carry are declared here, in one place (``_arch_ok``): the e4m3
flavour a chip converts natively (fnuz on gfx942 only).

``select(facts, arch)`` answers, per planner path, either the exact variants a model needs
(through the same selection functions the launchers call: ``prefill.config_for``,
``decode._pick_rows``, ``gather.variant``, ...) or a ``Refusal`` with a named reason from
``rules.check``. ``platform_for(arch)`` hands the same answers to the planner.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass, replace

from atom_backend.planning import rules
from atom_backend.planning.rules import ARCHS, FEATURES, SCALE_MODES, Entry, PathCaps, Refusal, Signature
from hip_kernels.runtime.arch import native_fp8_name

log = logging.getLogger("atom_backend")

_Q = {0: "bf16", 1: "fp16"}
_KV_DECODE = {2: "fp8_e4m3", 3: "fp8_e4m3fnuz"}
_OUT = {1: "bf16", 2: "fp16", 3: "fp32"}
_ALL_FEATURES = frozenset(FEATURES)
_PAGES = (1, 1024)


def _module_variants(mod, arch: str) -> list:
    """mod.variants(arch) when the module selects by arch, else mod.variants()."""
    fn = mod.variants
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "arch" in params:
        return list(fn(arch=arch))
    return list(fn())


def _config_for(prefill, head_dim: int, window: int, arch: str):
    fn = prefill.config_for
    try:
        if "arch" in inspect.signature(fn).parameters:
            return fn(head_dim, window, arch=arch)
    except (TypeError, ValueError):
        pass
    return fn(head_dim, window)


def _defines(v) -> dict:
    return {k: int(val) if val.lstrip("-").isdigit() else val for k, val in v.defines}


# KV_FP8 define of the FP8-compute prefill -> (scale mode, page sizes served, role)
_PREFILL_FP8 = {1: ("per_tensor", _PAGES, "fp8 compute, per-tensor scales"),
                2: ("per_page", _PAGES, "fp8 compute, a scale per key"),
                3: ("per_page", (16, 1024), "fp8 compute, a scale per 16 keys (pages of a multiple of 16)")}


def _prefill_entries(mod, arch: str) -> list[Entry]:
    out = []
    small = getattr(mod, "SMALL_WINDOW", 1024)
    for v in _module_variants(mod, arch):
        d = _defines(v)
        hd, code, sc = d.get("HEAD_DIM"), d.get("DTYPE"), d.get("SOFTCAP", 0)
        if hd is None or code not in _Q:
            log.warning("registry: %s has no HEAD_DIM/DTYPE define; skipped", v.name)
            continue
        tile = tuple((k, val) for k, val in sorted(d.items()) if k not in ("HEAD_DIM", "DTYPE", "SOFTCAP", "KV_FP8"))
        if d.get("KV_FP8"):  # FP8 compute: listed for the archs whose body it is (Hopper or portable)
            mode_name = next(n for n, m in mod.KV_FP8_MODES.items() if m == d["KV_FP8"])
            if not mod.fp8_compute_available(hd, arch) or \
                    v != mod._variant(hd, code, bool(sc), mod.config_for(hd, 0, arch, fp8=mode_name), d["KV_FP8"]):
                continue
            scale, pages, role = _PREFILL_FP8[d["KV_FP8"]]
            feats = {"sinks", "window", "sink_tokens", "lse"} | ({"softcap"} if sc else set())
            out.append(Entry("varlen_prefill_fp8", "varlen", _Q[code], native_fp8_name(arch), (scale,), hd, pages,
                             frozenset(feats), tile, (arch,), v.name, role))
            continue
        roles = []
        for label, w in (("full", 0), ("window<=%d" % small, min(small, 128))):
            try:
                if mod._variant(hd, code, bool(sc), _config_for(mod, hd, w, arch)) == v:
                    roles.append(label)
            except Exception:  # a module whose selection changed shape: still list the variant
                pass
        feats = {"sinks", "window", "sink_tokens", "lse"} | ({"softcap"} if sc else set())
        out.append(Entry("varlen_prefill", "varlen", _Q[code], "*", SCALE_MODES, hd, (0, 0), frozenset(feats),
                         tile, (arch,), v.name, "+".join(roles) or "tuning candidate"))
    return out


def _gather_entries(mod, arch: str) -> list[Entry]:
    out = []
    for v in _module_variants(mod, arch):
        d = _defines(v)
        layout = {0: "vllm", 1: "sglang"}.get(d.get("GATHER_LAYOUT"), "?")
        role = f"layout={layout}"
        fp8_ref = v.kernel == getattr(mod, "V_REF_KERNEL", None)  # per page: its pre-pass (each request's V reference)
        if v.kernel == getattr(mod, "FP8_KERNEL", None) or fp8_ref:  # e4m3 bytes in the FP8 prefill's layout
            scale = {1: "per_tensor", 2: "per_page"}[d["GATHER_SCALE"]]
            role += " v_ref" if fp8_ref else ""
            for q in ("bf16", "fp16"):
                out.append(Entry("gather_kv_fp8", "varlen", q, native_fp8_name(arch), (scale,), 0, _PAGES, _ALL_FEATURES,
                                 (), (arch,), v.name, role))
            continue
        if not d.get("GATHER_FP8"):
            for q in ("bf16", "fp16"):  # a byte copy: the packed K/V keep the cache dtype
                out.append(Entry("gather_kv", "varlen", q, "same", ("none",), 0, _PAGES, _ALL_FEATURES, (),
                                 (arch,), v.name, role))
            continue
        scale = {1: "per_tensor", 2: "per_page"}[d["GATHER_SCALE"]]
        out.append(Entry("gather_kv", "varlen", _OUT[d["GATHER_OUT"]], native_fp8_name(arch), (scale,), 0, _PAGES,
                         _ALL_FEATURES, (), (arch,), v.name, role))
    return out


def _decode_entries(mod, arch: str) -> list[Entry]:
    out = []
    for v in _module_variants(mod, arch):
        d = _defines(v)
        q, kv = _Q[d["Q_DTYPE"]], d["KV_DTYPE"]
        if kv >= 2:
            if _KV_DECODE[kv] != native_fp8_name(arch):
                continue  # the other e4m3 flavour: no cache of this arch holds it
            kvn, scales = _KV_DECODE[kv], ("per_tensor", "per_page")
        else:
            kvn, scales = "same", ("none",)
        tile = tuple((k, d[k]) for k in ("ROWS", "NUM_THREADS") if k in d)
        out.append(Entry("splitkv_decode", "splitkv", q, kvn, scales, d["HEAD_DIM"], _PAGES, _ALL_FEATURES, tile,
                         (arch,), v.name, f"rows={d.get('ROWS')}"))
    return out


def _combine_entries(mod, arch: str) -> list[Entry]:
    return [Entry("combine", "splitkv", _OUT[_defines(v)["COMBINE_OUT"]], "*", SCALE_MODES, 0, (0, 0), _ALL_FEATURES,
                  (), (arch,), v.name) for v in _module_variants(mod, arch)]


_DERIVE = {"prefill": _prefill_entries, "gather": _gather_entries, "decode": _decode_entries,
           "combine": _combine_entries}
# kernel name -> (path, module)
KERNELS = {"varlen_prefill": ("varlen", "prefill"), "gather_kv": ("varlen", "gather"),
           "varlen_prefill_fp8": ("varlen", "prefill"), "gather_kv_fp8": ("varlen", "gather"),
           "splitkv_decode": ("splitkv", "decode"), "combine": ("splitkv", "combine")}


def _modules() -> dict:
    from hip_kernels import variants as hv

    return hv.kernel_modules()


@functools.lru_cache(maxsize=None)
def entries_for(arch: str) -> tuple[Entry, ...]:
    """Every entry built for one compile target (rows of one arch)."""
    arch = rules.compile_target(arch)
    out: list[Entry] = []
    for name, mod in _modules().items():
        if name in _DERIVE:
            out += _DERIVE[name](mod, arch)
    return tuple(out)


def entries(arch: str | None = None) -> list[Entry]:
    """The registry: one row per (variant, role), with the archs it is built for."""
    archs = [rules.compile_target(arch)] if arch else list(ARCHS)
    merged: dict = {}
    for a in archs:
        for e in entries_for(a):
            key = replace(e, archs=())
            merged.setdefault(key, []).append(a)
    return [replace(k, archs=tuple(v)) for k, v in merged.items()]


@functools.lru_cache(maxsize=None)
def path_caps(arch: str) -> dict[str, PathCaps]:
    """{'varlen': PathCaps, 'varlen_fp8': PathCaps, 'splitkv': PathCaps} of one arch, for the
    planner ('varlen_fp8': FP8 compute over an FP8 cache, inside the varlen path)."""
    arch = rules.compile_target(arch)
    es = entries_for(arch)
    group = lambda kernel, pred=lambda e: True: (kernel, tuple(e for e in es if e.kernel == kernel and pred(e)))
    return {
        "varlen": PathCaps(arch, (group("varlen_prefill"), group("gather_kv", lambda e: e.role == "layout=vllm"))),
        "varlen_fp8": PathCaps(arch, (group("varlen_prefill_fp8"),
                                      group("gather_kv_fp8", lambda e: e.role == "layout=vllm"))),
        "splitkv": PathCaps(arch, (group("splitkv_decode"), group("combine"))),
    }


# The share of the copy rate a short decode batch's CTAs aim to stream together.
STREAM_TARGET = 0.97


def stream_fill_ctas(cost, kv: str, num_sms: int) -> int:
    """CTAs whose stream rates (the cost table's decode.cta_gbps[kv]) add up to STREAM_TARGET of
    its copy rate, short of every resident slot (Platform.decode_ctas_per_sm); 0 when the table
    has no such measurement (the per-SM fill rule then holds)."""
    copy = getattr(cost, "decode_copy_gbps", None)
    cta = (getattr(cost, "decode_cta_gbps", None) or {}).get(kv)
    if not copy or not cta:
        return 0
    from atom_backend.planning import Platform

    per_sm = Platform.decode_ctas_per_sm if kv == "16bit" else Platform.decode_ctas_per_sm_fp8
    return max(1, min(math.ceil(STREAM_TARGET * copy / cta), num_sms * per_sm - 1))


def platform_for(arch: str, *, num_sms: int = 132, varlen_kernel: bool = True, splitkv_kernel: bool = True,
                 cost=None, use_tables: bool = True, device: str = ""):
    """A planner Platform whose capabilities are this registry's answers for `arch` (and, with
    use_tables, whose cost model is the calibration table of `device`, its name, or else of the
    arch family, when one exists)."""
    from atom_backend.planning import Platform

    caps = path_caps(rules.compile_target(arch))
    if cost is None and use_tables:
        from atom_backend.catalog import tables

        cost = tables.cost_model(arch, device)
    target = rules.compile_target(arch)
    prefill = _modules().get("prefill")  # none: no FP8 prefill either, nothing to limit
    fill = {kv: stream_fill_ctas(cost, kv, num_sms) for kv in ("16bit", "fp8")}
    return Platform(vendor="amd" if arch.startswith("gfx") else "nvidia", arch=target,
                    num_sms=num_sms, varlen_kernel=varlen_kernel, splitkv_kernel=splitkv_kernel,
                    decode_fill_ctas=fill["16bit"], decode_fill_ctas_fp8=fill["fp8"],
                    varlen_caps=caps["varlen"], varlen_fp8_caps=caps["varlen_fp8"], splitkv_caps=caps["splitkv"],
                    cost=cost, fp8_max_keys=prefill.fp8_accurate_keys(target) if prefill else 0,
                    decode_balanced=getattr(cost, "decode_balanced", None) is not False)


# --- selection -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """What one model needs on one arch: per path, the variants or the reason it cannot run."""

    arch: str
    variants: dict  # path -> tuple of hip_kernels Variant (empty when refused)
    refusals: dict  # path -> Refusal

    def all_variants(self) -> list:
        seen, out = set(), []
        for vs in self.variants.values():
            for v in vs:
                if v not in seen:
                    seen.add(v)
                    out.append(v)
        return out


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def select(facts, arch: str, *, max_query_tokens: int = 1) -> Selection:
    """The variants `facts` (a planner ModelFacts) needs on `arch`, chosen by the launchers'
    own selection code, or the named reason each path cannot serve it.

    ``facts.layer_windows`` (or ``facts.window``) lists the windows of the model's layers: the
    varlen kernel picks its tile by window. ``max_query_tokens``: the planner's decode limit
    (speculative decoding needs more split-KV row variants)."""
    arch = rules.compile_target(arch)
    mods = _modules()
    caps = path_caps(arch)
    sig = Signature.of(facts)
    variants: dict = {}
    refusals: dict = {}
    for path in ("varlen", "splitkv"):
        r = rules.check(caps[path], sig)
        if r is not None:
            refusals[path] = r
            variants[path] = ()
            continue
        if path == "varlen":
            vs = _varlen_variants(mods, facts, arch)
            if rules.check(caps["varlen_fp8"], sig) is None:
                vs += [v for v in _fp8_variants(mods, facts, arch) if v not in vs]
        else:
            vs = _splitkv_variants(mods, facts, arch, max_query_tokens)
        declared = {e.variant for e in entries_for(arch)}
        missing = [v.name for v in vs if v.name not in declared]
        if missing:  # the selection asked for a variant the module does not declare
            refusals[path] = Refusal("kernel_unavailable", f"undeclared variants {missing}")
            variants[path] = ()
        else:
            variants[path] = tuple(vs)
    return Selection(arch, variants, refusals)


def _windows(facts) -> list[int]:
    ws = list(getattr(facts, "layer_windows", ()) or ()) or [facts.window]
    return sorted(set(int(w) for w in ws))


def _varlen_variants(mods, facts, arch):
    prefill, gather = mods["prefill"], mods["gather"]
    code = {"bf16": 0, "fp16": 1}[facts.dtype]
    out = []
    for w in _windows(facts):
        v = prefill._variant(facts.head_dim, code, facts.softcap > 0, _config_for(prefill, facts.head_dim, w, arch))
        if v not in out:
            out.append(v)
    fp8 = facts.kv_dtype.startswith("fp8")
    scale = facts.kv_scale_mode if fp8 else "per_tensor"
    out.append(gather.variant("vllm", fp8, _torch_dtype(facts.dtype), scale))
    return out


def _fp8_variants(mods, facts, arch):
    """FP8 compute's kernels: the prefill of the scale mode gather_kv_fp8 packs for this page
    size (it quantizes Q itself) and the gather."""
    prefill, gather = mods["prefill"], mods["gather"]
    code = {"bf16": 0, "fp16": 1}[facts.dtype]
    scale = facts.kv_scale_mode
    name = "per_page16" if scale == "per_page" and facts.page_size % 16 == 0 else scale
    out = []
    for w in _windows(facts):
        v = prefill._variant(facts.head_dim, code, facts.softcap > 0,
                             prefill.config_for(facts.head_dim, w, arch, fp8=name), prefill.KV_FP8_MODES[name])
        if v not in out:
            out.append(v)
    return out + [gather.fp8_variant("vllm", scale)] + ([gather.v_ref_variant("vllm")] if scale == "per_page" else [])


def _splitkv_variants(mods, facts, arch, max_query_tokens: int):
    decode, combine = mods["decode"], mods["combine"]
    qcode = {"bf16": 0, "fp16": 1}[facts.dtype]
    kv_code = {"fp8_e4m3": 2, "fp8_e4m3fnuz": 3}.get(facts.kv_dtype, qcode)
    group = facts.num_q_heads // facts.num_kv_heads
    impl = decode.choose_impl(arch, facts.head_dim, kv_code)  # as splitkv_partials chooses
    out = []
    for q in range(1, max(1, max_query_tokens) + 1):
        v = decode.launch_variant(impl, facts.head_dim, qcode, kv_code, q * group)
        if v not in out:
            out.append(v)
    out.append(combine.variant(_torch_dtype(facts.dtype)))
    return out


def variant_by_name(name: str, arch: str):
    """The hip_kernels Variant of a registry row (for build and tests)."""
    for mod in _modules().values():
        for v in _module_variants(mod, rules.compile_target(arch)):
            if v.name == name:
                return v
    raise KeyError(name)


__all__ = ["entries", "entries_for", "path_caps", "platform_for", "select", "Selection", "variant_by_name", "KERNELS"]
