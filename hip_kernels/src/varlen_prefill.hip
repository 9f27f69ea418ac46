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
// Hopper (WGMMA=1 on a target with ATOM_HAS_WGMMA, i.e. NVRTC sm_90a; d = 64/128): the same
// walk and softmax, but each warpgroup (4 warps, 64 query rows) issues wgmma.mma_async:
//   S = Q K^T   A = Q and B = the K tile, both straight from shared memory (128-byte swizzle),
//   O += P V    A = P in registers (the S accumulator converted in place), B = the V tile
//               read MN-major from shared memory (transpose flag).
// K and V have separate rings of STAGES tiles; iteration i issues S(i), then O += P(i-1) V(i-1),
// so the softmax of tile i overlaps the P V product of tile i-1 on the tensor cores.
// With WGMMA=1 on any other target (sm_80, gfx942, gfx950) the portable body below is built with
// the same BLOCK_M and thread count, so every variant compiles everywhere.
//
// Defines: DTYPE (0 bf16, 1 fp16), HEAD_DIM (64|128|256), SOFTCAP (0|1), WGMMA (0|1),
//          tuning: NUM_WARPS, WARP_M_TILES (16-row tiles per warp), BLOCK_N, STAGES, MIN_BLOCKS,
//          Q_IN_REGS, EXP_POLY (how many of the BLOCK_N/16 key groups take exp2 from a polynomial
//          on the FMA pipe instead of the special-function unit), DIAG (timing experiments only:
//          1 = no exp2, 2 = no softmax; results are wrong); wgmma only: WS (0|1: a producer warp
//          copies through an mbarrier ring instead of every thread + a block barrier per tile;
//          correct, slower on H100: docs/perf/prefill.md).

#include "atom_mma.h"

#ifndef WGMMA
#define WGMMA 0
#endif
#ifndef WS
#define WS 0  // wgmma path: + one producer warp that does every copy (mbarrier ring); slower, see docs
#endif
#if WGMMA && ATOM_HAS_WGMMA
#define PREFILL_WGMMA 1
#else
#define PREFILL_WGMMA 0
#if WGMMA
// The Hopper variant built for a target without wgmma: portable tile defaults, same BLOCK_M.
#undef BLOCK_N
#undef STAGES
#endif
#endif

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
static_assert(PREFILL_WGMMA || ((BN * CPR) % NT == 0 && (BM * CPR) % NT == 0), "copies must spread evenly over the threads");
constexpr int TILE_ELEMS = BN * D;
constexpr int SMEM_ELEMS = BM * D + NST * 2 * TILE_ELEMS;
static_assert(SMEM_ELEMS * 2 <= 227 * 1024, "Q tile + K/V ring exceed the 227 KB of shared memory a CTA can have");

ATOM_DEV int imin(int a, int b) { return a < b ? a : b; }
ATOM_DEV int imax(int a, int b) { return a > b ? a : b; }

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

// 2^x for x <= 0 on the FMA pipe: 2^floor(x) * p(frac), p a cubic fit (relative error < 1e-4,
// far under the bf16/fp16 rounding of P); x < -126 (and -inf) gives 0.
// floor / fma: belong in atom_device.h (asked for); NVRTC has no __builtin_floorf.
#if ATOM_NVIDIA
ATOM_DEV float floor_(float x) { return floorf(x); }
ATOM_DEV float fma_(float a, float b, float c) { return fmaf(a, b, c); }
#else
ATOM_DEV float floor_(float x) { return __builtin_floorf(x); }
ATOM_DEV float fma_(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#endif
ATOM_DEV float exp2_fma(float x) {
  const float xi = floor_(x);
  const float f = x - xi;
  const float p = fma_(fma_(fma_(0.07705726f, f, 0.22765566f), f, 0.69511443f), f, 1.0f);
  const float r = u32_as_f32(f32_as_u32(p) + ((u32)(int)xi << 23));
  return x < -126.f ? 0.f : r;
}

#if SOFTCAP
// c * tanh(x) with tanh from exp2 (|error| ~1e-6 relative, far under bf16 rounding).
ATOM_DEV float softcap_fn(float x, float c) {
  const float ax = fmin_(x < 0.f ? -x : x, 15.f);
  const float e = exp2_(ax * (2.f * kLog2e));
  const float t = 1.f - 2.f / (e + 1.f);
  return c * (x < 0.f ? -t : t);
}
#endif

}  // namespace atom_prefill

using namespace atom_prefill;

