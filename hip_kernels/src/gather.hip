// Paged KV cache -> packed K and V [total_kv, num_heads, head_dim] for the varlen path.
//
// Row r of the output belongs to packed sequence i with cu_seqlens_k[i] <= r < cu_seqlens_k[i+1]
// and is key position t = r - cu_seqlens_k[i] of request b = seq_ids[i] (or i when seq_ids is
// null). Its page comes from the vLLM block table (block_table[b, t / page_size]) or from the
// SGLang page list (page_indices[indptr[b] + t / page_size]); slot t % page_size.
//
// Defines (the Python side lists every combination in hip_kernels.gather.variants()):
//   GATHER_LAYOUT  0: vLLM block table, 1: SGLang indptr / page indices
//   GATHER_FP8     0: 16-bit cache copied as bytes, 1: e4m3 cache dequantised
//   GATHER_OUT     output dtype of the fp8 path: 1 bf16, 2 fp16
//   GATHER_SCALE   fp8 only: 1 per-tensor scalar, 2 per-page-per-head descale [num_blocks, H]
//
// Work split: a block owns `rows` consecutive output rows. It first resolves each row's page
// once into shared memory (the lookups are the only dependent loads), then streams chunks
// of K and V (16-byte stores) with several loads in flight per thread before any store. Grid size comes
// from the host-known total_kv: no device-to-host sync anywhere.
#include "atom_device.h"
#include "fp8_pack.h"

#ifndef GATHER_LAYOUT
#define GATHER_LAYOUT 0
#endif
#ifndef GATHER_FP8
#define GATHER_FP8 0
#endif
#ifndef GATHER_OUT
#define GATHER_OUT 1
#endif
#ifndef GATHER_SCALE
#define GATHER_SCALE 1
#endif

#define GATHER_THREADS 256
#define GATHER_MAX_ROWS 256

using namespace atom;

#if GATHER_FP8
#if GATHER_OUT == 1
typedef bf16_t out_t;
#else
typedef f16_t out_t;
#endif
// 8 fp8 values * scale -> 8 outputs: one full 16-byte store. (Loading 16 fp8 and storing two
// half-strided 16-byte pieces per lane measured 60-69% of copy bandwidth on H100, vs 94% for
// the 16-bit copy: every warp store then covered only half of each 32-byte sector.)
ATOM_DEV u32x4 dequant8(const u32x2& in, float s) {
  float f[8];
  fp8x4_to_f32x4(in.x, f + 0);
  fp8x4_to_f32x4(in.y, f + 4);
  out_t o;
  return u32x4{pack2(o, f[0] * s, f[1] * s), pack2(o, f[2] * s, f[3] * s), pack2(o, f[4] * s, f[5] * s),
               pack2(o, f[6] * s, f[7] * s)};
}
typedef u32x2 in_vec;
ATOM_DEV in_vec load_in(const void* p) { return load8_stream(p); }
#define IN_BYTES 1
#define IN_CHUNK 8
#define GATHER_UNROLL 8
#else
typedef u32x4 in_vec;
ATOM_DEV in_vec load_in(const void* p) { return load16_stream(p); }
#define IN_BYTES 2
#define IN_CHUNK 16
#define GATHER_UNROLL 4
#endif
#define OUT_BYTES 2

// Cache page of sequence b's logical page lp: vLLM's 2D block table (row stride table_stride), or
// SGLang's 1D page list with per-sequence starts (indptr).
ATOM_DEV i64 page_of(const i32* __restrict__ table, const i32* __restrict__ indptr, i64 b, i64 table_stride, i64 lp) {
#if GATHER_LAYOUT == 0
  (void)indptr;
  return table[b * table_stride + lp];
#else
  (void)table_stride;
  return table[(i64)indptr[b] + lp];
#endif
}

