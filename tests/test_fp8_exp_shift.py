"""The Hopper FP8 kernel's exp2 by bit shifts (kExpShift, f16 scores): a numpy model of its f16x2 steps,
against the error terms docs/fp8.md states for it, and tied to the kernel's constants."""

from pathlib import Path

import numpy as np
import pytest

SRC_DIR = Path(__file__).resolve().parents[1] / "hip_kernels" / "src"
# the kernel's constants and its f16x2 helpers
SOURCES = ("hopper_config.h", "hopper_f16x2.h")


def shift_constants(frac: int, exp: int = 15, direct: bool = False) -> dict:
    """The bias, the clamp (f16 bits), the shift and the mask of `h2::exp2_shifted` with `frac` fraction bits
    (exp: the f16 P's exponent for x = 0, 15 or kDirectP's 15 - kPLazy; direct: kDirectP's t in [1024,
    2048)), as the kernel's constexprs compute them (the test below checks that the source still has
    those lines)."""
    base = 1024 if direct else 32 << frac
    return {"frac": frac, "scale": float(1 << frac), "bias": float(base + exp * (1 << frac) - (2 if frac == 5 else 0)),
            "clamp": (25 if direct else 20 + frac) << 10, "shift": 10 - frac if direct else 5,
            "mask": 0x7C00 | (((1 << frac) - 1) << (10 - frac))}


def test_model_matches_kernel_source():
    src = "".join((SRC_DIR / name).read_text() for name in SOURCES)
    for line in ("constexpr int kShiftFrac = kGroupScales ? 5 : 3;",
                 "constexpr float kShiftScale = float(1 << kShiftFrac);",
                 "constexpr int kShiftExp = kDirectP ? 15 - kPLazy : 15;",
                 "constexpr int kShiftBase = kDirectP ? 1024 : 32 << kShiftFrac;",
                 "constexpr float kShiftBias = float(kShiftBase + kShiftExp * (1 << kShiftFrac) - (kShiftFrac == 5 ? 2 : 0));",
                 "constexpr u32 kShiftFloor = (u32)(kDirectP ? 25 : 20 + kShiftFrac) << 10;",
                 "constexpr int kShiftLeft = kDirectP ? 10 - kShiftFrac : 5;",
                 "constexpr float kDirectMean = (kShiftFrac == 5 ? 0.96440197f : 1.04035904f) * float(1 << (8 - kPLazy));",
                 "constexpr float kDirectK = kShiftFrac == 5 ? 247.743254f : 256.f;",
                 "enum : int { kPLazy = 5 };",
                 "ATOM_DEV u32 bytes_of(u32 t) { return max(t, kShiftFloor * 0x10001u) >> (kShiftFrac - 3); }",
                 "constexpr u32 kShiftMask = 0x7C00u | (((1u << kShiftFrac) - 1u) << (10 - kShiftFrac));",
                 "return (max(t, kShiftFloor * 0x10001u) << kShiftLeft) & (kShiftMask * 0x10001u);"):
        assert line in src, f"exp2_shifted's constants changed: update this model ({line})"


def shifted_exp2(s: np.ndarray, mul: float, nb: np.ndarray, k: dict) -> np.ndarray:
    """P of the kernel's S_F16 softmax (kExpShift): t = fma(s, mul, nb) rounded once to f16 (the
    HFMA2), clamped below (HMNMX2), then shifted and masked as one 32-bit word of two halves."""
    t = (s.astype(np.float64) * np.float64(np.float16(mul)) + nb.astype(np.float64)).astype(np.float16)
    bits = t.view(np.uint16).astype(np.uint32)
    lo, hi = bits[0::2], bits[1::2]
    clamp = k["clamp"] & 0xFFFF
    as_f16 = lambda b: b.astype(np.uint16).view(np.float16)
    lo = np.where(as_f16(lo) < as_f16(np.uint32(clamp)), clamp, lo)  # max.f16x2 (NaN: the other operand)
    hi = np.where(as_f16(hi) < as_f16(np.uint32(clamp)), clamp, hi)
    lo = np.where(np.isnan(as_f16(lo)), clamp, lo)
    hi = np.where(np.isnan(as_f16(hi)), clamp, hi)
    w = ((lo | (hi << 16)) << k["shift"]) & (k["mask"] * 0x10001) & 0xFFFFFFFF
    out = np.empty(s.shape, np.float32)
    out[0::2] = as_f16(w & 0xFFFF)
    out[1::2] = as_f16(w >> 16)
    return out


def _case(x: np.ndarray, rng, k):
    """Scores and per-element references such that the kernel's argument is about x (log2 units), and
    the argument exactly as the f16 addend gives it."""
    a = 0.127  # the softmax scale of d128 in log2 units
    s = (rng.normal(0, 1, x.size) * 30).astype(np.float16)
    msc = (s.astype(np.float64) * a - x).astype(np.float32)
    nb = (np.float32(k["bias"]) - k["scale"] * msc).astype(np.float16)
    mul = k["scale"] * a
    x_eff = (s.astype(np.float64) * np.float64(np.float16(mul)) + nb.astype(np.float64) - k["bias"]) / k["scale"]
    return s, mul, nb, x_eff


