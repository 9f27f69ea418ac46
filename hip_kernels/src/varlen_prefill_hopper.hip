// Varlen prefill attention on Hopper (sm_90a): the FlashAttention-3 structure, written for this
// package. Same semantics as varlen_prefill.hip (DESIGN.md; the tile walk and masks come from
// prefill_tiles.h), different machinery:
//
//   warp specialization  warpgroup 0 is the producer: it gives its registers away (setmaxnreg)
//                        and one of its threads issues every copy; warpgroups 1..NWG are
//                        consumers (64 query rows each, BLOCK_M = 64 * NWG) that only compute.
//   TMA                  Q, K and V tiles of the packed [total, heads, d] tensors arrive by bulk
//                        tensor copies (tensor maps encoded on the host, 128-byte swizzle done by
//                        the copy engine), each completing on a full mbarrier; consumers hand a
//                        stage back on its empty mbarrier once the MMAs reading it are done. K and
//                        V have rings of STAGES tiles; Q has one buffer, released after the last
//                        S = Q K^T of a work item so the next item's Q loads under the epilogue.
//   intra-warpgroup      round i issues S(i) = Q K(i)^T and O += P(i-1) V(i-1), waits for S(i)
//   overlap              only, and runs the softmax of tile i while the tensor cores do P V.
//   ping-pong            consumer warpgroups take turns to issue their MMAs (named barriers), so
//                        one's softmax runs under the other's MMAs.
//   persistent grid      one CTA per SM walks work units w = blockIdx.x, + gridDim.x, ...; a unit
//                        is (work item, head), items in the host's longest-first order (or, with
//                        no list, q tiles last to first), the heads of one KV head side by side.
//   output               normalised O goes to its own shared buffer, then 16-byte coalesced
//                        stores of the rows that belong to the request (a TMA store would write
//                        over the next request's rows).
// Rows that a TMA box reads past a request (the next request's, or zero past the tensor) are
// masked (keys) or never stored (queries); masked keys get P = 0 exactly.
//
// Defines: DTYPE (0 bf16, 1 fp16), HEAD_DIM (64|128), SOFTCAP (0|1), CONSUMERS (warpgroups of 64
// rows: 2 or 3), BLOCK_N (64|128), STAGES (>= 2), PINGPONG (0|1).
// Built for a target without wgmma (every arch but sm_90a) the kernel has no body: the launcher
// only selects it on sm_90a (hip_kernels/prefill.py), CI compiles it everywhere.

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
#ifndef CONSUMERS
#define CONSUMERS 2
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef PINGPONG
#define PINGPONG 1
#endif

namespace atom_prefill {
constexpr int NWG = CONSUMERS;
constexpr int NTB = 128 * (NWG + 1);  // threads: producer warpgroup + consumers
}  // namespace atom_prefill

using namespace atom_prefill;
using atom::mma::wgmma::tma_desc;

#if ATOM_HAS_WGMMA
namespace atom_prefill {
using atom::mma::acc_t;
using atom::mma::op_t;
namespace wg = atom::mma::wgmma;

#if DTYPE == 0
typedef bf16_t DT;
#else
typedef f16_t DT;
#endif
constexpr int D = HEAD_DIM;
constexpr int BM = 64 * NWG;
constexpr int BN = BLOCK_N;
constexpr int NST = STAGES;
constexpr int CPR = D / 8;  // 16-byte chunks per row
constexpr int TILE = BN * D;
static_assert(D == 64 || D == 128, "Hopper prefill: head_dim 64 or 128");
static_assert(BN == 64 || BN == 128, "Hopper prefill: BLOCK_N 64 or 128");
static_assert(NWG == 2 || NWG == 3, "Hopper prefill: 2 or 3 consumer warpgroups");
static_assert(NST >= 2, "the K/V rings need two stages");
// Registers per thread after the hand-over (setmaxnreg): producer + consumers within 64K.
constexpr int PRODUCER_REGS = NWG == 2 ? 24 : 32;
constexpr int CONSUMER_REGS = NWG == 2 ? 240 : 160;
static_assert(128 * (PRODUCER_REGS + NWG * CONSUMER_REGS) <= 65536, "register file");
constexpr int SMEM_BYTES = 2 * (2 * BM * D + 2 * NST * TILE);  // Q, O, K ring, V ring
static_assert(SMEM_BYTES + 1024 + 256 <= 227 * 1024, "shared memory");
typedef wg::sw128<BM> LQ;   // Q and O: [D/64][BM][64]
typedef wg::sw128<BN> LKV;  // K and V tiles: [D/64][BN][64]

// Named barriers: 0 is the block's; turns 1..NWG; each consumer's epilogue NWG+1..2*NWG.
ATOM_DEV int turn_bar(int grp) { return 1 + grp; }
ATOM_DEV int epi_bar(int grp) { return 1 + NWG + grp; }

// A work unit: (work item (request b, q tile t), query head h).
struct unit {
  int h, g, q0, sq, k0, sk, m0;
  bool live;
};
ATOM_DEV unit unit_of(i64 w, const i32* __restrict__ work, const i32* __restrict__ cu_q, const i32* __restrict__ cu_k,
                      int hq, int batch, int q_per_kv, int max_tiles) {
  unit u;
  const i64 item = w / hq;
  u.h = (int)(w - item * hq);
  u.g = u.h / q_per_kv;
  int b, t;
  if (work != nullptr) {
    b = work[2 * item];
    t = work[2 * item + 1];
  } else {
    b = (int)(item % batch);
    t = max_tiles - 1 - (int)(item / batch);
  }
  u.q0 = cu_q[b];
  u.sq = cu_q[b + 1] - u.q0;
  u.k0 = cu_k[b];
  u.sk = cu_k[b + 1] - u.k0;
  u.m0 = t * BM;
  u.live = u.m0 < u.sq;
  return u;
}
}  // namespace atom_prefill
#endif

