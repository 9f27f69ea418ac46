"""Per-batch metadata: vLLM's CommonAttentionMetadata -> one plan -> index tensors per route.

``AtomMetadataBuilder.build()`` runs once per batch (per KV-cache group) for all its layers,
on the host: lengths come from the CPU copies vLLM keeps (``query_start_loc_cpu``,
``seq_lens_cpu_upper_bound``, exact for prefill rows), so nothing waits on the device. It
calls ``atom_backend.planning.plan`` once, records it in the metrics (what it records depends
on the builder's place among the process's builders: ``Recording roles`` below), logs every request routed
away from its preferred path at debug level, and builds for each route (split-KV decode,
varlen, unified) the sub-batch the executors need: the token rows (a slice when contiguous,
vLLM puts decodes first), cu_seqlens, seq_lens and block-table rows, and for the varlen route
the packed-key layout of exactly the requests the plan sent there.

CUDA graphs: ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` (``UNIFORM_BATCH`` with speculative
decoding whose verification requests are decodes here, ``planner_config``). vLLM captures one
graph per padded batch size of uniform decodes and replays it for every later batch of that size
after running ``build`` eagerly; prefills and mixed batches run eagerly (piecewise graphs). The
captured launches read vLLM's persistent buffers (query_start_loc, seq_lens, block table: the
decode route holds views of them, checked at capture), so a replay sees the new batch; padded
requests have no query tokens and return at once. ``build_for_cudagraph_capture`` sizes the
split count for ``max_seq_len`` (vLLM passes max_model_len there; the dummy lengths are the
query's), since the count is baked into the graph as the grid's bound (each request then uses
the splits its own length is worth, ``planner.SplitRule``), and gives the route a
workspace and kernel counters the builder owns, made outside any capture (a graph outlives the
metadata it was captured with, and a buffer made inside a capture would come from the pool
vLLM's graphs share). Eager layers stay cheap too: the decode route's
``hip_kernels.decode.SplitKVPlan`` is made by the batch's first layer and launched by the others
(docs/perf/decode.md, 2026-11-23, "host cost per layer, plan once per batch").

Recording roles (who records which series on a model of several KV-cache groups):
``atom_backend.vllm.recording``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from atom_backend import planning as _planner
from atom_backend.execution import health
from atom_backend.vllm import compat
from atom_backend.vllm.recording import REGISTRY, layer_kind, layer_rank, records_here
from atom_backend.planning import ModelFacts, Path, Plan, PlannerConfig, Reason, plan

logger = logging.getLogger("atom_backend")

try:
    from atom_backend import metrics as _metrics
except ImportError:  # the metrics module is optional at run time (prometheus-client missing)
    _metrics = None

# Per-process routing counters (cheap ints) for in-process readers (integration_tests/runner.py);
# the Prometheus series (atom_backend.metrics) are what a deployment reads.
COUNTERS: dict[str, int] = {
    "batches": 0, "decode_requests": 0, "varlen_requests": 0, "unified_requests": 0,
    "varlen_prefix_hit_requests": 0, "varlen_cached_tokens": 0, "unified_prefix_hit_requests": 0,
    "mixed_batches": 0,  # batches whose requests went to more than one route
}
# (new, cached, path, reason) of recent prefill requests, for tests and debugging.
PREFILL_LOG: deque = deque(maxlen=512)


def _torch_dtype_name(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dt]


def kv_format(cache_dtype: str, model_dtype: torch.dtype, device_type: str) -> tuple[str, str]:
    """(planner kv_dtype, kv_scale_mode) of a vLLM cache dtype."""
    if cache_dtype.startswith("fp8"):
        fnuz = device_type == "cuda" and getattr(torch.version, "hip", None) and _is_fnuz()
        return ("fp8_e4m3fnuz" if fnuz else "fp8_e4m3"), "per_tensor"
    name = cache_dtype if cache_dtype in ("float16", "bfloat16") else None
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, model_dtype)
    kv = _torch_dtype_name(dt)
    if kv == "fp32":
        # The planner knows stored 16-bit / fp8 formats: an unquantised fp32 cache routes exactly
        # like one stored in the query dtype (kv_dtype only gates the split-KV kernel, which takes
        # 16-bit queries anyway); gather bytes use the query dtype.
        kv = "fp16"
    return kv, "none"


def _is_fnuz() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_fp8_fnuz())
    except Exception:
        return False


@dataclass
class Route:
    """One path's sub-batch. Request indices refer to the batch; rows to q/output."""

    path: str
    reqs: np.ndarray  # request indices, ascending (host)
    new: np.ndarray  # new query tokens per request (host)
    total: np.ndarray  # cached + new keys per request (host)
    rows: Any  # slice (contiguous token rows) or a device LongTensor of row indices
    num_tokens: int
    cu_seqlens_q: torch.Tensor  # int32 [n + 1], device
    seq_lens: torch.Tensor  # int32 [n], device (vLLM's exact lengths)
    block_table: torch.Tensor  # int32 [n, max_blocks], device
    max_seqlen_q: int
    max_seqlen_k: int
    # varlen only
    total_kv: int = 0
    cu_seqlens_k: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None  # int32 request rows of full_block_table (GPU gather)
    full_block_table: torch.Tensor | None = None
    gather_blocks: torch.Tensor | None = None  # CPU gather: physical block of each packed key
    gather_offsets: torch.Tensor | None = None
    # FP8 compute (plan.varlen_fp8): each request's first row in the packed e4m3 K/V (multiples of
    # 128, hip_kernels.gather.fp8_padded_starts) and the packed row count
    fp8: bool = False
    cu_kp: torch.Tensor | None = None
    total_pad: int = 0
    cache: dict = field(default_factory=dict)  # built by the first layer for all: work lists, the decode plan


