// Varlen prefill attention over packed KV (DESIGN.md: every visibility rule, sinks, lse).
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
// Defines: DTYPE (0 bf16, 1 fp16), HEAD_DIM (64|128|256), SOFTCAP (0|1),
//          tuning: NUM_WARPS, WARP_M_TILES (16-row tiles per warp), BLOCK_N, STAGES, MIN_BLOCKS,
//          Q_IN_REGS, EXP_POLY (how many of the BLOCK_N/16 key groups take exp2 from a polynomial
//          on the FMA pipe instead of the special-function unit), DIAG (timing experiments only:
//          1 = no exp2, 2 = no softmax; results are wrong).

#include "atom_mma.h"
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
#ifndef Q_IN_REGS
#define Q_IN_REGS (HEAD_DIM * WARP_M_TILES <= 128)
#endif
#ifndef EXP_POLY
#define EXP_POLY 0
#endif
#ifndef DIAG
#define DIAG 0
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
constexpr int CPR = D / 8;  // 16-byte chunks per row
static_assert(D % 16 == 0 && D >= 64, "head_dim must be a multiple of 16, at least 64 (8 chunks for the swizzle)");
static_assert(BN % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(NST >= 2, "the copy ring needs two stages");
static_assert(((BN * CPR) % NT == 0 && (BM * CPR) % NT == 0), "copies must spread evenly over the threads");
constexpr int TILE_ELEMS = BN * D;
constexpr int SMEM_ELEMS = BM * D + NST * 2 * TILE_ELEMS;
static_assert(SMEM_ELEMS * 2 <= 227 * 1024, "Q tile + K/V ring exceed the 227 KB of shared memory a CTA can have");

typedef mma::swizzled<D> SL;  // every shared block: [rows][D], 16-byte chunks swizzled
ATOM_DEV int swz(int row, int col) { return SL::off(row, col); }

// rows x D elements from global rows [row0, row0 + rows) (rows >= limit are zero-filled).
template <int ROWS>
ATOM_DEV void copy_rows(u16* dst, const u16* __restrict__ src, i64 row_stride, int row0, int limit) {
  constexpr int PER = ROWS * CPR / NT;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = (int)tid_x() + i * NT;
    const int r = c / CPR, ch = c % CPR;
    const int gr = row0 + r;
    const bool ok = gr < limit;
    const u16* s = src + (i64)(ok ? gr : 0) * row_stride + ch * 8;
    mma::cp_async16(dst + swz(r, ch * 8), s, ok);
  }
}

}  // namespace atom_prefill

using namespace atom_prefill;

// q [*, hq, D], k/v [*, hk, D], o like q (strides in elements, last dim contiguous);
// lse [total_q, hq] fp32 or null; sinks [hq] fp32 or null; work [n, 2] int32 (b, t) or null.
// a_log2: scale * log2(e) (or scale / softcap with SOFTCAP); c_log2: softcap * log2(e).
extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(NT, MIN_BLOCKS)
varlen_prefill(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse, const i32* __restrict__ cu_q,
               const i32* __restrict__ cu_k, const i32* __restrict__ work, const float* __restrict__ sinks,
               i64 q_st, i64 q_sh, i64 k_st, i64 k_sh, i64 v_st, i64 v_sh, i64 o_st, i64 o_sh,
               i64 batch, i64 q_per_kv, i64 max_tiles, i64 causal_i, i64 window_i, i64 sink_tok_i,
               float a_log2, float c_log2) {
#if ATOM_NVIDIA
  extern __shared__ __align__(16) unsigned char smem_raw[];
#else
  extern __shared__ unsigned char smem_raw[];
#endif
  u16* sQ = reinterpret_cast<u16*>(smem_raw);
  u16* sKV = sQ + BM * D;

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
  const int k0 = cu_k[b], sk = cu_k[b + 1] - k0;
  const int m0 = t * BM;
  if (m0 >= sq) return;
  const int g = h / (int)q_per_kv;
  const bool causal = causal_i != 0;
  const int W = (int)window_i, S = (int)sink_tok_i;

  const u16* qb = q + (i64)q0 * q_st + (i64)h * q_sh;
  const u16* kb = k + (i64)k0 * k_st + (i64)g * k_sh;
  const u16* vb = v + (i64)k0 * v_st + (i64)g * v_sh;

  const int off = sk - sq;  // query row i sits at key position off + i
  const kv_walk kw(sq, sk, m0, BM, BN, causal, W, S);  // KV tiles of this CTA
  const int n_iter = kw.n_iter;

  copy_rows<BM>(sQ, qb, q_st, m0, sq);
  mma::cp_async_commit();
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < n_iter) {
      const int kt = kw.tile(s);
      copy_rows<BN>(sKV + (2 * s) * TILE_ELEMS, kb, k_st, kt * BN, sk);
      copy_rows<BN>(sKV + (2 * s + 1) * TILE_ELEMS, vb, v_st, kt * BN, sk);
    }
    mma::cp_async_commit();
  }

  const int warp = (int)(tid_x() / ATOM_WARP_SIZE);
  const int wr0 = m0 + WR * warp;                  // first query row of this warp
  const int wp_first = off + wr0, wp_last = off + wr0 + WR - 1;
  const bool warp_live = wr0 < sq;
  const u16* sQw = sQ + WR * warp * D;

  // Q fragments stay in registers when they fit (Q_IN_REGS), else they are re-read from shared
  // memory per tile (ldmatrix), which leaves the registers to the accumulators.
  op_t qf[MT][Q_IN_REGS ? D / 16 : 1];
  acc_t oacc[MT][D / 16];
  float m_run[MT][acc_t::row_slots], l_run[MT][acc_t::row_slots];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) mma::zero(oacc[mt][dt]);
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      m_run[mt][s] = neg_inf();
      l_run[mt][s] = 0.f;
    }
  }
