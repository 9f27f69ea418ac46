"""The impl's CPU routes against atom_backend.reference, through the real builder and impl
(no vLLM engine): mixed batches split by route with outputs in the right rows, no gather for
requests the plan sent to the unified path, a prefix-cache-hit prefill with sinks on varlen,
FP8 KV with vLLM's per-tensor scales, both layer-compact KV layouts."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from atom_backend.planning import split_ranges
from atom_backend.execution import gather as atom_gather  # noqa: E402
from atom_backend import planning as planner  # noqa: E402
from atom_backend import reference as ref  # noqa: E402
from atom_backend.vllm.impl import split_kv_cache  # noqa: E402
from atom_backend.vllm.impl import AtomAttentionImpl  # noqa: E402
from atom_backend.vllm.metadata import AtomMetadataBuilder, kv_format  # noqa: E402
from atom_backend.planning import ModelFacts, PlannerConfig, Reason  # noqa: E402
from atom_backend.tolerances import assert_close  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

BS = 16


def _builder(facts: ModelFacts, config: PlannerConfig | None = None, device="cpu") -> AtomMetadataBuilder:
    """The real builder without a vLLM config: only what build() reads."""
    return AtomMetadataBuilder.for_model(facts, config or PlannerConfig(), device)


class Case:
    """A paged cache holding `cached` tokens per request, and `new` tokens about to be written."""

    def __init__(self, new, cached, hq=8, hk=2, d=32, dtype=torch.float32, layout="LBNHC", fp8=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.new, self.cached = list(new), list(cached)
        self.hq, self.hk, self.d, self.dtype, self.fp8 = hq, hk, d, dtype, fp8
        total = [n + c for n, c in zip(new, cached)]
        nblk = [-(-t // BS) for t in total]
        num_blocks = sum(nblk) + 3
        perm = torch.randperm(num_blocks, generator=g)
        perm = torch.cat([perm[perm == num_blocks - 1], perm[perm != num_blocks - 1]])  # use the pool's last page
        width = max(nblk) + 1
        self.block_table = torch.zeros(len(new), width, dtype=torch.int32)
        k = 0
        for b, n in enumerate(nblk):
            self.block_table[b, :n] = perm[k:k + n].to(torch.int32)
            k += n
        cdt = torch.uint8 if fp8 else dtype
        if layout == "LBNHC":  # token-major pages, K|V adjacent per (token, head)
            raw = torch.empty(num_blocks, BS, hk, 2 * d, dtype=cdt).permute(0, 2, 1, 3)
        else:  # LBHNC: head-major pages
            raw = torch.empty(num_blocks, hk, BS, 2 * d, dtype=cdt)
        self.kv_cache = raw
        fill = torch.randn(raw.shape, generator=g)
        if fp8:
            raw.view(torch.float8_e4m3fn).copy_((fill * 0.5).to(torch.float8_e4m3fn))
        else:
            raw.copy_(fill.to(dtype))
        self.q = torch.randn(sum(new), hq, d, generator=g).to(dtype)
        self.k_new = torch.randn(sum(new), hk, d, generator=g).to(dtype)
        self.v_new = torch.randn(sum(new), hk, d, generator=g).to(dtype)
        slots = []
        for b, (n, c) in enumerate(zip(new, cached)):
            for t in range(c, c + n):
                slots.append(int(self.block_table[b, t // BS]) * BS + t % BS)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        qsl = torch.zeros(len(new) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(new), 0)
        self.qsl = qsl
        self.seq_lens = torch.tensor(total, dtype=torch.int32)
        self.layout = layout

    def to(self, device) -> "Case":
        """The same case on another device, with the same KV layout (strides)."""
        kv = self.kv_cache
        if self.layout == "LBNHC":
            raw = torch.empty(kv.shape[0], kv.shape[2], kv.shape[1], kv.shape[3], dtype=kv.dtype, device=device)
            raw = raw.permute(0, 2, 1, 3)
        else:
            raw = torch.empty(kv.shape, dtype=kv.dtype, device=device)
        raw.copy_(kv)
        self.kv_cache = raw
        for name in ("q", "k_new", "v_new", "slot_mapping", "qsl", "seq_lens", "block_table"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def common(self) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl.cpu(), seq_lens=self.seq_lens, num_reqs=len(self.new),
            num_actual_tokens=int(self.qsl[-1]), max_query_len=max(self.new), max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=self.block_table, slot_mapping=self.slot_mapping,
            seq_lens_cpu_upper_bound=self.seq_lens.cpu())

    def facts(self, **kw) -> ModelFacts:
        dt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        kv = kv_format("fp8" if self.fp8 else "auto", self.dtype, "cpu")
        return ModelFacts(num_q_heads=self.hq, num_kv_heads=self.hk, head_dim=self.d, dtype=dt, kv_dtype=kv[0],
                          kv_scale_mode=kv[1], page_size=BS, **kw)


LAYER = types.SimpleNamespace(_k_scale_float=0.75, _v_scale_float=1.25)


def _run(case: Case, impl: AtomAttentionImpl, md):
    impl.do_kv_cache_update(LAYER, case.k_new, case.v_new, case.kv_cache, case.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, md, out)
    return out


def _reference(case: Case, impl: AtomAttentionImpl, sinks):
    k_cache, v_cache = split_kv_cache(case.kv_cache, case.d)
    if case.fp8:
        k_cache = ref.dequant_per_tensor(k_cache.view(torch.float8_e4m3fn), LAYER._k_scale_float)
        v_cache = ref.dequant_per_tensor(v_cache.view(torch.float8_e4m3fn), LAYER._v_scale_float)
    o, _ = ref.paged_attention(case.q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), case.qsl.cpu(),
                               case.block_table.cpu(), case.seq_lens.cpu(), scale=impl.scale, window=impl.sliding_window,
                               softcap=impl.logits_soft_cap, sinks=None if sinks is None else sinks.cpu().double())
    return o


def _impl(case: Case, window=0, softcap=0.0, sinks=None):
    return AtomAttentionImpl(case.hq, case.d, case.d ** -0.5, case.hk, None, window or None,
                             "fp8" if case.fp8 else "auto", softcap or None, sinks=sinks)


# Request order is deliberately not decode-first: rows of a route are not contiguous.
MIXED_NEW = [20, 1, 3, 9, 0, 1, 40]
MIXED_CACHED = [45, 37, 0, 700, 12, 16, 0]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("window,softcap,with_sinks", [(0, 0.0, False), (24, 0.0, True), (0, 30.0, True)])
def test_mixed_batch_routes_and_rows_match_reference(layout, window, softcap, with_sinks):
    case = Case(MIXED_NEW, MIXED_CACHED, layout=layout, seed=window + int(softcap))
    sinks = torch.randn(case.hq) if with_sinks else None
    md = _builder(case.facts(has_sinks=with_sinks, window=window, softcap=softcap)).build(0, case.common())
    p = md.plan
    assert p.decode.tolist() == [1, 5] and p.varlen.tolist() == [0, 6] and p.empty.tolist() == [4]
    assert p.unified.tolist() == [2, 3]
    assert list(p.unified_reasons) == [Reason.SMALL_PREFILL, Reason.GATHER_COST]
    impl = _impl(case, window, softcap, sinks)
    out = _run(case, impl, md)
    assert not out.isnan().any(), "some rows were not written"
    assert_close(out, _reference(case, impl, sinks).to(out.dtype), torch.float32)


def test_no_gather_for_unified_requests(monkeypatch):
    calls = []
    real = atom_gather.gather_kv

    def spy(route, *a, **kw):
        calls.append((route.reqs.tolist(), route.total_kv))
        return real(route, *a, **kw)

    monkeypatch.setattr(atom_gather, "gather_kv", spy)
    case = Case(MIXED_NEW, MIXED_CACHED, seed=3)
    md = _builder(case.facts()).build(0, case.common())
    impl = _impl(case)
    out = _run(case, impl, md)
    # One gather for the layer, of exactly the varlen requests (cached + new keys each).
    assert calls == [([0, 6], (20 + 45) + (40 + 0))]
    assert md.plan.gather_tokens == 105
    assert_close(out, _reference(case, impl, None).to(out.dtype), torch.float32)

    calls.clear()
    forced = _builder(case.facts(), PlannerConfig(force_path="unified")).build(0, case.common())
    assert len(forced.plan.varlen) == 0 and forced.varlen is None
    out = torch.full_like(case.q, float("nan"))
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, forced, out)
    assert calls == [], "requests the plan sent to unified were gathered"
    assert_close(out, _reference(case, impl, None).to(out.dtype), torch.float32)


def test_prefix_hit_prefill_with_sinks_takes_varlen():
    case = Case([32, 1], [64, 80], seed=7)  # a prefix-cache hit of 4 pages, and a decode
    sinks = torch.randn(case.hq)
    md = _builder(case.facts(has_sinks=True, window=48)).build(0, case.common())
    assert md.plan.varlen.tolist() == [0] and md.plan.unified.tolist() == []
    assert md.varlen.total_kv == 96 and md.varlen.new.tolist() == [32]
    impl = _impl(case, window=48, sinks=sinks)
    before = dict(atom_gather.STATS)
    out = _run(case, impl, md)
    assert atom_gather.STATS["tokens"] - before["tokens"] == 96
    assert_close(out, _reference(case, impl, sinks).to(out.dtype), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kv_cache_with_per_tensor_scales(dtype):
    case = Case(MIXED_NEW, MIXED_CACHED, dtype=dtype, fp8=True, seed=11)
    sinks = torch.randn(case.hq)
    md = _builder(case.facts(has_sinks=True)).build(0, case.common())
    impl = _impl(case, sinks=sinks)
    out = _run(case, impl, md)
    assert not out.isnan().any()
    # FP8 KV is judged against the reference on the dequantised cache, with the bf16 bounds.
    assert_close(out.float(), _reference(case, impl, sinks).float(), torch.bfloat16)


def test_decode_splits_match_single_split():
    case = Case([1, 1, 1], [300, 17, 513], seed=5)
    sinks = torch.randn(case.hq)
    facts = case.facts(has_sinks=True)
    md = _builder(facts).build(0, case.common())
    impl = _impl(case, sinks=sinks)
    impl.do_kv_cache_update(LAYER, case.k_new, case.v_new, case.kv_cache, case.slot_mapping)
    want = _reference(case, impl, sinks).to(case.dtype)
    b = _builder(facts)
    assert md.split_rule == planner.decode_split_rule(3, facts, b.platform, b.config)
    assert md.split_rule.min_tokens > 0 and md.split_rule.fill > 0
    # 100: the 17-key request keeps one split, the 300-key one three; the last rule: 301 keys keep
    # the fill target 2, 514 grow to 4 (a whole wave of 8 slots), 18 keep 1
    for splits in (1, 3, 8):
        for rule in (planner.SplitRule(), planner.SplitRule(100), planner.SplitRule(64, 2, 100, 2, 8, 95)):
            md.num_splits, md.split_rule = splits, rule
            out = torch.full_like(case.q, float("nan"))
            impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, md, out)
            assert_close(out, want, torch.float32, what=f"{splits} splits, {rule}")


def test_cpu_split_decode_divides_keys_as_the_split_rule_says(monkeypatch):
    """Every split count gives the same answer, so the ranges themselves are checked: the CPU
    executor's partials cover planning.split_ranges(keys, S, rule) of each request."""
    from atom_backend.execution import routes as executors

    case = Case([1, 1, 1], [300, 17, 513], seed=5)
    facts = case.facts()
    md = _builder(facts).build(0, case.common())
    impl = _impl(case)
    impl.do_kv_cache_update(LAYER, case.k_new, case.v_new, case.kv_cache, case.slot_mapping)
    seen = []
    real = executors.attend

    def recording(q, k, v, sk, p, key_lo=0, key_hi=None):
        seen.append((sk, key_lo, key_hi))
        return real(q, k, v, sk, p, key_lo, key_hi)

    monkeypatch.setattr(executors, "attend", recording)
    md.num_splits, md.split_rule = 8, planner.SplitRule(64, 2, 100, 2, 8, 95)
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, md, torch.empty_like(case.q))
    want = []
    for sk in (301, 18, 514):  # cached + the new token
        want += [(sk, j0, j1) for j0, j1 in split_ranges(sk, 8, md.split_rule)]
    assert seen == want
    assert [sum(1 for s, a, b in seen if s == sk and b > a) for sk in (301, 18, 514)] == [2, 1, 4]


