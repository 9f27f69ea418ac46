"""vLLM's offline engine on a GPU with one attention backend, as vLLM defaults it (torch.compile,
CUDA graphs FULL_AND_PIECEWISE); prints one RESULT JSON line (run as a subprocess).

    python integration_tests/gpu_runner.py MODEL_DIR --backend CUSTOM|TRITON_ATTN|FLASH_ATTN
        [--kv-cache-dtype fp8] [--ngram 3] [--kv-cache-gib 2] [--setting ATOM_FP8_COMPUTE=0]

Phases, in order, all greedy with logprobs, prompts as token ids:
- warmup: a few prompts (compiles, captures, first launches);
- mixed: prompts of 5 .. 3000 tokens at once under a 2048-token budget (chunked prefill: decodes
  and prefill chunks of the long prompts in one batch);
- prefix: a 1040-token prompt, then one sharing its first 1024 (a prefix-cache hit of 64 blocks);
- burst: 256 requests of 16 .. 512 tokens submitted together;
- long: one request of 32000 tokens (16 chunks, each attending to the chunks before it).
After each phase the runner notes our backend's state (in-process engine core): its routing counters
so far, the phase's prefill routes, compiles and fallbacks, so the suite can require none after
warmup.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

BUDGET = 2048
PREFIX, PREFIX_OWN = 1024, (16, 60)
LONG = 32000


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def phases(seed: int = 7) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    shared = _ids(rng, PREFIX)
    return {
        "warmup": [_ids(rng, n) for n in (9, 300)],
        "mixed": [_ids(rng, n) for n in (5, 40, 77, 130, 700, 3000)],
        "prefix_first": [shared + _ids(rng, PREFIX_OWN[0])],
        "prefix_second": [shared + _ids(rng, PREFIX_OWN[1])],
        "burst": [_ids(rng, rng.randrange(16, 513)) for _ in range(256)],
        "long": [_ids(rng, LONG)],
    }


def _series_total(prefix: str) -> float:
    """Sum of this process's samples of a counter family (prometheus-client's default registry)."""
    from prometheus_client import REGISTRY

    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name == prefix + "_total")


def _atom_state() -> dict:
    """Our backend's in-process counters, compiles and fallbacks (absent when another backend ran)."""
    try:
        from atom_backend.execution import gather, health
        from atom_backend.vllm import metadata as md
    except ImportError:
        return {}
    return {"counters": dict(md.COUNTERS), "gather": dict(gather.STATS), "prefills": list(md.PREFILL_LOG),
            "compiles": _series_total("atom_kernel_compiles"), "fallbacks": _series_total("atom_fallbacks"),
            "failed_paths": sorted(p for p, why in health.STATE.items() if why)}


def _clear_prefill_log() -> None:
    try:
        from atom_backend.vllm import metadata as md
    except ImportError:
        return
    md.PREFILL_LOG.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="CUSTOM")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--ngram", type=int, default=0, help="speculative tokens of an ngram proposer (0: none)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma-separated phases to leave out")
    ap.add_argument("--setting", action="append", default=[], metavar="ATOM_NAME=VALUE",
                    help="one of our settings for this engine (README: settings), e.g. ATOM_FP8_COMPUTE=0")
    ap.add_argument("--cprofile", default="", help="comma-separated phases to run under cProfile (the host's "
                    "share of a step: the 30 costliest functions by cumulative time go to stderr)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.0,
                    help="a fixed KV cache instead of vLLM's memory profiling, which assumes no other process "
                         "changes its GPU memory meanwhile (0: profile, gpu_memory_utilization 0.35)")
    a = ap.parse_args()
    for kv in a.setting:  # before vLLM and our backend load: settings are read once
        name, _, value = kv.partition("=")
        if not name.startswith("ATOM_") or not _:
            raise SystemExit(f"--setting {kv!r}: ATOM_NAME=VALUE expected")
        os.environ[name] = value

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="bfloat16", max_model_len=LONG + 1024, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=BUDGET, max_num_seqs=256, seed=0,
              kv_cache_dtype=a.kv_cache_dtype, attention_config={"backend": a.backend}, disable_log_stats=False)
    if a.kv_cache_gib:  # engines side by side: vLLM then only checks that this much is free at start
        kw.update(kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30), gpu_memory_utilization=0.02)
    else:
        kw.update(gpu_memory_utilization=0.35)
    if a.ngram:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": a.ngram, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}
    t0 = time.monotonic()
    llm = LLM(**kw)
    out: dict = {"startup_s": time.monotonic() - t0,
                 "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=5, ignore_eos=True)
    skip = set(filter(None, a.skip.split(",")))

    def run(prompts):
        t = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        res = [{"tokens": list(o.outputs[0].token_ids),
                "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs],
                "num_cached_tokens": o.num_cached_tokens or 0} for o in outs]
        return res, time.monotonic() - t

    out["phases"], out["seconds"], out["atom"] = {}, {}, {}
    profiled = set(filter(None, a.cprofile.split(",")))
    for name, prompts in phases().items():
        if name in skip:
            continue
        _clear_prefill_log()
        if name in profiled:
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                out["phases"][name], out["seconds"][name] = run(prompts)
            print(f"--- cProfile: phase {name}, {out['seconds'][name]:.3f} s", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
        else:
            out["phases"][name], out["seconds"][name] = run(prompts)
        out["atom"][name] = _atom_state()  # counters so far; prefills of this phase
    if a.ngram:
        from vllm.v1.metrics.reader import Counter

        out["spec"] = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter) and "spec_decode" in m.name}
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
