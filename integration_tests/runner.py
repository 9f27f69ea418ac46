"""Run vLLM's offline engine on a tiny model and print one JSON line (run as a subprocess).

    python integration_tests/runner.py MODEL_DIR --backend CUSTOM|default [--tp 2]

Phase 1 submits prompts of mixed lengths together (chunked prefill with a small token budget
mixes decodes and prefill chunks in one batch); phase 2 sends a long prompt, then a second one
sharing its first 96 tokens (a prefix-cache hit of whole blocks). Greedy, with logprobs.
With --tp, vLLM's tensor parallelism (one worker process per rank); with PROMETHEUS_MULTIPROC_DIR
set, the RESULT carries the atom_* series every process wrote there, aggregated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

BLOCK = 32


def prompts(seed: int = 1):
    rng = random.Random(seed)
    words = lambda n: " ".join(f"w{rng.randrange(256)}" for _ in range(n))  # noqa: E731
    batch = [words(n) for n in (5, 40, 77, 130, 12)]
    shared = words(3 * BLOCK + 10)
    first = shared + " " + words(14)
    second = " ".join(shared.split()[: 3 * BLOCK]) + " " + words(40)
    return batch, first, second


def _multiprocess_series(path: str) -> dict[str, float]:
    """The atom_* samples of every process that wrote to the multiprocess directory, aggregated as
    an API server's /metrics would show them: {name{labels}: value}."""
    from prometheus_client import CollectorRegistry, multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=path)
    out = {}
    for fam in reg.collect():
        for smp in fam.samples:
            if smp.name.startswith("atom_"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items()))
                out[f"{smp.name}{{{labels}}}"] = out.get(f"{smp.name}{{{labels}}}", 0.0) + smp.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="CUSTOM")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="float32", enforce_eager=True, max_model_len=256, block_size=BLOCK,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=64, max_num_seqs=8, seed=0, tensor_parallel_size=a.tp)
    if a.backend != "default":
        kw["attention_config"] = {"backend": a.backend}
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=3, ignore_eos=True)
    batch, first, second = prompts()

    def run(ps):
        outs = llm.generate(ps, sp, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append({"tokens": list(c.token_ids),
                        "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs],
                        "num_cached_tokens": o.num_cached_tokens or 0, "prompt_tokens": len(o.prompt_token_ids)})
        return res

    out = {"batch": run(batch), "first": run([first])[0]}
    state = {}
    try:
        from atom_backend.vllm import metadata as md

        state["before_second"] = len(md.PREFILL_LOG)
    except ImportError:
        pass
    out["second"] = run([second])[0]
    try:
        from atom_backend.execution import gather

        from atom_backend.vllm import metadata as md
        out["atom"] = {"counters": dict(md.COUNTERS), "gather": dict(gather.STATS),
                       "second_prefills": list(md.PREFILL_LOG)[state.get("before_second", 0):]}
    except ImportError:
        pass
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        out["metrics"] = _multiprocess_series(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
