// atom_mma.h: warp-level matrix tiles on the tensor cores of both vendors, and the async
// global -> shared copies that feed them.
//
// Kernels see one tile shape, 16x16, and three roles (the idea of llama.cpp's mma.cuh tile<I,J,T>,
// written for this package):
//   tile<16,16,float>  accumulator C (fp32). Element e of a lane sits at (get_i(e), get_j(e));
//                      the lanes that share a row are reduced with row_max / row_sum.
//   tile<16,16,u32>    16-bit operand (bf16 or fp16, packed in pairs): a 16x16 block of a matrix
//                      stored row-major, in the one "canonical" register layout that serves
//                      both as the left operand A (M x K) and the right operand given by rows
//                      B (N x K): mma(c, a, b) is c += a * b^T.
// Callers never do lane math: operands come from swizzled<ROW> shared-memory blocks through
// load_rows / load_cols (tile origin in, fragments out), results are read through get_i / get_j.
// The accumulator layout equals the operand layout (after packing pairs), so an fp32 result can
// become the left operand of the next product in registers: to_operand(c) (attention's P = S).
// e4m3 (ATOM_MMA_FP8): a 16 x 32 block of bytes (rows x K) sits in a lane's registers exactly as a
// 16 x 16 block of 16-bit elements does, on both back ends, so op_t carries it too and load_rows
// reads it (the bytes seen as 16-bit pairs); mma_fp8 multiplies over 32 K-bytes, to_operand_fp8
// makes two fp32 tiles (32 keys of P) one e4m3 operand.
//
// Back ends:
//   ATOM_MMA_SYNC (NVIDIA sm_80+)  mma.sync m16n8k16 (two per 16x16 tile), ldmatrix(.trans),
//                                  cp.async 16-byte copies with zero fill.
//   ATOM_MFMA (gfx942 / gfx950)    v_mfma_f32_16x16x16{bf16_1k,f16} on 64-lane waves, operands
//                                  swapped so that C comes out in the operand layout; operands
//                                  read from LDS with plain loads; copies are synchronous.
//   ATOM_MMA_FP8                   e4m3 x e4m3 -> fp32: mma.sync m16n8k32 (NVIDIA sm_89+), MFMA
//                                  16x16x32 fp8 (gfx942: e4m3 FNUZ; gfx950: OCP e4m3).
#pragma once

#include "atom_device.h"

#if ATOM_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ATOM_MMA_SYNC 1
#else
#define ATOM_MMA_SYNC 0
#endif
#if ATOM_AMD && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__))
#define ATOM_MFMA 1
#else
#define ATOM_MFMA 0
#endif
#define ATOM_MMA_AVAILABLE (ATOM_MMA_SYNC || ATOM_MFMA)
// e4m3 MMAs: mma.sync e4m3 from sm_89, MFMA fp8 on every ATOM_MFMA target.
#if (ATOM_MMA_SYNC && __CUDA_ARCH__ >= 890) || ATOM_MFMA
#define ATOM_MMA_FP8 1
#else
#define ATOM_MMA_FP8 0
#endif
// Warpgroup MMAs (wgmma.mma_async, Hopper): only in arch-specific sm_90a code (NVRTC / nvcc
// define __CUDA_ARCH_FEAT_SM90_ALL there); a plain sm_90 or any other target has none.
#if ATOM_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATOM_HAS_WGMMA 1
#else
#define ATOM_HAS_WGMMA 0
#endif
// Asynchronous global -> shared copies (the loop overlaps them with math when they exist).
#define ATOM_ASYNC_COPY ATOM_MMA_SYNC

// An MMA is a pure function of its registers, so its asm is not volatile (the compiler may
// schedule it freely). Fragment loads stay volatile: they read shared memory that barriers order.
#define ATOM_MMA_ASM asm

#if ATOM_NVIDIA
#define ATOM_LAUNCH_BOUNDS2(n, min_blocks) __launch_bounds__(n, min_blocks)
#else
#define ATOM_LAUNCH_BOUNDS2(n, min_blocks) __attribute__((amdgpu_flat_work_group_size(1, n)))
#endif

