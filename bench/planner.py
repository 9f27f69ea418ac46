"""`python -m bench.planner`: host cost of plan() for batches of 1..512 requests (CPU only).

The budget is 20 us for 256 requests (issues 2 and 11); the metadata builder hands the planner
int64 arrays, so that is what is timed here (lists are timed too, for reference). "arrays" and
"lists" route by the threshold rules; "cost" routes by the committed H100 cost table (gpt-oss
facts with full + windowed layers), as a GPU serving process does.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from atom_backend.planning import ModelFacts, PlannerConfig, plan
from atom_backend.catalog import platform_for


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
    costed = platform_for("sm_90a")  # the committed H100 cost table: cost routing
    if costed.cost is None:
        raise SystemExit("no cost table for sm_90 (atom_backend/catalog/tables/cost_sm_90.json)")
    facts_c = ModelFacts(64, 8, 64, has_sinks=True, window=0, layer_windows=(0, 128))
    rng = np.random.default_rng(0)
    print(f"{'requests':>8} {'arrays us':>10} {'lists us':>9} {'cost us':>8}")
    for n in map(int, args.sizes.split(",")):
        new, cached = batch(n, rng)
        ln, lc = new.tolist(), cached.tolist()
        t_arr = min(timeit.repeat(lambda: plan(new, cached, facts, platform, config), number=args.number, repeat=5))
        t_lst = min(timeit.repeat(lambda: plan(ln, lc, facts, platform, config), number=args.number, repeat=5))
        costed.cost.bind(facts_c)  # once per model (the builder's first batch)
        t_cost = min(timeit.repeat(lambda: plan(new, cached, facts_c, costed, config), number=args.number, repeat=5))
        print(f"{n:>8} {t_arr / args.number * 1e6:>10.1f} {t_lst / args.number * 1e6:>9.1f} "
              f"{t_cost / args.number * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
