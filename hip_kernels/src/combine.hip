// Split-KV combine (docs/design.md "Split-KV"): fp32 partials -> o in the output dtype, optional lse.
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
// Threads: 4 consecutive d of one (q, h) pair (16-byte loads of the partials) x `groups` split
// groups (a power of two, chosen by hip_kernels/combine.py): group g takes splits g, g + groups,
// ... Few pairs with many splits (one long request) then still spread their loads over many
// threads, one round trip per 8 splits of a group; the groups merge through shared memory.
#include "splitkv_combine.h"

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
    i64 out_row_stride, i64 out_head_stride, i64 groups) {  // elements
  __shared__ float sm_m[COMBINE_THREADS], sm_sum[COMBINE_THREADS];
  __shared__ u32x4 sm_acc[COMBINE_THREADS];
  const i64 tpp = head_dim / 4;        // threads per (q, h) pair and split group
  const i64 tpg = tpp * groups;        // threads per pair
  const i64 pairs_per_block = COMBINE_THREADS / tpg;
  const i64 t = tid_x();
  const i64 local = t / tpg;
  const i64 grp = (t - local * tpg) / tpp;
  const i64 d0 = (t - local * tpg - grp * tpp) * 4;
  const i64 pair = (i64)bid_x() * pairs_per_block + local;
  const bool live = local < pairs_per_block && pair < total_q * num_heads;
  const i64 split_stride_lse = total_q * num_heads;

  // This group's splits: max of their lse, then the weighted sum against it.
  float m = neg_inf();
  float sum = 0.f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (live)
    combine_splits4<false, 8>(lse_partial + pair, split_stride_lse, o_partial + pair * head_dim + d0,
                              split_stride_lse * head_dim, grp, groups, num_splits, m, sum, acc);
  if (groups > 1) {  // uniform: merge the groups of each pair into group 0
    sm_m[t] = m;
    sm_sum[t] = sum;
    sm_acc[t] = u32x4{f32_as_u32(acc[0]), f32_as_u32(acc[1]), f32_as_u32(acc[2]), f32_as_u32(acc[3])};
    sync_block();
    if (grp != 0) return;
    const i64 base = local * tpg + d0 / 4;
    m = neg_inf();
#pragma unroll 1
    for (i64 g = 0; g < groups; ++g) m = fmax_(m, sm_m[base + g * tpp]);
    sum = 0.f;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    if (m != neg_inf()) {
#pragma unroll 1
      for (i64 g = 0; g < groups; ++g) {
        const float mg = sm_m[base + g * tpp];
        if (mg == neg_inf()) continue;
        const float w = exp_(mg - m);
        const u32x4 v = sm_acc[base + g * tpp];
        sum += w * sm_sum[base + g * tpp];
        acc[0] += w * u32_as_f32(v.x);
        acc[1] += w * u32_as_f32(v.y);
        acc[2] += w * u32_as_f32(v.z);
        acc[3] += w * u32_as_f32(v.w);
      }
    }
  }
  if (!live) return;
  const i64 h = pair % num_heads, q = pair / num_heads;
  const float lse = finish_combined4(m, sum, acc, sinks, h);
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