#if PREFILL_WGMMA
namespace atom_prefill {
namespace wg = atom::mma::wgmma;
constexpr int NWG = NW / 4;  // warpgroups, 64 query rows each
static_assert(NW % 4 == 0 && MT == 1 && BM == 64 * NWG, "wgmma: whole warpgroups of 64 rows");
static_assert(D == 64 || D == 128, "wgmma path: head_dim 64 or 128");
static_assert(BN == 64 || BN == 128, "wgmma path: BLOCK_N 64 or 128");
typedef wg::sw128<BM> LQ;  // Q (and the output staging): [D/64][BM][64]
typedef wg::sw128<BN> LKV;  // K and V tiles: [D/64][BN][64]


#if WS
constexpr int NCP = ATOM_WARP_SIZE;  // copying threads: one producer warp after the warpgroups
#else
constexpr int NCP = NT;  // every thread copies
#endif
constexpr int NTB = NT + (WS ? ATOM_WARP_SIZE : 0);  // threads of the block

template <int ROWS>
ATOM_DEV void copy_rows_sw128(u16* dst, const u16* __restrict__ src, i64 row_stride, int row0, int limit, int ct) {
  constexpr int PER = (ROWS * CPR + NCP - 1) / NCP;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = ct + i * NCP;
    if ((ROWS * CPR) % NCP == 0 || c < ROWS * CPR) {
      const int r = c / CPR, ch = c % CPR;
      const int gr = row0 + r;
      const bool ok = gr < limit;
      mma::cp_async16(dst + wg::sw128<ROWS>::off(r, ch * 8), src + (i64)(ok ? gr : 0) * row_stride + ch * 8, ok);
    }
  }
}
}  // namespace atom_prefill

extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(NTB, 1)
varlen_prefill(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse, const i32* __restrict__ cu_q,
               const i32* __restrict__ cu_k, const i32* __restrict__ work, const float* __restrict__ sinks,
               i64 q_st, i64 q_sh, i64 k_st, i64 k_sh, i64 v_st, i64 v_sh, i64 o_st, i64 o_sh,
               i64 batch, i64 q_per_kv, i64 max_tiles, i64 causal_i, i64 window_i, i64 sink_tok_i,
               float a_log2, float c_log2) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzle atoms need 1024-byte alignment: the host adds 1024 bytes of slack.
  u16* sQ = reinterpret_cast<u16*>(wg::align1024(smem_raw));
  u16* sK = sQ + BM * D;             // NST K tiles
  u16* sV = sK + NST * TILE_ELEMS;  // NST V tiles

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

  // KV tiles of this CTA: sink-token tiles, then the band (as in the portable body).
  const int off = sk - sq;
  const int p_first = off + m0, p_last = off + imin(m0 + BM, sq) - 1;
  const int hi_key = causal ? imin(sk, p_last + 1) : sk;
  const int lo_key = W > 0 ? imax(0, p_first - W + 1) : 0;
  int n_sink = 0, first = 0, last = 0;
  if (hi_key > 0) {
    last = (hi_key + BN - 1) / BN;
    n_sink = (W > 0 && S > 0) ? imin((S + BN - 1) / BN, last) : 0;
    first = imax(n_sink, lo_key / BN);
  }
  const int n_iter = n_sink + imax(0, last - first);
  auto tile_of = [&](int it) { return it < n_sink ? it : first + (it - n_sink); };

#if WS
  static_assert(ATOM_WARP_SIZE == 32, "");
  // One producer warp (after the consumer warpgroups) copies Q and every K / V tile; consumers
  // wait on full[stage] and release empty[stage] (one arrival per consumer warp) once their MMAs
  // reading it have completed. The warpgroups never meet at a block barrier, so they drift out
  // of phase and one's softmax overlaps the other's MMAs.
  u64* bars = reinterpret_cast<u64*>(sV + NST * TILE_ELEMS);
  u64 *fullK = bars, *fullV = bars + NST, *emptyK = bars + 2 * NST, *emptyV = bars + 3 * NST, *fullQ = bars + 4 * NST;
  if (tid_x() == 0) {
    for (int s = 0; s < NST; ++s) {
      wg::mbar_init(fullK + s, NCP);
      wg::mbar_init(fullV + s, NCP);
      wg::mbar_init(emptyK + s, 4 * NWG);
      wg::mbar_init(emptyV + s, 4 * NWG);
    }
    wg::mbar_init(fullQ, NCP);
    wg::mbar_init_fence();
  }
  sync_block();
  const int wgi = wg::warpgroup_index();
  if (wgi == NWG) {
    const int ct = (int)lane_id();
    copy_rows_sw128<BM>(sQ, qb, q_st, m0, sq, ct);
    wg::mbar_arrive_cp_async(fullQ);
    for (int it = 0; it < n_iter; ++it) {
      const int s = it % NST, ph = ((it / NST) + 1) & 1;
      const int j0 = tile_of(it) * BN;
      if (it >= NST) wg::mbar_wait(emptyK + s, ph);
      copy_rows_sw128<BN>(sK + s * TILE_ELEMS, kb, k_st, j0, sk, ct);
      wg::mbar_arrive_cp_async(fullK + s);
      if (it >= NST) wg::mbar_wait(emptyV + s, ph);
      copy_rows_sw128<BN>(sV + s * TILE_ELEMS, vb, v_st, j0, sk, ct);
      wg::mbar_arrive_cp_async(fullV + s);
    }
    mma::cp_async_wait<0>();
    return;
  }
  const int grp = wgi;  // consumer warpgroup
