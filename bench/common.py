"""Shared benchmark helpers: median timing and the device's measured copy bandwidth.

docs/design.md "Performance accounting": report bytes moved over time and the fraction of the
copy bandwidth measured on the same GPU, in the same process.
"""

from __future__ import annotations

import functools

import torch


def parse_defines(items: list) -> tuple:
    """['NAME=VALUE', ...] (a bench's --define) -> (('NAME', 'VALUE'), ...) for a kernel variant's extra defines."""
    out = []
    for it in items:
        name, _, value = it.partition("=")
        if not name or not value:
            raise SystemExit(f"--define {it!r}: NAME=VALUE expected")
        out.append((name, value))
    return tuple(out)


def serving_build(head_dim: int, window: int = 0, fp8: str | None = None, *, source: str | None = None,
                  defines: tuple = (), **fields):
    """The tile a serving process launches on this device for that shape (call tuning.apply first for its
    arch's tuned tiles) as an explicit build (prefill.Build): another source (a bench overlay), extra
    defines, tile fields replaced (prefill.Config's, e.g. num_warps=8)."""
    import dataclasses

    from hip_kernels import prefill

    cfg = prefill.config_for(head_dim, window, prefill._default_arch(), fp8)
    return prefill.Build(dataclasses.replace(cfg, **fields), source=source, defines=defines)


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of fn() in milliseconds (device events; triton's do_bench when present)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    n = max(5, int(rep_ms / one))
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graphed(fn):
    """fn captured once in a CUDA graph, returned as its replay (how vLLM runs decode steps):
    timings then hold no host launch overhead. Falls back to fn where capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # compile, load and allocate outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # a peer that cannot be captured is timed eagerly
        print(f"# CUDA-graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:100]}); timing eagerly")
        torch.cuda.synchronize()
        return fn
    g._keep = fn  # the graph's buffers live as long as the closure
    return g.replay


@functools.lru_cache(maxsize=None)
def compiled_flex():
    """FlexAttention compiled once per process, static shapes (how a peer would deploy it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbs(nbytes: int = 1 << 30, device: int = 0) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), far above L2 size."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def rotated(names: list, rnd: int) -> list:
    """The variants' order in round `rnd`: each one leads one round in len(names)."""
    k = rnd % len(names)
    return names[k:] + names[:k]


def tflops(pairs: int, d: int, hq: int, ms: float) -> float:
    return 4.0 * pairs * d * hq / (ms * 1e-3) / 1e12