extern "C" __global__ void ATOM_LAUNCH_BOUNDS(GATHER_THREADS) atom_gather_kv(
    u8* __restrict__ k_out, u8* __restrict__ v_out,                // [total_kv, H, D], contiguous
    const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,  // [num_blocks, page, H, D], strided
    const i32* __restrict__ cu_seqlens_k,                          // [num_seqs + 1]
    const i32* __restrict__ seq_ids,                               // [num_seqs] or null
    const i32* __restrict__ table,                                 // block_table / page_indices
    const i32* __restrict__ indptr,                                // SGLang kv_indptr (vLLM: null)
    const float* __restrict__ k_scale_ptr, const float* __restrict__ v_scale_ptr,
    float k_scale_val, float v_scale_val,
    i64 total_kv, i64 num_seqs, i64 table_stride, i64 page_size,
    i64 page_stride, i64 slot_stride, i64 head_stride,  // cache strides, elements
    i64 num_heads, i64 head_dim, i64 rows_per_block) {
  __shared__ i64 s_off[GATHER_MAX_ROWS];  // element offset of the row's (page, slot)
#if GATHER_FP8 && GATHER_SCALE == 2
  __shared__ i32 s_page[GATHER_MAX_ROWS];
#endif
  const i64 row0 = (i64)bid_x() * rows_per_block;
  const i32 rows = (i32)(total_kv - row0 < rows_per_block ? total_kv - row0 : rows_per_block);

  for (i32 r = (i32)tid_x(); r < rows; r += GATHER_THREADS) {
    const i64 row = row0 + r;
    const i32 i = find_seq(cu_seqlens_k, (i32)num_seqs, row);
    const i64 b = seq_ids ? (i64)seq_ids[i] : (i64)i;
    const i64 t = row - cu_seqlens_k[i];
    const i64 lp = t / page_size;
    const i64 page = page_of(table, indptr, b, table_stride, lp);
    s_off[r] = page_offset(page, t - lp * page_size, 0, page_stride, slot_stride, 0);
#if GATHER_FP8 && GATHER_SCALE == 2
    s_page[r] = (i32)page;
#endif
  }
  sync_block();

  // A chunk is IN_CHUNK input bytes and 16 output bytes; a row has num_heads * cph chunks.
  const u32 cph = (u32)(head_dim * IN_BYTES / IN_CHUNK);
  const u32 cpr = (u32)num_heads * cph;
  const u32 items = (u32)rows * cpr;
#if GATHER_FP8 && GATHER_SCALE == 1
  const float ks = k_scale_ptr ? *k_scale_ptr : k_scale_val;
  const float vs = v_scale_ptr ? *v_scale_ptr : v_scale_val;
#endif

  for (u32 base = tid_x(); base < items; base += GATHER_THREADS * GATHER_UNROLL) {
    in_vec kin[GATHER_UNROLL], vin[GATHER_UNROLL];
    i64 dst[GATHER_UNROLL];
#if GATHER_FP8 && GATHER_SCALE == 2
    float ksu[GATHER_UNROLL], vsu[GATHER_UNROLL];  // loaded with the data: one round trip
#endif
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; ++u) {
      const u32 it = base + u * GATHER_THREADS;
      if (it < items) {
        const u32 r = it / cpr, c = it - r * cpr;
        const u32 h = c / cph, cc = c - h * cph;
        const i64 src = (s_off[r] + (i64)h * head_stride) * IN_BYTES + (i64)cc * IN_CHUNK;
        kin[u] = load_in(k_cache + src);
        vin[u] = load_in(v_cache + src);
        dst[u] = (((row0 + r) * num_heads + h) * head_dim) * OUT_BYTES + (i64)cc * 16;
#if GATHER_FP8 && GATHER_SCALE == 2
        const i64 sidx = (i64)s_page[r] * num_heads + h;
        ksu[u] = k_scale_ptr[sidx];
        vsu[u] = v_scale_ptr[sidx];
#endif
      }
    }
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; ++u) {
      const u32 it = base + u * GATHER_THREADS;
      if (it < items) {
#if GATHER_FP8
#if GATHER_SCALE == 2
        const float ks = ksu[u], vs = vsu[u];
#endif
        store16_stream(k_out + dst[u], dequant8(kin[u], ks));
        store16_stream(v_out + dst[u], dequant8(vin[u], vs));
#else
        store16_stream(k_out + dst[u], kin[u]);
        store16_stream(v_out + dst[u], vin[u]);
#endif
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 compute layout (hip_kernels.gather.gather_kv_fp8, src/fp8_pack.h), read by the FP8 prefill
// bodies: the e4m3 bytes as they are, V transposed in the key order of this target's P operand.
// One block of 256 threads per 128 rows (the rows of one request, or padding) and KV head (grid
// y): every K and V load of the block is in flight before its first store, and each V^T store of a
// warp writes whole 128-byte rows (1.24-1.52x blocks of all heads on H200, which staged one V head
// after another and stored 16 bytes to each of 32 rows: docs/perf/prefill.md).
// ---------------------------------------------------------------------------------------------
#define FP8_ROWS kFp8Align

#if GATHER_SCALE == 2
// The largest V scale of head h over sequence b's logical pages lp0..lp1, `stride` threads (this one
// the t-th) striding over them; each warp's lanes end with their warp's maximum (0 without a page).
ATOM_DEV float warp_v_scale_max(const i32* __restrict__ table, const i32* __restrict__ indptr,
                                const float* __restrict__ v_descale, i64 b, i64 table_stride, i64 num_heads, i64 h,
                                i64 lp0, i64 lp1, int t, int stride) {
  float m = 0.f;
  for (i64 lp = lp0 + t; lp <= lp1; lp += stride)
    m = fmax_(m, v_descale[page_of(table, indptr, b, table_stride, lp) * num_heads + h]);
  for (int o = ATOM_WARP_SIZE / 2; o > 0; o /= 2) m = fmax_(m, shfl_xor(m, o));
  return m;
}
#endif

extern "C" __global__ void ATOM_LAUNCH_BOUNDS(GATHER_THREADS) atom_gather_kv_fp8(
    u8* __restrict__ k8, u8* __restrict__ vt8, float* __restrict__ kvs, float* __restrict__ v_max,
    const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const i32* __restrict__ cu_seqlens_k,   // [num_seqs + 1] keys
    const i32* __restrict__ cu_kp,          // [num_seqs + 1] first rows, multiples of 128
    const i32* __restrict__ seq_ids, const i32* __restrict__ table, const i32* __restrict__ indptr,
    const float* __restrict__ k_descale, const float* __restrict__ v_descale,  // [num_blocks, H] (GATHER_SCALE 2)
    const float* __restrict__ v_ref,        // [num_seqs, H] (GATHER_SCALE 2): atom_fp8_v_ref's, or null (below)
    i64 total_pad, i64 num_seqs, i64 table_stride, i64 page_size,
    i64 page_stride, i64 slot_stride, i64 head_stride, i64 num_heads, i64 head_dim) {
  __shared__ i64 s_off[FP8_ROWS];  // byte offset of the row's (page, slot); -1: padding
  __shared__ u32x4 s_v16[FP8_ROWS * 256 / 16];  // the head's V rows (vidx), 16-byte aligned
  u32* s_v = reinterpret_cast<u32*>(s_v16);
  const i64 row0 = (i64)bid_x() * FP8_ROWS, h = (i64)bid_y();
  const int tid = (int)tid_x();
#if GATHER_SCALE == 2
  __shared__ float s_ks[FP8_ROWS], s_vs[FP8_ROWS];  // the rows' K and V scales (0: padding)
  __shared__ float s_ref[(GATHER_THREADS - FP8_ROWS) / ATOM_WARP_SIZE];
  __shared__ i32 s_seq;  // the block's request
#endif
  // The first half of the block resolves its rows' pages (and reads their scales); the second half
  // meanwhile, per page without v_ref, takes the request's largest V scale of head h from all of the
  // request's pages (the host passes null only for requests of few pages: FP8_INLINE_REF_PAGES), which
  // saves the pre-pass and its zeroed buffer: two launches, ~15 us of a 16k-key batch on H100. These
  // are the block's dependent loads: in two halves side by side, its latency before the copies is one
  // chain's.
  if (tid < FP8_ROWS) {
    const i64 row = row0 + tid;
    const i32 i = find_seq(cu_kp, (i32)num_seqs, row);
    const i64 t = row - cu_kp[i];
    i64 off = -1;
#if GATHER_SCALE == 2
    float ks = 0.f, vs = 0.f;
#endif
    if (t < (i64)(cu_seqlens_k[i + 1] - cu_seqlens_k[i])) {
      const i64 b = seq_ids ? (i64)seq_ids[i] : (i64)i;
      const i64 lp = t / page_size;
      const i64 page = page_of(table, indptr, b, table_stride, lp);
      off = page_offset(page, t - lp * page_size, 0, page_stride, slot_stride, 0);
#if GATHER_SCALE == 2
      ks = k_descale[page * num_heads + h];
      vs = v_descale[page * num_heads + h];
#endif
    }
    s_off[tid] = off;
#if GATHER_SCALE == 2
    s_ks[tid] = ks;
    s_vs[tid] = vs;
    if (tid == 0) s_seq = i;
#endif
  }
#if GATHER_SCALE == 2
  else if (v_ref == nullptr) {
    const i32 i = find_seq(cu_kp, (i32)num_seqs, row0);
    const i64 b = seq_ids ? (i64)seq_ids[i] : (i64)i;
    const i64 pages = ((i64)(cu_seqlens_k[i + 1] - cu_seqlens_k[i]) + page_size - 1) / page_size;
    const float m = warp_v_scale_max(table, indptr, v_descale, b, table_stride, num_heads, h, 0, pages - 1,
                                     tid - FP8_ROWS, GATHER_THREADS - FP8_ROWS);
    if (lane_id() == 0) s_ref[(tid - FP8_ROWS) / ATOM_WARP_SIZE] = m;
  }
#endif
  sync_block();
#if GATHER_SCALE == 2
  // O's unit in the FP8 bodies (atom_fp8_v_ref): the request's largest V scale of the head (0: 1).
  float ref_h = 0.f;
  if (v_ref != nullptr) {
    ref_h = v_ref[(i64)s_seq * num_heads + h];
  } else {
#pragma unroll
    for (int w = 0; w < (GATHER_THREADS - FP8_ROWS) / ATOM_WARP_SIZE; ++w) ref_h = fmax_(ref_h, s_ref[w]);
  }
  const float ref = ref_h > 0.f ? ref_h : 1.f;
  const bool groups = page_size % 16 == 0;  // per_page16 (as gather_kv_fp8 names it): the group block
  // A row's V factor (its scale over ref); per_page16 (src/fp8_pack.h) f = 2^-e f' with f' in (1/2, 1]:
  // s_vf holds f', s_vq the bytes' multiplier 2^-e (1: as they are; 0 for a zero or padding scale)
  __shared__ float s_vf[FP8_ROWS], s_vq[FP8_ROWS];
  if (tid < FP8_ROWS) {
    const float f = s_vs[tid] / ref;
    float fv = f, q = 1.f;
    if (groups) {  // f in [0, 1]: from its bits (a subnormal f, values under 2^-117 of O's unit, as 0)
      const u32 b = f32_as_u32(f), E = (b >> 23) & 0xffu, M = b & 0x7fffffu;
      fv = E == 0u ? 1.f : M == 0u ? 1.f : u32_as_f32(M | (126u << 23));
      q = E == 0u ? 0.f : u32_as_f32((M == 0u ? E : E + 1u) << 23);  // 2^-e: f = fv q
    }
    s_vf[tid] = fv;
    s_vq[tid] = q;
  }
  sync_block();
#endif

  // K and V rows of head h in 16-byte chunks, 4 of each per thread in flight (one round for
  // head_dim 128); K goes out as it is, V through shared memory.
  const u32 cph = (u32)(head_dim / 16), items = FP8_ROWS * cph;
  // Word w of staged V row r: rows of W words, each 16-key group's rotated by 4 words, so that the
  // transpose's reads (8 groups x 4 words per warp) hit 32 banks; 16-byte aligned.
  const int W = (int)head_dim / 4;
  auto vidx = [&](int r, int w) { return r * W + (w + 4 * (r >> 4)) % W; };
  for (u32 base = tid; base < items; base += 4 * GATHER_THREADS) {
    u32x4 kin[4], vin[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u32 it = base + u * GATHER_THREADS, r = it / cph, c = it - r * cph;
      kin[u] = vin[u] = u32x4{0u, 0u, 0u, 0u};
      if (it < items && s_off[r] >= 0) {
        const i64 src = s_off[r] + h * head_stride + (i64)c * 16;
        kin[u] = load16_stream(k_cache + src);
        vin[u] = load16_stream(v_cache + src);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u32 it = base + u * GATHER_THREADS, r = it / cph, c = it - r * cph;
      if (it < items) {
        store16_stream(k8 + ((row0 + r) * num_heads + h) * head_dim + (i64)c * 16, kin[u]);
        store16(s_v + vidx((int)r, 4 * (int)c), vin[u]);
      }
    }
  }
  sync_block();
  // V^T: 16 keys x 4 dims per thread, in the key order of the P operand; the 8 threads of a
  // 4-dim word's groups are adjacent lanes, so each store writes whole 128-byte rows.
  for (int it = tid; it < W * (FP8_ROWS / 16); it += GATHER_THREADS) {
    const int g = it % (FP8_ROWS / 16), dq = it / (FP8_ROWS / 16);
    // vidx(r, dq) of the group's keys, which lie in 16-key groups 2 (g / 2) and 2 (g / 2) + 1: r W
    // plus one of two rotations (no modulo per read)
    const int rb = 32 * (g >> 1), rot0 = vidx(rb, dq) - rb * W, rot1 = vidx(rb + 16, dq) - (rb + 16) * W;
    u32 w[16];
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      const int r = fp8_vt_key(16 * g + p);
      w[p] = s_v[r * W + ((r >> 4) & 1 ? rot1 : rot0)];
#if GATHER_SCALE == 2
      const float q = s_vq[r];
      if (q != 1.f) {  // a power of two: exact but for bytes that fall under e4m3's normals
        float x[4];
        fp8x4_to_f32x4(w[p], x);
        w[p] = f32x4_to_fp8x4(x[0] * q, x[1] * q, x[2] * q, x[3] * q);
      }
#endif
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        o[k] = ((w[4 * k] >> (8 * j)) & 0xffu) | (((w[4 * k + 1] >> (8 * j)) & 0xffu) << 8) |
               (((w[4 * k + 2] >> (8 * j)) & 0xffu) << 16) | (((w[4 * k + 3] >> (8 * j)) & 0xffu) << 24);
      store16_stream(vt8 + (h * head_dim + 4 * dq + j) * total_pad + row0 + 16 * g, u32x4{o[0], o[1], o[2], o[3]});
    }
  }

#if GATHER_SCALE == 2
  // Key scales: K's as they are, V's relative to ref.
  if (tid < FP8_ROWS) {
    const i64 blocks = total_pad / FP8_ROWS, blk = row0 / FP8_ROWS;
    const int r = tid;
    float* dst = kvs + (h * blocks + blk) * 2 * FP8_ROWS;
    const int pos = fp8_scale_pos(r);
    if (!(groups && pos >= kFp8GroupBlock && pos < kFp8GroupBlock + kFp8GroupWords)) dst[pos] = s_ks[r];
    dst[FP8_ROWS + pos] = s_vf[r];
    if (r == 0) v_max[h * blocks + blk] = ref;
    if (groups && r < FP8_ROWS / 16) {  // group r's ready-made factors (src/fp8_pack.h)
      // group g's K scale, > 0 (a zero-scale page's bytes are zero: -inf * 0 = NaN); padding's is 0
      auto k_of = [&](int g) { return fmax_(s_ks[16 * g], 1e-30f); };
      float kmax = 0.f;
      for (int g = 0; g < FP8_ROWS / 16; ++g) kmax = fmax_(kmax, k_of(g));
      const float kr = k_of(r) / kmax;
      const u32 vr = pack_f16x2(s_vf[16 * r], s_vf[16 * r]);
      dst[kFp8GroupBlock + r] = u32_as_f32(pack_f16x2(kr, kr));
      dst[kFp8GroupBlock + 8 + r] = u32_as_f32(vr);
      // V's factor as P's exponent (f' in (1/2, 1]: c in (-32, 0]), and the row sums' weight 2^(-c / 32)
      auto c_of = [&](int g) { return f16_to_f32((u16)(pack_f16x2(kFp8FoldScale * log2_(s_vf[16 * g]), 0.f) & 0xffffu)); };
      const float c = c_of(r);
      dst[kFp8GroupBlock + kFp8GroupFold + r] = u32_as_f32(pack_f16x2(c, c));
      if (r < 4) {  // groups 2r, 2r + 1
        auto weight = [&](int g) { return exp2_(-c_of(g) / kFp8FoldScale); };
        dst[kFp8GroupBlock + kFp8GroupRecip + r] = u32_as_f32(pack_f16x2(weight(2 * r), weight(2 * r + 1)));
      }
      if (r == 0) dst[kFp8GroupBlock + 16] = kmax;
    }
  }
#else
  (void)kvs; (void)v_max; (void)k_descale; (void)v_descale; (void)v_ref;
#endif
}

#if GATHER_SCALE == 2
// Per-page scales, before atom_gather_kv_fp8: each request's largest V scale of each head, O's
// unit in the FP8 prefill, into v_ref zeroed by the host (0: no positive scale; the gather takes
// 1). A block takes the pages of one 128-row block of the pack (one request's: cu_kp is
// 128-aligned), so every page's scales are read about once (a page of more than 128 keys once per
// block); one atomic max per head and block (non-negative floats order as their bits).
extern "C" __global__ void ATOM_LAUNCH_BOUNDS(GATHER_THREADS) atom_fp8_v_ref(
    float* __restrict__ v_ref,  // [num_seqs, H]
    const i32* __restrict__ cu_seqlens_k, const i32* __restrict__ cu_kp, const i32* __restrict__ seq_ids,
    const i32* __restrict__ table, const i32* __restrict__ indptr, const float* __restrict__ v_descale,
    i64 num_seqs, i64 table_stride, i64 page_size, i64 num_heads) {
  __shared__ float s_red[GATHER_THREADS / ATOM_WARP_SIZE];
  const i64 row0 = (i64)bid_x() * FP8_ROWS;
  const int tid = (int)tid_x();
  const i32 i = find_seq(cu_kp, (i32)num_seqs, row0);
  const i64 b = seq_ids ? (i64)seq_ids[i] : (i64)i;
  const i64 t0 = row0 - cu_kp[i], n = (i64)(cu_seqlens_k[i + 1] - cu_seqlens_k[i]);
  if (t0 >= n) return;  // padding rows only (uniform over the block)
  const i64 t1 = t0 + FP8_ROWS < n ? t0 + FP8_ROWS : n;
  const i64 lp0 = t0 / page_size, lp1 = (t1 - 1) / page_size;  // the pages it holds
  for (i64 h = 0; h < num_heads; ++h) {
    float m = warp_v_scale_max(table, indptr, v_descale, b, table_stride, num_heads, h, lp0, lp1, tid, GATHER_THREADS);
    if (lane_id() == 0) s_red[tid / ATOM_WARP_SIZE] = m;
    sync_block();
    if (tid == 0) {
      for (int w = 1; w < GATHER_THREADS / ATOM_WARP_SIZE; ++w) m = fmax_(m, s_red[w]);
      if (m > 0.f) atom::atomic_max(reinterpret_cast<u32*>(v_ref + i * num_heads + h), f32_as_u32(m));
    }
    sync_block();
  }
}
#endif