@pytest.mark.parametrize("frac,lo,hi,rms", [(3, -0.0731, 0.0723, (0.030, 0.034)), (5, -0.0528, 0.0276, (0.017, 0.021))])
def test_shifted_exp2_error_and_range(frac, lo, hi, rms):
    """docs/fp8.md's terms: F = 3 (per tensor) on e4m3's grid, relative error -7.3%..+7.2% (rms 0.032);
    F = 5 (per 16 keys, rounded to e4m3 after V's factor) -5.3%..+2.8% (rms 0.019); for 2^x >= 2^-13.9
    (F = 5's 2^(-1/16) makes 2^-14 an f16 subnormal); 0 below x = -15; at most 2^9 for x < 9 (the lazy
    reference keeps x <= 8)."""
    k = shift_constants(frac)
    rng = np.random.default_rng(7)
    x = rng.uniform(-20.0, 8.99, 1 << 18)
    s, mul, nb, x_eff = _case(x, rng, k)
    p = shifted_exp2(s, mul, nb, k)
    ok = x_eff > -13.9
    rel = p[ok] / np.exp2(x_eff[ok]) - 1
    assert lo <= rel.min() and rel.max() <= hi
    assert rms[0] < np.sqrt(np.mean(rel ** 2)) < rms[1]
    assert abs(rel.mean()) < 0.01
    assert np.all(p[x_eff < -15.0] == 0)
    assert np.all(p >= 0) and p.max() <= 512
    bits = p.astype(np.float16).view(np.uint16)
    assert np.all(bits & ~np.uint16(k["mask"] | 0x8000) == 0)  # F mantissa bits (F = 3: e4m3's grid)


@pytest.mark.parametrize("frac", [3, 5])
def test_shifted_exp2_masked_and_nan_keys_are_zero(frac):
    """A masked key's -inf (or a NaN) gives P = 0 in either half, whatever the other half holds."""
    k = shift_constants(frac)
    s = np.array([-np.inf, 3.0, 2.0, -np.inf, np.nan, 1.0], np.float16)
    nb = np.full(s.size, k["bias"], np.float16)
    p = shifted_exp2(s, 1.0, nb, k)
    assert p[0] == 0 and p[3] == 0 and p[4] == 0
    np.testing.assert_allclose(p[[1, 2, 5]], np.exp2(s[[1, 2, 5]].astype(np.float64) / k["scale"]), rtol=0.08)


@pytest.mark.parametrize("frac", [3, 5])
def test_snapped_reference_round_trips(frac):
    """move_reference's snap: the reference taken as the f16 addend's value (msc = (B - f16(B - 2^F msc)) /
    2^F), kept as m_run = msc / a, gives the same addend when the next tile rebuilds it from m_run * a
    (fp32), so P, the rescales and lse use one reference; and the snap moves it by at most half the
    addend's f16 step (in log2 units), inside the addend's range."""
    k = shift_constants(frac)
    rng = np.random.default_rng(11)
    msc = rng.uniform(-1500.0, 1500.0, 1 << 16).astype(np.float32)
    a = rng.uniform(0.01, 3.0, msc.size).astype(np.float32)
    bias, scale = np.float32(k["bias"]), np.float32(k["scale"])
    addend = (bias - scale * msc).astype(np.float16)
    snapped = ((bias - addend.astype(np.float32)) / scale).astype(np.float32)
    m_run = (snapped / a).astype(np.float32)
    again = (bias - scale * (m_run * a).astype(np.float32)).astype(np.float16)
    assert np.mean(again == addend) > 0.999
    step = np.spacing(np.abs(addend).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(again.astype(np.float32) - addend.astype(np.float32)) <= step)
    assert np.all(np.abs(snapped - msc) <= step / 2 / scale + 1e-6)


# kDirectP: P's e4m3 bytes from t's mantissa (h2::bytes_of), the kernel's constants per F (3: per tensor,
# 5: per 16 keys): kDirectMean at L = 8 (times 2^(8 - L), L = kPLazy), kDirectK, and x's limit for bytes <= 126
DIRECT = {3: (1.04035904, 256.0, 0.81), 5: (0.96440197, 247.743254, 0.92)}


def _clamped_words(s, mul, nb, k):
    """t = fma(s, mul, nb) rounded to f16, clamped below at t's binade (NaN too), as 32-bit words of two halves."""
    t = (s.astype(np.float64) * np.float64(np.float16(mul)) + nb.astype(np.float64)).astype(np.float16)
    clamp = np.float16(np.uint16(k["clamp"]).view(np.float16))
    t = np.where(np.isnan(t) | (t < clamp), clamp, t).astype(np.float16)
    bits = t.view(np.uint16).astype(np.uint32)
    return bits[0::2] | (bits[1::2] << 16)


def direct_bytes(s, mul, nb, k):
    """The bytes h2::bytes_of leaves at bits 0..7 and 16..23 of each word (>> F - 3 of the whole word)."""
    w = _clamped_words(s, mul, nb, k) >> (k["frac"] - 3)
    out = np.empty(s.shape, np.uint8)
    out[0::2] = w & 0xFF
    out[1::2] = (w >> 16) & 0xFF
    return out