namespace atom {
namespace mma {

// Synchronises the lanes of one warp around shared-memory traffic that stays inside the warp.
ATOM_DEV void warp_sync() {
#if ATOM_NVIDIA
  __syncwarp();
#else
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#endif
}

// True when pred holds on any lane of the warp (a warp-uniform branch condition).
ATOM_DEV bool warp_any(bool pred) {
#if ATOM_NVIDIA
  return __any_sync(0xffffffffu, pred) != 0;
#elif ATOM_WARP_SIZE == 64
  return __builtin_amdgcn_ballot_w64(pred) != 0;
#else
  return __builtin_amdgcn_ballot_w32(pred) != 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// Async copies: 16 bytes global -> shared; pred == false writes 16 zero bytes (no global read).
// ---------------------------------------------------------------------------------------------
ATOM_DEV void cp_async16(void* smem_dst, const void* gsrc, bool pred) {
#if ATOM_ASYNC_COPY
  const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gsrc), "r"(pred ? 16 : 0));
#else
  store16(smem_dst, pred ? load16(gsrc) : u32x4{0u, 0u, 0u, 0u});
#endif
}
ATOM_DEV void cp_async_commit() {
#if ATOM_ASYNC_COPY
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Wait until at most N committed groups of this thread are still in flight.
template <int N>
ATOM_DEV void cp_async_wait() {
#if ATOM_ASYNC_COPY
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---------------------------------------------------------------------------------------------
// Tiles
// ---------------------------------------------------------------------------------------------
template <int I, int J, class T>
struct tile;

#if ATOM_MMA_SYNC || !ATOM_MFMA
// NVIDIA layout (also the layout compiled, without tensor cores, on targets that have neither
// back end, so that every arch builds; mma() then traps).
template <>
struct tile<16, 16, float> {
  static constexpr int ne = 8;  // two m16n8 accumulators: e / 4 selects the 8-column half
  float x[ne];
  static constexpr int row_slots = 2;  // rows lane/4 and lane/4 + 8
  static ATOM_DEV int get_i(int e) { return (int)(lane_id() >> 2) + 8 * ((e >> 1) & 1); }
  static ATOM_DEV int get_j(int e) { return (e >> 2) * 8 + (int)(lane_id() & 3) * 2 + (e & 1); }
  static ATOM_DEV int row_slot(int e) { return (e >> 1) & 1; }
  static ATOM_DEV int slot_row(int s) { return (int)(lane_id() >> 2) + 8 * s; }
  static ATOM_DEV bool row_leader() { return (lane_id() & 3) == 0; }
  static ATOM_DEV float row_max(float v) {
    v = fmax_(v, shfl_xor(v, 1));
    return fmax_(v, shfl_xor(v, 2));
  }
  static ATOM_DEV float row_sum(float v) {
    v += shfl_xor(v, 1);
    return v + shfl_xor(v, 2);
  }
};
// x[0]: rows 0-7 x cols 0-7, x[1]: rows 8-15 x cols 0-7, x[2]: rows 0-7 x cols 8-15,
// x[3]: rows 8-15 x cols 8-15; each an 8x8 fragment holding (lane/4, 2*(lane%4) + {0,1}).
// As e4m3 (16 rows x 32 K-bytes, the A and B fragments of mma.sync m16n8k32): word w holds
// K-bytes k8(w) .. k8(w) + 3 of row acc_t::slot_row(slot8(w)).
template <>
struct tile<16, 16, u32> {
  static constexpr int ne = 4;
  u32 x[ne];
  static ATOM_DEV int slot8(int w) { return w & 1; }
  static ATOM_DEV int k8(int w) { return 16 * (w >> 1) + 4 * (int)(lane_id() & 3); }
};
#else
template <>
struct tile<16, 16, float> {
  static constexpr int ne = 4;  // (row lane%16, cols 4*(lane/16) + e)
  float x[ne];
  static constexpr int row_slots = 1;
  static ATOM_DEV int get_i(int) { return (int)(lane_id() & 15); }
  static ATOM_DEV int get_j(int e) { return (int)(lane_id() >> 4) * 4 + e; }
  static ATOM_DEV int row_slot(int) { return 0; }
  static ATOM_DEV int slot_row(int) { return (int)(lane_id() & 15); }
  static ATOM_DEV bool row_leader() { return lane_id() < 16; }
  static ATOM_DEV float row_max(float v) {
    v = fmax_(v, shfl_xor(v, 16));
    return fmax_(v, shfl_xor(v, 32));
  }
  static ATOM_DEV float row_sum(float v) {
    v += shfl_xor(v, 16);
    return v + shfl_xor(v, 32);
  }
};
// (row lane%16, cols 4*(lane/16) + {0,1} in x[0], + {2,3} in x[1]). As e4m3 (16 rows x 32
// K-bytes, the operands of MFMA 16x16x32 fp8): row lane%16, K-bytes 8*(lane/16) + {0..3} in x[0],
// + {4..7} in x[1] (slot8 / k8 as in the NVIDIA layout).
template <>
struct tile<16, 16, u32> {
  static constexpr int ne = 2;
  u32 x[ne];
  static ATOM_DEV int slot8(int) { return 0; }
  static ATOM_DEV int k8(int w) { return 8 * (int)(lane_id() >> 4) + 4 * w; }
};
#endif

typedef tile<16, 16, float> acc_t;
typedef tile<16, 16, u32> op_t;

ATOM_DEV void zero(acc_t& c) {
#pragma unroll
  for (int e = 0; e < acc_t::ne; ++e) c.x[e] = 0.f;
}

// fp32 accumulator -> 16-bit left operand (same element positions, pairs packed).
template <class DT>
ATOM_DEV void to_operand(op_t& a, const acc_t& c) {
#pragma unroll
  for (int k = 0; k < op_t::ne; ++k) a.x[k] = pack2(DT{}, c.x[2 * k], c.x[2 * k + 1]);
}

// ---------------------------------------------------------------------------------------------
// Shared-memory blocks: rows of ROW 16-bit elements, 16-byte chunks XOR-swizzled by (row & 7), so
// the 8-row accesses of ldmatrix (and of the MFMA loads) hit 8 different bank groups; rows of 32
// elements (64 bytes: two share a 128-byte bank line) by ((row >> 1) & 3). An e4m3 block is a
// 16-bit block of half as many columns: its 16 x 32 operands load as 16 x 16 ones (load_rows).
// ---------------------------------------------------------------------------------------------
template <int ROW>
struct swizzled {
  static_assert(ROW % 64 == 0 || ROW == 32, "rows of 4 or of at least 8 chunks of 16 bytes");
  static ATOM_DEV int off(int row, int col) {
    return row * ROW + ((((col >> 3) ^ (ROW == 32 ? (row >> 1) & 3 : row & 7))) << 3) + (col & 7);
  }
  // For R % 8 == 0, C % 16 == 0 and col_in_tile < 16: off(R + r, C + c) == R * ROW + (off(r, c) ^ C).
  // The loaders compute off(r, c) of the lane once; each tile then costs one XOR, not a live
  // register per (R, C).
  static ATOM_DEV int at(int lane_off, int R, int C) { return R * ROW + (lane_off ^ C); }
};

// 16x16 block at (R, C) of a swizzled [rows][ROW] block, stored row-major -> canonical operand.
template <int ROW>
ATOM_DEV void load_rows(op_t& t, const u16* base, int R, int C) {
  const int l = (int)lane_id();
#if ATOM_MMA_SYNC
  const int lo = swizzled<ROW>::off(l & 15, (l >> 4) * 8);
  const u32 p = (u32)__cvta_generic_to_shared(base + swizzled<ROW>::at(lo, R, C));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(t.x[0]), "=r"(t.x[1]), "=r"(t.x[2]), "=r"(t.x[3])
               : "r"(p));
#elif ATOM_MFMA
  const int lo = swizzled<ROW>::off(l & 15, (l >> 4) * 4);
  u32x2 v = load8(base + swizzled<ROW>::at(lo, R, C));
  t.x[0] = v.x;
  t.x[1] = v.y;
#else
  (void)l; (void)base; (void)R; (void)C;
#pragma unroll
  for (int k = 0; k < op_t::ne; ++k) t.x[k] = 0u;
#endif
}

// 16x16 block at (R, C) stored transposed, [16 k][16 n] (e.g. V as [key][dim]) -> canonical
// N x K operand.
template <int ROW>
ATOM_DEV void load_cols(op_t& t, const u16* base, int R, int C) {
  const int l = (int)lane_id();
#if ATOM_MMA_SYNC
  const int m = l >> 3;
  const int lo = swizzled<ROW>::off((m >> 1) * 8 + (l & 7), (m & 1) * 8);
  const u32 p = (u32)__cvta_generic_to_shared(base + swizzled<ROW>::at(lo, R, C));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(t.x[0]), "=r"(t.x[1]), "=r"(t.x[2]), "=r"(t.x[3])
               : "r"(p));
#elif ATOM_MFMA
  const int n = l & 15, k0 = (l >> 4) * 4;
  u32 e[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int lo = swizzled<ROW>::off(k0 + r, n);
    e[r] = base[swizzled<ROW>::at(lo, R, C)];
  }
  t.x[0] = e[0] | (e[1] << 16);
  t.x[1] = e[2] | (e[3] << 16);
#else
  (void)l; (void)base; (void)R; (void)C;
#pragma unroll
  for (int k = 0; k < op_t::ne; ++k) t.x[k] = 0u;
#endif
}

// ---------------------------------------------------------------------------------------------
// c += a * b^T  (a: 16 x 16 (M x K), b: 16 x 16 (N x K)), DT = bf16_t or f16_t.
// ---------------------------------------------------------------------------------------------
#if ATOM_MMA_SYNC
template <class DT> struct mma_ptx;
template <> struct mma_ptx<bf16_t> {
  static ATOM_DEV void run(float* c, const u32* a, u32 b0, u32 b1) {
    ATOM_MMA_ASM("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct mma_ptx<f16_t> {
  static ATOM_DEV void run(float* c, const u32* a, u32 b0, u32 b1) {
    ATOM_MMA_ASM("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
#endif

#if ATOM_MFMA
typedef float f32x4_t __attribute__((ext_vector_type(4)));
typedef short i16x4_t __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4_t __attribute__((ext_vector_type(4)));
// An accumulator tile as the MFMA's 4-float operand, and the result back into it.
ATOM_DEV f32x4_t mfma_in(const acc_t& c) { return f32x4_t{c.x[0], c.x[1], c.x[2], c.x[3]}; }
ATOM_DEV void mfma_out(acc_t& c, const f32x4_t& d) {
#pragma unroll
  for (int e = 0; e < 4; ++e) c.x[e] = d[e];
}
#endif

template <class DT>
ATOM_DEV void mma(acc_t& c, const op_t& a, const op_t& b) {
#if ATOM_MMA_SYNC
  mma_ptx<DT>::run(&c.x[0], a.x, b.x[0], b.x[2]);  // columns 0-7 of c: rows 0-7 of b
  mma_ptx<DT>::run(&c.x[4], a.x, b.x[1], b.x[3]);  // columns 8-15 of c: rows 8-15 of b
#elif ATOM_MFMA
  // MFMA returns D with lane = column: computing b * a^T = (a * b^T)^T puts C's rows on the
  // lanes, the operand layout, so P = S needs no data movement.
  u32x2 ua{a.x[0], a.x[1]}, ub{b.x[0], b.x[1]};
  if constexpr (sizeof(DT) && __is_same(DT, bf16_t)) {
    mfma_out(c, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4_t, ub), __builtin_bit_cast(i16x4_t, ua), mfma_in(c), 0, 0, 0));
  } else {
    mfma_out(c, __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4_t, ub), __builtin_bit_cast(f16x4_t, ua), mfma_in(c), 0, 0, 0));
  }
#else
  (void)c; (void)a; (void)b;
  trap_();
#endif
}

// c += a * b^T over 32 K-bytes of e4m3 (the platform's flavour): a 16 x 32 (M x K), b 16 x 32
// (N x K), both as op_t (load_rows of the bytes as 16-bit pairs, to_operand_fp8).
ATOM_DEV void mma_fp8(acc_t& c, const op_t& a, const op_t& b) {
#if ATOM_MMA_FP8 && ATOM_MMA_SYNC
  // The e4m3 B fragment of columns 0-7 is b's rows 0-7 (x[0], x[2]), as in mma<DT>.
  ATOM_MMA_ASM("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[2]));
  ATOM_MMA_ASM("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.x[4]), "+f"(c.x[5]), "+f"(c.x[6]), "+f"(c.x[7])
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[1]), "r"(b.x[3]));
#elif ATOM_MMA_FP8 && ATOM_MFMA
  // Operands swapped as in mma<DT> (b * a^T): C's rows on the lanes.
  const u32x2 ua{a.x[0], a.x[1]}, ub{b.x[0], b.x[1]};
  mfma_out(c, __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(__builtin_bit_cast(long, ub), __builtin_bit_cast(long, ua), mfma_in(c), 0, 0, 0));
#else
  (void)c; (void)a; (void)b;
  trap_();
#endif
}

// Two fp32 accumulator tiles (keys 0-15 and 16-31 of a 32-key step: P) -> the e4m3 left operand
// of O += P V, with no data moving between lanes: a lane's own accumulators become its K-bytes,
// so K-byte p holds the key fp8_p_key(p), and V^T must hold that key's values at position p
// (hip_kernels/gather.py writes that order per arch: FP8_KEY_ORDERS).
//   NVIDIA (mma.sync m16n8k32, and wgmma k32's register A: the same fragment): keys 2q, 2q+1,
//   8+2q, 9+2q of each tile (q = lane % 4) become K-bytes 4q..4q+3 (+16 for the second tile).
//   MFMA 16x16x32: keys 4q..4q+3 of each tile (q = lane / 16) become K-bytes 8q..8q+3 and
//   8q+4..8q+7.
ATOM_DEV void to_operand_fp8(op_t& a, const acc_t& lo, const acc_t& hi) {
#if ATOM_MFMA
  a.x[0] = f32x4_to_fp8x4(lo.x[0], lo.x[1], lo.x[2], lo.x[3]);
  a.x[1] = f32x4_to_fp8x4(hi.x[0], hi.x[1], hi.x[2], hi.x[3]);
#else
  a.x[0] = f32x4_to_fp8x4(lo.x[0], lo.x[1], lo.x[4], lo.x[5]);
  a.x[1] = f32x4_to_fp8x4(lo.x[2], lo.x[3], lo.x[6], lo.x[7]);
  a.x[2] = f32x4_to_fp8x4(hi.x[0], hi.x[1], hi.x[4], hi.x[5]);
  a.x[3] = f32x4_to_fp8x4(hi.x[2], hi.x[3], hi.x[6], hi.x[7]);
#endif
}
// The key (0..31) of a 32-key step whose P to_operand_fp8 puts at K-byte p.
ATOM_DEV int fp8_p_key(int p) {
#if ATOM_MFMA
  return 4 * (p >> 3) + (p & 3) + 16 * ((p >> 2) & 1);
#else
  return 16 * (p >> 4) + 2 * ((p >> 2) & 3) + (p & 1) + 8 * ((p >> 1) & 1);
#endif
}


// ---------------------------------------------------------------------------------------------
// Warpgroup MMAs (ATOM_HAS_WGMMA): 4 consecutive warps (a warpgroup, starting at a warp index
// divisible by 4) compute D[64 x N] (+)= A[64 x 16] * B[16 x N] asynchronously, B (and A, or A from
// registers) read straight from shared memory through 64-bit descriptors.
//
// Shared-memory layout (sw128<ROWS>): a [ROWS][COLS] block of 16-bit elements is stored as
// COLS/64 column panels [ROWS][64], each row 128 bytes with its 16-byte chunks XOR-swizzled by
// (row & 7): the "128-byte swizzle" canonical layout of wgmma. The same bytes serve a K-major
// operand (rows = M or N, columns = K: Q and K tiles) and an MN-major one (rows = K, columns = N:
// V as [key][dim], with the transpose flag). Panels must start 1024-byte aligned.
//
// Accumulators: D's 64 rows are 16 per warp (warp w of the group owns rows 16w..16w+15), and
// within a warp every 16 columns are exactly an acc_t (same get_i / get_j / row_slot), so the
// softmax code written for acc_t runs unchanged; to_operand() of an accumulator tile is the
// register A fragment of the next wgmma (P = S in attention).
// ---------------------------------------------------------------------------------------------
namespace wgmma {

template <int ROWS>
struct sw128 {
  static_assert(ROWS % 8 == 0, "panels hold whole 8-row swizzle atoms");
  static ATOM_DEV int off(int row, int col) {
    return (col >> 6) * (ROWS * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
  }
};

// A CUDA tensor map (CUtensorMap): 128 opaque bytes, 64-byte aligned. Declared for every target
// so that kernels taking one keep one signature; only ATOM_HAS_WGMMA code reads it.
struct alignas(64) tma_desc {
  u64 w[16];
};
#if ATOM_NVIDIA
#define ATOM_GRID_CONSTANT __grid_constant__  // a by-value parameter the kernel may take the address of
#else
#define ATOM_GRID_CONSTANT
#endif

#if ATOM_HAS_WGMMA
// Descriptor fields (16-byte units): start address [0,14), leading byte offset [16,30), stride byte
// offset [32,46), layout [62,64) (1 = 128-byte swizzle, 2 = 64-byte: rows of 64 bytes, 8-row groups
// of 512; 3 = 32-byte: rows of 32 bytes, groups of 256).
ATOM_DEV u64 desc_bits(const void* smem, u32 lbo_bytes, u32 sbo_bytes, u32 layout = 1) {
  const u32 a = (u32)__cvta_generic_to_shared(smem);
  return (u64)((a >> 4) & 0x3fffu) | ((u64)((lbo_bytes >> 4) & 0x3fffu) << 16) |
         ((u64)((sbo_bytes >> 4) & 0x3fffu) << 32) | ((u64)layout << 62);
}
// The descriptor of the operand `bytes` (a multiple of 16) past d's: the 14-bit start-address field
// takes the offset without a carry out (shared memory lies below 256 KB), so one add on the low word.
ATOM_DEV u64 desc_add(u64 d, u32 bytes) { return (d & ~0xffffffffull) | (u32)((u32)d + (bytes >> 4)); }
// K-major operand (rows = M or N, 64 K-columns per panel): 8-row groups 1024 bytes apart; the
// K offset inside a panel (multiples of 16 elements = 32 bytes) is added to the start address.
ATOM_DEV u64 desc_k(const u16* panel_row0_col) { return desc_bits(panel_row0_col, 16, 1024); }
// MN-major operand of ROWS K-rows (64 N-columns per panel): N panels ROWS * 128 bytes apart
// (leading byte offset), 8-row K groups 1024 bytes apart (stride byte offset).
template <int ROWS>
ATOM_DEV u64 desc_mn(const u16* krow0) { return desc_bits(krow0, ROWS * 128, 1024); }

// Rounds a shared-memory pointer up to 1024 bytes (swizzle atoms must start there).
ATOM_DEV void* align1024(void* smem) {
  const u32 a = (u32)__cvta_generic_to_shared(smem);
  return static_cast<unsigned char*>(smem) + (((a + 1023u) & ~1023u) - a);
}

// wgmma.fence before the first MMA of a batch whose registers (accumulators, A) were written.
ATOM_DEV void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
ATOM_DEV void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
ATOM_DEV void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Ordinary (and cp.async) shared-memory writes become visible to wgmma's async proxy.
ATOM_DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Warpgroup index of the calling thread, as a value the compiler knows is warp-uniform (wgmma
// under a branch on it is not serialised).
ATOM_DEV int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)(tid_x() / 128), 0); }
// Barrier over `threads` threads (whole warps) on hardware barrier `id` (0 is sync_block's).
ATOM_DEV void bar_sync(int id, int threads) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }

// Shared-memory mbarriers (phase-parity waits).
ATOM_DEV u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
ATOM_DEV void mbar_init(u64* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
ATOM_DEV void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Every mbarrier / bulk-copy helper also takes a 32-bit shared-memory address (smem_addr): code
// short of registers (a producer warpgroup) keeps one base and constant offsets.
ATOM_DEV void mbar_arrive(u32 bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
ATOM_DEV void mbar_arrive(u64* bar) { mbar_arrive(smem_addr(bar)); }
// Arrives (without adding to the expected count) once this thread's earlier cp.async copies land.
ATOM_DEV void mbar_arrive_cp_async(u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// The spin loop stays inside the asm: to the compiler the wait is straight-line code, so the
// wgmma after it is not in a divergent region.
ATOM_DEV void mbar_wait(u32 bar, int parity) {
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
               ::"r"(bar), "r"(parity) : "memory");
}
ATOM_DEV void mbar_wait(u64* bar, int parity) { mbar_wait(smem_addr(bar), parity); }

// Bulk tensor copies (TMA): one thread moves a whole box of a tensor described by a 128-byte
// tensor map (encoded on the host, passed as a __grid_constant__ kernel parameter) into shared
// memory and signals an mbarrier with the bytes it wrote; rows past the tensor are zero-filled.
// With the map's 128-byte swizzle a box of [rows][64] 16-bit elements lands in sw128 layout.
ATOM_DEV void tma_prefetch_desc(const tma_desc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
ATOM_DEV void tma_load_3d(u32 dst, const tma_desc* map, u32 bar, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
               ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
ATOM_DEV void tma_load_2d(u32 dst, const tma_desc* map, u32 bar, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
               ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1)
               : "memory");
}
// The reverse copy, shared -> global, in bulk groups of the issuing thread: a box's rows past the
// tensor are not written. Its shared memory may be written again once bulk_wait_read<0>() returns
// (in the same thread); ordinary writes before the copy need fence_proxy_async() first.
ATOM_DEV void tma_store_3d(const tma_desc* map, u32 src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
ATOM_DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
ATOM_DEV void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// The producer's arrival on a full barrier, announcing the bytes its copies will deliver.
ATOM_DEV void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrival on hardware barrier `id` without waiting (the other side bar_sync()s on it).
ATOM_DEV void bar_arrive(int id, int threads) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
// Moves registers between warpgroups (whole warpgroup, kernel launched with a register cap):
// data movers give theirs up, the math warpgroups take them.
template <int N>
ATOM_DEV void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
ATOM_DEV void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Pins register values around async MMAs (the compiler must not move their reads or writes
// across a wait).
template <int NT_>
ATOM_DEV void fence_regs(acc_t (&d)[NT_]) {
#pragma unroll
  for (int t = 0; t < NT_; ++t)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) asm volatile("" : "+f"(d[t].x[e])::"memory");
}
template <int N_>
ATOM_DEV void fence_regs(float (&f)[N_]) {
#pragma unroll
  for (int i = 0; i < N_; ++i) asm volatile("" : "+f"(f[i])::"memory");
}
template <int N_>
ATOM_DEV void fence_regs(u32 (&f)[N_]) {
#pragma unroll
  for (int i = 0; i < N_; ++i) asm volatile("" : "+r"(f[i])::"memory");
}
template <int NT_>
ATOM_DEV void fence_regs(op_t (&a)[NT_]) {
#pragma unroll
  for (int t = 0; t < NT_; ++t)
#pragma unroll
    for (int e = 0; e < op_t::ne; ++e) asm volatile("" : "+r"(a[t].x[e])::"memory");
}

// op<N, DT>::ss(d, da, db, scale_d): d[N/16] (+)= A(desc) * B(desc)^T, both K-major (scale_d = 0
// overwrites d). op<N, DT>::rs_t(d, a, db): d += a * B with a in registers, B MN-major.
// (Generated: one asm per shape and dtype; operands are the N/2 accumulator floats of a lane.)
template <int N, class DT> struct op;
template <> struct op<64, bf16_t> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  // B given MN-major (tnspB = 1), e.g. V stored [key][dim].
  static ATOM_DEV void rs_t(acc_t* d, const op_t& a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(1));
  }
};
template <> struct op<64, f16_t> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  // B given MN-major (tnspB = 1), e.g. V stored [key][dim].
  static ATOM_DEV void rs_t(acc_t* d, const op_t& a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(1));
  }
};
template <> struct op<128, bf16_t> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  // B given MN-major (tnspB = 1), e.g. V stored [key][dim].
  static ATOM_DEV void rs_t(acc_t* d, const op_t& a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(1));
  }
};
template <> struct op<128, f16_t> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  // B given MN-major (tnspB = 1), e.g. V stored [key][dim].
  static ATOM_DEV void rs_t(acc_t* d, const op_t& a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(1));
  }
};
// P -> the e4m3 A fragment of a k32 wgmma: a warp's part of it is mma.sync m16n8k32's A fragment,
// so the portable to_operand_fp8 (and its V^T key order) serves.
using mma::to_operand_fp8;

