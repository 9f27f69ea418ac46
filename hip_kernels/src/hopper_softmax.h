// The Hopper kernel's online softmax (log2 units) of a warpgroup's tiles: FP8 key scales, the lazy
// reference max, the fp32 softmax (16-bit compute, FP8 per key) and the f16-score one (FP8 per tensor
// and per 16 keys), P into the operands of P V, and O's and l's rescale after each P V.
#pragma once

#include "hopper_config.h"
#include "hopper_consumer.h"
#include "hopper_f16x2.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
typedef float group_f[kGroupScales ? BN / 16 : 1];  // a tile's 16-key groups' scales (KV_FP8 = 3)

// Where a tile's FP8 scales sit in its K stage. Key scales (KV_FP8 >= 2) sit in the stage as SC_BLOCKS x
// [K's, V's] x 128, each in lane order: lane quad q reads the 32 columns 16 n + 8 h + 2 q + b of its block
// at 32 q + 4 n + 2 h + b, as 8 float4. The tile's group nt is its first block's group
// n = nt + (the tile's first key in that block) / 16; n >= 8: group n - 8 of the next block.
struct stage_scales {
  const kv_walk& kw;
  const stages& st;
  const float* sS;

  // The tile's 16-key group nt, counted from its first 128-key block's first group.
  ATOM_DEV int block_group(int it, int nt) const { return (kw.tile(it) * BN) % kFp8Align / 16 + nt; }
  ATOM_DEV const float* group_at(int it, int which, int nt) const {
    const int n = block_group(it, nt);
    return sS + st.stage(it) * SC_TILE + (SC_BLOCKS > 1 ? (n >> 3) * 2 * kFp8Align : 0) + which * kFp8Align + 4 * (n & 7);
  }
  ATOM_DEV float4 key_scales(int it, int which, int nt) const {
    return *reinterpret_cast<const float4*>(group_at(it, which, nt) + 32 * (int)(lane_id() & 3));
  }
  // The tile's group nt lies in its second 128-key block.
  ATOM_DEV bool in_second(int it, int nt) const { return SC_BLOCKS > 1 && block_group(it, nt) >= 8; }
  static ATOM_DEV float pick(const float4& v, int e) {
    const int i = (e >> 2) * 2 + (e & 1);
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  }
};

// A tile's scales per 16 keys (KV_FP8 = 3), read from its stage before S is waited for.
struct group_scales {
  const stage_scales& at;
  // K's and V's, one broadcast read each. K's > 0: a zero-scale page's bytes are zero (the floor keeps
  // -inf * 0 from making a NaN of a masked key).
  group_f& gk;
  group_f& gv;
  // kRelGK: the pack's group block (src/fp8_pack.h), four 16-byte reads and a word: K's group factors,
  // V's (f16 pairs), then the block's largest K scale; gk / gv unused.
  u32x4 (&grel)[kRelGK ? 4 : 1];
  float& gscale_t;
  // kRowsumGroups: the weights 2^(-c / 2^F) of groups 2q, 2q + 1 (lane quad q), f16 pairs: this tile's,
  // and the tile before's (whose P V's sums finish adds to l)
  u32 &rv_cur, &rv_prev;

  ATOM_DEV u32 grel_at(int w) const {  // word w of the group block's first 16
    const u32x4& v = grel[w / 4];
    return w % 4 == 0 ? v.x : w % 4 == 1 ? v.y : w % 4 == 2 ? v.z : v.w;
  }
  ATOM_DEV void load(int it) const {
    const float* sS = at.sS;
    if constexpr (kRowsumGroups) {
      rv_prev = rv_cur;
      rv_cur = f32_as_u32(sS[at.st.stage(it) * SC_TILE + kFp8GroupBlock + kFp8GroupRecip + (int)(lane_id() & 3)]);
    }
    if constexpr (kRelGK) {
      const float* b = sS + at.st.stage(it) * SC_TILE + kFp8GroupBlock;
#pragma unroll
      for (int i = 0; i < 4; ++i)  // kFoldV: V's exponents in place of its factors
        grel[i] = *reinterpret_cast<const u32x4*>(b + 4 * i + (kFoldV && i >= 2 ? kFp8GroupFold - 8 : 0));
      gscale_t = fmax_(b[16], 1e-30f);  // the gather floors it already: a zero here would make -inf * 0
    } else if constexpr (kGroupScales) {
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
        gk[nt] = fmax_(*at.group_at(it, 0, nt), 1e-30f);
        gv[nt] = *at.group_at(it, 1, nt);
      }
    }
  }
};

