"""`python -m bench.host`: host time per layer of a decode step, what vLLM pays for every layer
where attention runs eagerly (piecewise CUDA graphs leave attention out of the graph: prefills
and mixed batches), against a captured decode graph (vLLM's FULL graphs for batches of
single-token decodes, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE).

    PYTHONPATH=. python -m bench.host [--json PATH]

Rows (us per call, median of --repeats timings of --calls calls each):
- `step / layer`: one decode step as vLLM runs it eagerly, per layer: the builder's metadata for
  the batch, then STEP_LAYERS layers of AtomAttentionImpl.forward over LAYERS layers (each its
  own impl and vLLM-layout cache) in turn; the first layer of every step plans the batch.
- `graph step / layer`: the same step as vLLM runs a captured decode graph: the builder's
  metadata (vLLM still builds it eagerly), then one replay of the STEP_LAYERS layers.
- `impl.forward`: one more layer on metadata already planned (the steady per-layer cost);
  `executors.run`: the same without the impl (its cache views and parameters).
- `SplitKVPlan.run`: the hip_kernels call under it, at 1, 4 and 32 splits (32 is past
  FUSE_MAX_SPLITS: the combine kernel follows where the splits are not balanced).
- `splitkv_decode`: plan and run on every call (a caller that keeps no plan).
- `builder.build`: the metadata of one batch (once per step, all layers).
Contexts are short, so the GPU does not hold the host back; `device us` is the same call
replayed from a CUDA graph: where it approaches the host time, the row is not host bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.common import bench_ms, device_name, graphed

HQ, HK, D, PAGE, CTX, LAYERS, STEP_LAYERS = 32, 8, 128, 16, 256, 4, 32


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over repeats of the host time of one fn() call (no sync inside a timing)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def device_us(fn) -> float:
    return bench_ms(graphed(fn), warmup_ms=10, rep_ms=50) * 1e3


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("ATOM_METRICS", "0")
    from bench import _vllm

    _vllm.install()
    import types

    from atom_backend.execution import routes as executors
    from atom_backend.vllm.impl import AtomAttentionImpl
    from atom_backend.vllm.metadata import AtomMetadataBuilder
    from atom_backend.planning import ModelFacts, PlannerConfig
    from bench.calibrate import cu, paged
    from hip_kernels import decode
    from vllm.v1.attention.backend import CommonAttentionMetadata

    dev = torch.device("cuda")
    builder = AtomMetadataBuilder.for_model(ModelFacts(HQ, HK, D, page_size=PAGE), PlannerConfig(), dev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{device_name()}: host us per call (device us per call from a graph replay)", flush=True)
    for batch in (1, 8, 64):
        total = [CTX] * batch
        caches = [paged(total, HK, D, gen=gen) for _ in range(LAYERS)]
        _, _, bt, seq_lens = caches[0]
        nb = caches[0][0].shape[0]
        # vLLM's per-layer cache: logical [blocks, kv_heads, block_size, 2 * head], token-major
        kv_caches = [torch.randn(nb, PAGE, HK, 2 * D, dtype=torch.bfloat16, device=dev).permute(0, 2, 1, 3)
                     for _ in range(LAYERS)]
        impls = [AtomAttentionImpl(HQ, D, D ** -0.5, HK) for _ in range(LAYERS)]
        attn_layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
        qsl = cu([1] * batch)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens, num_reqs=batch,
            num_actual_tokens=batch, max_query_len=1, max_seq_len=CTX, block_table_tensor=bt,
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev), seq_lens_cpu_upper_bound=seq_lens.cpu())
        md = builder.build(0, cm)
        p = executors.LayerParams(D ** -0.5, 0, 0.0, None, None, None, torch.bfloat16)
        layer = [0]

        def one_layer(md=md):
            kc, vc = caches[layer[0]][:2]
            layer[0] = (layer[0] + 1) % LAYERS
            executors.run(md, q, out, kc, vc, p)

        def add(what, splits, host, dev_fn):
            row = {"what": what, "batch": batch, "splits": splits, "host_us": round(host, 1),
                   "device_us": round(device_us(dev_fn), 1) if dev_fn else None}
            rows.append(row)
            d = f"{row['device_us']:6.1f}" if dev_fn else "     -"
            print(f"  batch {batch:3d}  S {splits:2d}  {what:18s} host {host:7.1f}  device {d}", flush=True)

        add("builder.build", md.num_splits, per_call_us(lambda: builder.build(0, cm), args.calls, args.repeats), None)

        def forward(md, i):
            impls[i % LAYERS].forward(attn_layer, q, q, q, kv_caches[i % LAYERS], md, out)

        def step():
            step_md = builder.build(0, cm)
            for i in range(STEP_LAYERS):
                forward(step_md, i)

        def one_forward(md=md):
            forward(md, layer[0])
            layer[0] = (layer[0] + 1) % LAYERS

        add("step / layer", md.num_splits,
            per_call_us(step, max(1, args.calls // STEP_LAYERS), args.repeats) / STEP_LAYERS, None)
        cap = builder.build_for_cudagraph_capture(cm)
        for i in range(STEP_LAYERS):  # warm-up, as vLLM runs before capturing
            forward(cap, i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(STEP_LAYERS):
                forward(cap, i)

        def graph_step():
            builder.build(0, cm)
            graph.replay()

        add("graph step / layer", cap.num_splits,
            per_call_us(graph_step, max(1, args.calls // STEP_LAYERS), args.repeats) / STEP_LAYERS, None)
        add("impl.forward", md.num_splits, per_call_us(one_forward, args.calls, args.repeats), one_forward)
        add("executors.run", md.num_splits, per_call_us(one_layer, args.calls, args.repeats), one_layer)
        kc, vc = caches[0][:2]
        for s in (1, 4, 32):
            plan = decode.SplitKVPlan(qsl, seq_lens, bt, max_query_len=1, num_splits=s)
            run = lambda plan=plan: plan.run(q, kc, vc, out=out)
            add("SplitKVPlan.run", s, per_call_us(run, args.calls, args.repeats), run)
            once = lambda s=s: decode.splitkv_decode(q, kc, vc, qsl, seq_lens, bt, max_query_len=1, num_splits=s,
                                                     out=out)
            add("splitkv_decode", s, per_call_us(once, args.calls, args.repeats), None)
        del caches
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
