// Varlen prefill attention over packed KV (docs/design.md: every visibility rule, sinks, lse).
//
// FlashAttention-2 structure on the portable tile layer (atom_mma.h):
//   CTA = (query head h, work item (request b, q tile t)), grid (hq, work items). NW warps, each
//   owns 16 * MT query rows of the BLOCK_M = 16 * MT * NW rows of the tile (MT > 1 lets every
//   K/V fragment read from shared memory feed MT MMAs); Q lives in registers when it fits.
//   K/V tiles of BLOCK_N keys go through a STAGES-deep shared-memory ring (cp.async on NVIDIA),
//   rows swizzled in 16-byte chunks (chunk ^ (row & 7)) so ldmatrix reads are conflict-free.
//   One block barrier per KV tile: after it, every warp is done with the stage the next copy
//   overwrites.
// Work is proportional to visible pairs: the CTA walks only the KV tiles its rows can see (the
// StreamingLLM sink-token tiles, then the causal/window band); a warp skips a tile that is fully
// masked for its own 16 rows, and masks elements only on tiles that are partly visible.
// Online softmax in log2 units (exp2), fp32 accumulation; the per-head sink logit joins the
// denominator at the end: o = acc / (l + 2^(s_h*log2e - m)).
// Work order: heads on grid x (the GQA heads of one KV head run side by side, sharing its tiles
// in L2), then either a host-sorted list of (b, t) items (longest first), or, with no list,
// q tiles from the last to the first (causal: longest first) for every request.
//
// Hopper (sm_90a) runs its own body for d = 64/128: varlen_prefill_hopper.hip (warp-specialized,
// TMA, ping-pong, persistent); this one serves every other arch and head dim, and small windows'
// fallback tile shapes. Both take their tile walk and masks from prefill_tiles.h.
//
// FP8 compute (KV_FP8 != 0; docs/fp8.md, the semantics of the Hopper kernel's FP8 path): e4m3
// operands on the e4m3 MMAs (atom_mma.h mma_fp8: MFMA 16x16x32 fp8 on gfx942 / gfx950, mma.sync
// m16n8k32 on NVIDIA sm_89+), over the pack of hip_kernels.gather.gather_kv_fp8 (src/fp8_pack.h):
// K8 [total_pad, hk, D] and V^T [hk, D, total_pad] bytes, V^T's keys in the order of this target's
// P operand, so P's accumulators are the left operand of P V as they stand (to_operand_fp8).
// Q arrives 16-bit and each warp quantizes its rows into registers, one scale per (token, head)
// that joins the row's softmax scale. K/V scales: per tensor (KV_FP8 = 1: K's in the softmax
// scale, V's in the epilogue), per key (2) or per 16 keys (3, pages of a multiple of 16: K's joins
// the exp2's multiplier, the row max is taken per 16 keys on the unscaled S). The row's reference
// max moves only when the new one is more than kLazyLog2 past it (P <= 2^8, 2^7 in e4m3 FNUZ), and
// P's columns are multiplied by their V scale relative to the request's largest (v_ref, from the
// gather; KV_FP8 = 2 takes it per tile): O is kept in units of v_ref.
// O_PROMOTE (tiles, FP8; 0: off): two-level accumulation, as the Hopper kernel's. Every O_PROMOTE
// tiles of a request O's accumulators are added in fp32 to a second register copy (times the row
// factors of the rescales since the last addition) and restart from zero, so that O's bound holds
// whatever the e4m3 MMA keeps when it adds into its accumulator: Hopper's wgmma keeps ~14 bits,
// mma.sync e4m3 on H100 measured as exact as fp32 (the same result with and without promotion),
// MFMA e4m3 unmeasured (docs/fp8.md "Long requests").
//
// Defines: DTYPE (0 bf16, 1 fp16), HEAD_DIM (64|128|256), SOFTCAP (0|1), KV_FP8 (0|1|2|3: FP8
//          compute needs HEAD_DIM 64|128 and BLOCK_N 64|128),
//          tuning: NUM_WARPS, WARP_M_TILES (16-row tiles per warp), BLOCK_N, STAGES, MIN_BLOCKS,
//          Q_IN_REGS.

#include "atom_mma.h"
#include "fp8_pack.h"
#include "prefill_tiles.h"