@dataclass
class AtomMetadata:
    num_actual_tokens: int
    plan: Plan
    num_splits: int
    decode: Route | None
    varlen: Route | None
    unified: Route | None
    slot_mapping: torch.Tensor
    on_cpu: bool
    decode_kernel: str  # "hip" | "triton" | "torch": who runs the decode route
    decode_balanced: bool | None = None  # hip decode: None = the kernel's default, False = fixed ranges
    # How many of the grid's num_splits each request uses, decided on the device
    # (planner.SplitRule): num_splits is the bound (a captured graph's is sized for
    # max_model_len), a short request uses fewer splits.
    split_rule: _planner.SplitRule = _planner.SplitRule()
    workspace: torch.Tensor | None = None  # decode partials of a captured graph (the builder's)
    counters: torch.Tensor | None = None  # split-KV kernel counters of a captured graph (the builder's)

    def routes(self):
        return [r for r in (self.decode, self.varlen, self.unified) if r is not None]


layer_windows = _planner.reduce_layer_windows


def _spec_decode_len(vllm_config) -> int:
    """vLLM's widest verification request of speculative decoding (1 without)."""
    return compat.max_decode_query_len(vllm_config)


def planner_config(vllm_config, env=None) -> PlannerConfig:
    """The planner's settings (ATOM_* environment) for this engine. With speculative decoding and
    ATOM_DECODE_MAX_QUERY_TOKENS unset, a verification request (1 + k tokens, up to the decode
    kernel's 8) is a decode, as vLLM's batch reorder already treats it."""
    env = os.environ if env is None else env
    cfg = PlannerConfig.from_env(env)
    spec = _spec_decode_len(vllm_config)
    if "ATOM_DECODE_MAX_QUERY_TOKENS" not in env and cfg.decode_max_query_tokens < spec <= 8:
        cfg = replace(cfg, decode_max_query_tokens=spec)
    return cfg


def _group_layers(vllm_config, layer_names):
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention, layer_names)


