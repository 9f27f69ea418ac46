"""What "supported" means: registry entries, problem signatures and the validation rules.

Torch-free and vLLM-free (the planner imports this module). The registry
(``atom_backend.catalog.registry``) derives ``Entry`` rows from the kernel modules' declared
variants; the planner receives them, per path and arch, as ``PathCaps`` inside its
``Platform``. ``check(caps, sig)`` walks the ordered ``RULES``: each rule keeps the entries
that can serve the signature on one axis, and the first rule that leaves none names the
reason, which is the planner's routing reason (``Reason`` values in ``planner.py``). So the
question "is this supported?" has one answer, asked in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Query / output dtypes, KV formats and scale modes, as the planner spells them.
Q_DTYPES = ("bf16", "fp16", "fp32")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e4m3fnuz")
SCALE_MODES = ("none", "per_tensor", "per_page")
FEATURES = ("sinks", "window", "sink_tokens", "softcap", "lse")
# Compile targets the registry declares: sm_90a runs on the H100 here; the AMD ones are
# compile-checked in CI (clang-22) and run where ROCm is installed.
ARCHS = ("sm_90a", "gfx942", "gfx950", "gfx1250")


def arch_family(arch: str) -> str:
    """The key of per-arch tables: 'sm_90a' and 'sm_90' -> 'sm_90'; gfx names as they are."""
    return arch[:-1] if arch.startswith("sm_") and arch.endswith("a") else arch


def compile_target(arch: str) -> str:
    """The registry's compile target of an arch name: 'sm_90' -> 'sm_90a' (exact-sm cubin with
    the Hopper instructions), others unchanged."""
    if arch.startswith("sm_") and not arch.endswith("a") and int(arch[3:] or 0) >= 90:
        return arch + "a"
    return arch


@dataclass(frozen=True)
class Entry:
    """One compiled variant the backend can request, described by what it serves.

    ``kv_dtype`` "same" means the KV tensor has the query dtype (16-bit caches, packed K/V of
    the varlen kernel); "*" means the kernel does not read KV (combine). ``page_sizes`` is the
    inclusive class (lo, hi) of cache page sizes served; (0, 0) for kernels on packed tensors.
    """

    kernel: str  # varlen_prefill | gather_kv | splitkv_decode | combine
    path: str  # varlen | splitkv: the planner path that launches it
    q_dtype: str
    kv_dtype: str
    scale_modes: tuple
    head_dim: int  # 0: any
    page_sizes: tuple
    features: frozenset
    tile: tuple  # (name, value) pairs of the tile configuration
    archs: tuple
    variant: str  # hip_kernels Variant.name (readable id, also the cache file stem)
    role: str = ""  # free text: "full" / "small window" tile, "rows=8", "layout vllm", ...

    def serves_kv(self, q_dtype: str, kv_dtype: str) -> bool:
        if self.kv_dtype == "*":
            return True
        if self.kv_dtype == "same":
            return kv_dtype == q_dtype
        return kv_dtype == self.kv_dtype

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "path": self.path, "q_dtype": self.q_dtype, "kv_dtype": self.kv_dtype,
                "scale_modes": list(self.scale_modes), "head_dim": self.head_dim or "any",
                "page_sizes": list(self.page_sizes), "features": sorted(self.features), "tile": dict(self.tile),
                "archs": list(self.archs), "variant": self.variant, "role": self.role}


@dataclass(frozen=True)
class Signature:
    """A problem as the planner sees it (one model, one layer type, one path)."""

    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    scale_mode: str = "none"
    head_dim: int = 128
    page_size: int = 16
    features: frozenset = frozenset()

    @classmethod
    def of(cls, facts) -> "Signature":
        """From a planner ``ModelFacts`` (duck-typed: this module imports nothing)."""
        feats = set()
        if facts.has_sinks:
            feats.add("sinks")
        if facts.window > 0 or any(w > 0 for w in getattr(facts, "layer_windows", ())):
            feats.add("window")
        if facts.sink_tokens > 0:
            feats.add("sink_tokens")
        if facts.softcap > 0:
            feats.add("softcap")
        return cls(facts.dtype, facts.kv_dtype, facts.kv_scale_mode, facts.head_dim, facts.page_size,
                   frozenset(feats))


@dataclass(frozen=True)
class Refusal:
    reason: str  # a planner Reason value
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


# An ordered rule: (reason, what it checks, keep(entry, sig) -> bool, available(entries) -> str).
@dataclass(frozen=True)
class Rule:
    reason: str
    what: str
    keep: Callable
    offered: Callable


def _fmt(values) -> str:
    return "{" + ", ".join(str(v) for v in sorted(set(values), key=lambda v: (isinstance(v, str), v))) + "}"


RULES = (
    Rule("unsupported_head_dim", "head dim",
         lambda e, s: e.head_dim in (0, s.head_dim),
         lambda es, s: f"head dim {s.head_dim} not in {_fmt(e.head_dim for e in es)}"),
    Rule("unsupported_dtype", "query dtype",
         lambda e, s: e.q_dtype == s.q_dtype,
         lambda es, s: f"query dtype {s.q_dtype} not in {_fmt(e.q_dtype for e in es)}"),
    Rule("unsupported_kv_format", "kv dtype",
         lambda e, s: e.serves_kv(s.q_dtype, s.kv_dtype),
         lambda es, s: f"kv dtype {s.kv_dtype} with {s.q_dtype} queries not in "
                       f"{_fmt(s.q_dtype + ' (same)' if e.kv_dtype == 'same' else e.kv_dtype for e in es)}"),
    Rule("unsupported_kv_format", "fp8 scale mode",
         lambda e, s: s.scale_mode in e.scale_modes,
         lambda es, s: f"{s.kv_dtype} scale mode {s.scale_mode} not built (built: "
                       f"{_fmt(m for e in es for m in e.scale_modes)})"),
    Rule("unsupported_page_size", "page size",
         lambda e, s: e.page_sizes == (0, 0) or e.page_sizes[0] <= s.page_size <= e.page_sizes[1],
         lambda es, s: f"page size {s.page_size} outside {_fmt(f'{a}..{b}' for a, b in (e.page_sizes for e in es))}"),
    Rule("unsupported_feature", "features",
         lambda e, s: s.features <= e.features,
         lambda es, s: f"features {sorted(s.features)} not all in {_fmt(f for e in es for f in e.features)}"),
)


@dataclass(frozen=True, eq=False)
class PathCaps:
    """What one planner path can serve on one arch: its registry entries, grouped by the kernels
    the path launches (every group must serve the signature). ``any_problem`` marks the CPU
    torch routes, which serve every problem the planner accepts."""

    arch: str
    groups: tuple = ()  # ((kernel name, (Entry, ...)), ...)
    any_problem: bool = False
    # eq=False: hashed by identity, so the planner's memo of (caps, facts) -> reason is a
    # cheap lookup (registry.path_caps builds one per arch and keeps it).

    def check(self, sig: Signature) -> Refusal | None:
        return check(self, sig)


ANY = PathCaps("cpu", (), True)


def check_entries(entries, sig: Signature, kernel: str = "") -> Refusal | None:
    """The first rule that leaves no entry able to serve `sig`, or None."""
    left = list(entries)
    if not left:
        return Refusal("kernel_unavailable", f"no {kernel or 'kernel'} variant is built for this arch")
    for rule in RULES:
        kept = [e for e in left if rule.keep(e, sig)]
        if not kept:
            return Refusal(rule.reason, f"{kernel}: {rule.offered(left, sig)}" if kernel else rule.offered(left, sig))
        left = kept
    return None


def check(caps: PathCaps | None, sig: Signature) -> Refusal | None:
    if caps is None:
        return Refusal("kernel_unavailable", "the registry declares no kernel for this path")
    if caps.any_problem:
        return None
    if not caps.groups:
        return Refusal("kernel_unavailable", f"no kernel of this path is built for {caps.arch}")
    for kernel, entries in caps.groups:
        r = check_entries(entries, sig, kernel)
        if r is not None:
            return r
    return None


__all__ = ["Entry", "Signature", "Refusal", "Rule", "RULES", "PathCaps", "ANY", "check", "check_entries",
           "arch_family", "compile_target", "ARCHS", "Q_DTYPES", "KV_DTYPES", "SCALE_MODES", "FEATURES"]