#ifndef DTYPE
#define DTYPE 0
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 8
#endif
#ifndef BLOCK_N
#define BLOCK_N (HEAD_DIM > 128 ? 32 : 64)
#endif
#ifndef STAGES
#define STAGES (HEAD_DIM > 128 ? 2 : 3)
#endif
#ifndef WARP_M_TILES
#define WARP_M_TILES 1
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef Q_IN_REGS
#define Q_IN_REGS (KV_FP8 || HEAD_DIM * WARP_M_TILES <= 128)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif

namespace atom_prefill {

using namespace atom;
using atom::mma::acc_t;
using atom::mma::op_t;

#if DTYPE == 0
typedef bf16_t DT;
#else
typedef f16_t DT;
#endif

constexpr int D = HEAD_DIM;
constexpr int NW = NUM_WARPS;
constexpr int MT = WARP_M_TILES;  // 16-row tiles per warp
constexpr int WR = 16 * MT;       // query rows per warp
constexpr int BM = WR * NW;
constexpr int BN = BLOCK_N;
constexpr int NST = STAGES;
constexpr int NT = NW * ATOM_WARP_SIZE;
constexpr int CPR = D / 8;  // 16-byte chunks per row of 16-bit elements
constexpr bool kFp8 = KV_FP8 != 0;
constexpr bool kKeyScales = KV_FP8 >= 2;  // per page: scales per key (2) or per 16 keys (3)
constexpr bool kGroupScales = KV_FP8 == 3;
constexpr bool kGroupK = kGroupScales && !SOFTCAP;  // K's group scale joins the exp2's multiplier
#ifndef O_PROMOTE
#define O_PROMOTE 0
#endif
constexpr int kPromote = kFp8 ? O_PROMOTE : 0;
// How far (log2 units) a row's max may pass its reference before O is rescaled: P <= 2^8 in e4m3
// (largest 448), 2^7 in e4m3 FNUZ (largest 240).
constexpr float kLazyLog2 = ATOM_FP8_FNUZ ? 7.f : 8.f;
constexpr int EB = kFp8 ? 1 : 2;  // bytes per K, V element (Q arrives 16-bit either way)
constexpr int KSTEP = kFp8 ? 32 : 16;  // K-elements of one MMA (head dims of Q K^T, keys of P V)
static_assert(D % 16 == 0 && D >= 64, "head_dim must be a multiple of 16, at least 64 (8 chunks for the swizzle)");
static_assert(BN % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(NST >= 2, "the copy ring needs two stages");
static_assert(((BN * CPR) % NT == 0 && (BM * CPR) % NT == 0), "copies must spread evenly over the threads");
static_assert(!kFp8 || ((D == 64 || D == 128) && (BN == 64 || BN == 128) && Q_IN_REGS),
              "FP8 prefill: head_dim 64 or 128, BLOCK_N 64 or 128 (a tile inside one 128-key block of the pack), Q in registers");
constexpr int TILE_U16 = BN * D * EB / 2;  // a K or V tile, in 16-bit elements
constexpr int SMEM_BYTES = 2 * (BM * D + NST * 2 * TILE_U16);
static_assert(SMEM_BYTES <= 227 * 1024, "Q tile + K/V ring exceed the 227 KB of shared memory a CTA can have");

typedef mma::swizzled<D> SL;  // every 16-bit shared block: [rows][D], 16-byte chunks swizzled
ATOM_DEV int swz(int row, int col) { return SL::off(row, col); }
// e4m3 tiles are 16-bit blocks of half as many columns (atom_mma.h swizzled): K [BN keys][D] and
// V^T [D dims][BN keys] bytes.
constexpr int KROW = D * EB / 2;  // 16-bit columns of a K tile row
constexpr int VTROW = BN / 2;     // of an e4m3 V^T tile row

// ROWS rows of ROW 16-bit elements from global rows [row0, row0 + ROWS), row_stride apart (rows >=
// limit are zero-filled), into a swizzled<ROW> block.
template <int ROWS, int ROW = D>
ATOM_DEV void copy_rows(u16* dst, const u16* __restrict__ src, i64 row_stride, int row0, int limit) {
  constexpr int CH = ROW / 8;  // 16-byte chunks per row
  static_assert((ROWS * CH) % NT == 0, "copies must spread evenly over the threads");
#pragma unroll
  for (int i = 0; i < ROWS * CH / NT; ++i) {
    const int c = (int)tid_x() + i * NT;
    const int r = c / CH, ch = c % CH;
    const int gr = row0 + r;
    const bool ok = gr < limit;
    const u16* s = src + (i64)(ok ? gr : 0) * row_stride + ch * 8;
    mma::cp_async16(dst + mma::swizzled<ROW>::off(r, ch * 8), s, ok);
  }
}

// Four 16-bit values of a row of the Q tile (4-aligned column) as floats.
ATOM_DEV void load4(float* f, const u16* sQ, int row, int col) {
  const u32x2 w = load8(sQ + swz(row, col));
  f[0] = to_f32(DT{}, (u16)(w.x & 0xffffu));
  f[1] = to_f32(DT{}, (u16)(w.x >> 16));
  f[2] = to_f32(DT{}, (u16)(w.y & 0xffffu));
  f[3] = to_f32(DT{}, (u16)(w.y >> 16));
}

// FP8: the warp's Q rows (16-bit, sQw) -> e4m3 fragments in registers (the first D / 32 of each
// row tile's), one scale per row (token, head): s = max|q| / kFp8Max (1 for an all-zero row),
// q8 = rn(q / s) (docs/fp8.md); a_row of the lane's rows becomes a * s. The fragment's rows are
// acc_t's row slots, so acc_t::row_max reduces a row's maximum over the lanes that hold it. Two
// passes over shared memory (once per CTA) keep the 16-bit row out of registers.
ATOM_DEV void quantize_q(op_t (&qf)[MT][D / 16], float (&a_row)[MT][acc_t::row_slots], const u16* sQw, float a) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float amax[acc_t::row_slots], inv[acc_t::row_slots];
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) amax[s] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 32; ++kc)
#pragma unroll
      for (int w = 0; w < op_t::ne; ++w) {
        float f[4];
        load4(f, sQw, 16 * mt + acc_t::slot_row(op_t::slot8(w)), 32 * kc + op_t::k8(w));
        float& m = amax[op_t::slot8(w)];
        m = fmax_(fmax_(m, fmax_(fabs_(f[0]), fabs_(f[1]))), fmax_(fabs_(f[2]), fabs_(f[3])));
      }
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      const float m = acc_t::row_max(amax[s]);
      const float qsc = m > 0.f ? m / kFp8Max : 1.f;
      inv[s] = 1.f / qsc;
      a_row[mt][s] = a * qsc;
    }
