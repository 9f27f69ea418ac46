"""Prometheus metrics of the backend: what the planner routed, what fell back, what compiled,
and a sampled device time per path. Every name is documented in docs/metrics.md.

Callers use only the four module functions (team contract):

    metrics.record_plan(plan, seconds, layer_kind=..., step=..., routing=..., layers=...)
                                                    # every planned batch, in the metadata builder
    metrics.record_fallback(reason, path)           # a run-time fallback (also logged)
    metrics.record_compile(kernel, seconds, cache_hit)
    with metrics.kernel_timer(path): ...            # around a kernel launch

vLLM plans one batch per KV-cache group per engine step (a gpt-oss model has a window group and a
full one), so the builder says what each call stands for: ``step`` (this call counts the step's
tokens: one builder per process does), ``routing`` (this call counts the routing series of its
``layer_kind``: one builder per kind does), ``layers`` (the layers this plan serves: the gather
runs once per layer). docs/metrics.md states the unit of every series.

Environment (read on the first call, not at import):
- ``ATOM_METRICS=0`` disables every update; each call is then a attribute lookup and a return.
- ``ATOM_METRICS_SAMPLE_RATE`` (default 0.01): the fraction of ``kernel_timer`` blocks timed.
  On a GPU a sampled block records a pair of device events; their elapsed time is read on a
  later call once the end event has completed (``Event.query()``), so the host never waits.
  Without CUDA/ROCm torch the block is timed with ``time.perf_counter``.
- ``PROMETHEUS_MULTIPROC_DIR``: prometheus-client's multiprocess mode. vLLM runs the API server,
  the engine core and the workers in separate processes, and only the API server answers
  /metrics. vLLM (``vllm.v1.metrics.prometheus.get_prometheus_registry``, 0.26 to 0.33) serves a
  ``MultiProcessCollector`` registry whenever this variable is set, so with it set in the
  environment *before* vLLM starts (deploy/ does this) the workers' atom_* series appear on the
  API server's /metrics. Without it the values stay in the process that recorded them.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from typing import Any

logger = logging.getLogger("atom_backend")

PHASE_PATHS = (("prefill", "varlen"), ("prefill", "unified"), ("decode", "splitkv"), ("decode", "unified"))

# Kernel time per launch: a decode step of a small model is ~10 us, a long prefill ~100 ms.
KERNEL_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
# The planner costs ~10 us for 256 requests (bench/planner.py); the tail catches GC pauses.
PLANNER_BUCKETS = (2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2)
# ATOM_MAX_SPLITS defaults to 64; powers of two, since that is how the split count moves.
SPLIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# A burst of sampled launches whose events nobody reads (e.g. no later batch) must not grow
# without bound: past this many, the oldest unread pairs are dropped.
MAX_PENDING_EVENTS = 1024

def _enabled_from_env() -> bool:
    from atom_backend.planning import env_flag

    return env_flag(os.environ, "ATOM_METRICS", True)


def rate_from_env(env=None) -> float:
    """ATOM_METRICS_SAMPLE_RATE as a fraction in [0, 1] (ValueError naming a bad value)."""
    raw = (os.environ if env is None else env).get("ATOM_METRICS_SAMPLE_RATE", "").strip()
    if not raw:
        return 0.01
    try:
        rate = float(raw)
    except ValueError:
        raise ValueError(f"ATOM_METRICS_SAMPLE_RATE={raw!r} is not a number in [0, 1]") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"ATOM_METRICS_SAMPLE_RATE={raw!r} is outside [0, 1]")
    return rate


def use_multiprocess_values() -> None:
    """Make metric values file-backed when PROMETHEUS_MULTIPROC_DIR is set.

    prometheus-client picks its value class when it is first imported. A process that imported
    it before the variable was set (vLLM's ``setup_multiprocess_prometheus`` sets it at run
    time for several API servers) would keep ours in memory, invisible to /metrics."""
    from prometheus_client import values

    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()


class _NullTimer:
    """The context manager for unsampled blocks and disabled metrics: shared, stateless."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


NULL_TIMER = _NullTimer()


class _CpuTimer:
    __slots__ = ("_hist", "_t0")

    def __init__(self, hist) -> None:
        self._hist = hist

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        if exc_type is None:
            self._hist.observe(time.perf_counter() - self._t0)
        return False


