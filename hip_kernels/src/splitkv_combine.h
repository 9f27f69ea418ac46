// Split-KV combine (docs/design.md "Split-KV") of one (query token, head) row, 4 consecutive dims, over
// splits s0, s0 + step, ...: m = max lse_s, sum = sum exp(lse_s - m), acc = sum exp(lse_s - m) o_s.
// Shared by combine.hip (its thread groups) and decode_mma.hip (the last CTA of a group).
// One pass with a running max, BATCH splits' lse and o loaded before any is used: a round trip
// per BATCH splits instead of one per split and per pass. An empty split (lse -inf) weighs 0:
// its o is loaded (in bounds of the workspace) but never used, so no NaN of stale memory reaches
// acc. COHERENT: the partials were written by other CTAs of the same launch (loads bypass L1,
// see atom_device.h).
#pragma once
#include "atom_device.h"

namespace atom {

template <bool COHERENT, int BATCH>
ATOM_DEV void combine_splits4(const float* lse, i64 lse_stride, const float* o, i64 o_stride, i64 s0, i64 step,
                              i64 num_splits, float& m, float& sum, float (&acc)[4]) {
  m = neg_inf();
  sum = 0.f;
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
  for (i64 s = s0; s < num_splits; s += BATCH * step) {
    float l[BATCH];
    u32x4 v[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const i64 sk = s + k * step;
      const bool in = sk < num_splits;
      if constexpr (COHERENT) {
        l[k] = in ? loadf_device(lse + sk * lse_stride) : neg_inf();
        v[k] = in ? load16_device(o + sk * o_stride) : u32x4{0u, 0u, 0u, 0u};
      } else {
        l[k] = in ? lse[sk * lse_stride] : neg_inf();
        v[k] = in ? load16(o + sk * o_stride) : u32x4{0u, 0u, 0u, 0u};
      }
    }
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const float mn = fmax_(m, l[k]);
      if (mn == neg_inf()) continue;  // every split so far empty
      const float a = exp_(m - mn), w = exp_(l[k] - mn);
      sum = sum * a + w;
      acc[0] = acc[0] * a + (w > 0.f ? w * u32_as_f32(v[k].x) : 0.f);
      acc[1] = acc[1] * a + (w > 0.f ? w * u32_as_f32(v[k].y) : 0.f);
      acc[2] = acc[2] * a + (w > 0.f ? w * u32_as_f32(v[k].z) : 0.f);
      acc[3] = acc[3] * a + (w > 0.f ? w * u32_as_f32(v[k].w) : 0.f);
      m = mn;
    }
  }
}

// docs/design.md's per-head sink logit, applied once after the combine: o *= sigmoid(lse - sink).
ATOM_DEV float sink_factor(float lse, const float* sinks, i64 h) {
  return sinks != nullptr ? 1.f / (1.f + exp_(sinks[h] - lse)) : 1.f;
}

// A combined row (m, sum, acc from combine_splits4) -> its output: acc becomes o with the sinks
// applied; returns the lse without the sinks (-inf and o = 0 where every split was empty).
ATOM_DEV float finish_combined4(float m, float sum, float (&acc)[4], const float* sinks, i64 h) {
  if (!(sum > 0.f)) {
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    return neg_inf();
  }
  const float lse = m + log_(sum);
  const float inv = sink_factor(lse, sinks, h) / sum;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] *= inv;
  return lse;
}

}  // namespace atom