#pragma unroll
    for (int kc = 0; kc < D / 32; ++kc)
#pragma unroll
      for (int w = 0; w < op_t::ne; ++w) {
        float f[4];
        load4(f, sQw, 16 * mt + acc_t::slot_row(op_t::slot8(w)), 32 * kc + op_t::k8(w));
        const float r = inv[op_t::slot8(w)];
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = fmin_(fmax_(f[i] * r, -kFp8Max), kFp8Max);  // rounding may pass the largest
        qf[mt][kc].x[w] = f32x4_to_fp8x4(f[0], f[1], f[2], f[3]);
      }
  }
}

// What masks a 16-row tile of S: its first key j0, its first row's key position p0, the request's
// keys, window and sink tokens; need: some element of it is masked (tile_needs_mask).
struct tile_mask {
  bool need;
  int j0, p0, sk, W, S;
  bool causal;
};
// S = -inf where the tile's query positions p0 + get_i cannot see the key.
ATOM_DEV void mask_tile(acc_t (&sa)[BN / 16], const tile_mask& mk) {
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) {
      const int j = mk.j0 + nt * 16 + acc_t::get_j(e);
      const int p = mk.p0 + acc_t::get_i(e);
      if (!visible(j, p, mk.sk, mk.causal, mk.W, mk.S)) sa[nt].x[e] = neg_inf();
    }
}

// 16-bit: mask and online softmax (log2 units) of one 16-row tile's S, O's rescale, P as 16-bit
// operands. a_log2: S's multiplier, scale * log2(e); with the soft-cap scale / softcap, S becomes
// tanh(S a_log2) and c_log2 (softcap * log2(e)) takes it to log2 units.
ATOM_DEV void softmax16(acc_t (&sa)[BN / 16], op_t (&pf)[BN / 16], acc_t (&oa)[D / 16], float (&m_run)[acc_t::row_slots],
                        float (&l_run)[acc_t::row_slots], const tile_mask& mk, float a_log2, float c_log2) {
  const float a_eff = SOFTCAP ? c_log2 : a_log2;
#if SOFTCAP
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) sa[nt].x[e] = tanh_(sa[nt].x[e] * a_log2);
#endif
  if (mk.need) mask_tile(sa, mk);

  // Online softmax (log2 units): new running max per row, rescale, exponentiate.
  float mx[acc_t::row_slots], alpha[acc_t::row_slots], msc[acc_t::row_slots];