class _DeviceTimer:
    """Records start/end events on the current stream; the owner reads them later."""

    __slots__ = ("_owner", "_hist", "_start")

    def __init__(self, owner: "Metrics", hist) -> None:
        self._owner = owner
        self._hist = hist

    def __enter__(self):
        self._start = self._owner._event()
        self._start.record()
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        owner = self._owner
        if exc_type is None:
            end = owner._event()
            end.record()
            owner._pending.append((self._hist, self._start, end))
            if len(owner._pending) > MAX_PENDING_EVENTS:
                owner._pending.popleft()
        else:
            owner._free.append(self._start)
        return False


class Metrics:
    """The metric families on one registry. The module functions use one instance on the
    default registry; tests make their own on a private ``CollectorRegistry``."""

    def __init__(self, registry: Any = None, sample_rate: float = 0.01, device_timing: bool | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate={sample_rate} is outside [0, 1]")
        use_multiprocess_values()
        reg = REGISTRY if registry is None else registry
        self.sample_rate = sample_rate
        # None: decided on the first sampled timer (torch may not be imported yet).
        self._device_timing = device_timing
        self._pending: deque = deque()
        self._free: list = []
        self._rand = random.random

        self.tokens = Counter(
            "atom_tokens", "New query tokens scheduled, once per engine step, by the planner's phase", ["phase"],
            registry=reg,
        )
        self.batches = Counter(
            "atom_batches", "Engine steps with at least one request on this phase and path, per layer kind",
            ["phase", "path", "layer_kind"], registry=reg,
        )
        self.routed_tokens = Counter(
            "atom_routed_tokens", "New query tokens routed, once per engine step per layer kind, by phase and path",
            ["phase", "path", "layer_kind"], registry=reg,
        )
        self.requests = Counter(
            "atom_routed_requests",
            "Requests routed, once per engine step per layer kind, by phase, path and the planner's reason",
            ["phase", "path", "reason", "layer_kind"],
            registry=reg,
        )
        self.gathered_bytes = Counter(
            "atom_gathered_bytes", "Bytes written into packed K and V by the varlen gather, summed over layers",
            ["layer_kind"], registry=reg,
        )
        self.gathered_tokens = Counter(
            "atom_gathered_tokens", "Keys (cached + new) packed by the varlen gather, counted once per layer",
            ["layer_kind"], registry=reg,
        )
        self.varlen_compute = Counter(
            "atom_varlen_compute_requests",
            "Varlen prefill requests by compute precision (fp8: FP8 cache computed in FP8; 16bit) and why, "
            "once per engine step per layer kind",
            ["compute", "reason", "layer_kind"],
            registry=reg,
        )
        self.fallbacks = Counter(
            "atom_fallbacks", "Run-time fallbacks to another path, by reason and the path taken", ["reason", "path"],
            registry=reg,
        )
        self.compiles = Counter(
            "atom_kernel_compiles", "Kernel variants compiled (cache misses), by kernel", ["kernel"], registry=reg
        )
        self.cache_hits = Counter(
            "atom_kernel_cache_hits", "Kernel variants loaded from the disk cache, by kernel", ["kernel"], registry=reg
        )
        self.compile_seconds = Counter(
            "atom_kernel_compile_seconds", "Time spent compiling or loading kernel variants, by kernel", ["kernel"],
            registry=reg,
        )
        self.planner_seconds = Histogram(
            "atom_planner_seconds", "Host time of one planner call (one per KV-cache group per engine step)",
            buckets=PLANNER_BUCKETS, registry=reg,
        )
        self.kernel_seconds = Histogram(
            "atom_kernel_seconds",
            "Sampled kernel time per launch, by path (device events on GPUs)",
            ["path"],
            buckets=KERNEL_BUCKETS,
            registry=reg,
        )
        self.decode_splits = Histogram(
            "atom_decode_num_splits", "Split-KV splits of a decode batch, once per engine step per layer kind",
            ["layer_kind"], buckets=SPLIT_BUCKETS, registry=reg,
        )

        # Label lookups take a lock and hash the tuple; resolve the fixed ones once. Creating
        # them also exports zeros from the start, so rate() works from the first increment.
        self._tok_prefill = self.tokens.labels("prefill")
        self._tok_decode = self.tokens.labels("decode")
        self._kinds: dict[str, _KindSeries] = {}
        self._ktime: dict = {}

    # -- record_plan -------------------------------------------------------------------
    def _kind(self, layer_kind: str) -> "_KindSeries":
        k = self._kinds.get(layer_kind)
        if k is None:
            k = self._kinds[layer_kind] = _KindSeries(self, layer_kind)
        return k

    def record_plan(self, plan: Any, seconds: float, *, layer_kind: str = "full", step: bool = True,
                    routing: bool = True, layers: int = 1) -> None:
        self.planner_seconds.observe(seconds)
        kind = self._kind(layer_kind)
        if step:
            self._record_step(plan)
        if routing:
            kind.record_routing(plan)
        if layers and len(plan.varlen):
            kind.gbytes.inc(plan.gather_bytes * layers)
            kind.gtok.inc(plan.gather_tokens * layers)
        if self._pending:
            self.poll()

    def _record_step(self, plan: Any) -> None:
        prefill = plan.varlen_tokens + plan.unified_tokens
        if prefill:
            self._tok_prefill.inc(prefill)
        if plan.decode_tokens:
            self._tok_decode.inc(plan.decode_tokens)

    # -- fallbacks and compiles --------------------------------------------------------
    def record_fallback(self, reason: str, path: str) -> None:
        self.fallbacks.labels(str(reason), str(path)).inc()

    def record_compile(self, kernel: str, seconds: float, cache_hit: bool) -> None:
        (self.cache_hits if cache_hit else self.compiles).labels(kernel).inc()
        self.compile_seconds.labels(kernel).inc(max(0.0, float(seconds)))

    # -- kernel time -------------------------------------------------------------------
    def kernel_timer(self, path: str):
        if self._rand() >= self.sample_rate:
            return NULL_TIMER
        hist = self._ktime.get(path)
        if hist is None:
            hist = self._ktime[path] = self.kernel_seconds.labels(path)
        if self._device_timing is None:
            self._device_timing = _cuda_usable()
        if not self._device_timing:
            return _CpuTimer(hist)
        # Event records cannot go into a graph being captured; replays are timed elsewhere.
        if self._capturing():
            return NULL_TIMER
        if self._pending:
            self.poll()
        return _DeviceTimer(self, hist)

    def _capturing(self) -> bool:
        import torch

        return torch.cuda.is_current_stream_capturing()

    def _event(self):
        if self._free:
            return self._free.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def poll(self) -> int:
        """Observe every sampled launch whose end event has completed, oldest first; never
        waits. Returns how many are still pending."""
        pending = self._pending
        while pending:
            hist, start, end = pending[0]
            if not end.query():
                break
            pending.popleft()
            hist.observe(start.elapsed_time(end) * 1e-3)
            self._free.append(start)
            self._free.append(end)
        return len(pending)


class _KindSeries:
    """The children of one layer kind's series, resolved once: the hot path then only
    increments (the four phase/path combinations exist from the kind's first plan, at 0)."""

    def __init__(self, m: Metrics, kind: str) -> None:
        self._m, self.kind = m, kind
        self.batch = {pp: m.batches.labels(*pp, kind) for pp in PHASE_PATHS}
        self.tok = {pp: m.routed_tokens.labels(*pp, kind) for pp in PHASE_PATHS}
        self.req: dict = {}
        self.vc: dict = {}
        self.gbytes = m.gathered_bytes.labels(kind)
        self.gtok = m.gathered_tokens.labels(kind)
        self.splits = m.decode_splits.labels(kind)

    def _req_child(self, phase: str, path: str, reason: Any):
        key = (phase, path, reason)
        child = self.req.get(key)
        if child is None:
            child = self.req[key] = self._m.requests.labels(phase, path, getattr(reason, "value", reason), self.kind)
        return child

    def _vc_child(self, fp8: bool, why: Any):
        key = ("fp8" if fp8 else "16bit", getattr(why, "value", why))
        child = self.vc.get(key)
        if child is None:
            child = self.vc[key] = self._m.varlen_compute.labels(*key, self.kind)
        return child

    def record_routing(self, plan: Any) -> None:
        n = len(plan.decode)
        if n:
            path = getattr(plan.decode_path, "value", plan.decode_path)
            self.batch["decode", path].inc()
            self.tok["decode", path].inc(plan.decode_tokens)
            self._req_child("decode", path, plan.decode_reason).inc(n)
            if path == "splitkv":
                self.splits.observe(plan.num_splits)
        n = len(plan.varlen)
        if n:
            self.batch["prefill", "varlen"].inc()
            self.tok["prefill", "varlen"].inc(plan.varlen_tokens)
            self._req_child("prefill", "varlen", getattr(plan, "varlen_reason", "preferred")).inc(n)
            self._vc_child(getattr(plan, "varlen_fp8", False), getattr(plan, "varlen_compute_reason", "preferred")).inc(n)
        if len(plan.unified):
            self.batch["prefill", "unified"].inc()
            self.tok["prefill", "unified"].inc(plan.unified_tokens)
            reasons = plan.unified_reasons
            first = reasons[0]
            if reasons.count(first) == len(reasons):  # the usual case: one reason for the batch
                self._req_child("prefill", "unified", first).inc(len(reasons))
            else:
                for r in set(reasons):
                    self._req_child("prefill", "unified", r).inc(reasons.count(r))


def _cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class _Disabled:
    """ATOM_METRICS=0: the same methods, doing nothing."""

    sample_rate = 0.0

    def record_plan(self, plan, seconds, *, layer_kind="full", step=True, routing=True, layers=1) -> None:
        pass

    def record_fallback(self, reason, path) -> None:
        pass

    def record_compile(self, kernel, seconds, cache_hit) -> None:
        pass

    def kernel_timer(self, path):
        return NULL_TIMER

    def poll(self) -> int:
        return 0


_impl: Metrics | _Disabled | None = None
_logged_fallbacks: set = set()


def _init() -> Metrics | _Disabled:
    global _impl
    if _impl is None:
        if not _enabled_from_env():
            _impl = _Disabled()
        else:
            _impl = Metrics(sample_rate=rate_from_env())
            if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                logger.info(
                    "atom metrics live in process %d only: set PROMETHEUS_MULTIPROC_DIR before starting vLLM "
                    "so that its /metrics shows the workers' atom_* series (docs/metrics.md)",
                    os.getpid(),
                )
    return _impl


def record_plan(plan: Any, seconds: float, *, layer_kind: str = "full", step: bool = True, routing: bool = True,
                layers: int = 1) -> None:
    """Record one planner call: its host time in seconds, always; with ``step``, the step's new
    query tokens by phase (atom_tokens); with ``routing``, the routing series of ``layer_kind``
    (batches, routed tokens and requests by phase/path/reason, varlen compute, decode splits);
    the gather's bytes and keys times ``layers``, the layers the plan serves. The defaults are
    a plan standing alone: one layer kind, one layer."""
    (_impl or _init()).record_plan(plan, seconds, layer_kind=layer_kind, step=step, routing=routing, layers=layers)


def record_fallback(reason: str, path: str) -> None:
    """Count a run-time fallback (e.g. the kernel of `path` failed to load; its requests ran on
    the next path) and log it: a warning the first time per (reason, path), debug after that."""
    key = (str(reason), str(path))
    if key in _logged_fallbacks:
        logger.debug("atom-backend fallback from %s: %s", path, reason)
    else:
        _logged_fallbacks.add(key)
        logger.warning("atom-backend fallback from %s: %s (further ones are counted in atom_fallbacks_total)",
                       path, reason)
    (_impl or _init()).record_fallback(reason, path)


def record_compile(kernel: str, seconds: float, cache_hit: bool) -> None:
    """Count a kernel variant made ready: compiled (cache_hit False) or loaded from the cache."""
    (_impl or _init()).record_compile(kernel, seconds, cache_hit)


def kernel_timer(path: str):
    """Context manager around a kernel launch on `path` ("varlen", "unified", "splitkv", ...).
    Most calls return a shared no-op; a sampled one records device events (read later, never
    synchronising) or, without a GPU, host time."""
    return (_impl or _init()).kernel_timer(path)


def poll() -> int:
    """Read the sampled device timings that have completed (record_plan does this at each
    planner call). Returns how many are still in flight."""
    return (_impl or _init()).poll()


def exposition_registry():
    """The registry a /metrics endpoint of this process should serve: a multiprocess
    collector over PROMETHEUS_MULTIPROC_DIR when it is set (what vLLM's own /metrics does),
    else the default registry."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return reg
    return REGISTRY


def start_http_server(port: int, addr: str = "127.0.0.1"):
    """Serve exposition_registry() on addr:port, for engines run without vLLM's API server
    (offline ``LLM(...)``). Returns prometheus-client's (server, thread)."""
    import prometheus_client

    return prometheus_client.start_http_server(port, addr=addr, registry=exposition_registry())


def _reset_for_tests() -> None:
    """Forget the module instance so that the next call re-reads the environment. Only for
    tests running in a fresh process (the families stay registered on the default registry)."""
    global _impl
    _impl = None
    _logged_fallbacks.clear()