#if SOFTCAP
  constexpr bool kSoftcap = true;
#else
  constexpr bool kSoftcap = false;
#endif
  const float a_eff = kSoftcap ? 1.f : a_log2;

  for (int it = 0; it < n_iter; ++it) {
    mma::cp_async_wait<NST - 2>();
    sync_block();
#if Q_IN_REGS
    if (it == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc)
          mma::load_rows<D>(qf[mt][kc], sQw, mt * 16, kc * 16);
    }
#endif
    {
      const int nx = it + NST - 1;
      if (nx < n_iter) {
        const int st = nx % NST;
        const int kt = kw.tile(nx);
        copy_rows<BN>(sKV + (2 * st) * TILE_ELEMS, kb, k_st, kt * BN, sk);
        copy_rows<BN>(sKV + (2 * st + 1) * TILE_ELEMS, vb, v_st, kt * BN, sk);
      }
      mma::cp_async_commit();
    }
    const int kt = kw.tile(it);
    const int j0 = kt * BN, j1 = j0 + BN;  // keys [j0, j1) of this tile
    // Fully masked for this warp's rows: beyond causality, or below the window and no sink token.
    const bool skip = !warp_live || (causal && j0 > wp_last) || (W > 0 && j1 - 1 <= wp_first - W && j0 >= S);
    if (skip) continue;
    const bool need_mask = tile_needs_mask(j0, j1, wp_first, wp_last, sk, causal, W, S);
    const u16* sK = sKV + (2 * (it % NST)) * TILE_ELEMS;
    const u16* sV = sK + TILE_ELEMS;

    // S = Q K^T: each K fragment serves the warp's MT row tiles.
    acc_t sacc[MT][BN / 16];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) mma::zero(sacc[mt][nt]);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
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
        mma::load_rows<D>(kf, sK, nt * 16, kc * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma::mma<DT>(sacc[mt][nt], *qk[mt], kf);
      }
    }

    op_t pf[MT][BN / 16];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#if SOFTCAP
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) sacc[mt][nt].x[e] = softcap_fn(sacc[mt][nt].x[e] * a_log2, c_log2);
#endif
      if (need_mask) {
        const int p0 = wp_first + 16 * mt;
#pragma unroll
        for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
          for (int e = 0; e < acc_t::ne; ++e) {
            const int j = j0 + nt * 16 + acc_t::get_j(e);
            const int p = p0 + acc_t::get_i(e);
            if (!visible(j, p, sk, causal, W, S)) sacc[mt][nt].x[e] = neg_inf();
          }
      }

      // Online softmax (log2 units): new running max per row, rescale, exponentiate.
      float mx[acc_t::row_slots], alpha[acc_t::row_slots], msc[acc_t::row_slots];
#if DIAG != 2
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) mx[s] = m_run[mt][s];
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) {
          const int s = acc_t::row_slot(e);
          mx[s] = fmax_(mx[s], sacc[mt][nt].x[e]);
        }
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) {
        mx[s] = acc_t::row_max(mx[s]);
        // A row with nothing visible yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
        msc[s] = mx[s] == neg_inf() ? 0.f : mx[s] * a_eff;
        alpha[s] = exp2_(m_run[mt][s] * a_eff - msc[s]);
        m_run[mt][s] = mx[s];
        l_run[mt][s] *= alpha[s];
      }
      // Past the first tiles the running max rarely moves: skip the rescale when no row's did.
      bool moved = false;
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) moved |= alpha[s] != 1.f;
      if (mma::warp_any(moved)) {
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
          for (int e = 0; e < acc_t::ne; ++e) oacc[mt][dt].x[e] *= alpha[acc_t::row_slot(e)];
      }
#else
      (void)alpha; (void)mx;
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) msc[s] = 0.f;
#endif
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) {
          const int s = acc_t::row_slot(e);
#if DIAG == 1
          const float pv = fmax_(sacc[mt][nt].x[e] * a_eff - msc[s] + 1.f, 0.f);
#elif DIAG == 2
          const float pv = sacc[mt][nt].x[e];
#else
          const float arg = sacc[mt][nt].x[e] * a_eff - msc[s];
          const float pv = nt < EXP_POLY ? exp2_fma(arg) : exp2_(arg);
#endif
          sacc[mt][nt].x[e] = pv;
          l_run[mt][s] += pv;
        }
        mma::to_operand<DT>(pf[mt][nt], sacc[mt][nt]);
      }
    }

    // O += P V: each V fragment serves the warp's MT row tiles.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        op_t vf;
        mma::load_cols<D>(vf, sV, kk * 16, dt * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma::mma<DT>(oacc[mt][dt], pf[mt][kk], vf);
      }
    }
  }

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
        const float m2 = m_run[mt][s] * a_eff;
        lse_v = (m2 + log2_(l)) * kLn2;
        float den = l;
        if (sinks != nullptr) den += exp2_(sinks[h] * kLog2e - m2);
        inv[s] = 1.f / den;
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