#pragma unroll
  for (int s = 0; s < acc_t::row_slots; ++s) mx[s] = m_run[s];
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) {
      const int s = acc_t::row_slot(e);
      mx[s] = fmax_(mx[s], sa[nt].x[e]);
    }
#pragma unroll
  for (int s = 0; s < acc_t::row_slots; ++s) {
    mx[s] = acc_t::row_max(mx[s]);
    // A row with nothing visible yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
    msc[s] = mx[s] == neg_inf() ? 0.f : mx[s] * a_eff;
    alpha[s] = exp2_(m_run[s] * a_eff - msc[s]);
    m_run[s] = mx[s];
    l_run[s] *= alpha[s];
  }
  // Past the first tiles the running max rarely moves: skip the rescale when no row's did.
  bool moved = false;
#pragma unroll
  for (int s = 0; s < acc_t::row_slots; ++s) moved |= alpha[s] != 1.f;
  if (mma::warp_any(moved)) {
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) oa[dt].x[e] *= alpha[acc_t::row_slot(e)];
  }
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt) {
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) {
      const int s = acc_t::row_slot(e);
      const float pv = exp2_(sa[nt].x[e] * a_eff - msc[s]);
      sa[nt].x[e] = pv;
      l_run[s] += pv;
    }
    mma::to_operand<DT>(pf[nt], sa[nt]);
  }
}

// FP8: one KV tile's scales as the softmax takes them (KV_FP8 >= 2; src/fp8_pack.h). sc: the
// 128-key block's K scales then V's (relative to the block's v_max, v_tile: the request's largest V
// scale, so O's unit), fp8_scale_pos order; jb: the tile's first key in the block; gk / gv
// (KV_FP8 = 3): its 16-key groups' scales, K's > 0 (a zero-scale page's bytes are zero: -inf * 0
// would make a NaN of a masked key); vc: P's factor (<= 1, so P's e4m3 stays <= 2^kLazyLog2);
// vfac: O's, the old v_ref in units of the new one.
struct fp8_tile {
  const float* sc;
  int jb;
  float gk[BN / 16], gv[BN / 16], vc, vfac;
  ATOM_DEV float k(int j) const { return sc[fp8_scale_pos(jb + j)]; }
  ATOM_DEV float v(int j) const { return sc[kFp8Align + fp8_scale_pos(jb + j)]; }
};
// The scales of the tile at key jb of pack block blk ([hk][kv_blocks] index); KV_FP8 = 2 moves
// v_ref to the tile's v_max (as the Hopper kernel does); KV_FP8 = 3 keeps the unit's v_ref, which
// every block of the request holds.
ATOM_DEV fp8_tile fp8_tile_scales(const float* key_scales, const float* v_max, i64 blk, int jb, float& v_ref) {
  fp8_tile t;
  t.sc = nullptr;
  t.jb = jb;
  t.vc = t.vfac = 1.f;
  if constexpr (kKeyScales) {
    t.sc = key_scales + blk * 2 * kFp8Align;
    if constexpr (kGroupScales) {
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
        t.gk[nt] = fmax_(t.k(16 * nt), 1e-30f);
        t.gv[nt] = t.v(16 * nt);
      }
    } else {
      const float v_tile = v_max[blk];
      t.vfac = v_ref / v_tile;
      v_ref = v_tile;
    }
  }
  return t;
}

