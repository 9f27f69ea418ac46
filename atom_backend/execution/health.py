"""Health of the compiled kernels in this process: which can run, which failed, and the
platform the planner sees once the failed ones are taken out.

A compiled kernel that cannot run (module missing, no toolchain, compile or launch failure) is
reported once (``metrics.record_fallback`` and a log line); the batch at hand runs on the next
path and the builder plans later batches without it (``without_failed_kernels``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from atom_backend import metrics
from atom_backend.planning import Platform, Reason, rules

logger = logging.getLogger("atom_backend")


def _observe_compiles() -> None:
    """Count the compiled kernels' compiles and cache hits in the metrics (atom_kernel_compiles_total)."""
    from hip_kernels import runtime

    runtime.observe_compiles(metrics.record_compile)
    _observe_triton_compiles()


# The unified path's Triton kernels (atom_backend.unified._kernels), counted as "unified <name>".
_TRITON_KERNELS = ("unified_attn_kernel", "combine_kernel")


def _observe_triton_compiles() -> None:
    """Count the unified path's Triton compiles and cache loads too: the JIT makes a variant at its
    first launch, so one counted after warm-up is a batch that waited on a compiler. Triton has
    one listener slot; one already set (another library's) keeps being called."""
    try:
        import triton
    except ImportError:
        return
    knobs = getattr(triton, "knobs", None)
    prev = getattr(getattr(knobs, "compilation", None), "listener", None) if knobs else None
    if knobs is None or getattr(prev, "atom_backend", False):
        return

    def listener(**kw):
        name = getattr(getattr(kw.get("src"), "fn", None), "__name__", "")
        if name in _TRITON_KERNELS:
            total = getattr(kw.get("times"), "total", 0) or 0  # microseconds
            metrics.record_compile(f"unified {name}", total * 1e-6, bool(kw.get("cache_hit")))
        if prev is not None:
            prev(**kw)

    listener.atom_backend = True
    knobs.compilation.listener = listener

# "varlen" / "splitkv" / "varlen_fp8" (FP8 compute inside varlen) -> None (usable) or why not
STATE: dict[str, str | None] = {}


def kernel_unavailable(path: str) -> str | None:
    """Why the compiled kernel of ``path`` cannot run here (None: it can), probed once."""
    if path not in STATE:
        why = None
        try:
            from hip_kernels import runtime

            _observe_compiles()
            if path == "varlen":
                import hip_kernels.gather  # noqa: F401
                import hip_kernels.prefill  # noqa: F401
            else:
                import hip_kernels.combine  # noqa: F401
                import hip_kernels.decode  # noqa: F401
            runtime.toolchain_for(runtime.device_arch())
        except Exception as e:  # ImportError, ToolchainMissingError, no device...
            why = f"{type(e).__name__}: {e}"
        STATE[path] = why
        if why is not None:
            _fallback(Reason.NO_KERNEL.value, path, why)
    return STATE[path]


def mark_kernel_failed(path: str, why: str) -> None:
    """A kernel failed at run time (e.g. compile error): later batches plan around it (their
    requests counted with reason kernel_unavailable: without_failed_kernels)."""
    STATE[path] = why
    _fallback(Reason.NO_KERNEL.value, path, why)


def without_failed_kernels(platform: Platform) -> Platform:
    """`platform` less the kernels that failed at run time (mark_kernel_failed)."""
    failed = {k for k, why in STATE.items() if why is not None}
    now = dict(varlen_kernel=platform.varlen_kernel and "varlen" not in failed,
               splitkv_kernel=platform.splitkv_kernel and "splitkv" not in failed,
               varlen_fp8_caps=None if "varlen_fp8" in failed else platform.varlen_fp8_caps)
    if all(getattr(platform, k) is v for k, v in now.items()):
        return platform  # the same object: caches keyed on it stay valid
    return replace(platform, **now)


def usable(path: str) -> bool:
    """No run-time failure is recorded for the kernel of ``path``."""
    return STATE.get(path) is None