def test_a_route_from_the_first_request_reads_vllms_query_start_loc():
    """Decodes come first (vLLM reorders them): their route's cu_seqlens_q is a view of vLLM's
    query_start_loc (no host-to-device copy per batch); a route further in gets its own."""
    case = Case([1, 1, 1, 40], [300, 17, 513, 0], seed=6)
    md = _builder(case.facts(), PlannerConfig(cost_routing=False)).build(0, case.common())
    assert md.plan.decode.tolist() == [0, 1, 2] and md.varlen is not None and md.varlen.reqs.tolist() == [3]
    assert md.decode.cu_seqlens_q.data_ptr() == case.qsl.data_ptr()
    assert md.decode.cu_seqlens_q.tolist() == [0, 1, 2, 3]
    assert md.varlen.cu_seqlens_q.data_ptr() != case.qsl.data_ptr()
    assert md.varlen.cu_seqlens_q.tolist() == [0, 40]


def test_capture_metadata_splits_for_max_seq_len_and_views_vllms_buffers():
    """vLLM captures a decode graph with dummy lengths (1) and max_seq_len = max_model_len, then
    replays it for any batch of that size: the split count is sized for max_seq_len, the route's
    tensors are vLLM's buffers (a replay reads the new batch), the workspace is the builder's
    and shared by the graphs; anything else is refused at capture."""
    from atom_backend.catalog import platform_for

    case = Case([1] * 4, [0] * 4, seed=7)
    b = _builder(case.facts())
    b.platform = platform_for("sm_90a", num_sms=132, use_tables=False)  # a GPU's waves to fill
    cm = case.common()
    cm.max_seq_len = 4096
    eager = b.build(0, cm)
    md = b.build_for_cudagraph_capture(cm)
    assert eager.num_splits == 1 < md.num_splits
    assert md.num_splits == planner.decode_splits(4, 4096, b.facts, b.platform, b.config)
    assert md.decode.seq_lens.data_ptr() == case.seq_lens.data_ptr()
    assert md.decode.block_table.data_ptr() == case.block_table.data_ptr()
    need = md.num_splits * 4 * case.hq * (case.d + 1)
    assert md.workspace.dtype == torch.float32 and md.workspace.numel() >= need
    assert b.build_for_cudagraph_capture(cm).workspace is md.workspace
    assert eager.workspace is None
    cm.seq_lens = case.seq_lens.long()  # a copy would be captured: refused
    with pytest.raises(RuntimeError, match="seq_lens is a copy"):
        b.build_for_cudagraph_capture(cm)
    mixed = Case([1, 40], [10, 0], seed=8)
    with pytest.raises(RuntimeError, match="decodes only"):
        _builder(mixed.facts()).build_for_cudagraph_capture(mixed.common())