// FP8: mask and online softmax (log2 units) of one 16-row tile's S = Q8 K8^T (unscaled), then O's
// rescale and P as e4m3 operands (pf[0 .. BN / 32)). The row's reference max m_run moves only when
// the new max passes it by more than kLazyLog2, so most tiles leave O and l alone; l adds the
// unrounded P, P V takes P times its key's V factor (O in units of v_ref).
ATOM_DEV void fp8_softmax(acc_t (&sa)[BN / 16], op_t (&pf)[BN / 16], acc_t (&oa)[D / 16], float (&m_run)[acc_t::row_slots],
                          float (&l_run)[acc_t::row_slots], const float (&a_row)[acc_t::row_slots], const fp8_tile& t,
                          const tile_mask& mk, float c_log2, float (&hf)[acc_t::row_slots]) {
  constexpr int RS = acc_t::row_slots;
  float a_eff[RS];  // S's multiplier to log2 units after the soft-cap (which takes the scale first)
#pragma unroll
  for (int s = 0; s < RS; ++s) a_eff[s] = SOFTCAP ? c_log2 : a_row[s];
  if constexpr (KV_FP8 == 2) {
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) sa[nt].x[e] *= t.k(16 * nt + acc_t::get_j(e));
  } else if constexpr (kGroupScales && !kGroupK) {
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) sa[nt].x[e] *= t.gk[nt];
  }
#if SOFTCAP
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) sa[nt].x[e] = tanh_(sa[nt].x[e] * a_row[acc_t::row_slot(e)]);
#endif
  if (mk.need) mask_tile(sa, mk);
  float mx[RS], msc[RS], alpha[RS], rs[RS];
#pragma unroll
  for (int s = 0; s < RS; ++s) mx[s] = m_run[s];
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt) {
    if constexpr (kGroupK) {  // K's group scale times the group's unscaled max (scale > 0)
      float gm[RS];
#pragma unroll
      for (int s = 0; s < RS; ++s) gm[s] = neg_inf();
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) gm[acc_t::row_slot(e)] = fmax_(gm[acc_t::row_slot(e)], sa[nt].x[e]);
#pragma unroll
      for (int s = 0; s < RS; ++s) mx[s] = fmax_(mx[s], gm[s] * t.gk[nt]);
    } else {
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) mx[acc_t::row_slot(e)] = fmax_(mx[acc_t::row_slot(e)], sa[nt].x[e]);
    }
  }
#pragma unroll
  for (int s = 0; s < RS; ++s) {
    mx[s] = acc_t::row_max(mx[s]);
    const bool grow = m_run[s] == neg_inf() || (mx[s] - m_run[s]) * a_eff[s] > kLazyLog2;
    const float m_new = grow ? mx[s] : m_run[s];
    msc[s] = m_new == neg_inf() ? 0.f : m_new * a_eff[s];  // nothing visible yet: exp2 gives 0, not NaN
    alpha[s] = grow ? exp2_(m_run[s] * a_eff[s] - msc[s]) : 1.f;
    m_run[s] = m_new;
    rs[s] = 0.f;
  }
#pragma unroll
  for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e) {
      const int s = acc_t::row_slot(e);
      const float arg = sa[nt].x[e] * (kGroupK ? a_eff[s] * t.gk[nt] : a_eff[s]) - msc[s];
      const float pv = exp2_(arg);
      rs[s] += pv;
      sa[nt].x[e] = pv * (kGroupScales ? t.gv[nt] * t.vc : KV_FP8 == 2 ? t.v(16 * nt + acc_t::get_j(e)) : 1.f);
    }
  bool moved = false;
  float of[RS];
#pragma unroll
  for (int s = 0; s < RS; ++s) {
    l_run[s] = l_run[s] * alpha[s] + rs[s];
    of[s] = alpha[s] * t.vfac;
    moved |= of[s] != 1.f;
    if constexpr (kPromote != 0) hf[s] *= of[s];  // O's promoted part takes the rescales when it is read
  }
  if (mma::warp_any(moved)) {
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) oa[dt].x[e] *= of[acc_t::row_slot(e)];
  }
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) mma::to_operand_fp8(pf[kk], sa[2 * kk], sa[2 * kk + 1]);
}

}  // namespace atom_prefill

using namespace atom_prefill;

