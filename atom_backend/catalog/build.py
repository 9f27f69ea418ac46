"""Ahead-of-time build: compile exactly the variants a model needs (or every declared variant)
into the on-disk kernel cache, in parallel processes, with a progress bar and a summary.

After a build, a serving process with the same ``ATOM_KERNEL_CACHE`` (and ``ATOM_NO_COMPILE=1``
if you want a miss to be an error) compiles nothing: the selection here is the launchers' own
(``registry.select``), after the arch's tuning table is applied as the serving process does.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from atom_backend.catalog import registry, tuning


from atom_backend.planning import rules
@dataclass
class Job:
    arch: str
    variants: list  # hip_kernels Variant
    why: dict = field(default_factory=dict)  # variant name -> "model facts / path" (for --dry-run)
    refusals: list = field(default_factory=list)  # (facts description, path, Refusal)


@dataclass
class Result:
    arch: str
    name: str
    cache_hit: bool
    seconds: float
    error: str = ""


def plan_build(archs: list[str], facts_for=None, max_query_tokens: int = 1) -> list[Job]:
    """The variants to compile per arch. ``facts_for(arch) -> [ModelFacts]``; None: every
    declared variant of the arch."""
    jobs = []
    for arch in archs:
        arch = rules.compile_target(arch)
        tuning.apply(arch)
        if facts_for is None:
            names = []
            for e in registry.entries_for(arch):
                if e.variant not in names:
                    names.append(e.variant)
            jobs.append(Job(arch, [registry.variant_by_name(n, arch) for n in names],
                            {n: "declared" for n in names}))
            continue
        job = Job(arch, [])
        for facts in facts_for(arch):
            sel = registry.select(facts, arch, max_query_tokens=max_query_tokens)
            for path, vs in sel.variants.items():
                for v in vs:
                    if v not in job.variants:
                        job.variants.append(v)
                    job.why.setdefault(v.name, f"{path} kv={facts.kv_dtype}")
            for path, r in sel.refusals.items():
                job.refusals.append((f"kv={facts.kv_dtype}", path, r))
        jobs.append(job)
    return jobs


def _compile_one(arch: str, variant) -> Result:
    from hip_kernels import runtime

    t0 = time.perf_counter()
    try:
        c = runtime.compile_variant(variant, arch)
        return Result(arch, variant.name, c.cache_hit, c.seconds)
    except Exception as e:  # reported in the summary; the build fails at the end
        return Result(arch, variant.name, False, time.perf_counter() - t0, f"{type(e).__name__}: {e}")


class _Progress:
    """tqdm when installed, else one counter line rewritten in place."""

    def __init__(self, total: int, desc: str):
        self.n, self.total, self.desc = 0, total, desc
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="variant", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label[:60], refresh=False)
            self.bar.update(1)
        else:
            end = "\n" if self.n == self.total or not sys.stderr.isatty() else "\r"
            print(f"{self.desc}: {self.n}/{self.total} {label[:70]}", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(jobs: list[Job], workers: int | None = None, progress: bool = True) -> list[Result]:
    """Compile every (arch, variant) of the jobs in `workers` processes (default: all cores)."""
    from hip_kernels import runtime

    tasks = [(j.arch, v) for j in jobs for v in j.variants]
    if not tasks:
        return []
    for arch in {a for a, _ in tasks}:
        runtime.toolchain_for(arch)  # a missing compiler fails here, named, before any work
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    bar = _Progress(len(tasks), "atom build") if progress else None
    results = []
    if workers == 1:
        for arch, v in tasks:
            results.append(_compile_one(arch, v))
            if bar:
                bar.update(f"{arch} {v.kernel}")
    else:
        import multiprocessing as mp

        # fork is cheap, but not after CUDA is initialised in this process (the tuner's case)
        torch_mod = sys.modules.get("torch")
        cuda_up = torch_mod is not None and torch_mod.cuda.is_initialized()
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") and not cuda_up else "spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futs = {pool.submit(_compile_one, arch, v): (arch, v) for arch, v in tasks}
            for f in as_completed(futs):
                results.append(f.result())
                if bar:
                    arch, v = futs[f]
                    bar.update(f"{arch} {v.kernel}")
    if bar:
        bar.close()
    # the parent's counters: a build is a compile step too (atom_kernel_compiles_total)
    try:
        from atom_backend import metrics

        for r in results:
            if not r.error:
                metrics.record_compile(r.name, r.seconds, r.cache_hit)
    except ImportError:
        pass
    return results


def summary(results: list[Result], seconds: float, workers: int) -> str:
    from hip_kernels import runtime

    lines = []
    for arch in sorted({r.arch for r in results}):
        rs = [r for r in results if r.arch == arch]
        ok = [r for r in rs if not r.error]
        hits = sum(r.cache_hit for r in ok)
        lines.append(f"  {arch:8s} {len(rs):3d} variants: {len(ok) - hits} compiled, {hits} cache hits, "
                     f"{len(rs) - len(ok)} failed, {sum(r.seconds for r in rs):.1f} s of compiler time")
    failed = [r for r in results if r.error]
    for r in failed:
        lines.append(f"  FAILED {r.arch} {r.name}: {r.error.splitlines()[0][:200]}")
    total_hits = sum(r.cache_hit for r in results if not r.error)
    head = (f"atom build: {len(results)} variants ({len(results) - total_hits - len(failed)} compiled, "
            f"{total_hits} cache hits, {len(failed)} failed) in {seconds:.1f} s with {workers} processes "
            f"-> {runtime.cache_dir()}")
    return "\n".join([head] + lines)