def e4m3(b):
    """e4m3 bytes -> values (0x7F / 0xFF are NaN)."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return np.where(b & 0x80, -v, v)


@pytest.mark.parametrize("frac", [3, 5])
@pytest.mark.parametrize("lazy", [5])
def test_direct_bytes_error_and_range(frac, lazy):
    """docs/fp8.md's kDirectP terms: P encoded as 2^x 2^(8 - L) kDirectMean, relative error -8.0%..+6.6%
    about that scale (rms 0.031, the earlier per-tensor form's); e4m3 bytes without NaN or sign for
    x < L + 0.81 (F = 3) / 0.92 (F = 5; the lazy reference keeps x <= L plus <= 0.2); 0 below x = L - 14.8,
    normal bytes from x = L - 13.9."""
    mean, _, top = DIRECT[frac]
    k = shift_constants(frac, 15 - lazy, direct=True)
    rng = np.random.default_rng(3)
    x = rng.uniform(lazy - 20.0, lazy + top + 0.1, 1 << 18)
    s, mul, nb, x_eff = _case(x, rng, k)
    b = direct_bytes(s, mul, nb, k)
    assert b[x_eff < lazy + top].max() <= 0x7E and b[x_eff > lazy + top + 0.05].min() >= 0x7F
    p = e4m3(b)
    ok = (x_eff > lazy - 13.9) & (x_eff < lazy + top)
    rel = p[ok] / (np.exp2(x_eff[ok]) * mean * 2.0 ** (8 - lazy)) - 1
    assert -0.081 <= rel.min() and rel.max() <= 0.066
    assert 0.029 < np.sqrt(np.mean(rel ** 2)) < 0.034
    assert abs(rel.mean()) < 0.003
    assert np.all(b[ok] >= 8)
    assert np.all(p[x_eff < lazy - 14.95] == 0)


@pytest.mark.parametrize("frac", [3, 5])
def test_direct_bytes_masked_and_nan_keys_are_zero(frac):
    """A masked key's -inf (or a NaN) gives byte 0 in either half."""
    k = shift_constants(frac, 10, direct=True)
    s = np.array([-np.inf, 3.0, 2.0, -np.inf, np.nan, 1.0], np.float16)
    b = direct_bytes(s, 1.0, np.full(s.size, k["bias"], np.float16), k)
    assert b[0] == 0 and b[3] == 0 and b[4] == 0
    np.testing.assert_allclose(e4m3(b[[1, 2, 5]]), np.exp2(s[[1, 2, 5]].astype(np.float64) / k["scale"]) * DIRECT[frac][0] * 8,
                               rtol=0.09)


@pytest.mark.parametrize("frac", [3, 5])
def test_direct_constants_and_fallback_scale(frac):
    """kDirectMean and kDirectK as the model gives them (x's fraction uniform); the warp that takes the
    f16 P (exp2_shifted on the same t) times kDirectK has the bytes' scale (F = 3: the same values), so
    tiles of either path add into one O and l."""
    lazy = 5
    mean, kd, _ = DIRECT[frac]
    k = shift_constants(frac, 15 - lazy, direct=True)
    x = (np.arange(1 << 20) + 0.5) / (1 << 20) * 4 - 2
    t = np.round(k["scale"] * x + k["bias"])  # fma's rounding; in [1024, 2048) here
    byte = np.floor((t - 1024) / 2 ** (frac - 3))
    direct = e4m3(byte.astype(np.uint8)) / np.exp2(x)
    np.testing.assert_allclose(direct.mean(), mean * 2.0 ** (8 - lazy), rtol=2e-6)
    mant = (t - 1024) * 2 ** (5 - frac)  # the f16 P's bits: 32 a unit of x after the shift
    f16 = 2.0 ** (np.floor(mant / 32) - 15) * (1 + np.floor(mant % 32 / 2 ** (5 - frac)) / 2 ** frac) / np.exp2(x)
    np.testing.assert_allclose(direct.mean() / f16.mean(), kd, rtol=2e-6)
    # the fallback as the kernel runs it: exp2_shifted's f16 P, times kDirectK in f16, rounded to e4m3
    rng = np.random.default_rng(5)
    xs = rng.uniform(-8.0, lazy, 1 << 16)
    s, mul, nb, x_eff = _case(xs, rng, k)
    p16 = shifted_exp2(s, mul, nb, k).astype(np.float16) * np.float16(kd)
    fb = p16.astype(np.float32)
    e = np.floor(np.log2(fb))
    fb = np.round(fb / 2.0 ** e * 8) / 8 * 2.0 ** e  # e4m3's rounding (normals here)
    pd = e4m3(direct_bytes(s, mul, nb, k))
    ratio = np.mean(fb / np.exp2(x_eff)) / np.mean(pd / np.exp2(x_eff))
    assert abs(ratio - 1) < 0.005
    if frac == 3:
        np.testing.assert_array_equal(fb, pd)