// q [*, hq, D], k/v [*, hk, D], o like q (strides in elements, last dim contiguous);
// lse [total_q, hq] fp32 or null; sinks [hq] fp32 or null; work [n, 2] int32 (b, t) or null.
// a_log2: scale * log2(e) (or scale / softcap with SOFTCAP); c_log2: softcap * log2(e).
// FP8 (else null / 0): k is the pack's K8 [total_pad, hk, D] (k_st, k_sh its strides) and v its
// V^T [hk, D, total_pad] (v_st: its stride between dims, v_sh: between heads), both e4m3 bytes;
// kv_scale: the per-tensor K and V scales (2 fp32, KV_FP8 = 1); key_scales [hk][kv_blocks][2][128]
// and v_max [hk][kv_blocks] fp32 (KV_FP8 >= 2, src/fp8_pack.h); cu_kp: the requests' first rows
// in the pack (keys: cu_k).
extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(NT, MIN_BLOCKS)
varlen_prefill(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse, const i32* __restrict__ cu_q,
               const i32* __restrict__ cu_k, const i32* __restrict__ work, const float* __restrict__ sinks,
               i64 q_st, i64 q_sh, i64 k_st, i64 k_sh, i64 v_st, i64 v_sh, i64 o_st, i64 o_sh,
               i64 batch, i64 q_per_kv, i64 max_tiles, i64 causal_i, i64 window_i, i64 sink_tok_i,
               float a_log2, float c_log2, const float* __restrict__ kv_scale, const float* __restrict__ key_scales,
               const float* __restrict__ v_max, i64 kv_blocks, const i32* __restrict__ cu_kp) {
#if ATOM_NVIDIA
  extern __shared__ __align__(16) unsigned char smem_raw[];
#else
  extern __shared__ unsigned char smem_raw[];
#endif
  u16* sQ = reinterpret_cast<u16*>(smem_raw);
  u16* sKV = sQ + BM * D;  // stage s: K tile at 2 s TILE_U16, V's (FP8: V^T's) after it

  const int h = (int)bid_x();
  int b, t;
  if (work != nullptr) {
    b = work[2 * bid_y()];
    t = work[2 * bid_y() + 1];
  } else {
    const int y = (int)bid_y();
    b = y % (int)batch;
    t = (int)max_tiles - 1 - y / (int)batch;
  }
  const int q0 = cu_q[b], sq = cu_q[b + 1] - q0;
  const int sk = cu_k[b + 1] - cu_k[b];
  const int k0 = kFp8 ? cu_kp[b] : cu_k[b];  // FP8: the request's first row in the 128-aligned pack
  const int m0 = t * BM;
  if (m0 >= sq) return;
  const int g = h / (int)q_per_kv;
  const bool causal = causal_i != 0;
  const int W = (int)window_i, S = (int)sink_tok_i;

  // FP8: K8 and V^T are e4m3 bytes (strides in bytes), moved as 16-bit pairs: V^T's rows are dims,
  // from the request's first key.
  const u16* qb = q + (i64)q0 * q_st + (i64)h * q_sh;
  const u16* kb = kFp8 ? reinterpret_cast<const u16*>(reinterpret_cast<const u8*>(k) + (i64)k0 * k_st + (i64)g * k_sh)
                       : k + (i64)k0 * k_st + (i64)g * k_sh;
  const u16* vb = kFp8 ? reinterpret_cast<const u16*>(reinterpret_cast<const u8*>(v) + (i64)g * v_sh + k0)
                       : v + (i64)k0 * v_st + (i64)g * v_sh;

  const int off = sk - sq;  // query row i sits at key position off + i
  const kv_walk kw(sq, sk, m0, BM, BN, causal, W, S);  // KV tiles of this CTA
  const int n_iter = kw.n_iter;

  // K/V tile kt into ring stage st (rows past the request's keys: zero; FP8: the pack's zero rows).
  auto load_tile = [&](int st, int kt) {
    u16* dst = sKV + 2 * st * TILE_U16;
    if constexpr (kFp8) {
      copy_rows<BN, KROW>(dst, kb, k_st / 2, kt * BN, sk);
      copy_rows<D, VTROW>(dst + TILE_U16, vb + kt * VTROW, v_st / 2, 0, D);
    } else {
      copy_rows<BN>(dst, kb, k_st, kt * BN, sk);
      copy_rows<BN>(dst + TILE_U16, vb, v_st, kt * BN, sk);
    }
  };
  copy_rows<BM>(sQ, qb, q_st, m0, sq);
  mma::cp_async_commit();
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < n_iter) load_tile(s, kw.tile(s));
    mma::cp_async_commit();
  }

  const int warp = (int)(tid_x() / ATOM_WARP_SIZE);
  const int wr0 = m0 + WR * warp;                  // first query row of this warp
  const int wp_first = off + wr0, wp_last = off + wr0 + WR - 1;
  const bool warp_live = wr0 < sq;
  const u16* sQw = sQ + WR * warp * D;

  // Q fragments stay in registers when they fit (Q_IN_REGS; FP8: always, D / 32 of them as e4m3),
  // else they are re-read from shared memory per tile (ldmatrix), which leaves the registers to the
  // accumulators.
  op_t qf[MT][Q_IN_REGS ? D / 16 : 1];
  acc_t oacc[MT][D / 16];
  // O_PROMOTE: O = ohi * hf + oacc once promoted (ohi: the earlier tiles' sums in fp32).
  acc_t ohi[MT][kPromote ? D / 16 : 1];
  float m_run[MT][acc_t::row_slots], l_run[MT][acc_t::row_slots], hf[MT][acc_t::row_slots];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) mma::zero(oacc[mt][dt]);
