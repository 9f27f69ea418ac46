// Rows of 16-bit values -> e4m3 (the platform's flavour) with one fp32 scale per row:
// x8 = round(x / s), s = max|x| / FP8_MAX (1 for an all-zero row), so that x ~= x8 * s.
// The FP8 prefill quantizes Q this way, one row per (token, head) (hip_kernels/quant.py).
//
// Defines: DTYPE (0 bf16, 1 fp16). One warp per row; a lane holds up to 2 chunks of 4 values
// (head_dim <= 256, a multiple of 4).
#include "atom_device.h"

#ifndef DTYPE
#define DTYPE 0
#endif

using namespace atom;

#if DTYPE == 0
typedef bf16_t in_t;
#else
typedef f16_t in_t;
#endif

#define QUANT_WARPS 8
#define QUANT_CHUNKS 2

#if ATOM_FP8_FNUZ
#define FP8_MAX 240.f
#else
#define FP8_MAX 448.f
#endif

// x [rows, heads, dim] with strides (elements) x_rs, x_hs; x8 [rows, heads, dim] contiguous;
// scale [rows, heads] fp32.
extern "C" __global__ void ATOM_LAUNCH_BOUNDS(QUANT_WARPS * ATOM_WARP_SIZE) atom_quantize_rows(
    u8* __restrict__ x8, float* __restrict__ scale, const u16* __restrict__ x, i64 rows, i64 heads, i64 dim,
    i64 x_rs, i64 x_hs) {
  const i64 row = (i64)bid_x() * QUANT_WARPS + (i64)(tid_x() / ATOM_WARP_SIZE);
  if (row >= rows * heads) return;
  const i64 t = row / heads, h = row - t * heads;
  const u16* src = x + t * x_rs + h * x_hs;
  const int chunks = (int)(dim / 4);
  const int lane = (int)lane_id();
  float v[QUANT_CHUNKS][4];
  float amax = 0.f;
#pragma unroll
  for (int c = 0; c < QUANT_CHUNKS; ++c) {
    const int ch = lane + c * ATOM_WARP_SIZE;
    if (ch < chunks) {
      const u32x2 w = load8(src + 4 * ch);
      v[c][0] = to_f32(in_t{}, (u16)(w.x & 0xffffu));
      v[c][1] = to_f32(in_t{}, (u16)(w.x >> 16));
      v[c][2] = to_f32(in_t{}, (u16)(w.y & 0xffffu));
      v[c][3] = to_f32(in_t{}, (u16)(w.y >> 16));
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmax_(amax, fabs_(v[c][i]));
    }
  }
  for (int o = ATOM_WARP_SIZE / 2; o > 0; o /= 2) amax = fmax_(amax, shfl_xor(amax, o));
  const float s = amax > 0.f ? amax / FP8_MAX : 1.f;
  const float inv = 1.f / s;
#pragma unroll
  for (int c = 0; c < QUANT_CHUNKS; ++c) {
    const int ch = lane + c * ATOM_WARP_SIZE;
    if (ch < chunks)
      *reinterpret_cast<u32*>(x8 + row * dim + 4 * ch) =
          f32x4_to_fp8x4(v[c][0] * inv, v[c][1] * inv, v[c][2] * inv, v[c][3] * inv);
  }
  if (lane == 0) scale[row] = s;
}
