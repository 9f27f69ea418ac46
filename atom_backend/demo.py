"""`python -m atom_backend.demo`: plan realistic batches, print the plan table, and compute one
batch through the reference semantics (CPU, float32).

Options: --platform {h100,cpu} (which executors exist), --no-compute.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from atom_backend import reference as ref
from atom_backend.planning import ModelFacts, PlannerConfig, Platform, plan

GPT_OSS = ModelFacts(num_q_heads=64, num_kv_heads=8, head_dim=64, has_sinks=True, window=128, page_size=16)
LLAMA = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
ODD_HEAD = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=80, page_size=16)

# (title, model, [(new tokens, cached tokens), ...])
BATCHES = [
    ("decode-only (64 requests, 4k context)", GPT_OSS, [(1, 4095)] * 64),
    ("fresh prefill (2 x 4k)", LLAMA, [(4096, 0), (4096, 0)]),
    ("prefix-cache hit (512 new on 4k cached, sinks)", GPT_OSS, [(512, 4096), (256, 8192)]),
    ("mixed (decodes + chunked prefill + tiny chunk on a long prefix)", GPT_OSS,
     [(1, 900), (1, 17000), (2048, 0), (300, 1200), (4, 30000), (0, 12)]),
    ("unsupported head size 80 (varlen/split-KV kernels take 64/128)", ODD_HEAD, [(1, 500), (1024, 0)]),
]


def plan_table(title: str, facts: ModelFacts, reqs, platform: Platform, config: PlannerConfig) -> str:
    new = np.array([r[0] for r in reqs], dtype=np.int64)
    cached = np.array([r[1] for r in reqs], dtype=np.int64)
    plan(new, cached, facts, platform, config)  # warm: the first call pays numpy's dispatch setup
    t0 = time.perf_counter()
    p = plan(new, cached, facts, platform, config)
    us = (time.perf_counter() - t0) * 1e6
    lines = [
        f"== {title}",
        f"   model: {facts.num_q_heads}q/{facts.num_kv_heads}kv heads, d={facts.head_dim}, {facts.dtype}, "
        f"kv {facts.kv_dtype}, sinks={facts.has_sinks}, window={facts.window}, page={facts.page_size}",
        f"   {'req':>4} {'new':>6} {'cached':>7}  {'phase':<8} {'path':<8} reason",
    ]
    shown = reqs if len(reqs) <= 8 else reqs[:3]
    for i, (n, c) in enumerate(shown):
        phase, path, reason = p.route_of(i)
        lines.append(f"   {i:>4} {n:>6} {c:>7}  {phase:<8} {path:<8} {reason}")
    if len(reqs) > len(shown):
        lines.append(f"   ... {len(reqs) - len(shown)} more alike")
    lines.append(
        f"   decode: {len(p.decode)} req -> {p.decode_path.value} x {p.num_splits} splits | varlen: {len(p.varlen)} req, "
        f"gather {p.gather_tokens} tokens = {p.gather_bytes / 2**20:.1f} MiB | unified: {len(p.unified)} req | "
        f"planned in {us:.0f} us"
    )
    return "\n".join(lines)


def compute_one_batch() -> str:
    """A small mixed batch (prefix hit + decode + fresh prefill) with sinks and a window,
    through the paged reference, checked against split-KV partials + combine for the decode."""
    gen = torch.Generator().manual_seed(0)
    hq, hk, d, page = 8, 2, 64, 16
    seqs = [(24, 72), (1, 40), (33, 33)]  # (new, total keys)
    num_blocks = 32
    k_cache = torch.randn(num_blocks, page, hk, d, generator=gen)
    v_cache = torch.randn(num_blocks, page, hk, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(seqs), 8, dtype=torch.int32)
    at = 0
    for b, (_, sk) in enumerate(seqs):
        n = -(-sk // page)
        bt[b, :n] = perm[at : at + n]
        at += n
    cu_q = torch.tensor([0, 24, 25, 58], dtype=torch.int32)
    q = torch.randn(58, hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen)
    seq_lens = torch.tensor([sk for _, sk in seqs])
    o, lse = ref.paged_attention(q, k_cache, v_cache, cu_q, bt, seq_lens, sinks=sinks, window=32)
    # the decode row again through split-KV (4 splits) + combine + sinks after the combine
    k, v, cu_k = ref.gather_vllm(k_cache, v_cache, bt[1:2], seq_lens[1:2])
    o_s, lse_s = ref.split_kv_partials(q[24:25], k, v, torch.tensor([0, 1]), cu_k, 4, window=32)
    o_c, lse_c = ref.combine_splits(o_s, lse_s)
    o_c = ref.apply_sinks(o_c, lse_c, sinks)
    diff = (o_c - o[24:25]).abs().max().item()
    return (
        f"== reference compute: 3 requests (prefix hit 24/72, decode 1/40, fresh 33/33), {hq}q/{hk}kv d={d}, "
        f"page {page}, sinks, window 32\n"
        f"   o: {tuple(o.shape)}, |o| = {o.norm():.4f}, lse range [{lse.min():.3f}, {lse.max():.3f}], NaN: {bool(o.isnan().any())}\n"
        f"   decode row via split-KV (4 splits) + combine: max |diff| = {diff:.2e}"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", choices=["h100", "cpu-no-kernels"], default="h100")
    ap.add_argument("--no-compute", action="store_true")
    args = ap.parse_args(argv)
    from atom_backend.catalog import platform_for

    platform = (platform_for("sm_90a", use_tables=False) if args.platform == "h100"
                else Platform(vendor="cpu", varlen_kernel=False, splitkv_kernel=False))
    config = PlannerConfig.from_env()
    where = ("simulated: the plans an H100 / H200 gets, computed on the host, no GPU used"
             if args.platform == "h100" else "simulated: a GPU whose compiled kernels are unavailable")
    print(f"platform: {platform.vendor} {platform.arch}, {platform.num_sms} SMs ({where})\nconfig: {config}\n")
    for title, facts, reqs in BATCHES:
        print(plan_table(title, facts, reqs, platform, config))
        print()
    if not args.no_compute:
        print(compute_one_batch())


if __name__ == "__main__":
    main()
