// The Hopper kernel's softmax on f16 scores (S_F16: FP8 per tensor and per 16 keys): hopper_softmax.h's
// softmax on S's f16x2 pairs, P in place of S (s16), keys masked in f16, exp2 by bit shifts
// (hopper_f16x2.h), P's e4m3 bytes straight from the exp2's argument (kDirectP).
#pragma once

#include "hopper_softmax.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
// Pair 4 nt + j of tile nt holds row slot j & 1's columns 16 nt + {2q, 2q + 1} (j < 2) or
// 16 nt + {8 + 2q, 9 + 2q} (j >= 2).
ATOM_DEV void softmax_f16::operator()(int it, float* alpha, float* rs, float& vfac) const {
  wg::fence_regs(s16);
  const int j0 = kw.tile(it) * BN;
  if constexpr (SOFTCAP) {  // S = tanh(S a_row) (times K's group scale), each pair through fp32
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) {
      const float m = a_row[i & 1] * (kGroupScales ? gk[i / 4] : 1.f);
      s16[i] = pack_f16x2(tanh_(h2::lo(s16[i]) * m), tanh_(h2::hi(s16[i]) * m));
    }
  }
  // Per 16 keys: each group's K scale relative to the tile's largest (f <= 1) joins the exp2's
  // multiplier, the largest (gscale) the row's. The max tree runs on the unscaled S, as per
  // tensor: max_j S_j f_j <= gscale max(max_j S_j, 0), a bound of the scaled row max that decides
  // whether a row may move (most tiles: no); only then is the exact max taken (refine).
  float gscale = 1.f;
  if constexpr (kRelGK) gscale = gscale_t;
  // A group factor that f16 rounds to zero counts as 2^-24 (0x0001): -inf * 0 would make a NaN of a
  // masked key; an unmasked one moves by at most 57344 * 2^-24 of the tile's scale.
  constexpr u32 kTiny = 0x00010001u;
  if (tile_needs_mask(j0, j0 + BN, wp_first, wp_last, u.sk, causal, W, S))
    mask_cols<acc_t>(s16, j0, pos, u.sk, causal, W, S);
  float gmax[acc_t::row_slots];  // this lane's part of each row's max (times K's scale)
  {
    u32 hm[BN / 8][2];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int sl = 0; sl < 2; ++sl) hm[i][sl] = s16[4 * (i / 2) + 2 * (i % 2) + sl];
#pragma unroll
    for (int w = 1; w < BN / 8; w *= 2)
#pragma unroll
      for (int i = 0; i + w < BN / 8; i += 2 * w)
#pragma unroll
        for (int sl = 0; sl < 2; ++sl) hm[i][sl] = h2::max(hm[i][sl], hm[i + w][sl]);
#pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      const float m = fmax_(h2::lo(hm[0][sl]), h2::hi(hm[0][sl]));
      gmax[sl] = kRelGK ? (m > 0.f ? m * gscale : 0.f) : m * gscale;
    }
  }
  vfac = 1.f;
  float msc[acc_t::row_slots];
  const bool moved = move_reference(gmax, msc, alpha, [&](float (&lmax)[acc_t::row_slots]) {
    if constexpr (kRelGK) {  // the exact maxes: each group's, times its factor
      u32 gm[2];
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
        const u32 f = h2::max(grel_at(nt), kTiny);
#pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          const u32 g = h2::mul(h2::max(s16[4 * nt + sl], s16[4 * nt + 2 + sl]), f);
          gm[sl] = nt ? h2::max(gm[sl], g) : g;
        }
      }
#pragma unroll
      for (int sl = 0; sl < 2; ++sl) lmax[sl] = fmax_(h2::lo(gm[sl]), h2::hi(gm[sl])) * gscale;
    }
  });
  // f16's range: a multiplier under 2^-24 moves no argument by more than 57344 * 2^-24; one over
  // 65504, or a row max past it (in log2 units), only comes with logits of more than 65504.
  // Both row slots' multipliers (mul_pair) and addends (add_pair, kExpShift: t = 2^F x + B) as pairs,
  // whose halves the argument's HFMA2 selects. The addends and the band's vote (below) follow the
  // reference, the multipliers a_eff: they are taken again only on the tiles where the warp took its
  // rows' maxes (the unit's first and few others). Per 16 keys the multipliers carry the tile's
  // largest K scale too, so they are taken every tile.
  const auto multipliers = [&] {
    constexpr float k = kExpShift ? kShiftScale : 1.f;  // exact: k (a g) = (k a) g
    float mf[2];
#pragma unroll
    for (int sl = 0; sl < 2; ++sl) mf[sl] = fmin_(fmax_(k * a_eff[sl] * gscale, k * 5.9604645e-8f), 65504.f);  // a g >= 0
    return h2::pair(mf[0], mf[1]);
  };
  if (moved) {
    float nf[2];
#pragma unroll
    for (int sl = 0; sl < 2; ++sl) nf[sl] = kExpShift ? h2::shift_addend(msc[sl]) : -h2::in_range(msc[sl]);
    add_pair = h2::pair(nf[0], nf[1]);
    if constexpr (kFoldV || kDirectP) in_band = !mma::warp_any(fabs_(nf[0]) >= 2048.f || fabs_(nf[1]) >= 2048.f);
    if constexpr (!kRelGK) mul_pair = multipliers();
  }
  // kRelGK: one HFMA2 a group takes K's factor into both slots' multipliers (8 HFMA2 a tile fewer
  // than one a slot); kFoldV: V's c added to both slots' addends by one HADD2
  if constexpr (kRelGK) mul_pair = multipliers();
  u32 sum[2] = {0u, 0u};
  // kFoldV: c joins the addend only where the addend's f16 step is at most 1 (|B - 2^F msc| < 2048:
  // references within about [-22, 106] log2 units with kDirectP's B, [-17, 111] without); a warp
  // with a row past that multiplies P by 2^(c / 2^F) instead, as exact as the factors of the pack
  // (kDirectP: the same band for the bytes, and that warp's P goes through the f16 form).
  // fast: kFoldV's c in the addend, kDirectP's bytes; else the f16 P, times V's factors (and kDirectK).
  auto exps = [&](auto fast_t) {
    constexpr bool fast = decltype(fast_t)::value;
    constexpr bool fold = fast && kFoldV;
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      u32 gv16 = 0u, gmul[2], gnb[2] = {h2::lo_lo(add_pair), h2::hi_hi(add_pair)};
      if constexpr (kRelGK) {
        gv16 = grel_at(8 + nt);
        const u32 g = h2::fma(grel_at(nt), mul_pair, kTiny);
        gmul[0] = h2::lo_lo(g);
        gmul[1] = h2::hi_hi(g);
        if constexpr (fold) {  // gv16: (c, c)
          const u32 b = h2::add(add_pair, gv16);
          gnb[0] = h2::lo_lo(b);
          gnb[1] = h2::hi_hi(b);
        } else if constexpr (kFoldV) {
          gv16 = h2::exp2(h2::mul(gv16, h2::splat(1.f / kShiftScale)));
          if constexpr (kDirectP) gv16 = h2::mul(gv16, h2::splat(kDirectK));
        }
      } else if constexpr (kGroupScales) {
        gv16 = h2::splat(gv[nt]);
      } else if constexpr (kDirectP) {
        gv16 = h2::splat(kDirectK);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 arg = h2::fma(s16[4 * nt + j], kRelGK ? gmul[j & 1] : j & 1 ? h2::hi_hi(mul_pair) : h2::lo_lo(mul_pair), gnb[j & 1]);
        if constexpr (kDirectP && fast) {
          s16[4 * nt + j] = h2::bytes_of(arg);
        } else {
          u32 p = kExpShift ? h2::exp2_shifted(arg) : h2::exp2(arg);
          if constexpr (!kRowsumMma) sum[j & 1] = h2::add(sum[j & 1], p);
          if constexpr ((kGroupScales || kDirectP) && !fold) p = h2::mul(p, gv16);
          s16[4 * nt + j] = kDirectP ? h2::fp8_spread(p) : p;
        }
      }
    }
  };
  if constexpr (kFoldV || kDirectP) {
    if (in_band) exps(kv_tag<true>{});
    else exps(kv_tag<false>{});
  } else {
    exps(kv_tag<false>{});
  }
#pragma unroll
  for (int sl = 0; sl < 2; ++sl) rs[sl] = h2::lo(sum[sl]) + h2::hi(sum[sl]);
}

// S_F16: P (s16) -> the operand registers of its P V.
ATOM_DEV void p_operand16::operator()(op_t (&pd)[NPF]) const {
#pragma unroll
  for (int kk = 0; kk < NPF; ++kk) {  // kDirectP: s16 holds the bytes already
    const auto pk = [](u32 a, u32 b) { return kDirectP ? h2::pack_bytes(a, b) : h2::to_fp8x4(a, b); };
    pd[kk].x[0] = pk(s16[8 * kk], s16[8 * kk + 2]);
    pd[kk].x[1] = pk(s16[8 * kk + 1], s16[8 * kk + 3]);
    pd[kk].x[2] = pk(s16[8 * kk + 4], s16[8 * kk + 6]);
    pd[kk].x[3] = pk(s16[8 * kk + 5], s16[8 * kk + 7]);
  }
}
}  // namespace atom_prefill
#endif