def _fallback(reason: str, path: str, why: str) -> None:
    logger.debug("atom: %s kernel unavailable (%s), its requests go to the next path", path, why)
    metrics.record_fallback(reason, path)


def detect_platform(device: torch.device) -> Platform:
    """The planner's Platform: the kernel registry's answers for this device's arch (its
    tuning table applied, its cost table when there is one); on the CPU the torch routes,
    which serve every problem the planner accepts."""
    if device.type == "cpu":
        return Platform(vendor="cpu", arch="cpu", num_sms=max(1, torch.get_num_threads()),
                                 varlen_caps=rules.ANY, splitkv_caps=rules.ANY)
    from hip_kernels import runtime

    arch = runtime.device_arch(device.index)
    props = torch.cuda.get_device_properties(device)
    varlen_ok = kernel_unavailable("varlen") is None
    splitkv_ok = kernel_unavailable("splitkv") is None
    try:
        from atom_backend.catalog import registry, tuning

        tuning.apply(arch, props.name)
        return registry.platform_for(arch, num_sms=props.multi_processor_count, varlen_kernel=varlen_ok,
                                     splitkv_kernel=splitkv_ok, device=props.name)
    except ImportError as e:  # kernel modules missing: every request on the Triton path
        _fallback(Reason.NO_KERNEL.value, "varlen+splitkv", f"{type(e).__name__}: {e}")
        return Platform(vendor="amd" if runtime.is_amd_arch(arch) else "nvidia", arch=arch,
                                 num_sms=props.multi_processor_count, varlen_kernel=False, splitkv_kernel=False)


# Compiled per process start at most once per (arch, model facts, decode width).
_WARMED: set = set()


def warm_kernels(facts, device: torch.device, max_query_tokens: int) -> None:
    """Compile (or fetch from the disk cache) every kernel variant `facts` can launch on `device`
    before the first batch: the selection is the launchers' own (``catalog.registry.select``), so a
    request that comes later in serving, a prefix hit or a speculative step, finds its variant ready
    instead of stalling its batch on a compile. Threads, not processes: vLLM's engine and worker
    processes are daemons, which may not start children. A variant that fails is left to the first
    launch, which reports it (``mark_kernel_failed``) and plans around it."""
    if device.type != "cuda":
        return
    from hip_kernels import runtime

    arch = runtime.device_arch(device.index)
    key = (arch, facts, max_query_tokens)
    if key in _WARMED:
        return
    _WARMED.add(key)
    built, failed = [], []
    try:
        from atom_backend.catalog import build

        jobs = build.plan_build([arch], lambda _arch: [facts], max_query_tokens=max_query_tokens)
        for j in jobs:
            j.triton = []  # an ahead-of-time Triton compile does not fill the JIT's cache: launched below
        results = build.run(jobs, workers=min(8, os.cpu_count() or 1), progress=False, threads=True)
        failed = [r for r in results if r.error]
        built = [r for r in results if not r.error and not r.skipped]
    except Exception as e:  # the first launch will meet and report the same problem
        logger.warning("atom-backend: kernels not compiled ahead of the first batch (%s: %s)", type(e).__name__, e)
    for r in failed:
        logger.warning("atom-backend: %s did not compile ahead of serving: %s", r.name, r.error.splitlines()[0])
    unified, seconds = _warm_unified(facts, arch, device, max_query_tokens)
    logger.info("atom-backend: %d kernel variants ready for %s (%d compiled now, %.1f s); %d unified (Triton) "
                "variants launched once (%.1f s)", len(built), arch, sum(not r.cache_hit for r in built),
                sum(r.seconds for r in built), len(unified), seconds)


def _warm_unified(facts, arch: str, device: torch.device, max_query_tokens: int) -> tuple[list[str], float]:
    """Launch the unified path's variants once (Triton compiles at first launch). A failure is left
    to the first real launch, which reports it and plans around it."""
    try:
        from atom_backend.unified import warm

        return warm.timed_warm(facts, arch, device, max_query_tokens)
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("atom-backend: unified (Triton) kernels not launched ahead of the first batch (%s: %s)",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return [], 0.0