// q, k, v: tensor maps of [total, heads, d] (box {64, 1, BLOCK_M or BLOCK_N} rows, 128-byte
// swizzle); o [total_q, hq, d] (strides in elements); lse [total_q, hq] fp32 or null; sinks [hq]
// fp32 or null; work [n_items, 2] int32 (b, t) or null (then n_items = batch * max_tiles).
// a_log2: scale * log2(e) (or scale / softcap with SOFTCAP); c_log2: softcap * log2(e).
extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(NTB, 1)
varlen_prefill_hopper(const ATOM_GRID_CONSTANT tma_desc tm_q, const ATOM_GRID_CONSTANT tma_desc tm_k,
                      const ATOM_GRID_CONSTANT tma_desc tm_v, u16* __restrict__ o, float* __restrict__ lse,
                      const i32* __restrict__ cu_q, const i32* __restrict__ cu_k, const i32* __restrict__ work,
                      const float* __restrict__ sinks, i64 o_st, i64 o_sh, i64 n_items, i64 hq_i, i64 batch_i,
                      i64 q_per_kv_i, i64 max_tiles_i, i64 causal_i, i64 window_i, i64 sink_tok_i, float a_log2,
                      float c_log2) {
#if ATOM_HAS_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u16* sQ = reinterpret_cast<u16*>(wg::align1024(smem_raw));
  u16* sO = sQ + BM * D;
  u16* sK = sO + BM * D;
  u16* sV = sK + NST * TILE;
  u64* bars = reinterpret_cast<u64*>(sV + NST * TILE);
  u64 *fullQ = bars, *emptyQ = bars + 1, *fullK = bars + 2, *emptyK = fullK + NST, *fullV = emptyK + NST,
      *emptyV = fullV + NST;

  const int hq = (int)hq_i, batch = (int)batch_i, q_per_kv = (int)q_per_kv_i, max_tiles = (int)max_tiles_i;
  const bool causal = causal_i != 0;
  const int W = (int)window_i, S = (int)sink_tok_i;
  const i64 total = n_items * hq;

  if (tid_x() == 0) {
    wg::tma_prefetch_desc(&tm_q);
    wg::tma_prefetch_desc(&tm_k);
    wg::tma_prefetch_desc(&tm_v);
    wg::mbar_init(fullQ, 1);
    wg::mbar_init(emptyQ, 4 * NWG);  // one arrival per consumer warp
    for (int s = 0; s < NST; ++s) {
      wg::mbar_init(fullK + s, 1);
      wg::mbar_init(fullV + s, 1);
      wg::mbar_init(emptyK + s, 4 * NWG);
      wg::mbar_init(emptyV + s, 4 * NWG);
    }
    wg::mbar_init_fence();
  }
  sync_block();

  const int wgi = wg::warpgroup_index();
  if (wgi == 0) {
    // ---- producer: one thread issues every copy ----
    wg::regs_dec<PRODUCER_REGS>();
    if (tid_x() == 0) {
      int base = 0, qn = 0;  // K/V tiles and Q tiles loaded so far (ring stage and phase)
      auto load_kv = [&](const tma_desc* map, u16* ring, u64* full, u64* empty, int idx, int row, int g) {
        const int s = idx % NST;
        wg::mbar_wait(empty + s, ((idx / NST) & 1) ^ 1);
        wg::mbar_arrive_expect_tx(full + s, TILE * 2);
#pragma unroll
        for (int p = 0; p < D / 64; ++p) wg::tma_load_3d(ring + s * TILE + p * BN * 64, map, full + s, p * 64, g, row);
      };
      for (i64 w = bid_x(); w < total; w += gdim_x()) {
        const unit u = unit_of(w, work, cu_q, cu_k, hq, batch, q_per_kv, max_tiles);
        if (!u.live) continue;
        const kv_walk kw(u.sq, u.sk, u.m0, BM, BN, causal, W, S);
        wg::mbar_wait(emptyQ, (qn & 1) ^ 1);
        wg::mbar_arrive_expect_tx(fullQ, BM * D * 2);
#pragma unroll
        for (int p = 0; p < D / 64; ++p) wg::tma_load_3d(sQ + p * BM * 64, &tm_q, fullQ, p * 64, u.h, u.q0 + u.m0);
        ++qn;
        // K(i) runs ahead of V(i - 1): round i of the consumers needs both.
        for (int it = 0; it < kw.n_iter; ++it) {
          load_kv(&tm_k, sK, fullK, emptyK, base + it, u.k0 + kw.tile(it) * BN, u.g);
          if (it > 0) load_kv(&tm_v, sV, fullV, emptyV, base + it - 1, u.k0 + kw.tile(it - 1) * BN, u.g);
        }
        if (kw.n_iter > 0) load_kv(&tm_v, sV, fullV, emptyV, base + kw.n_iter - 1, u.k0 + kw.tile(kw.n_iter - 1) * BN, u.g);
        base += kw.n_iter;
      }
    }
  } else {
    // ---- consumers ----
    wg::regs_inc<CONSUMER_REGS>();
    const int grp = wgi - 1;
    const int warp = (int)((tid_x() / 32) % 4);  // warp in the warpgroup
    const bool releaser = lane_id() == 0;
    int base = 0, qn = 0;
#if PINGPONG
    bool first_round = true;
    // Turns: consumer grp issues its MMAs after consumer grp - 1 issued the same round (consumer 0
    // after the last one's previous round). Every sync meets exactly one arrival.
    auto turn_wait = [&]() {
      if (!(grp == 0 && first_round)) wg::bar_sync(turn_bar(grp), 256);
      first_round = false;
    };
    auto turn_pass = [&]() { wg::bar_arrive(turn_bar((grp + 1) % NWG), 256); };
#else
    auto turn_wait = [&]() {};
    auto turn_pass = [&]() {};
#endif
#if SOFTCAP
    constexpr bool kSoftcap = true;
#else
    constexpr bool kSoftcap = false;
#endif
    const float a_eff = kSoftcap ? 1.f : a_log2;

    for (i64 w = bid_x(); w < total; w += gdim_x()) {
      const unit u = unit_of(w, work, cu_q, cu_k, hq, batch, q_per_kv, max_tiles);
      if (!u.live) continue;
      const kv_walk kw(u.sq, u.sk, u.m0, BM, BN, causal, W, S);
      const int off = u.sk - u.sq;
      const int wr0 = u.m0 + 64 * grp;  // first query row of this warpgroup
      const int wp_first = off + wr0, wp_last = off + wr0 + 63;
      const int p_warp = wp_first + 16 * warp;
      const int n_iter = kw.n_iter;

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

      auto stage = [&](int it) { return (base + it) % NST; };
      auto parity = [&](int it) { return ((base + it) / NST) & 1; };
      auto wait_k = [&](int it) { wg::mbar_wait(fullK + stage(it), parity(it)); };
      auto wait_v = [&](int it) { wg::mbar_wait(fullV + stage(it), parity(it)); };
      auto free_k = [&](int it) { if (releaser) wg::mbar_arrive(emptyK + stage(it)); };
      auto free_v = [&](int it) { if (releaser) wg::mbar_arrive(emptyV + stage(it)); };
      auto free_q = [&]() { if (releaser) wg::mbar_arrive(emptyQ); };
      auto issue_s = [&](int it) {  // S = Q K^T of tile it
        const u16* sKs = sK + stage(it) * TILE;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc)
          wg::op<BN, DT>::ss(sacc, wg::desc_k(sQ + LQ::off(64 * grp, kc * 16)), wg::desc_k(sKs + LKV::off(0, kc * 16)), kc);
        wg::commit();
      };
      auto issue_pv = [&](int it) {  // O += P V of tile it
        const u16* sVs = sV + stage(it) * TILE;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wg::op<D, DT>::rs_t(oacc, pf[kk], wg::desc_mn<BN>(sVs + LKV::off(kk * 16, 0)));
        wg::commit();
      };
      // Mask and online softmax (log2 units) of tile it: sacc becomes P; alpha rescales O and l,
      // rs holds this lane's part of P's row sums.
      auto softmax = [&](int it, float* alpha, float* rs) {
        wg::fence_regs(sacc);
        const int j0 = kw.tile(it) * BN;
#if SOFTCAP
#pragma unroll
        for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
          for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] = softcap_fn(sacc[nt].x[e] * a_log2, c_log2);
#endif
        if (tile_needs_mask(j0, j0 + BN, wp_first, wp_last, u.sk, causal, W, S)) {
#pragma unroll
          for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
            for (int e = 0; e < acc_t::ne; ++e)
              if (!visible(j0 + nt * 16 + acc_t::get_j(e), p_warp + acc_t::get_i(e), u.sk, causal, W, S))
                sacc[nt].x[e] = neg_inf();
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

      wg::mbar_wait(fullQ, qn & 1);
      ++qn;
      if (n_iter == 0) {
        free_q();
      } else {
        float alpha[acc_t::row_slots], rs[acc_t::row_slots];
        wait_k(0);
        turn_wait();
        wg::fence();
        issue_s(0);
        turn_pass();
        wg::wait<0>();
        free_k(0);
        if (n_iter == 1) free_q();
        softmax(0, alpha, rs);
        finish(alpha, rs);
        for (int it = 1; it < n_iter; ++it) {
          wait_k(it);
          wait_v(it - 1);
          turn_wait();
          wg::fence();
          issue_s(it);
          issue_pv(it - 1);
          turn_pass();
          wg::wait<1>();  // S(it) done; the softmax overlaps O += P V of tile it - 1
          free_k(it);
          if (it == n_iter - 1) free_q();
          softmax(it, alpha, rs);
          wg::wait<0>();
          free_v(it - 1);
          wg::fence_regs(oacc);
          wg::fence_regs(pf);
          finish(alpha, rs);
        }
        wait_v(n_iter - 1);
        turn_wait();
        wg::fence();
        issue_pv(n_iter - 1);
        turn_pass();
        wg::wait<0>();
        free_v(n_iter - 1);
        wg::fence_regs(oacc);
      }
      base += n_iter;

      // Epilogue: normalise (sink in the denominator), lse, O through this warpgroup's rows of sO
      // (after every thread of the group is done reading them for the previous unit).
      wg::bar_sync(epi_bar(grp), 128);
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
            if (sinks != nullptr) den += exp2_(sinks[u.h] * kLog2e - m2);
            inv[s] = 1.f / den;
          }
          if (lse != nullptr && acc_t::row_leader() && row < u.sq) lse[(i64)(u.q0 + row) * hq + u.h] = lse_v;
        }
        const int r0 = 64 * grp + 16 * warp;
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
          for (int e = 0; e < acc_t::ne; e += 2) {
            const float f = inv[acc_t::row_slot(e)];
            const u32 wv = pack2(DT{}, oacc[dt].x[e] * f, oacc[dt].x[e + 1] * f);
            *reinterpret_cast<u32*>(sO + LQ::off(r0 + acc_t::get_i(e), dt * 16 + acc_t::get_j(e))) = wv;
          }
      }
      wg::bar_sync(epi_bar(grp), 128);
