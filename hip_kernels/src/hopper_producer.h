// The Hopper kernel's copier: one thread of the producer warpgroup issues every TMA copy of Q, K, V
// (and the key scales) into the rings, as the consumers hand stages back.
#pragma once

#include "hopper_config.h"
#include "hopper_scheduler.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
// Shared-memory addresses as one 32-bit base and constant offsets: this thread has few registers.
struct copier {
  const tma_desc &tm_q, &tm_k, &tm_v, &tm_s;
  u32 a_q, a_k, a_v, a_s, a_fullQ, a_emptyQ, a_fullK, a_emptyK, a_fullV, a_emptyV;

  ATOM_DEV copier(const tma_desc& q, const tma_desc& k, const tma_desc& v, const tma_desc& s, const void* sQ)
      : tm_q(q), tm_k(k), tm_v(v), tm_s(s) {
    a_q = wg::smem_addr(sQ), a_k = a_q + 2 * QST * BM * D + PRO + 2 * BM * D + Q8, a_v = a_k + EB * NST * TILE;
    a_s = a_v + NST * VSTAGE;
    const u32 a_bar = a_s + 4 * NST * SC_TILE + (kFp8 ? 4 * BM : 0);
    a_fullQ = a_bar, a_emptyQ = a_bar + 8 * QST, a_fullK = a_bar + 16 * QST, a_emptyK = a_fullK + 8 * NST;
    a_fullV = a_emptyK + 8 * NST, a_emptyV = a_fullV + 8 * NST;
  }

  // A K tile (with its key scales, KV_FP8 >= 2) or V tile of BN keys from `row` of KV head g.
  template <class Which>
  ATOM_DEV void load_kv(Which, u32 full, u32 empty, int idx, int row, int g) const {
    constexpr bool is_v = Which::value;  // a compile-time choice: this thread is short of registers
    const int s = idx % NST;
    const u32 ring = is_v ? a_v : a_k, slot = is_v ? VSTAGE : EB * TILE;  // bytes
    wg::mbar_wait(empty + 8 * s, ((idx / NST) & 1) ^ 1);
    wg::mbar_arrive_expect_tx(full + 8 * s, TILE * EB + (is_v ? 0 : SC_TILE * 4));
    if constexpr (kFp8) {
      if constexpr (is_v) {
#pragma unroll
        for (int p = 0; p < BN / VT_PANEL; ++p)  // V^T: panels [D][VT_PANEL] bytes
          wg::tma_load_3d(ring + s * slot + p * VT_PANEL * VROWS, &tm_v, full + 8 * s, row + p * VT_PANEL, 0, g);
      } else {
        wg::tma_load_3d(ring + s * slot, &tm_k, full + 8 * s, 0, g, row);
        if (kKeyScales)  // a block past the pack's end arrives as zeros (its keys are masked)
#pragma unroll
          for (int b = 0; b < SC_BLOCKS; ++b)
            wg::tma_load_2d(a_s + 4 * (s * SC_TILE + b * 2 * kFp8Align), &tm_s, full + 8 * s,
                            2 * ((row & -kFp8Align) + b * kFp8Align), g);
      }
    } else {
#pragma unroll
      for (int p = 0; p < D / 64; ++p)
        wg::tma_load_3d(ring + s * slot + 2 * p * BN * 64, is_v ? &tm_v : &tm_k, full + 8 * s, p * 64, g, row);
    }
  }

  // A unit's copies, tile by tile as the consumers' rounds take them (base: the K/V tiles loaded before
  // it, qn: the Q tiles): K(0) first (its stage is free long before the consumers hand Q back), then Q ...
  ATOM_DEV void first(const unit& u, const kv_walk& kw, int base, int qn) const {
    if (kw.n_iter > 0) load_kv(is_k_tag{}, a_fullK, a_emptyK, base, u.k0 + kw.tile(0) * BN, u.g);
    const int qs = qn % QST;
    wg::mbar_wait(a_emptyQ + 8 * qs, ((qn / QST) & 1) ^ 1);
    wg::mbar_arrive_expect_tx(a_fullQ + 8 * qs, BM * D * 2);
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
      wg::tma_load_3d(a_q + 2 * (qs * BM * D + p * BM * 64), &tm_q, a_fullQ + 8 * qs, p * 64, u.h0, u.q0 + u.m0);
  }
  // ... then K(i) ahead of V(i - 1) (round i of the consumers needs both), and V of the last tile.
  ATOM_DEV void rest(const unit& u, const kv_walk& kw, int base) const {
    for (int it = 1; it < kw.n_iter; ++it) {
      load_kv(is_k_tag{}, a_fullK, a_emptyK, base + it, u.k0 + kw.tile(it) * BN, u.g);
      load_kv(is_v_tag{}, a_fullV, a_emptyV, base + it - 1, u.k0 + kw.tile(it - 1) * BN, u.g);
    }
    if (kw.n_iter > 0) load_kv(is_v_tag{}, a_fullV, a_emptyV, base + kw.n_iter - 1, u.k0 + kw.tile(kw.n_iter - 1) * BN, u.g);
  }
};
}  // namespace atom_prefill
#endif