#else
  constexpr int AHEAD = NST - 1;
  // Copy groups: group i holds K of iteration i and V of iteration i - 1 (iteration i multiplies
  // by V of the tile before); AHEAD groups are in flight before the first iteration.
  const int ct = (int)tid_x();
  copy_rows_sw128<BM>(sQ, qb, q_st, m0, sq, ct);
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < n_iter) copy_rows_sw128<BN>(sK + (s % NST) * TILE_ELEMS, kb, k_st, tile_of(s) * BN, sk, ct);
    if (s >= 1 && s - 1 < n_iter) copy_rows_sw128<BN>(sV + ((s - 1) % NST) * TILE_ELEMS, vb, v_st, tile_of(s - 1) * BN, sk, ct);
    mma::cp_async_commit();
  }
  const int grp = (int)(tid_x() / 128);  // warpgroup
#endif
  const int warp = (int)((tid_x() / ATOM_WARP_SIZE) % 4);  // warp in the warpgroup
  const int wr0 = m0 + 64 * grp;              // first query row of the warpgroup
  const int wp_first = off + wr0, wp_last = off + wr0 + 63;
  const int p_warp = wp_first + 16 * warp;  // position of this warp's first row

  acc_t oacc[D / 16], sacc[BN / 16];
  op_t pf[BN / 16];
  float m_run[acc_t::row_slots], l_run[acc_t::row_slots];
#pragma unroll
  for (int dt = 0; dt < D / 16; ++dt) mma::zero(oacc[dt]);
#pragma unroll
  for (int s = 0; s < acc_t::row_slots; ++s) {
    m_run[s] = neg_inf();
    l_run[s] = 0.f;
  }
#if SOFTCAP
  constexpr bool kSoftcap = true;
#else
  constexpr bool kSoftcap = false;
#endif
  const float a_eff = kSoftcap ? 1.f : a_log2;

  // Every wgmma is issued on a path that is uniform over the CTA (a wgmma under a branch that
  // depends on the thread is serialised by ptxas): no per-warpgroup tile skipping here; a tile
  // that is fully masked for one warpgroup's rows only gives it P = 0.
  // Start of iteration it: K(it) and V(it - 1) have landed for every thread, and every
  // warpgroup is done with the stages the next copies overwrite (K(it - 1), V(it - 2)).
#if WS
  auto wait_k = [&](int it) { wg::mbar_wait(fullK + it % NST, (it / NST) & 1); };
  auto wait_v = [&](int it) { wg::mbar_wait(fullV + it % NST, (it / NST) & 1); };
  auto free_k = [&](int it) { if (lane_id() == 0) wg::mbar_arrive(emptyK + it % NST); };
  auto free_v = [&](int it) { if (lane_id() == 0) wg::mbar_arrive(emptyV + it % NST); };
#else
  auto next_tile = [&](int it) {
    mma::cp_async_wait<AHEAD - 1>();
    wg::fence_proxy_async();
    sync_block();
    const int nk = it + AHEAD, nv = nk - 1;
    if (nk < n_iter) copy_rows_sw128<BN>(sK + (nk % NST) * TILE_ELEMS, kb, k_st, tile_of(nk) * BN, sk, ct);
    if (nv < n_iter) copy_rows_sw128<BN>(sV + (nv % NST) * TILE_ELEMS, vb, v_st, tile_of(nv) * BN, sk, ct);
    mma::cp_async_commit();
  };