def test_speculative_verification_requests_are_decodes_and_graphed(monkeypatch):
    """With speculative decoding (k drafts) a verification request of 1 + k tokens is a decode
    (vLLM reorders it with the decodes) unless ATOM_DECODE_MAX_QUERY_TOKENS says otherwise, and
    batches of them get FULL graphs (UNIFORM_BATCH); without, single-token decode batches."""
    from atom_backend.vllm.metadata import AtomMetadataBuilder, planner_config
    from vllm.v1.attention.backend import AttentionCGSupport

    def cfg(k, parallel=False):
        spec = None if k is None else types.SimpleNamespace(num_speculative_tokens=k, parallel_drafting=parallel)
        return types.SimpleNamespace(speculative_config=spec, use_v2_model_runner=False)

    monkeypatch.delenv("ATOM_DECODE_MAX_QUERY_TOKENS", raising=False)
    support = AtomMetadataBuilder.get_cudagraph_support
    assert planner_config(cfg(None), env={}).decode_max_query_tokens == 1
    assert support(cfg(None), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert planner_config(cfg(3), env={}).decode_max_query_tokens == 4
    assert planner_config(cfg(7), env={}).decode_max_query_tokens == 8
    assert planner_config(cfg(8), env={}).decode_max_query_tokens == 1  # 9 tokens: past the kernel's 8
    assert planner_config(cfg(3), env={"ATOM_DECODE_MAX_QUERY_TOKENS": "1"}).decode_max_query_tokens == 1
    assert planner_config(cfg(2, parallel=True), env={}).decode_max_query_tokens == 5
    assert support(cfg(3), None) == AttentionCGSupport.UNIFORM_BATCH
    assert support(cfg(8), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_a_layer_reuses_its_cache_views_and_params_until_they_change():
    """forward makes a layer's cache views and LayerParams once; a new cache tensor or new FP8
    scales (calibration, reload) are picked up, never stale."""
    case = Case([1, 1], [40, 9], seed=8, fp8=True)
    impl = _impl(case)
    layer = types.SimpleNamespace(_k_scale_float=0.75, _v_scale_float=1.25)
    k1, _ = impl._caches(case.kv_cache)
    assert impl._caches(case.kv_cache)[0] is k1
    other = case.kv_cache.clone()
    assert impl._caches(other)[0].data_ptr() == other.data_ptr()
    p1 = impl._layer_params(layer, torch.float32)
    assert impl._layer_params(layer, torch.float32) is p1
    layer._k_scale_float = 0.5
    p2 = impl._layer_params(layer, torch.float32)
    assert p2 is not p1 and p2.k_scale == 0.5 and p2.v_scale == 1.25
    assert impl._layer_params(layer, torch.bfloat16).out_dtype == torch.bfloat16


def test_reloaded_sinks_land_in_the_buffer_the_kernels_read():
    """vLLM reloads weights in place and keeps its CUDA graphs: new sink values must reach the
    fp32 buffer captured launches point at, for bf16 sinks (converted) and fp32 ones (as is)."""
    case = Case([1], [40], seed=9)
    bf = torch.nn.Parameter(torch.randn(case.hq).to(torch.bfloat16), requires_grad=False)
    impl = _impl(case, sinks=bf)
    first = impl._sinks()
    assert first.dtype == torch.float32 and torch.equal(first, bf.float())
    bf.data.copy_(torch.randn(case.hq).to(torch.bfloat16))
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl._sinks() is first and torch.equal(first, bf.float())
    fp = torch.nn.Parameter(torch.randn(case.hq), requires_grad=False)
    impl = _impl(case, sinks=fp)
    assert impl._sinks().data_ptr() == fp.data_ptr()
    impl.process_weights_after_loading(torch.float32)
    assert impl._sinks().data_ptr() == fp.data_ptr()


def test_padding_slots_are_skipped_and_profile_run_zero_fills():
    case = Case([4], [0], seed=2)
    impl = _impl(case)
    before = case.kv_cache.clone()
    slots = torch.tensor([-1, -1, -1, -1])
    impl.do_kv_cache_update(LAYER, case.k_new, case.v_new, case.kv_cache, slots)
    assert torch.equal(before, case.kv_cache)
    out = torch.full_like(case.q, float("nan"))
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, None, out)
    assert torch.equal(out, torch.zeros_like(out))
    assert np.isfinite(out.numpy()).all()


def test_routed_away_requests_log_their_reason_and_count(caplog):
    import logging

    from atom_backend.vllm import metadata

    case = Case(MIXED_NEW, MIXED_CACHED, seed=1)
    b = _builder(case.facts())
    before = dict(metadata.COUNTERS)
    with caplog.at_level(logging.DEBUG, logger="atom_backend"):
        b.build(0, case.common())
    msgs = [r.getMessage() for r in caplog.records]
    assert any("request 2 (new=3, cached=0) -> unified (reason: small_prefill)" in m for m in msgs), msgs
    assert any("request 3 (new=9, cached=700) -> unified (reason: gather_cost)" in m for m in msgs), msgs
    assert metadata.COUNTERS["batches"] == before["batches"] + 1
    assert metadata.COUNTERS["mixed_batches"] == before["mixed_batches"] + 1
    assert (45, "varlen") in [(c, p) for _, c, p, _ in list(metadata.PREFILL_LOG)[-8:]]


def test_a_kernel_that_fails_at_run_time_is_planned_around(monkeypatch):
    """FP8 compute that fails at run time: the batch runs the dequantizing gather + 16-bit kernel;
    that failing too, the Triton path. Each failure is recorded once and later batches are planned
    without the kernel (requests counted with reason kernel_unavailable), not run on another path
    behind a plan that says varlen."""
    from atom_backend.catalog import platform_for
    from atom_backend.execution import health
    from atom_backend.execution import routes as executors

    monkeypatch.setattr(health, "STATE", {})
    ran = []

    def failing_varlen(route, q, out, k_cache, v_cache, p, fp8):
        ran.append("fp8" if fp8 else "16-bit")
        raise RuntimeError("no kernel")

    monkeypatch.setattr(executors, "_gpu_varlen", failing_varlen)
    monkeypatch.setattr(executors, "_gpu_unified", lambda *a: ran.append("unified"))
    case = Case([300, 900], [0, 100], hq=32, hk=8, d=128, dtype=torch.bfloat16, fp8=True)
    b = AtomMetadataBuilder.for_model(case.facts(), PlannerConfig(), "cpu", platform_for("sm_90a", use_tables=False))
    first = b.build(0, case.common()).plan
    assert first.varlen_fp8 and list(first.varlen) == [0, 1]

    executors._gpu_varlen_or_fallback(types.SimpleNamespace(fp8=True), None, None, None, None, None)
    assert ran == ["fp8", "16-bit", "unified"]
    assert {k for k, why in health.STATE.items() if why} == {"varlen_fp8", "varlen"}
    later = b.build(0, case.common()).plan
    assert len(later.varlen) == 0 and set(later.unified_reasons) == {Reason.NO_KERNEL}

    health.STATE.pop("varlen")  # only FP8 compute failed: varlen in 16-bit compute
    b.platform = platform_for("sm_90a", use_tables=False)
    only_fp8 = b.build(0, case.common()).plan
    assert list(only_fp8.varlen) == [0, 1] and not only_fp8.varlen_fp8
    assert only_fp8.varlen_compute_reason == Reason.NO_KERNEL
    ran.clear()
    executors._gpu_varlen_or_fallback(types.SimpleNamespace(fp8=False), None, None, None, None, None)
    assert ran == ["16-bit", "unified"]


def test_per_page_scales_are_refused_by_the_builder():
    """The executors take vLLM's per-tensor scales: a per-page model would be read with them."""
    facts = ModelFacts(8, 2, 128, kv_dtype="fp8_e4m3", kv_scale_mode="per_page", page_size=BS)
    with pytest.raises(planner.PlanError, match="per-tensor KV scales"):
        _builder(facts)


@pytest.mark.parametrize("device_balanced, deterministic, want", [
    (True, False, None), (True, True, False), (False, False, False), (False, True, False)])
def test_decode_balancing_follows_the_device_and_the_setting(device_balanced, deterministic, want):
    """The split kernel balances where its rule says it pays (None) unless the device's table says
    balancing is slower there, or ATOM_DETERMINISTIC_DECODE asks for fixed ranges (False)."""
    from dataclasses import replace as dc_replace

    from atom_backend.catalog import platform_for

    case = Case([1, 1], [4000, 9000], hq=32, hk=8, d=128, dtype=torch.bfloat16)
    platform = dc_replace(platform_for("sm_90a", use_tables=False), decode_balanced=device_balanced)
    b = AtomMetadataBuilder.for_model(case.facts(), PlannerConfig(deterministic_decode=deterministic), "cpu",
                                      platform)
    assert b.build(0, case.common()).decode_balanced is want
