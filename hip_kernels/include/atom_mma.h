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
//
// Back ends:
//   ATOM_MMA_SYNC (NVIDIA sm_80+)  mma.sync m16n8k16 (two per 16x16 tile), ldmatrix(.trans),
//                                  cp.async 16-byte copies with zero fill.
//   ATOM_MFMA (gfx942 / gfx950)    v_mfma_f32_16x16x16{bf16_1k,f16} on 64-lane waves, operands
//                                  swapped so that C comes out in the operand layout; operands
//                                  read from LDS with plain loads; copies are synchronous.
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
// Asynchronous global -> shared copies (the loop overlaps them with math when they exist).
#define ATOM_ASYNC_COPY ATOM_MMA_SYNC

// An MMA is a pure function of its registers, so its asm is not volatile (the compiler may
// schedule it freely); ATOM_MMA_ASM_VOLATILE=1 pins MMAs in program order (experiment knob).
// Fragment loads stay volatile: they read shared memory that barriers order.
#if defined(ATOM_MMA_ASM_VOLATILE) && ATOM_MMA_ASM_VOLATILE
#define ATOM_MMA_ASM asm volatile
#else
#define ATOM_MMA_ASM asm
#endif

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
template <>
struct tile<16, 16, u32> {
  static constexpr int ne = 4;
  u32 x[ne];
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
// (row lane%16, cols 4*(lane/16) + {0,1} in x[0], + {2,3} in x[1])
template <>
struct tile<16, 16, u32> {
  static constexpr int ne = 2;
  u32 x[ne];
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
// the 8-row accesses of ldmatrix (and of the MFMA loads) hit 8 different bank groups.
// ---------------------------------------------------------------------------------------------
template <int ROW>
struct swizzled {
  static_assert(ROW % 64 == 0, "rows of at least 8 chunks of 16 bytes");
  static ATOM_DEV int off(int row, int col) { return row * ROW + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7); }
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
#endif

template <class DT>
ATOM_DEV void mma(acc_t& c, const op_t& a, const op_t& b) {
#if ATOM_MMA_SYNC
  mma_ptx<DT>::run(&c.x[0], a.x, b.x[0], b.x[2]);  // columns 0-7 of c: rows 0-7 of b
  mma_ptx<DT>::run(&c.x[4], a.x, b.x[1], b.x[3]);  // columns 8-15 of c: rows 8-15 of b
#elif ATOM_MFMA
  // MFMA returns D with lane = column: computing b * a^T = (a * b^T)^T puts C's rows on the
  // lanes, the operand layout, so P = S needs no data movement.
  f32x4_t acc = {c.x[0], c.x[1], c.x[2], c.x[3]};
  u32x2 ua{a.x[0], a.x[1]}, ub{b.x[0], b.x[1]};
  if constexpr (sizeof(DT) && __is_same(DT, bf16_t)) {
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4_t, ub), __builtin_bit_cast(i16x4_t, ua), acc, 0, 0, 0);
  } else {
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4_t, ub), __builtin_bit_cast(f16x4_t, ua), acc, 0, 0, 0);
  }
  c.x[0] = acc[0];
  c.x[1] = acc[1];
  c.x[2] = acc[2];
  c.x[3] = acc[3];
#else
  (void)c; (void)a; (void)b;
  __builtin_trap();
#endif
}

}  // namespace mma
}  // namespace atom