// op8<N>::ss(d, da, db, scale_d): d[N/16] (+)= A(desc) * B(desc)^T over 32 e4m3 K-elements, both
// operands K-major (FP8 wgmma has no transposed form: V goes in as V^T). op8<N>::rs(d, a, db): the
// same with A in registers: op_t holds 16 e4m3 per lane, rows (get_i of e = 0, 2) x K-bytes
// 4 * (lane % 4) + {0..3} in x[0] / x[1] and 16 + those in x[2] / x[3] (to_operand_fp8); scale_d = 0
// makes d = A B (a fresh accumulator, no zeroing).
template <int N> struct op8;
template <> struct op8<64> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  static ATOM_DEV void rs(acc_t* d, const op_t& a, u64 db, int scale_d = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(scale_d));
  }
};
template <> struct op8<128> {
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
  static ATOM_DEV void rs(acc_t* d, const op_t& a, u64 db, int scale_d = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(scale_d));
  }
  // rs, N = 136: columns 128..135 of B (V^T's rows of ones: the FP8 prefill's row sums) accumulate into l[4]
  // (l[0..1]: row slot 0's two columns, l[2..3]: slot 1's).
  static ATOM_DEV void rs_sum(acc_t* d, float (&l)[4], const op_t& a, u64 db, int scale_d = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %73, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, {%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7]), "+f"(l[0]), "+f"(l[1]), "+f"(l[2]), "+f"(l[3])
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(db), "r"(scale_d));
  }
};
// op8h<N>::ss(d, da, db, scale_d): S = A B^T of e4m3 operands (both K-major) into an f16
// accumulator: d[N / 4] f16x2 pairs, pair i holding the fp32 layout's elements 2i and 2i + 1
// (acc_t: tile i / 4, x[2 (i % 4)], x[2 (i % 4) + 1]). Half an fp32 accumulator's registers.
template <int N> struct op8h;
template <> struct op8h<128> {
  static ATOM_DEV void ss(u32* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct op8<96> {  // S of a 96-key FP8 tile (ss only: P V runs N = head_dim)
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
template <> struct op8<192> {  // S of a 192-key FP8 tile (ss only: P V runs N = head_dim)
  static ATOM_DEV void ss(acc_t* d, u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
                 : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]), "+f"(d[0].x[4]), "+f"(d[0].x[5]), "+f"(d[0].x[6]), "+f"(d[0].x[7]), "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]), "+f"(d[1].x[4]), "+f"(d[1].x[5]), "+f"(d[1].x[6]), "+f"(d[1].x[7]), "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]), "+f"(d[2].x[4]), "+f"(d[2].x[5]), "+f"(d[2].x[6]), "+f"(d[2].x[7]), "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]), "+f"(d[3].x[4]), "+f"(d[3].x[5]), "+f"(d[3].x[6]), "+f"(d[3].x[7]), "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]), "+f"(d[4].x[4]), "+f"(d[4].x[5]), "+f"(d[4].x[6]), "+f"(d[4].x[7]), "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]), "+f"(d[5].x[4]), "+f"(d[5].x[5]), "+f"(d[5].x[6]), "+f"(d[5].x[7]), "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]), "+f"(d[6].x[4]), "+f"(d[6].x[5]), "+f"(d[6].x[6]), "+f"(d[6].x[7]), "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]), "+f"(d[7].x[4]), "+f"(d[7].x[5]), "+f"(d[7].x[6]), "+f"(d[7].x[7]), "+f"(d[8].x[0]), "+f"(d[8].x[1]), "+f"(d[8].x[2]), "+f"(d[8].x[3]), "+f"(d[8].x[4]), "+f"(d[8].x[5]), "+f"(d[8].x[6]), "+f"(d[8].x[7]), "+f"(d[9].x[0]), "+f"(d[9].x[1]), "+f"(d[9].x[2]), "+f"(d[9].x[3]), "+f"(d[9].x[4]), "+f"(d[9].x[5]), "+f"(d[9].x[6]), "+f"(d[9].x[7]), "+f"(d[10].x[0]), "+f"(d[10].x[1]), "+f"(d[10].x[2]), "+f"(d[10].x[3]), "+f"(d[10].x[4]), "+f"(d[10].x[5]), "+f"(d[10].x[6]), "+f"(d[10].x[7]), "+f"(d[11].x[0]), "+f"(d[11].x[1]), "+f"(d[11].x[2]), "+f"(d[11].x[3]), "+f"(d[11].x[4]), "+f"(d[11].x[5]), "+f"(d[11].x[6]), "+f"(d[11].x[7])
                 : "l"(da), "l"(db), "r"(scale_d));
  }
};
#endif  // ATOM_HAS_WGMMA

}  // namespace wgmma

}  // namespace mma
}  // namespace atom
