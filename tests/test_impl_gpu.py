"""The impl's GPU routes (hip split-KV decode + combine, hip gather + varlen prefill, Triton
unified) through the real builder and impl, against atom_backend.reference.

The GPU machine has no vLLM (TOOLCHAINS.md), so when vLLM is missing this module installs a
minimal stand-in for the few vLLM names our modules import (base classes and enums); every
line of atom_backend that runs here is the production code. Run: pytest -m gpu tests/test_impl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


from bench import _vllm  # noqa: E402  (the one stand-in; a no-op where vLLM is installed)

_vllm.install()

from atom_backend import reference as ref  # noqa: E402
from atom_backend.backend import split_kv_cache  # noqa: E402
from atom_backend.planner import PlannerConfig  # noqa: E402
from atom_backend.tolerances import assert_close  # noqa: E402
from tests.test_impl_cpu import LAYER, MIXED_CACHED, MIXED_NEW, Case, _builder, _impl, _reference  # noqa: E402

# These tests pin the routes of the threshold rules; cost routing has its own tests
# (tests/test_cost_model.py on the CPU, bench.trace on the GPU).
THRESHOLDS = PlannerConfig(cost_routing=False)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def _write(case: Case) -> None:
    """New K/V into the pages (vLLM's own Triton store does this in production)."""
    k_cache, v_cache = split_kv_cache(case.kv_cache, case.d)
    if case.fp8:
        k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        kn = (case.k_new.float() / LAYER._k_scale_float).to(torch.float8_e4m3fn)
        vn = (case.v_new.float() / LAYER._v_scale_float).to(torch.float8_e4m3fn)
    else:
        kn, vn = case.k_new, case.v_new
    bs = k_cache.shape[1]
    blk, off = case.slot_mapping // bs, case.slot_mapping % bs
    k_cache[blk, off] = kn
    v_cache[blk, off] = vn


def _forward(case, impl, md):
    _write(case)
    out = torch.full_like(case.q, float("nan"))
    impl.forward(LAYER, case.q, case.k_new, case.v_new, case.kv_cache, md, out)
    torch.cuda.synchronize()
    return out


@needs_cuda
@pytest.mark.parametrize("d,layout", [(64, "LBNHC"), (128, "LBHNC"), (128, "LBNHC")])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (24, True)])
def test_mixed_batch_on_compiled_kernels(d, layout, window, with_sinks):
    from atom_backend import gather as atom_gather
    from atom_backend.planner import Path

    case = Case(MIXED_NEW, MIXED_CACHED, d=d, dtype=torch.bfloat16, layout=layout, seed=d + window).to("cuda")
    sinks = torch.randn(case.hq, device="cuda") if with_sinks else None
    b = _builder(case.facts(has_sinks=with_sinks, window=window), THRESHOLDS, device="cuda")
    assert b.platform.varlen_kernel and b.platform.splitkv_kernel, b.platform
    md = b.build(0, case.common())
    assert md.plan.decode_path == Path.SPLITKV and md.decode_kernel == "hip"
    assert md.plan.varlen.tolist() == [0, 6] and md.plan.unified.tolist() == [2, 3]
    before = atom_gather.STATS["tokens"]
    out = _forward(case, _impl(case, window, 0.0, sinks), md)
    assert atom_gather.STATS["tokens"] - before == 105  # the varlen requests only
    assert not out.isnan().any()
    assert_close(out.float().cpu(), _reference(case, _impl(case, window, 0.0, sinks), sinks).float(), torch.bfloat16)


@needs_cuda
def test_fp8_cache_on_compiled_kernels():
    case = Case(MIXED_NEW, MIXED_CACHED, d=128, dtype=torch.bfloat16, fp8=True, seed=4).to("cuda")
    sinks = torch.randn(case.hq, device="cuda")
    md = _builder(case.facts(has_sinks=True), THRESHOLDS, device="cuda").build(0, case.common())
    impl = _impl(case, sinks=sinks)
    out = _forward(case, impl, md)
    assert_close(out.float().cpu(), _reference(case, impl, sinks).float(), torch.bfloat16)


@needs_cuda
def test_unsupported_head_dim_and_fp32_route_to_triton():
    from atom_backend.planner import Path, Reason

    case = Case(MIXED_NEW, MIXED_CACHED, d=32, dtype=torch.float32, seed=9).to("cuda")
    sinks = torch.randn(case.hq, device="cuda")
    md = _builder(case.facts(has_sinks=True), THRESHOLDS, device="cuda").build(0, case.common())
    assert md.plan.decode_path == Path.UNIFIED and md.decode_kernel == "triton"
    assert len(md.plan.varlen) == 0 and set(md.plan.unified_reasons) == {Reason.HEAD_DIM}
    impl = _impl(case, sinks=sinks)
    out = _forward(case, impl, md)
    assert_close(out.float().cpu(), _reference(case, impl, sinks).float(), torch.float32)