// The online softmax of a warpgroup's tiles, in the units the kernel instantiates per work unit: each
// holds references to the unit's rows and registers (the kernel declares them) and runs as a call.

// A row's reference max (m_run, in S's units; a_eff: S's multiplier to log2 units).
struct reference_max {
  row_f& m_run;
  const row_f& a_eff;

  // The row's reference max moves only when the new one exceeds it by more than kLazyLog2 (log2
  // units), so most tiles leave O and l as they are (finish skips the rescale); P <= 2^8
  // meanwhile (kDirectP: 2^L, encoded times 2^(8 - L)), which e4m3 (448) and 16-bit P hold, and
  // O, l are fp32. Most tiles move no row's reference: this lane's maxes (lmax) and one vote of the
  // warp tell, so the rows' maxes (shuffles between the lanes of a row) are only taken when one may
  // move. msc: the reference in log2 units; alpha: O's and l's rescale. lmax may be an upper bound of
  // the lane's maxes: refine then makes it exact, only when a row may move.
  // Returns whether the warp took the rows' maxes (only then may msc differ from the last tile's).
  template <class Refine>
  ATOM_DEV bool operator()(float (&lmax)[acc_t::row_slots], float* msc, float* alpha, Refine&& refine) const {
    bool grow = false;
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) grow |= m_run[s] == neg_inf() || (lmax[s] - m_run[s]) * a_eff[s] > kLazyLog2;
    if (mma::warp_any(grow)) {
      refine(lmax);
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) {
        const float mx = acc_t::row_max(fmax_(lmax[s], m_run[s]));
        const bool g = m_run[s] == neg_inf() || (mx - m_run[s]) * a_eff[s] > kLazyLog2;
        float m_new = g ? mx : m_run[s];
        msc[s] = m_new == neg_inf() ? 0.f : m_new * a_eff[s];  // nothing visible yet: exp2 gives 0, not NaN
        if (kExpShift && g && m_new != neg_inf() && a_eff[s] > 0.f) {
          // the reference the exp2's f16 addend holds (B - 2^F msc, rounded), so that O's and l's
          // rescales and lse use the one P was computed with
          msc[s] = (kShiftBias - h2::lo(h2::splat(h2::shift_addend(msc[s])))) / kShiftScale;
          m_new = msc[s] / a_eff[s];
        }
        alpha[s] = g ? exp2_(m_run[s] * a_eff[s] - msc[s]) : 1.f;
        m_run[s] = m_new;
      }
      return true;
    }
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      msc[s] = m_run[s] * a_eff[s];
      alpha[s] = 1.f;
    }
    return false;
  }

};

// Mask and online softmax (log2 units) of tile it on fp32 scores (sacc: 16-bit compute, FP8 per key): sacc
// becomes P; alpha rescales O and l, rs holds this lane's part of P's row sums; vfac: O's extra factor
// (KV_FP8 = 2: the previous tile's v_max in units of this one's; 1 otherwise). v_ref: O's unit (KV_FP8 >= 2).
struct softmax_fp32 {
  s_regs& sacc;
  const kv_walk& kw;
  const unit& u;
  const float* __restrict__ const& v_max;
  const i64& v_max_blocks;
  const group_f& gk;
  const stage_scales& ss;
  const int &wp_first, &wp_last;
  const bool& causal;
  const int &W, &S;
  const row_f& a_row;
  const row_i& pos;
  float& v_ref;
  const reference_max& move_reference;
  const row_f& a_eff;
  const group_f& gv;

