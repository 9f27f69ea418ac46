// Split-KV combine (DESIGN.md "Split-KV") of one (query token, head) row, 4 consecutive dims, over
// splits s0, s0 + step, ...: m = max lse_s, sum = sum exp(lse_s - m), acc = sum exp(lse_s - m) o_s.
// Shared by combine.hip (its thread groups) and decode_mma.hip (the last CTA of a group).
// An empty split (lse -inf) weighs 0: its o is loaded (in bounds of the workspace) but never used,
// so no NaN of stale memory reaches acc. COHERENT: the partials were written by other CTAs of the
// same launch (loads bypass L1, see atom_device.h).
#pragma once
#include "atom_device.h"

namespace atom {

template <bool COHERENT>
ATOM_DEV void combine_splits4(const float* lse, i64 lse_stride, const float* o, i64 o_stride, i64 s0, i64 step,
                              i64 num_splits, float& m, float& sum, float (&acc)[4]) {
  auto ldf = [](const float* p) {
    if constexpr (COHERENT) return loadf_device(p);
    else return *p;
  };
  auto ld16 = [](const float* p) {
    if constexpr (COHERENT) return load16_device(p);
    else return load16(p);
  };
  m = neg_inf();
  sum = 0.f;
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll 4
  for (i64 s = s0; s < num_splits; s += step) m = fmax_(m, ldf(lse + s * lse_stride));
  if (m == neg_inf()) return;
#pragma unroll 4
  for (i64 s = s0; s < num_splits; s += step) {
    const float w = exp_(ldf(lse + s * lse_stride) - m);
    const u32x4 v = ld16(o + s * o_stride);
    if (w > 0.f) {
      acc[0] += w * u32_as_f32(v.x);
      acc[1] += w * u32_as_f32(v.y);
      acc[2] += w * u32_as_f32(v.z);
      acc[3] += w * u32_as_f32(v.w);
    }
    sum += w;
  }
}

}  // namespace atom