#endif
  auto issue_s = [&](int it) {  // S = Q K^T of tile it
    const u16* sKs = sK + (it % NST) * TILE_ELEMS;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc)
      wg::op<BN, DT>::ss(sacc, wg::desc_k(sQ + LQ::off(64 * grp, kc * 16)), wg::desc_k(sKs + LKV::off(0, kc * 16)), kc);
    wg::commit();
  };
  auto issue_pv = [&](int it) {  // O += P V of tile it
    const u16* sVs = sV + (it % NST) * TILE_ELEMS;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wg::op<D, DT>::rs_t(oacc, pf[kk], wg::desc_mn<BN>(sVs + LKV::off(kk * 16, 0)));
    wg::commit();
  };
  // Mask and online softmax (log2 units) of tile it: sacc becomes P; returns the row rescale.
  // rs: the row sums of P (this lane's part).
  auto softmax = [&](int it, float* alpha, float* rs) {
    wg::fence_regs(sacc);
    const int j0 = tile_of(it) * BN, j1 = j0 + BN;
#if SOFTCAP
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] = softcap_fn(sacc[nt].x[e] * a_log2, c_log2);
#endif
    const bool need_mask = j1 > sk || (causal && j1 - 1 > wp_first) || (W > 0 && j0 <= wp_last - W && j1 > S);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) {
          const int j = j0 + nt * 16 + acc_t::get_j(e);
          const int p = p_warp + acc_t::get_i(e);
          const bool vis = j < sk && (!causal || j <= p) && (W <= 0 || j > p - W || j < S);
          if (!vis) sacc[nt].x[e] = neg_inf();
        }
    }
    float mx[acc_t::row_slots], msc[acc_t::row_slots];
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) mx[s] = m_run[s];
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) mx[acc_t::row_slot(e)] = fmax_(mx[acc_t::row_slot(e)], sacc[nt].x[e]);
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      mx[s] = acc_t::row_max(mx[s]);
      msc[s] = mx[s] == neg_inf() ? 0.f : mx[s] * a_eff;  // nothing visible yet: exp2 gives 0, not NaN
      alpha[s] = exp2_(m_run[s] * a_eff - msc[s]);
      m_run[s] = mx[s];
      rs[s] = 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) {
        const int s = acc_t::row_slot(e);
        const float pv = exp2_(sacc[nt].x[e] * a_eff - msc[s]);
        sacc[nt].x[e] = pv;
        rs[s] += pv;
      }
  };
  // After O += P V of the previous tile completed: rescale O, update l, P -> operand registers.
  auto finish = [&](const float* alpha, const float* rs) {
    bool moved = false;
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      l_run[s] = l_run[s] * alpha[s] + rs[s];
      moved |= alpha[s] != 1.f;
    }
    if (mma::warp_any(moved)) {
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) oacc[dt].x[e] *= alpha[acc_t::row_slot(e)];
    }
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) mma::to_operand<DT>(pf[nt], sacc[nt]);
  };

  if (n_iter > 0) {
    float alpha[acc_t::row_slots], rs[acc_t::row_slots];
#if WS
    wg::mbar_wait(fullQ, 0);
    wait_k(0);
    wg::fence_proxy_async();
    wg::fence();
    issue_s(0);
    wg::wait<0>();
    free_k(0);
    softmax(0, alpha, rs);
    finish(alpha, rs);
    for (int it = 1; it < n_iter; ++it) {
      wait_k(it);
      wait_v(it - 1);
      wg::fence_proxy_async();
      wg::fence();
      issue_s(it);
      issue_pv(it - 1);
      wg::wait<1>();
      free_k(it);
      softmax(it, alpha, rs);
      wg::wait<0>();
      free_v(it - 1);
      wg::fence_regs(oacc);
      wg::fence_regs(pf);
      finish(alpha, rs);
    }
    wait_v(n_iter - 1);
    wg::fence_proxy_async();
    wg::fence();
    issue_pv(n_iter - 1);
    wg::wait<0>();
    wg::fence_regs(oacc);
#else
    next_tile(0);
    wg::fence();
    issue_s(0);
    wg::wait<0>();
    softmax(0, alpha, rs);
    finish(alpha, rs);
    for (int it = 1; it < n_iter; ++it) {
      next_tile(it);
      wg::fence();
      issue_s(it);
      issue_pv(it - 1);
      wg::wait<1>();  // S(it) done; the softmax overlaps O += P V of tile it - 1
      softmax(it, alpha, rs);
      wg::wait<0>();
      wg::fence_regs(oacc);
      wg::fence_regs(pf);
      finish(alpha, rs);
    }
    next_tile(n_iter);
    wg::fence();
    issue_pv(n_iter - 1);
    wg::wait<0>();
    wg::fence_regs(oacc);
#endif
  }

  // Epilogue: normalise (sink in the denominator), lse, stage O in this warpgroup's Q rows (its
  // own MMAs, the only readers, have completed), 16-byte stores of those 64 rows.
  {
    float inv[acc_t::row_slots];
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      const float l = acc_t::row_sum(l_run[s]);
      const int row = wr0 + 16 * warp + acc_t::slot_row(s);
      float lse_v = neg_inf();
      inv[s] = 0.f;
      if (l > 0.f) {
        const float m2 = m_run[s] * a_eff;
        lse_v = (m2 + log2_(l)) * kLn2;
        float den = l;
        if (sinks != nullptr) den += exp2_(sinks[h] * kLog2e - m2);
        inv[s] = 1.f / den;
      }
      if (lse != nullptr && acc_t::row_leader() && row < sq) lse[(i64)(q0 + row) * (i64)gdim_x() + h] = lse_v;
    }
    const int r0 = 64 * grp + 16 * warp;
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
      for (int e = 0; e < acc_t::ne; e += 2) {
        const float f = inv[acc_t::row_slot(e)];
        const u32 w = pack2(DT{}, oacc[dt].x[e] * f, oacc[dt].x[e + 1] * f);
        *reinterpret_cast<u32*>(sQ + LQ::off(r0 + acc_t::get_i(e), dt * 16 + acc_t::get_j(e))) = w;
      }
  }
  wg::bar_sync(1 + grp, 128);