  ATOM_DEV void operator()(int it, float* alpha, float* rs, float& vfac) const {
    wg::fence_regs(sacc);
    const int j0 = kw.tile(it) * BN;
    // KV_FP8 = 2: V scales in the stage are relative to v_max of their block (v_blk[0], and
    // v_blk[1] for the second block of a 96- or 192-key tile where it holds keys of the
    // request); v_tile: the larger.
    float v_tile = 1.f, v_blk[SC_BLOCKS];
    if constexpr (kKeyScales && !kGroupScales) {
      const i64 vb = (i64)u.g * v_max_blocks + (u.k0 + j0) / kFp8Align;
      v_blk[0] = v_tile = v_max[vb];
      if constexpr (SC_BLOCKS > 1) {
        const int next = ((u.k0 + j0) / kFp8Align + 1) * kFp8Align - u.k0;  // the second block's first key
        v_blk[1] = next < u.sk && next < j0 + BN ? v_max[vb + 1] : 0.f;
        v_tile = fmax_(v_tile, v_blk[1]);
      }
    }
    if constexpr (kGroupScales && !kGroupK) {
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] *= gk[nt];
    } else if constexpr (kKeyScales && !kGroupScales) {
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt) {
        const float4 ks = ss.key_scales(it, 0, nt);
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] *= stage_scales::pick(ks, e);
      }
    }
    const bool masked = tile_needs_mask(j0, j0 + BN, wp_first, wp_last, u.sk, causal, W, S);
#if SOFTCAP
    // A masked tile caps first: tanh(-inf) = -1 would make a masked key visible.
    const bool late = kLateCap && !masked;
    if (!late)
#pragma unroll
      for (int nt = 0; nt < BN / 16; ++nt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] = tanh_(sacc[nt].x[e] * a_row[acc_t::row_slot(e)]);
#endif
    if (masked) mask_cols<acc_t>(sacc, j0, pos, u.sk, causal, W, S);
    // This lane's part of each row's max: every 16-key group's, then a tree over the groups (a
    // chain of BN / 4 dependent max operations would sit on the softmax's critical path).
    float gmax[BN / 16][acc_t::row_slots];
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      bool seen[acc_t::row_slots] = {};
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) {
        const int s = acc_t::row_slot(e);
        gmax[nt][s] = seen[s] ? fmax_(gmax[nt][s], sacc[nt].x[e]) : sacc[nt].x[e];
        seen[s] = true;
      }
      if constexpr (kGroupK)  // K's scale times the group's unscaled max (scale > 0)
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) gmax[nt][s] *= gk[nt];
    }
#pragma unroll
    for (int w = 1; w < BN / 16; w *= 2)
#pragma unroll
      for (int nt = 0; nt + w < BN / 16; nt += 2 * w)
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) gmax[nt][s] = fmax_(gmax[nt][s], gmax[nt + w][s]);
#if SOFTCAP
    if (late)
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) gmax[0][s] = tanh_(gmax[0][s] * a_row[s]);
#endif
    // V's factors of this tile (O's unit v_ref, known before S: it does not wait for the max).
    vfac = 1.f;
    float vc[SC_BLOCKS];  // a block's relative V scales -> O's unit
#pragma unroll
    for (int b = 0; b < SC_BLOCKS; ++b) vc[b] = 1.f;
    if constexpr (kKeyScales && !kGroupScales) {  // a scale per key: O in units of this tile's v_tile (a running max spills here)
      vfac = v_ref / v_tile;
      v_ref = v_tile;
      if constexpr (SC_BLOCKS > 1)
#pragma unroll
        for (int b = 0; b < SC_BLOCKS; ++b) vc[b] = v_blk[b] / fmax_(v_tile, 1e-30f);
    }
    float msc[acc_t::row_slots];
    move_reference(gmax[0], msc, alpha, [](float (&)[acc_t::row_slots]) {});
    // P = exp2(S * a - msc), its row sums; then P times V's scales (relative to O's unit).
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) rs[s] = 0.f;
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      const float vcn = ss.in_second(it, nt) ? vc[SC_BLOCKS - 1] : vc[0];
      float4 vr;
      if constexpr (kKeyScales && !kGroupScales) {
        vr = ss.key_scales(it, 1, nt);
        if constexpr (SC_BLOCKS > 1) vr = float4{vr.x * vcn, vr.y * vcn, vr.z * vcn, vr.w * vcn};
      }
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) {
        const int s = acc_t::row_slot(e);
        float x = sacc[nt].x[e];
#if SOFTCAP
        if (late) x = tanh_(x * a_row[s]);
#endif
        const float arg = x * (kGroupK ? a_eff[s] * gk[nt] : a_eff[s]) - msc[s];
        const float pv = exp2_(arg);
        if constexpr (!kRowsumMma) rs[s] += pv;
        if constexpr (kGroupScales) sacc[nt].x[e] = pv * (gv[nt] * vcn);
        else if constexpr (kKeyScales) sacc[nt].x[e] = pv * stage_scales::pick(vr, e);
        else sacc[nt].x[e] = pv;
      }
    }
  }

};