#pragma unroll
    for (int dt = 0; dt < (kPromote ? D / 16 : 1); ++dt) mma::zero(ohi[mt][dt]);
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      m_run[mt][s] = neg_inf();
      l_run[mt][s] = 0.f;
      hf[mt][s] = 1.f;
    }
  }
  // O's accumulators into ohi (ohi = ohi * hf + oacc), which restart from zero.
  auto promote = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int dt = 0; dt < (kPromote ? D / 16 : 0); ++dt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) {
          ohi[mt][dt].x[e] = fma_(ohi[mt][dt].x[e], hf[mt][acc_t::row_slot(e)], oacc[mt][dt].x[e]);
          oacc[mt][dt].x[e] = 0.f;
        }
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) hf[mt][s] = 1.f;
    }
  };
#if SOFTCAP
  constexpr bool kSoftcap = true;
#else
  constexpr bool kSoftcap = false;
#endif
  const float a_eff = kSoftcap ? c_log2 : a_log2;  // S's multiplier to log2 units (soft-cap: S is tanh(S a_log2))
  // FP8: per-tensor scales (K's joins the softmax scale, V's the epilogue's); a_row: a row's scale
  // of S in log2 units, times Q's row scale and K's per-tensor one once Q is quantized; v_ref: the
  // V scale O's accumulator is in units of (KV_FP8 >= 2).
  const float k_scale = KV_FP8 == 1 ? kv_scale[0] : 1.f, v_scale = KV_FP8 == 1 ? kv_scale[1] : 1.f;
  float a_row[MT][acc_t::row_slots];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) a_row[mt][s] = a_log2;
  float v_ref = 1.f;
  if (kGroupScales && sk > 0) v_ref = v_max[(i64)g * kv_blocks + k0 / kFp8Align];  // the request's largest V scale

  for (int it = 0; it < n_iter; ++it) {
    mma::cp_async_wait<NST - 2>();
    sync_block();
#if Q_IN_REGS
    if (it == 0) {
      if constexpr (kFp8) {
        quantize_q(qf, a_row, sQw, a_log2 * k_scale);
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kc = 0; kc < D / 16; ++kc)
            mma::load_rows<D>(qf[mt][kc], sQw, mt * 16, kc * 16);
      }
    }
#endif
    {
      const int nx = it + NST - 1;
      if (nx < n_iter) load_tile(nx % NST, kw.tile(nx));
      mma::cp_async_commit();
    }
    const int kt = kw.tile(it);
    const int j0 = kt * BN, j1 = j0 + BN;  // keys [j0, j1) of this tile
    // Fully masked for this warp's rows: beyond causality, or below the window and no sink token.
    const bool skip = !warp_live || (causal && j0 > wp_last) || (W > 0 && j1 - 1 <= wp_first - W && j0 >= S);
    if (skip) continue;
    const bool need_mask = tile_needs_mask(j0, j1, wp_first, wp_last, sk, causal, W, S);
    const u16* sK = sKV + 2 * (it % NST) * TILE_U16;
    const u16* sV = sK + TILE_U16;

    // S = Q K^T: each K fragment serves the warp's MT row tiles.
    acc_t sacc[MT][BN / 16];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) mma::zero(sacc[mt][nt]);