#pragma unroll
  for (int i = 0; i < 64 * CPR / 128; ++i) {
    const int c = (int)(tid_x() % 128) + i * 128;
    const int r = 64 * grp + c / CPR, ch = c % CPR;
    if (m0 + r < sq) {
      u16* dst = o + (i64)(q0 + m0 + r) * o_st + (i64)h * o_sh + ch * 8;
      store16(dst, load16(sQ + LQ::off(r, ch * 8)));
    }
  }
}

#else  // portable body: mma.sync (NVIDIA sm_80+) or MFMA (gfx942 / gfx950)


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

  // KV tiles of this CTA: sink-token tiles, then the band [lo_key, hi_key).
  const int off = sk - sq;  // query row i sits at key position off + i
  const int p_first = off + m0, p_last = off + imin(m0 + BM, sq) - 1;
  const int hi_key = causal ? imin(sk, p_last + 1) : sk;
  const int lo_key = W > 0 ? imax(0, p_first - W + 1) : 0;
  int n_sink = 0, first = 0, last = 0;
  if (hi_key > 0) {
    last = (hi_key + BN - 1) / BN;
    n_sink = (W > 0 && S > 0) ? imin((S + BN - 1) / BN, last) : 0;
    first = imax(n_sink, lo_key / BN);
  }
  const int n_iter = n_sink + imax(0, last - first);

  copy_rows<BM>(sQ, qb, q_st, m0, sq);
  mma::cp_async_commit();
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < n_iter) {
      const int kt = s < n_sink ? s : first + (s - n_sink);
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
        const int kt = nx < n_sink ? nx : first + (nx - n_sink);
        copy_rows<BN>(sKV + (2 * st) * TILE_ELEMS, kb, k_st, kt * BN, sk);
        copy_rows<BN>(sKV + (2 * st + 1) * TILE_ELEMS, vb, v_st, kt * BN, sk);
      }
      mma::cp_async_commit();
    }
    const int kt = it < n_sink ? it : first + (it - n_sink);
    const int j0 = kt * BN, j1 = j0 + BN;  // keys [j0, j1) of this tile
    // Fully masked for this warp's rows: beyond causality, or below the window and no sink token.
    const bool skip = !warp_live || (causal && j0 > wp_last) || (W > 0 && j1 - 1 <= wp_first - W && j0 >= S);
    if (skip) continue;
    const bool need_mask = j1 > sk || (causal && j1 - 1 > wp_first) || (W > 0 && j0 <= wp_last - W && j1 > S);
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
            const bool vis = j < sk && (!causal || j <= p) && (W <= 0 || j > p - W || j < S);
            if (!vis) sacc[mt][nt].x[e] = neg_inf();
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
#endif  // PREFILL_WGMMA
