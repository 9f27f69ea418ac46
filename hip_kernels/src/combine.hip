// Split-KV combine (DESIGN.md "Split-KV"): fp32 partials -> o in the output dtype, optional lse.
//
//   lse = log(sum_s exp(lse_s)),  o = sum_s exp(lse_s - lse) * o_s
// Splits with lse_s = -inf weigh 0; all -inf gives o = 0, lse = -inf. Sinks (optional, per head,
// fp32 logits) are applied once after the combine: o *= sigmoid(lse - sink); lse_out stays
// without the sink.
//
// Defines: COMBINE_OUT  1 bf16, 2 fp16, 3 fp32.
// Layout: o_partial [S, total_q, H, D] fp32 contiguous, lse_partial [S, total_q, H] fp32
// contiguous; out [total_q, H, D] with row / head strides (last dim contiguous); lse_out
// [total_q, H] contiguous or null; sinks [H] or null.
// Each thread owns 4 consecutive d of one (q, h) pair: 16-byte loads of the partials.
#include "atom_device.h"

#ifndef COMBINE_OUT
#define COMBINE_OUT 1
#endif
#define COMBINE_THREADS 256

using namespace atom;

extern "C" __global__ void ATOM_LAUNCH_BOUNDS(COMBINE_THREADS) atom_combine_splits(
    u8* __restrict__ out, float* __restrict__ lse_out,
    const float* __restrict__ o_partial, const float* __restrict__ lse_partial,
    const float* __restrict__ sinks,
    i64 num_splits, i64 total_q, i64 num_heads, i64 head_dim,
    i64 out_row_stride, i64 out_head_stride) {  // elements
  const i64 tpp = head_dim / 4;  // threads per (q, h) pair
  const i64 pairs_per_block = COMBINE_THREADS / tpp;
  const i64 local = tid_x() / tpp;
  const i64 pair = (i64)bid_x() * pairs_per_block + local;
  const i64 d0 = (i64)(tid_x() - local * tpp) * 4;
  if (local >= pairs_per_block || pair >= total_q * num_heads) return;
  const i64 q = pair / num_heads, h = pair - q * num_heads;
  const i64 split_stride_lse = total_q * num_heads;

  // Few (q, h) pairs with many splits (one long request) leave few threads, each walking every
  // split: unrolled loops with unconditional loads keep 4 splits' loads in flight per thread
  // (8 spills scalar registers on gfx942).
  float m = neg_inf();
#pragma unroll 4
  for (i64 s = 0; s < num_splits; ++s) m = fmax_(m, lse_partial[s * split_stride_lse + pair]);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float lse = neg_inf();
  if (m != neg_inf()) {
    float sum = 0.f;
#pragma unroll 4
    for (i64 s = 0; s < num_splits; ++s) {
      const float l = lse_partial[s * split_stride_lse + pair];
      const float w = exp_(l - m);
      // an empty split (lse -inf, w = 0) may leave its o_s unwritten: loaded (in bounds of the
      // workspace) but never used, so no NaN of stale memory reaches acc
      const u32x4 v = load16(o_partial + (s * split_stride_lse + pair) * head_dim + d0);
      if (w > 0.f) {
        acc[0] += w * u32_as_f32(v.x);
        acc[1] += w * u32_as_f32(v.y);
        acc[2] += w * u32_as_f32(v.z);
        acc[3] += w * u32_as_f32(v.w);
      }
      sum += w;
    }
    lse = m + log_(sum);
    float inv = 1.f / sum;
    if (sinks) inv *= 1.f / (1.f + exp_(sinks[h] - lse));  // sigmoid(lse - sink)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] *= inv;
  }
  const i64 o_off = q * out_row_stride + h * out_head_stride + d0;
#if COMBINE_OUT == 3
  store16(reinterpret_cast<float*>(out) + o_off,
          u32x4{f32_as_u32(acc[0]), f32_as_u32(acc[1]), f32_as_u32(acc[2]), f32_as_u32(acc[3])});
#elif COMBINE_OUT == 2
  store8(reinterpret_cast<u16*>(out) + o_off, u32x2{pack_f16x2(acc[0], acc[1]), pack_f16x2(acc[2], acc[3])});
#else
  store8(reinterpret_cast<u16*>(out) + o_off, u32x2{pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3])});
#endif
  if (lse_out && d0 == 0) lse_out[pair] = lse;
}