#pragma unroll
      for (int i = 0; i < 64 * CPR / 128; ++i) {
        const int c = (int)(tid_x() % 128) + i * 128;
        const int r = 64 * grp + c / CPR, ch = c % CPR;
        if (u.m0 + r < u.sq) {
          u16* dst = o + (i64)(u.q0 + u.m0 + r) * o_st + (i64)u.h * o_sh + ch * 8;
          store16(dst, load16(sO + LQ::off(r, ch * 8)));
        }
      }
    }
#if PINGPONG
    // Consumer 0 skipped the wait of its first round; the last consumer's final pass is
    // consumed here so that every hardware barrier ends balanced.
    if (grp == 0 && !first_round) wg::bar_sync(turn_bar(0), 256);
#endif
  }
#else
  (void)tm_q; (void)tm_k; (void)tm_v; (void)o; (void)lse; (void)cu_q; (void)cu_k; (void)work; (void)sinks;
  (void)o_st; (void)o_sh; (void)n_items; (void)hq_i; (void)batch_i; (void)q_per_kv_i; (void)max_tiles_i;
  (void)causal_i; (void)window_i; (void)sink_tok_i; (void)a_log2; (void)c_log2;
  __builtin_trap();  // no wgmma / TMA on this target: the launcher never selects this kernel here
#endif
}
