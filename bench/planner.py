"""`python -m bench.planner`: host cost of plan() for batches of 1..512 requests (CPU only).

The budget is 20 us for 256 requests (issue 2); the metadata builder hands the planner int64
arrays, so that is what is timed here (lists are timed too, for reference).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from atom_backend.planner import ModelFacts, PlannerConfig, plan
from atom_backend.kernels import platform_for


def batch(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A serving-like mix: mostly decodes, some chunked prefills and prefix hits."""
    kind = rng.choice(3, size=n, p=[0.8, 0.1, 0.1])
    new = np.where(kind == 0, 1, np.where(kind == 1, rng.integers(512, 8192, n), rng.integers(16, 1024, n)))
    cached = np.where(kind == 1, 0, rng.integers(0, 32768, n))
    return new.astype(np.int64), cached.astype(np.int64)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,16,64,256,512")
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args(argv)
    facts = ModelFacts(64, 8, 64, has_sinks=True, window=128)
    platform, config = platform_for("sm_90a", use_tables=False), PlannerConfig()
    rng = np.random.default_rng(0)
    print(f"{'requests':>8} {'arrays us':>10} {'lists us':>9}")
    for n in map(int, args.sizes.split(",")):
        new, cached = batch(n, rng)
        ln, lc = new.tolist(), cached.tolist()
        t_arr = min(timeit.repeat(lambda: plan(new, cached, facts, platform, config), number=args.number, repeat=5))
        t_lst = min(timeit.repeat(lambda: plan(ln, lc, facts, platform, config), number=args.number, repeat=5))
        print(f"{n:>8} {t_arr / args.number * 1e6:>10.1f} {t_lst / args.number * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