class AtomMetadataBuilder(AttentionMetadataBuilder[AtomMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """FULL graphs for batches of decodes of one length: single tokens, and speculative
        decoding's verification requests where they are decodes here (planner_config)."""
        # Microbatching (DBO) hands capture per-microbatch copies of query_start_loc / seq_lens that
        # a graph would keep: the same values for single-token decodes, not for wider requests
        # split across microbatches.
        ubatching = getattr(getattr(vllm_config, "parallel_config", None), "use_ubatching", False)
        if not ubatching and planner_config(vllm_config).decode_max_query_tokens >= _spec_decode_len(vllm_config) > 1:
            return AttentionCGSupport.UNIFORM_BATCH
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = planner_config(vllm_config)
        # Decodes first, so the split-KV route reads one contiguous slice of rows.
        self._init_reorder_batch_threshold(self.config.decode_max_query_tokens, supports_spec_as_decode=True)
        self.block_size = kv_cache_spec.block_size
        model_config = vllm_config.model_config
        layers = _group_layers(vllm_config, layer_names)
        impls = [layer.impl for layer in layers.values()]
        per_layer = [getattr(i, "sliding_window", None) or 0 for i in impls]
        windows = set(per_layer)
        num_q_heads = ({getattr(i, "num_heads", None) for i in impls} - {None}) or {
            model_config.get_num_attention_heads(vllm_config.parallel_config)}
        kv_dtype, scale_mode = kv_format(vllm_config.cache_config.cache_dtype, model_config.dtype, device.type)
        self.facts = ModelFacts(
            num_q_heads=max(num_q_heads), num_kv_heads=kv_cache_spec.num_kv_heads, head_dim=kv_cache_spec.head_size,
            dtype=_torch_dtype_name(model_config.dtype), kv_dtype=kv_dtype, kv_scale_mode=scale_mode,
            has_sinks=any(getattr(i, "sinks", None) is not None for i in impls),
            # A group mixing windowed and global layers shares one plan: size splits for full context.
            window=windows.pop() if len(windows) == 1 else 0,
            softcap=max((getattr(i, "logits_soft_cap", 0.0) or 0.0) for i in impls) if impls else 0.0,
            page_size=self.block_size, layer_windows=layer_windows(per_layer),
        )
        self._setup(device, health.detect_platform(device), layer_names)
        health.warm_kernels(self.facts, device, self.config.decode_max_query_tokens)
        logger.debug("atom: builder for %d layers: %s on %s", len(layer_names), self.facts, self.platform)

    @classmethod
    def for_model(cls, facts: ModelFacts, config: PlannerConfig, device, platform=None,
                  layer_names=None) -> "AtomMetadataBuilder":
        """A builder without a vLLM engine (tests, benchmarks): the model's facts and settings
        given, the platform detected for `device` unless given. Without ``layer_names`` it records
        every metric as if alone; with them it takes its recording role among the process's
        builders like one vLLM made."""
        device = torch.device(device)
        b = object.__new__(cls)
        b.facts, b.config, b.block_size = facts, config, facts.page_size
        b._setup(device, platform or health.detect_platform(device), layer_names)
        return b

    def _setup(self, device, platform, layer_names=None) -> None:
        if self.facts.kv_scale_mode == "per_page":
            # LayerParams carries vLLM's per-tensor scales only; a per-page cache would be read with those
            raise _planner.PlanError("the backend's executors take per-tensor KV scales (vLLM's); per-page scales "
                                     "are for hip_kernels.gather / hip_kernels.prefill callers")
        self.on_cpu = device.type == "cpu"
        self.platform = platform
        self._warned_sync = False
        self._graph_workspaces: list[torch.Tensor] = []
        self._graph_counters: list[torch.Tensor] = []
        self.layer_kind = layer_kind(self.facts)
        self._num_layers = len(layer_names) if layer_names else 1
        self._rank = layer_rank(layer_names or ())
        self._registered = bool(layer_names)
        self._drafter = False
        self._roles = (-1, True, True)  # (registry version, records the step, records its kind's routing)
        if self._registered:
            REGISTRY.add(self)

    # -- recording roles ----------------------------------------------------------------
    def _decide_roles(self) -> tuple[int, bool, bool]:
        version = REGISTRY.version
        if not self._registered:
            roles = (version, True, True)
        elif self._drafter or not records_here():
            roles = (version, False, False)
        else:
            live = list(REGISTRY.builders)
            step = self._rank <= min(b._rank for b in live)
            routing = self._rank <= min(b._rank for b in live if b.layer_kind == self.layer_kind)
            roles = (version, step, routing)
        self._roles = roles
        return roles

    def _record(self, p: Plan, seconds: float) -> None:
        roles = self._roles
        if roles[0] != REGISTRY.version:
            roles = self._decide_roles()
        _metrics.record_plan(p, seconds, layer_kind=self.layer_kind, step=roles[1], routing=roles[2],
                             layers=self._num_layers)

    # -- host lengths ------------------------------------------------------------------
    def _host_seq_lens(self, cm: CommonAttentionMetadata) -> np.ndarray:
        s = cm.seq_lens_cpu_upper_bound
        if s is None:
            if cm.seq_lens.device.type == "cpu":
                s = cm.seq_lens
            else:
                if not self._warned_sync:
                    logger.warning("atom: vLLM gave no host seq_lens; copying them from the device (sync)")
                    self._warned_sync = True
                s = cm.seq_lens.cpu()
        return np.asarray(s[: cm.num_reqs].numpy(), dtype=np.int64)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AtomMetadata:
        return self._build(common_attn_metadata)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> AtomMetadata:
        """The metadata a decode graph is captured with: splits for the longest context the
        graph will replay (``max_seq_len``), the route's tensors checked to be views of vLLM's
        persistent buffers, a builder-owned workspace."""
        cm = common_attn_metadata
        # vLLM's dummy runs (capture, FULL-graph warm-up) come here: no user's tokens, nothing recorded.
        md = self._build(cm, split_context=int(cm.max_seq_len), record=False)
        r = md.decode
        if r is None or md.varlen is not None or md.unified is not None or int(r.reqs[0]) != 0:
            raise RuntimeError("atom: a CUDA graph is captured for a batch of decodes only (vLLM's uniform decode); "
                               f"got routes {[x.path for x in md.routes()]}")
        for name, mine, vllms in (("query_start_loc", r.cu_seqlens_q, cm.query_start_loc),
                                  ("seq_lens", r.seq_lens, cm.seq_lens),
                                  ("block_table", r.block_table, cm.block_table_tensor)):
            if mine.data_ptr() != vllms.data_ptr():
                raise RuntimeError(f"atom: the decode route's {name} is a copy, not a view of vLLM's buffer "
                                   f"({vllms.dtype}): a captured graph would read stale values")
        # Shared by every captured graph (they replay one at a time) and made here, outside any
        # capture: made inside, they would come from the pool vLLM's graphs share, where another
        # graph's temporaries overwrite them.
        from hip_kernels.decode import counter_elems, workspace_elems
        from hip_kernels.runtime.workspace import grown_buffer

        dev, f = cm.query_start_loc.device, self.facts
        md.workspace = grown_buffer(self._graph_workspaces, workspace_elems(md.num_splits, r.num_tokens, f.num_q_heads,
                                                                            f.head_dim), torch.float32, dev)
        if md.decode_kernel == "hip":
            md.counters = grown_buffer(self._graph_counters, counter_elems(len(r.reqs), f.num_q_heads, f.num_kv_heads,
                                                                           r.max_seqlen_q), torch.int32, dev)
        return md

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int) -> AtomMetadata:
        """A draft model's batch: planned like any, recorded nowhere (the verification step counts
        the drafted tokens). A builder that drafts leaves the recording roles to the target's."""
        if not self._drafter:
            self._drafter = True
            REGISTRY.discard(self)
        return self._build(common_attn_metadata, record=False)

    def _build(self, cm: CommonAttentionMetadata, split_context: int | None = None,
               record: bool = True) -> AtomMetadata:
        n = cm.num_reqs
        qsl = np.asarray(cm.query_start_loc_cpu[: n + 1].numpy(), dtype=np.int64)
        new = np.diff(qsl)
        total = self._host_seq_lens(cm)
        cached = np.maximum(total - new, 0)
        t0 = time.perf_counter()
        if any(health.STATE.values()):  # a kernel that failed at run time since this builder was made
            self.platform = health.without_failed_kernels(self.platform)
        p = plan(new, cached, self.facts, self.platform, self.config)
        dt = time.perf_counter() - t0
        if record and _metrics is not None:
            self._record(p, dt)
        self._log_routes(p, new, cached)

        decode_kernel = "torch" if self.on_cpu else ("hip" if p.decode_path == Path.SPLITKV else "triton")
        md = AtomMetadata(
            num_actual_tokens=cm.num_actual_tokens, plan=p,
            num_splits=int(p.num_splits) if split_context is None else _planner.decode_splits(
                len(p.decode), split_context, self.facts, self.platform, self.config, p.split_rule),
            decode=self._route(cm, p.decode, p.decode_path.value, qsl, new, total),
            varlen=self._route(cm, p.varlen, Path.VARLEN.value, qsl, new, total, varlen=True, fp8=p.varlen_fp8),
            unified=self._route(cm, p.unified, Path.UNIFIED.value, qsl, new, total),
            slot_mapping=cm.slot_mapping, on_cpu=self.on_cpu, decode_kernel=decode_kernel,
            decode_balanced=None if self.platform.decode_balanced and not self.config.deterministic_decode else False,
            split_rule=p.split_rule,
        )
        self._count(p, new, cached)
        return md

    def _route(self, cm, idx: np.ndarray, path: str, qsl, new, total, varlen: bool = False,
               fp8: bool = False) -> Route | None:
        if len(idx) == 0:
            return None
        dev = cm.query_start_loc.device
        i0, i1 = int(idx[0]), int(idx[-1]) + 1
        contiguous = i1 - i0 == len(idx)
        r_new, r_total = new[idx], total[idx]
        cu_q = np.zeros(len(idx) + 1, dtype=np.int32)
        np.cumsum(r_new, out=cu_q[1:])
        if contiguous:
            rows = slice(int(qsl[i0]), int(qsl[i1]))
            seq_lens = cm.seq_lens[i0:i1]
            block_table = cm.block_table_tensor[i0:i1]
        else:
            rows_np = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in idx])
            rows = torch.from_numpy(rows_np).to(dev, non_blocking=True)
            idx_dev = torch.from_numpy(idx).to(dev, non_blocking=True)
            seq_lens = cm.seq_lens.index_select(0, idx_dev)
            block_table = cm.block_table_tensor.index_select(0, idx_dev)
        if contiguous and i0 == 0 and cm.query_start_loc.dtype == torch.int32:
            cu_dev = cm.query_start_loc[: i1 + 1]  # the route's prefix of vLLM's own: no copy
        else:
            cu_dev = torch.from_numpy(cu_q).to(dev, non_blocking=True)
        r = Route(
            path=path, reqs=idx, new=r_new, total=r_total, rows=rows, num_tokens=int(cu_q[-1]),
            cu_seqlens_q=cu_dev, seq_lens=seq_lens.to(torch.int32),
            block_table=block_table, max_seqlen_q=int(r_new.max()), max_seqlen_k=int(r_total.max()),
        )
        if varlen:
            cu_k = np.zeros(len(idx) + 1, dtype=np.int32)
            np.cumsum(r_total, out=cu_k[1:])
            r.total_kv = int(cu_k[-1])
            r.cu_seqlens_k = torch.from_numpy(cu_k).to(dev, non_blocking=True)
            r.full_block_table = cm.block_table_tensor
            r.seq_ids = torch.from_numpy(idx.astype(np.int32)).to(dev, non_blocking=True)
            if fp8:
                from hip_kernels.gather import fp8_padded_starts

                cu_kp = fp8_padded_starts(r_total.tolist())
                r.fp8, r.total_pad = True, cu_kp[-1]
                r.cu_kp = torch.tensor(cu_kp, dtype=torch.int32).to(dev, non_blocking=True)
            if self.on_cpu:
                # (block, offset) of every packed key, computed once for all layers.
                pos = np.concatenate([np.arange(t) for t in r_total])
                req = np.repeat(idx, r_total)
                bt = cm.block_table_tensor
                r.gather_blocks = bt[torch.from_numpy(req), torch.from_numpy(pos // self.block_size)].long()
                r.gather_offsets = torch.from_numpy(pos % self.block_size)
        return r

    # -- observability ------------------------------------------------------------------
    def _log_routes(self, p: Plan, new, cached) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        if p.predictions is not None:
            idx, tv, tu = p.predictions
            for i, a, b in zip(idx.tolist(), tv.tolist(), tu.tolist()):
                logger.debug("atom: prefill request %d (new=%d, cached=%d) -> %s (reason: cost, predicted per layer: "
                             "varlen %.1f us, unified %.1f us)", i, new[i], cached[i],
                             "varlen" if a < b else "unified", a, b)
        if len(p.decode) and p.decode_reason != Reason.PREFERRED:
            logger.debug("atom: %d decode requests -> %s (reason: %s)", len(p.decode), p.decode_path.value,
                         p.decode_reason.value)
        for i, why in zip(p.unified.tolist(), p.unified_reasons):
            if why == Reason.COST:
                continue  # logged with its predictions above
            logger.debug("atom: prefill request %d (new=%d, cached=%d) -> unified (reason: %s)", i, new[i],
                         cached[i], why.value)

    def _count(self, p: Plan, new, cached) -> None:
        c = COUNTERS
        c["batches"] += 1
        c["mixed_batches"] += int(sum(1 for r in (p.decode, p.varlen, p.unified) if len(r)) > 1)
        c["decode_requests"] += len(p.decode)
        c["varlen_requests"] += len(p.varlen)
        c["unified_requests"] += len(p.unified)
        if len(p.varlen):  # (numpy calls on empty arrays cost a decode step ~10 us)
            c_v = cached[p.varlen]
            c["varlen_prefix_hit_requests"] += int((c_v > 0).sum())
            c["varlen_cached_tokens"] += int(c_v.sum())
            for i in p.varlen.tolist():
                PREFILL_LOG.append((int(new[i]), int(cached[i]), "varlen", p.varlen_reason.value))
        if len(p.unified):
            c["unified_prefix_hit_requests"] += int((cached[p.unified] > 0).sum())
            for i, why in zip(p.unified.tolist(), p.unified_reasons):
                PREFILL_LOG.append((int(new[i]), int(cached[i]), "unified", why.value))
