"""`python -m bench.serve`: what a user of vLLM sees, per attention backend: output tokens per
second, median time to first token and time per output token, on vLLM's offline engine (torch.compile
and CUDA graphs as vLLM defaults them) with real-size models built from a config and dummy weights
(no download), prompts as token ids.

    python -m bench.serve --model llama8b --workload prefix --backends CUSTOM,FLASH_ATTN,TRITON_ATTN \\
        --rounds 3 --out bench-serve/

Models: llama8b (Llama-3.1-8B's shape: 32 q / 8 kv heads, d 128, 32 layers) and gptoss20b
(gpt-oss-20b's shape: 64 / 8 heads, d 64, sinks, window 128 on alternate layers, 32 experts; bf16
weights, where the released model is MXFP4). Workloads:
- decode: 256 requests, 1k tokens in, 1k out (decode-heavy);
- prefix: 64 requests sharing an 8k prefix, 512 own tokens each, 256 out, prefix caching on (one
  request first to fill the cache, as a served system's earlier traffic would);
- long: 8 requests of 32k tokens in, 512 out.
Each backend runs in an engine of its own (a subprocess), with the KV cache that holds the whole
workload at once, so every backend runs the same schedule. When the engines fit on the GPU
together they start side by side and the rounds interleave the backends (A B C, A B C, ...);
otherwise one engine at a time runs its rounds back to back. A prefix round starts from the
shared prefix alone in the cache. Each (backend, round) writes its own result file under --out,
so a run cut short resumes where it stopped. The summary prints each backend's medians and its
ratio to the others. --profile adds one profiled round per backend, in an engine of its own whose
engine core runs in-process (so the torch profiler sees its kernels): the share of GPU time in
attention kernels (kernels named by backend) beside the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "llama8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
                "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16", "_weights_gib": 15.0},
    "gptoss20b": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                  "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
                  "experts_per_token": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
                  "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
                  "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "hidden_act": "silu", "swiglu_limit": 7.0,
                  "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096},
                  "tie_word_embeddings": False, "bos_token_id": 199998, "eos_token_id": 200002,
                  "pad_token_id": 199999, "torch_dtype": "bfloat16", "_weights_gib": 39.0},
}

WORKLOADS = {
    # name: (requests, prompt tokens, shared prefix tokens, output tokens, prefix caching)
    "decode": (256, 1024, 0, 1024, False),
    "prefix": (64, 512, 8192, 256, True),
    "long": (8, 32768, 0, 512, False),
}


def model_dir(name: str, root: Path) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in MODELS[name].items() if not k.startswith("_")}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def prompts(workload: str, vocab: int, seed: int = 0) -> list[list[int]]:
    n, own, shared, _, _ = WORKLOADS[workload]
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, vocab - 1000) for _ in range(shared)]
    return [prefix + [rng.randrange(1000, vocab - 1000) for _ in range(own)] for _ in range(n)]


def kv_cache_gib(model: str, workload: str, kv_cache_dtype: str) -> float:
    """The KV cache that holds every request of the workload at once (all layers full length, with
    an eighth to spare): each backend then runs the same schedule, whatever memory it is given."""
    n, own, shared, out_len, _ = WORKLOADS[workload]
    cfg = MODELS[model]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    per_token *= 1 if kv_cache_dtype.startswith("fp8") else 2
    return 1.125 * per_token * (shared + n * (own + out_len)) / 2**30


def engine(a) -> None:
    """The child: one engine, warmed, then one timed round per "run ROUND [profile]" line on stdin;
    a RESULT line each."""
    from vllm import LLM, SamplingParams

    n, own, shared, out_len, caching = WORKLOADS[a.workload]
    cfg = MODELS[a.model]
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir(a.model, Path(a.models_dir))), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=own + shared + out_len + 16, enable_prefix_caching=caching,
              max_num_seqs=max(n, 256), kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30),
              gpu_memory_utilization=0.02,  # with a fixed KV cache vLLM only checks this much is free at start
              attention_config={"backend": a.backend}, disable_log_stats=False, seed=0,
              **({"kv_cache_dtype": a.kv_cache_dtype} if a.kv_cache_dtype != "auto" else {}))
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
    ps = [{"prompt_token_ids": p} for p in prompts(a.workload, cfg["vocab_size"])]
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][-64:]} for p in ps[:2]],
                 SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # first launches
    print(f"READY {time.perf_counter() - t0:.1f}", flush=True)
    for line in sys.stdin:
        cmd, rnd, *flags = line.split()
        if cmd != "run":
            break
        if caching:  # each round starts from the shared prefix alone in the cache, as earlier traffic leaves it
            llm.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": ps[0]["prompt_token_ids"][:shared] + [1001]}],
                         SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        res = {"model": a.model, "workload": a.workload, "backend": a.backend, "round": rnd,
               "kv_cache_gib": a.kv_cache_gib, "kv_cache_dtype": a.kv_cache_dtype}
        res.update(timed_round(llm, ps, sp, profile="profile" in flags))
        print("RESULT " + json.dumps(res), flush=True)


def timed_round(llm, ps: list, sp, profile: bool) -> dict:
    prof = None
    if profile:
        import torch

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    res["output_tok_s"] = res["output_tokens"] / wall
    # offline: every request arrives at t0, so TTFT includes its wait for a place in the batch
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    tpot = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if o.metrics is not None and len(o.outputs[0].token_ids) > 1]
    res["ttft_median_s"] = statistics.median(ttft) if ttft else None
    res["tpot_median_s"] = statistics.median(tpot) if tpot else None
    res["cached_tokens"] = sum(o.num_cached_tokens or 0 for o in outs)
    if prof is not None:
        import torch

        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        res["kernels"] = kernel_shares(prof)
    return res


# Kernel names of the attention backends compared here (ours: hip_kernels' and the unified path's).
ATTENTION_KERNELS = ("varlen_prefill", "splitkv_decode", "decode_mma", "combine", "gather", "unified_attention",
                     "flash", "fmha", "attention", "attn", "reshape_and_cache")


def kernel_shares(prof) -> dict:
    """GPU time by kernel from a finished torch profiler: the total, the attention kernels' part, and
    the ten largest kernels."""
    rows = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t for _, t in rows)
    attn = sum(t for k, t in rows if any(s in k.lower() for s in ATTENTION_KERNELS))
    top = sorted(rows, key=lambda r: -r[1])[:10]
    return {"total_us": total, "attention_us": attn, "attention_share": attn / total if total else 0.0,
            "top": [{"kernel": k[:120], "us": t} for k, t in top]}


def summary(results: list[dict]) -> str:
    by = {}
    for r in results:
        by.setdefault((r["model"], r["workload"]), {}).setdefault(r["backend"], []).append(r)
    lines = []
    for (model, wl), backs in sorted(by.items()):
        med = {b: statistics.median(r["output_tok_s"] for r in rs) for b, rs in backs.items()}
        lines.append(f"## {model} / {wl}")
        lines.append("| backend | rounds | output tok/s (median) | TTFT median ms | TPOT median ms | vs CUSTOM |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for b, rs in sorted(backs.items()):
            ttft = statistics.median(r["ttft_median_s"] for r in rs if r.get("ttft_median_s") is not None) * 1e3
            tpot = statistics.median(r["tpot_median_s"] for r in rs if r.get("tpot_median_s") is not None) * 1e3
            rel = med.get("CUSTOM", float("nan")) / med[b]
            lines.append(f"| {b} | {len(rs)} | {med[b]:.0f} | {ttft:.1f} | {tpot:.2f} | {rel:.3f}x |")
    return "\n".join(lines)


class Engine:
    """A child engine (``--engine``) driven line by line; its output goes to a log file."""

    def __init__(self, a, backend: str, kv_gib: float, log: Path, in_process: bool = False):
        cmd = [sys.executable, "-m", "bench.serve", "--engine", "--model", a.model, "--workload", a.workload,
               "--backend", backend, "--kv-cache-dtype", a.kv_cache_dtype, "--kv-cache-gib", f"{kv_gib:.3f}",
               "--models-dir", a.models_dir]
        self.backend, self.log = backend, log.open("a")
        # its own compile cache: engines starting side by side do not write one directory at once
        env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(tempfile.gettempdir(), "atom-bench-vllm-cache", backend))
        if in_process:  # the engine core in the child's own process, where its profiler sees the kernels
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.t0 = time.monotonic()

    def expect(self, tag: str) -> str:
        """The rest of the child's next line that starts with tag (other lines go to the log)."""
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]
            self.log.write(line)
        raise RuntimeError(f"{self.backend}: engine exited (rc={self.proc.wait()}), log {self.log.name}")

    def run(self, rnd: str, profile: bool) -> dict:
        self.proc.stdin.write(f"run {rnd}{' profile' if profile else ''}\n")
        self.proc.stdin.flush()
        return json.loads(self.expect("RESULT"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def fits_together(a, backends: list[str], kv_gib: float) -> bool:
    """Whether one engine per backend fits on the GPU at once (weights, KV cache, and a reserve for
    activations, CUDA graphs and the CUDA context)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    need = len(backends) * (MODELS[a.model]["_weights_gib"] + kv_gib + ENGINE_RESERVE_GIB) * 2**30
    return need <= 0.9 * free


ENGINE_RESERVE_GIB = 8.0


def run_plan(a, out: Path) -> None:
    """Runs every (backend, round) without a result file under out: engines side by side when they
    fit, rounds interleaved A B C, A B C; otherwise one engine at a time, its rounds back to back."""
    backends = [b for b in a.backends.split(",") if b]
    rounds = [str(r) for r in range(a.rounds)]
    suffix = "" if a.kv_cache_dtype == "auto" else "_" + a.kv_cache_dtype

    def path(b: str, r: str) -> Path:
        return out / f"{a.model}_{a.workload}_{b}_{r}{suffix}.json"

    def log(b: str) -> Path:
        return out / f"{a.model}_{a.workload}_{b}{suffix}.log"

    def save(b: str, r: str, res: dict) -> None:
        path(b, r).write_text(json.dumps(res, indent=1))
        print(f"{b} round {r}: {res['output_tok_s']:.0f} output tok/s ({res['wall_s']:.1f} s)", flush=True)

    kv_gib = kv_cache_gib(a.model, a.workload, a.kv_cache_dtype)
    todo = {b: [r for r in rounds if not path(b, r).exists()] for b in backends}
    todo = {b: rs for b, rs in todo.items() if rs}
    if todo:
        together = fits_together(a, list(todo), kv_gib)
        print(f"{a.model}/{a.workload}: KV cache {kv_gib:.1f} GiB per engine, engines "
              f"{'side by side, rounds interleaved' if together else 'one at a time'}", flush=True)
        for group in [list(todo)] if together else [[b] for b in todo]:
            engines = {b: Engine(a, b, kv_gib, log(b)) for b in group}
            try:
                for b, e in engines.items():
                    print(f"{b}: engine ready in {float(e.expect('READY')):.0f} s", flush=True)
                for r in rounds:
                    for b, e in engines.items():
                        if r in todo[b]:
                            save(b, r, e.run(r, profile=False))
            finally:
                for e in engines.values():
                    e.close()
    # Profiled rounds: the engine core in the child's process (vLLM runs it in another one by
    # default, out of the profiler's sight), so apart from the timed rounds, one engine at a time.
    for b in backends if a.profile else ():
        if path(b, "profile").exists():
            continue
        e = Engine(a, b, kv_gib, log(b), in_process=True)
        try:
            e.expect("READY")
            save(b, "profile", e.run("profile", profile=True))
        finally:
            e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="prefix")
    ap.add_argument("--backends", default="CUSTOM,FLASH_ATTN,TRITON_ATTN")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--profile", action="store_true", help="one more round per backend under the torch profiler")
    ap.add_argument("--out", default="bench-serve")
    ap.add_argument("--models-dir", default=None, help="where model configs are written (default: OUT/models)")
    ap.add_argument("--summary", action="store_true", help="only print the summary of the results in --out")
    # the child's arguments
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-gib", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    out = Path(a.out)
    a.models_dir = a.models_dir or str(out / "models")
    if a.engine:
        engine(a)
        return
    out.mkdir(parents=True, exist_ok=True)
    if not a.summary:
        run_plan(a, out)
    results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{a.model}_{a.workload}_*.json"))
               if "profile" not in p.name]
    print(summary(results))
    for p in sorted(out.glob(f"{a.model}_{a.workload}_*_profile*.json")):
        k = json.loads(p.read_text())["kernels"]
        print(f"{p.stem}: attention {k['attention_share']:.1%} of {k['total_us'] / 1e3:.0f} ms GPU time")


if __name__ == "__main__":
    main()
