"""Ahead-of-time build: compile exactly the variants a model needs (or every declared variant)
into the on-disk kernel cache, in parallel processes, with a progress bar and a summary.

The unified path's Triton kernel is compiled too, for the arch's target with the installed
Triton (its own cache), once per declared tile config the model needs
(``atom_backend.unified.aot``): a config the deployment's compiler rejects (a ptxas crash) fails
the build instead of the first request that needs it.

After a build, a serving process with the same ``ATOM_KERNEL_CACHE`` (and ``ATOM_NO_COMPILE=1``
if you want a miss to be an error) compiles nothing: the selection here is the launchers' own
(``registry.select``), after the arch's tuning table is applied as the serving process does.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from atom_backend.catalog import registry, tuning
from atom_backend.planning import rules
from atom_backend.unified import aot, configs


@dataclass
class Job:
    arch: str
    variants: list  # hip_kernels Variant
    why: dict = field(default_factory=dict)  # variant name -> "model facts / path" (for --dry-run)
    refusals: list = field(default_factory=list)  # (facts description, path, Refusal)
    triton: list = field(default_factory=list)  # atom_backend.unified.aot Variant
    triton_skip: str = ""  # why the arch's Triton configs are not compiled ("" when they are)


@dataclass
class Result:
    arch: str
    name: str
    cache_hit: bool
    seconds: float
    error: str = ""
    skipped: str = ""  # the reason nothing was compiled (a Triton target it cannot compile for)


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
            job = Job(arch, [registry.variant_by_name(n, arch) for n in names], {n: "declared" for n in names})
            _plan_triton(job, aot.declared_facts(arch), max_query_tokens, "unified declared")
            jobs.append(job)
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
        _plan_triton(job, facts_for(arch), max_query_tokens, "unified")
        jobs.append(job)
    return jobs


def _plan_triton(job: Job, facts_list, max_query_tokens: int, why: str) -> None:
    """The unified path's declared Triton configs of ``facts_list`` on the job's arch."""
    if configs.arch_family(job.arch) is None:
        job.triton_skip = f"no declared unified tile table for {job.arch} (the launcher retries lighter tiles)"
        return
    for facts in facts_list:
        for v in aot.launch_variants(job.arch, facts, max_query_tokens):
            if v not in job.triton:
                job.triton.append(v)
                job.why.setdefault(v.name, f"{why} kv={facts.kv_dtype}")


def _compile_one(arch: str, variant) -> Result:
    t0 = time.perf_counter()
    try:
        if isinstance(variant, aot.Variant):
            c = aot.compile_variant(arch, variant)
        else:
            from hip_kernels import runtime

            c = runtime.compile_variant(variant, arch)
        return Result(arch, variant.name, c.cache_hit, c.seconds)
    except Exception as e:  # reported in the summary; the build fails at the end
        return Result(arch, variant.name, False, time.perf_counter() - t0, f"{type(e).__name__}: {e}")


def _triton_skips(jobs: list[Job]) -> list[Result]:
    """One skipped result per arch whose Triton configs cannot be compiled here; those jobs lose
    their Triton variants."""
    out = []
    for j in jobs:
        if j.triton and not j.triton_skip:
            j.triton_skip = aot.cannot_compile(j.arch)
            if j.triton_skip:
                j.triton = []
        if j.triton_skip:
            out.append(Result(j.arch, "unified (triton)", False, 0.0, skipped=j.triton_skip))
    return out


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


def run(jobs: list[Job], workers: int | None = None, progress: bool = True, threads: bool = False) -> list[Result]:
    """Compile every (arch, variant) of the jobs in `workers` processes (default: all cores), or
    threads (a daemon process, such as a vLLM worker, may not start processes)."""
    skips = _triton_skips(jobs)
    tasks = [(j.arch, v) for j in jobs for v in j.variants + j.triton]
    if not tasks:
        return skips
    if any(j.variants for j in jobs):
        from hip_kernels import runtime

        for arch in {j.arch for j in jobs if j.variants}:
            runtime.toolchain_for(arch)  # a missing compiler fails here, named, before any work
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    bar = _Progress(len(tasks), "atom build") if progress else None
    results = list(skips)
    if workers == 1:
        for arch, v in tasks:
            results.append(_compile_one(arch, v))
            if bar:
                bar.update(f"{arch} {v.kernel}")
    else:
        if threads:
            pool = ThreadPoolExecutor(max_workers=workers)
        else:
            import multiprocessing as mp

            # fork is cheap, but not after CUDA is initialised in this process (the tuner's case)
            torch_mod = sys.modules.get("torch")
            cuda_up = torch_mod is not None and torch_mod.cuda.is_initialized()
            ctx = mp.get_context("fork" if sys.platform.startswith("linux") and not cuda_up else "spawn")
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        with pool:
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
            if not r.error and not r.skipped:
                metrics.record_compile(r.name, r.seconds, r.cache_hit)
    except ImportError:
        pass
    return results


def summary(results: list[Result], seconds: float, workers: int) -> str:
    from hip_kernels import runtime

    lines = []
    skipped = [r for r in results if r.skipped]
    results = [r for r in results if not r.skipped]
    for arch in sorted({r.arch for r in results}):
        rs = [r for r in results if r.arch == arch]
        ok = [r for r in rs if not r.error]
        hits = sum(r.cache_hit for r in ok)
        lines.append(f"  {arch:8s} {len(rs):3d} variants: {len(ok) - hits} compiled, {hits} cache hits, "
                     f"{len(rs) - len(ok)} failed, {sum(r.seconds for r in rs):.1f} s of compiler time")
    for r in skipped:
        lines.append(f"  skipped {r.arch} {r.name}: {r.skipped}")
    failed = [r for r in results if r.error]
    for r in failed:
        lines.append(f"  FAILED {r.arch} {r.name}: {r.error.splitlines()[0][:200]}")
    total_hits = sum(r.cache_hit for r in results if not r.error)
    head = (f"atom build: {len(results)} variants ({len(results) - total_hits - len(failed)} compiled, "
            f"{total_hits} cache hits, {len(failed)} failed) in {seconds:.1f} s with {workers} processes "
            f"-> {runtime.cache_dir()}")
    return "\n".join([head] + lines)
