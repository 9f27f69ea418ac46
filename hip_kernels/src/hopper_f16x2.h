// f16x2 arithmetic of the Hopper kernel's softmax on f16 scores (S_F16), and exp2 by bit shifts.
#pragma once

#include "hopper_config.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
// f16x2 arithmetic of the S_F16 softmax (sm_90a).
namespace h2 {
ATOM_DEV u32 max(u32 a, u32 b) { u32 d; asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 fma(u32 a, u32 b, u32 c) { u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d; }
ATOM_DEV u32 add(u32 a, u32 b) { u32 d; asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 mul(u32 a, u32 b) { u32 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 exp2(u32 a) { u32 d; asm("ex2.approx.f16x2 %0, %1;" : "=r"(d) : "r"(a)); return d; }
// The low / high half in both (ptxas folds these into the f16x2 instruction's operand selects).
ATOM_DEV u32 lo_lo(u32 a) { u32 d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l};}" : "=r"(d) : "r"(a)); return d; }
ATOM_DEV u32 hi_hi(u32 a) { u32 d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h};}" : "=r"(d) : "r"(a)); return d; }
ATOM_DEV u32 pair(float lo, float hi) { u32 d; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); return d; }
// f16's finite range (a multiplier or an addend past it would be inf).
ATOM_DEV float in_range(float x) { return fmin_(fmax_(x, -65504.f), 65504.f); }
// kExpShift's f16 addend B - 2^F msc for the reference msc (log2 units), before its rounding to f16.
ATOM_DEV float shift_addend(float msc) { return in_range(kShiftBias - kShiftScale * msc); }
// 2^((t - B) / 2^F) per half with F mantissa bits (kExpShift above); 0 below t = kShiftBase.
ATOM_DEV u32 exp2_shifted(u32 t) {
  return (max(t, kShiftFloor * 0x10001u) << kShiftLeft) & (kShiftMask * 0x10001u);
}
ATOM_DEV float rcp(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
ATOM_DEV u32 splat(float x) { u32 d; asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(x)); return d; }
ATOM_DEV float lo(u32 a) { return f16_to_f32((u16)(a & 0xffffu)); }
ATOM_DEV float hi(u32 a) { return f16_to_f32((u16)(a >> 16)); }
// Two f16x2 pairs -> four e4m3 bytes (a's low, a's high, b's low, b's high), as f32x4_to_fp8x4.
ATOM_DEV u32 to_fp8x4(u32 a, u32 b) {
  u32 d;
  asm("{.reg .b16 x, y; cvt.rn.satfinite.e4m3x2.f16x2 x, %1; cvt.rn.satfinite.e4m3x2.f16x2 y, %2; mov.b32 %0, {x, y};}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// kDirectP: t's byte per half, at bits 0..7 and 16..23 (the bits around them are not read).
ATOM_DEV u32 bytes_of(u32 t) { return max(t, kShiftFloor * 0x10001u) >> (kShiftFrac - 3); }
// An f16x2 pair -> its two e4m3 bytes where bytes_of puts them.
ATOM_DEV u32 fp8_spread(u32 a) {
  u32 d;
  asm("{.reg .b16 x; .reg .b32 w; cvt.rn.satfinite.e4m3x2.f16x2 x, %1; mov.b32 w, {x, x}; prmt.b32 %0, w, 0, 0x4140;}"
      : "=r"(d) : "r"(a));
  return d;
}
// Two such pairs -> four e4m3 bytes (a's low, a's high, b's low, b's high), as to_fp8x4.
ATOM_DEV u32 pack_bytes(u32 a, u32 b) { u32 d; asm("prmt.b32 %0, %1, %2, 0x6420;" : "=r"(d) : "r"(a), "r"(b)); return d; }
}  // namespace h2
}  // namespace atom_prefill
#endif
