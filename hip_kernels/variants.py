"""Every kernel variant the package can request, and a cache pre-warmer for deployments.

    python -m hip_kernels.variants --arch sm_90a --arch gfx942     # compile all into the cache
    python -m hip_kernels.variants --list                          # just list them

With the cache warm, serving can run with ATOM_NO_COMPILE=1 (a miss is then an error, not a
silent compile on the first request). CI compiles the same list (tests/test_hip_compile.py).
"""

from __future__ import annotations

import argparse
import importlib
import time
from types import ModuleType

from . import runtime
from .runtime import Variant

# Modules exposing variants(); a module that is not there yet is skipped, one that fails to
# import is an error (it would fail at serving time too).
KERNEL_MODULES = ("gather", "combine", "prefill", "decode")


def kernel_modules() -> dict[str, ModuleType]:
    out = {}
    for name in KERNEL_MODULES:
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.{name}":
                continue
            raise
        if hasattr(mod, "variants"):
            out[name] = mod
    return out


def all_variants() -> list[tuple[str, Variant]]:
    return [(name, v) for name, mod in kernel_modules().items() for v in mod.variants()]


def prewarm(archs: list[str], verbose: bool = True) -> list[tuple[str, str, bool, float]]:
    """Compile every variant for every arch; returns (variant, arch, cache_hit, seconds)."""
    done = []
    for arch in archs:
        for _, v in all_variants():
            c = runtime.compile_variant(v, arch)
            done.append((v.name, arch, c.cache_hit, c.seconds))
            if verbose:
                use = ", ".join(f"{k} {n}" for k, n in runtime.resource_usage(c).items())
                print(f"{arch:8s} {'hit ' if c.cache_hit else 'new '} {c.seconds * 1e3:8.1f} ms  {v.name}  [{use}]")
    return done


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", default=[], help="sm_90a, gfx942, gfx950, ... (repeatable)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list or not args.arch:
        for name, v in all_variants():
            print(f"{name:8s} {v.name}")
        return
    t0 = time.perf_counter()
    done = prewarm(args.arch)
    new = sum(not hit for _, _, hit, _ in done)
    print(f"{len(done)} variants ready in {runtime.cache_dir()} ({new} compiled) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
