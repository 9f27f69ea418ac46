// The Hopper kernel's O promotion (O_PROMOTE, FP8): every kPromote tiles of a long unit, O's registers
// leave the tensor cores' accumulator (which adds with ~14 bits) for a partial in shared memory, which the
// kernel adds back before its epilogue (hopper_config.h's O_PROMOTE notes, docs/fp8.md "Long requests").
#pragma once

#include "hopper_consumer.h"
#include "hopper_softmax.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
struct promotion {
  o_regs& oacc;
  row_f& part_f;
  bool& has_part;
  const row_sums& sums;  // the rows' sums l (row_l)
  const mma_issue& mma;  // restart(j)
  unsigned char* sPro;
  u16* sO;
  int grp;
  bool o_issuer;

  // This thread's chunk i (0..15: oacc[i / 2].x[4 (i % 2) ..]) of O's partial: 8 in the warpgroup's
  // own 16 KB, 4 in each 64-column panel of its rows of sO.
  ATOM_DEV float4* part_chunk(int i) const {
    const int t = (int)(tid_x() % 128);
    unsigned char* p = i < 8 ? sPro + grp * 128 * D + (i * 128 + t) * 16
                             : reinterpret_cast<unsigned char*>(sO) + (i - 8) / 4 * BM * 128 + grp * 64 * 128 +
                                   ((i - 8) % 4 * 128 + t) * 16;
    return reinterpret_cast<float4*>(p);
  }
  ATOM_DEV float4 with_part(int i, const float4& a) const {  // O's chunk i plus a partial: x[0..1] of row slot 0, x[2..3] of slot 1
    const float* x = oacc[i / 2].x + 4 * (i % 2);
    return float4{fmaf(a.x, part_f[0], x[0]), fmaf(a.y, part_f[0], x[1]), fmaf(a.z, part_f[1], x[2]),
                  fmaf(a.w, part_f[1], x[3])};
  }
  // S_F16: chunk i (0..7) of the f16 partial holds oacc[i] (pairs x[0..1], x[2..3], x[4..5], x[6..7]).
  ATOM_DEV u32x4* half_chunk(int i) const {
    const int t = (int)(tid_x() % 128);
    return reinterpret_cast<u32x4*>(reinterpret_cast<unsigned char*>(sO) + i / 4 * BM * 128 + grp * 64 * 128 +
                                    (i % 4 * 128 + t) * 16);
  }

  // O's registers (complete P V's) into the partial: part = part * part_f + oacc, part_f = 1 (S_F16:
  // the f16 partial in units of the row sum lam, part_f = lam). The first of a unit waits until the
  // previous unit's O has left sO (TMA stores, other threads' reads).
  ATOM_DEV void promote() const {
    if (!has_part) {
      if (o_issuer) wg::bulk_wait_read<0>();
      wg::bar_sync(epi_bar(grp), 128);
    }
    if constexpr (kHalfPart) {
      // lam: the row's sum l so far (it covers every key in O's registers), so |part| <= 448. On f16
      // pairs, one chunk at a time (the registers of S(j + 1) and P are live beside it): part =
      // part * (part_f / lam) + oacc / lam, one rounding to f16 per promotion (docs/fp8.md).
      float lam[acc_t::row_slots], inv[acc_t::row_slots];
#pragma unroll
      for (int sl = 0; sl < acc_t::row_slots; ++sl) {
        lam[sl] = fmax_(sums.row_l(sl), 1e-30f);
        inv[sl] = h2::rcp(lam[sl]);  // the unit only: lam * inv is 1 within 2^-22
      }
      const u32 r0 = h2::splat(part_f[0] * inv[0]), r1 = h2::splat(part_f[1] * inv[1]);
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        const float* x = oacc[i].x;
        u32x4 o{pack_f16x2(x[0] * inv[0], x[1] * inv[0]), pack_f16x2(x[2] * inv[1], x[3] * inv[1]),
                pack_f16x2(x[4] * inv[0], x[5] * inv[0]), pack_f16x2(x[6] * inv[1], x[7] * inv[1])};
        if (has_part) {
          const u32x4 a = *half_chunk(i);
          o = u32x4{h2::fma(a.x, r0, o.x), h2::fma(a.y, r1, o.y), h2::fma(a.z, r0, o.z), h2::fma(a.w, r1, o.w)};
        }
        *half_chunk(i) = o;
      }
      has_part = true;
#pragma unroll
      for (int sl = 0; sl < acc_t::row_slots; ++sl) part_f[sl] = lam[sl];
      return;
    }
    // has_part tested once, not per chunk: ptxas then has 8 chunks' loads in flight before their
    // adds and stores (per chunk, a branch each kept them one load-add-store round trip apart)
    if (has_part) {
#pragma unroll
      for (int i = 0; i < 16; ++i) *part_chunk(i) = with_part(i, *part_chunk(i));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float* x = oacc[i / 2].x + 4 * (i % 2);
        *part_chunk(i) = float4{x[0], x[1], x[2], x[3]};
      }
    }
    has_part = true;
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) part_f[s] = 1.f;
  }
  // Before P V(j) restarts O's registers: under S(j + 1) in the tensor cores (O's registers are
  // complete since the last round's wait), then a fence orders those reads before the P V's writes.
  ATOM_DEV void before(int j) const {
    if (!kHalfPart && mma.restart(j)) {
      promote();
      wg::fence();
    }
  }
};
}  // namespace atom_prefill
#endif