// P -> the operand registers of its P V (before the P V in flight completes: another buffer).
struct p_operand {
  const s_regs& sacc;

  // P -> the operand registers of its P V (before the P V in flight completes: another buffer).
  ATOM_DEV void operator()(op_t (&pa)[NPF]) const {
    if constexpr (kFp8) {
#pragma unroll
      for (int kk = 0; kk < NPF; ++kk) wg::to_operand_fp8(pa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
    } else {
#pragma unroll
      for (int nt = 0; nt < NPF; ++nt) mma::to_operand<DT>(pa[nt], sacc[nt]);
    }
  }

};

// The same softmax on S's f16x2 pairs (S_F16, hopper_softmax16.h), P in place of S (s16).
struct softmax_f16 {
  s16_regs& s16;
  const kv_walk& kw;
  const row_f& a_row;
  const group_f& gk;
  const u32x4 (&grel)[kRelGK ? 4 : 1];
  const float& gscale_t;
  const int &wp_first, &wp_last;
  const unit& u;
  const bool& causal;
  const int &W, &S;
  const row_i& pos;
  const reference_max& move_reference;
  const row_f& a_eff;
  u32& add_pair;
  bool& in_band;
  u32& mul_pair;
  const group_f& gv;

  ATOM_DEV u32 grel_at(int w) const {  // word w of the group block's first 16
    const u32x4& v = grel[w / 4];
    return w % 4 == 0 ? v.x : w % 4 == 1 ? v.y : w % 4 == 2 ? v.z : v.w;
  }
  ATOM_DEV void operator()(int it, float* alpha, float* rs, float& vfac) const;
};

// S_F16: P (s16) -> the operand registers of its P V.
struct p_operand16 {
  const s16_regs& s16;

  ATOM_DEV void operator()(op_t (&pd)[NPF]) const;
};

// The rows' sums: l so far, and a finished P V's (kRowsumMma).
struct row_sums {
  const row_f& l_run;
  const float (&lacc)[4];

  // A row's sum l so far (kRowsumMma: every lane holds it; else this lane's part, summed over the row).
  ATOM_DEV float row_l(int s) const { return kRowsumMma && !kRowsumGroups ? l_run[s] : acc_t::row_sum(l_run[s]); }
  // kRowsumMma: a finished P V's sums in l's units (per 16 keys: each group's times its weight)
  ATOM_DEV float tile_l(int s, u32 rv) const {
    return kRowsumGroups ? h2::lo(rv) * lacc[2 * s] + h2::hi(rv) * lacc[2 * s + 1] : lacc[2 * s];
  }
};

// After O += P V of the previous tile completed: rescale O, update l.
struct rescale {
  row_f& l_run;
  const row_sums& sums;
  const u32& rv_prev;
  o_regs& oacc;
  row_f& part_f;
  float (&lacc)[4];

  // After O += P V of the previous tile completed: rescale O, update l.
  ATOM_DEV void operator()(const float* alpha, const float* rs, float vfac) const {
    bool moved = false;
    float of[acc_t::row_slots];
#pragma unroll
    for (int s = 0; s < acc_t::row_slots; ++s) {
      l_run[s] = kRowsumMma ? (l_run[s] + sums.tile_l(s, rv_prev)) * alpha[s] : l_run[s] * alpha[s] + rs[s];
      of[s] = alpha[s] * vfac;
      moved |= of[s] != 1.f;
    }
    if (mma::warp_any(moved)) {
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) oacc[dt].x[e] *= of[acc_t::row_slot(e)];
    }
    if constexpr (kPromote != 0)
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) part_f[s] *= of[s];
    if constexpr (kRowsumMma) {  // the next P V's sums start from zero, set before its wgmma.fence
#pragma unroll
      for (int e = 0; e < 4; ++e) lacc[e] = 0.f;
      wg::fence_regs(lacc);
    }
  }
};
}  // namespace atom_prefill
#endif