#pragma unroll
    for (int kc = 0; kc < D / KSTEP; ++kc) {
#if Q_IN_REGS
      const op_t* qk[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) qk[mt] = &qf[mt][kc];
#else
      op_t qt[MT];
      const op_t* qk[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma::load_rows<D>(qt[mt], sQw, mt * 16, kc * 16);
        qk[mt] = &qt[mt];
      }
#endif
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
        op_t kf;
        mma::load_rows<KROW>(kf, sK, nt * 16, kc * 16);  // FP8: 32 bytes of 16 keys
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (kFp8) mma::mma_fp8(sacc[mt][nt], *qk[mt], kf);
          else mma::mma<DT>(sacc[mt][nt], *qk[mt], kf);
        }
      }
    }

    // Softmax of each row tile; P as operands (BN / 16 16-bit fragments, or BN / 32 e4m3 ones).
    op_t pf[MT][BN / 16];
    auto mask = [&](int mt) { return tile_mask{need_mask, j0, wp_first + 16 * mt, sk, W, S, causal}; };
    if constexpr (kFp8) {
      const fp8_tile ts = fp8_tile_scales(key_scales, v_max, (i64)g * kv_blocks + (k0 + j0) / kFp8Align,
                                          j0 % kFp8Align, v_ref);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fp8_softmax(sacc[mt], pf[mt], oacc[mt], m_run[mt], l_run[mt], a_row[mt], ts, mask(mt), c_log2, hf[mt]);
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) softmax16(sacc[mt], pf[mt], oacc[mt], m_run[mt], l_run[mt], mask(mt), a_log2, c_log2);
    }

    // O += P V: each V fragment serves the warp's MT row tiles.
#pragma unroll
    for (int kk = 0; kk < BN / KSTEP; ++kk) {
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        op_t vf;
        if constexpr (kFp8) {
          mma::load_rows<VTROW>(vf, sV, dt * 16, kk * 16);  // V^T: 16 dims x 32 keys
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma::mma_fp8(oacc[mt][dt], pf[mt][kk], vf);
        } else {
          mma::load_cols<D>(vf, sV, kk * 16, dt * 16);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma::mma<DT>(oacc[mt][dt], pf[mt][kk], vf);
        }
      }
    }
    if (kPromote && n_iter > kPromote && (it + 1) % (kPromote ? kPromote : 1) == 0) promote();
  }
  // The promoted part back into O (a request of at most O_PROMOTE tiles never promoted).
  if (kPromote && n_iter > kPromote)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int dt = 0; dt < (kPromote ? D / 16 : 0); ++dt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e)
          oacc[mt][dt].x[e] = fma_(ohi[mt][dt].x[e], hf[mt][acc_t::row_slot(e)], oacc[mt][dt].x[e]);

  // Epilogue: normalise (sink in the denominator), lse, stage O through this warp's Q rows.
  mma::cp_async_wait<0>();
  sync_block();
  u16* sO = const_cast<u16*>(sQw);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[acc_t::row_slots];
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      const float l = acc_t::row_sum(l_run[mt][s]);
      const int row = wr0 + 16 * mt + acc_t::slot_row(s);
      float lse_v = neg_inf();
      inv[s] = 0.f;
      if (l > 0.f) {
        const float m2 = m_run[mt][s] * (kFp8 && !kSoftcap ? a_row[mt][s] : a_eff);
        lse_v = (m2 + log2_(l)) * kLn2;
        float den = l;
        if (sinks != nullptr) den += exp2_(sinks[h] * kLog2e - m2);
        inv[s] = (KV_FP8 == 1 ? v_scale : kKeyScales ? v_ref : 1.f) / den;
      }
      if (lse != nullptr && acc_t::row_leader() && row < sq) lse[(i64)(q0 + row) * (i64)gdim_x() + h] = lse_v;
    }
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; e += 2) {
        const float f = inv[acc_t::row_slot(e)];
        const u32 w = pack2(DT{}, oacc[mt][dt].x[e] * f, oacc[mt][dt].x[e + 1] * f);
        *reinterpret_cast<u32*>(sO + swz(16 * mt + acc_t::get_i(e), dt * 16 + acc_t::get_j(e))) = w;
      }
  }
  mma::warp_sync();
  const int lane = (int)lane_id();
#pragma unroll
  for (int i = 0; i < WR * CPR / ATOM_WARP_SIZE; ++i) {
    const int c = lane + i * ATOM_WARP_SIZE;
    const int r = c / CPR, ch = c % CPR;
    if (wr0 + r < sq) {
      u16* dst = o + (i64)(q0 + wr0 + r) * o_st + (i64)h * o_sh + ch * 8;
      store16(dst, load16(sO + swz(r, ch * 8)));
    }
  }
}
