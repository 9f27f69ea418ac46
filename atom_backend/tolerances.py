"""Accuracy bounds of docs/design.md ("Correctness checks"), shared by every test and GPU check."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bound:
    rel: float  # ||out - ref|| / ||ref||
    max_abs: float


# fp32 accumulation over bf16 inputs; FP8 KV is judged on dequantised values with these too.
BF16 = Bound(rel=1e-2, max_abs=2e-2)
# docs/design.md bounds fp16 by its relative error; its max-abs bound is bf16's, never looser.
FP16 = Bound(rel=3e-3, max_abs=2e-2)
# float32 end to end (reference against reference-like code, CPU kernels under interpretation).
FP32 = Bound(rel=1e-5, max_abs=1e-4)

# FP8 compute (Q and P rounded to e4m3 on the way; K and V are already e4m3 in the cache, so the
# reference on the dequantised cache sees none of their rounding): docs/design.md "FP8 compute".
# rel: predicted ~0.026 (one e4m3 rounding of P, rms) to ~0.037 (plus Q's at unit-variance logits);
# max abs: P's rounding moves o_i by at most 2^-4 max|v| (all errors aligned), doubled for Q's.
FP8_COMPUTE_REL = 5e-2
FP8_COMPUTE_MAX_ABS_OF_V = 2.0 ** -3


def fp8_compute_bound(v_absmax: float) -> Bound:
    """The FP8-compute bound for outputs over values V with max |V| = v_absmax (dequantised)."""
    return Bound(rel=FP8_COMPUTE_REL, max_abs=FP8_COMPUTE_MAX_ABS_OF_V * float(v_absmax))


def fp8_compute_lse_bound(logit_absmax: float) -> Bound:
    """lse moves by sum_j p_j dx_j, at most max |dx_j| <= 2^-4 max |x_j| (Q's rounding)."""
    return Bound(rel=FP8_COMPUTE_REL, max_abs=2.0 ** -4 * float(logit_absmax))


_BY_DTYPE = {torch.bfloat16: BF16, torch.float16: FP16, torch.float32: FP32, torch.float64: FP32}


def bound_for(dtype) -> Bound:
    """The bound for outputs computed from inputs of this dtype (FP8 KV: pass the query dtype;
    FP8 compute: pass fp8_compute_bound(...), a Bound, which is returned as it is)."""
    return dtype if isinstance(dtype, Bound) else _BY_DTYPE[dtype]


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max abs error), computed in float64."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = r.norm().item()
    rel = (o - r).norm().item() / denom if denom > 0 else (o - r).norm().item()
    mx = (o - r).abs().max().item() if o.numel() else 0.0
    return rel, mx


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype, what: str = "output") -> None:
    """Fail on NaN anywhere, or on errors above docs/design.md's bound for `dtype` (or a Bound)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or poisoned rows?)"
    b = bound_for(dtype)
    rel, mx = errors(out, ref)
    assert rel <= b.rel and mx <= b.max_abs, f"{what}: rel={rel:.3e} (<= {b.rel}), max_abs={mx:.3e} (<= {b.max_abs})"


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, dtype, what: str = "lse") -> None:
    """-inf exactly where the reference has -inf (no visible key), close elsewhere."""
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    assert not torch.isnan(lse).any(), f"{what}: NaN"
    empty = torch.isinf(ref) & (ref < 0)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{what}: -inf rows differ from the reference"
    if (~empty).any():
        assert_close(lse[~empty], ref[~empty], dtype, what)
