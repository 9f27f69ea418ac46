// The Hopper kernel's consumer warpgroups: the types of their per-unit registers, the rings they wait on
// and hand back, their turns (ping-pong), the MMAs they issue, the hand-back of tiles they skip.
#pragma once

#include "hopper_config.h"
#include "hopper_scheduler.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
enum : int { NPF = kFp8 ? BN / 32 : BN / 16 };  // P's operand fragments (k16 16-bit or k32 e4m3)

// Turns: consumer grp issues its MMAs after consumer grp - 1 issued the same round (consumer 0 after the
// last one's previous round). Every sync meets exactly one arrival. Without ping-pong: no turns.
struct turns {
  int grp;
  bool first_round = true;

  ATOM_DEV void wait() {
#if PINGPONG
    if (!(grp == 0 && first_round)) wg::bar_sync(turn_bar(grp), 256);
    first_round = false;
#endif
  }
  ATOM_DEV void pass() const {
#if PINGPONG
    wg::bar_arrive(turn_bar((grp + 1) % NWG), 256);
#endif
  }
  // Consumer 0 skipped the wait of its first round; the last consumer's final pass is consumed here so
  // that every hardware barrier ends balanced.
  ATOM_DEV void finish() const {
#if PINGPONG
    if (grp == 0 && !first_round) wg::bar_sync(turn_bar(0), 256);
#endif
  }
};

// A warpgroup's registers over a unit (the kernel declares each; the units hold references to them, as
// the kernel's code would see them): O's and S's accumulators, S as f16x2 pairs (S_F16), P's operands,
// a float or an int per row slot of the lane.
typedef acc_t o_regs[D / 16];
typedef acc_t s_regs[BN / 16];
typedef u32 s16_regs[kSF16 ? BN / 4 : 1];
typedef float row_f[acc_t::row_slots];
typedef int row_i[acc_t::row_slots];

// The K / V ring stages of a unit's tiles (base: the CTA's tiles before it) and its Q stage: waits,
// and the hand-backs (one arrival per warp).
struct stages {
  u64 *fullK, *emptyK, *fullV, *emptyV, *emptyQ;
  int base, qs;
  bool releaser;

  ATOM_DEV int stage(int it) const { return (base + it) % NST; }
  ATOM_DEV int parity(int it) const { return ((base + it) / NST) & 1; }
  ATOM_DEV void wait_k(int it) const { wg::mbar_wait(fullK + stage(it), parity(it)); }
  ATOM_DEV void wait_v(int it) const { wg::mbar_wait(fullV + stage(it), parity(it)); }
  ATOM_DEV void free_k(int it) const { if (releaser) wg::mbar_arrive(emptyK + stage(it)); }
  ATOM_DEV void free_v(int it) const { if (releaser) wg::mbar_arrive(emptyV + stage(it)); }
  ATOM_DEV void free_q() const { if (releaser) wg::mbar_arrive(emptyQ + qs); }
};

// The MMAs of a warpgroup's tiles: S = Q K^T (into sacc, or s16 on f16 scores) and O += P V (P V's row
// sums into lacc with kRowsumMma).
struct mma_issue {
  const stages& st;
  s16_regs& s16;
  s_regs& sacc;
  o_regs& oacc;
  float (&lacc)[4];
  const unsigned char *sQs, *sQ8, *sK, *sV;
  int grp;
  bool promo;  // O_PROMOTE: P V(j) starts O's registers from zero after a promotion (restart(j))

  ATOM_DEV bool restart(int j) const { return promo && j > 0 && j % (kPromote ? kPromote : 1) == 0; }

  ATOM_DEV void s(int it) const {  // S = Q K^T of tile it
    const unsigned char* sKs = sK + EB * st.stage(it) * TILE;
    if constexpr (kFp8) {  // rows of 128 bytes: K steps of 32 bytes inside the swizzle atom
      // The steps' descriptors by desc_add (one add each, not the address's encoding, between the turns).
      const u64 dq0 = wg::desc_bits(sQ8 + 64 * grp * D, 16, 1024), dk0 = wg::desc_bits(sKs, 16, 1024);
#pragma unroll
      for (int kc = 0; kc < D / 32; ++kc) {
        const u64 dq = wg::desc_add(dq0, kc * 32), dk = wg::desc_add(dk0, kc * 32);
        if constexpr (kSF16) wg::op8h<kSF16 ? BN : 128>::ss(s16, dq, dk, kc);
        else wg::op8<BN>::ss(sacc, dq, dk, kc);
      }
    } else {
      const u16 *q16 = reinterpret_cast<const u16*>(sQs), *k16 = reinterpret_cast<const u16*>(sKs);
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc)
        wg::op<BN16, DT>::ss(sacc, wg::desc_k(q16 + LQ::off(64 * grp, kc * 16)), wg::desc_k(k16 + LKV::off(0, kc * 16)), kc);
    }
    wg::commit();
  }

  ATOM_DEV void pv(int it, const op_t (&pa)[NPF]) const {  // O += P V of tile it
    const unsigned char* sVs = sV + st.stage(it) * VSTAGE;
    if constexpr (kFp8) {  // V^T panels [D][VT_PANEL]: K-major, keys in steps of 32 bytes
      const int keep = restart(it) ? 0 : 1;
      const u64 dv0 = wg::desc_bits(sVs, 16, 8 * VT_PANEL, VT_LAYOUT);
#pragma unroll
      for (int kk = 0; kk < BN / 32; ++kk) {
        const u64 db = wg::desc_add(dv0, 32 * kk / VT_PANEL * VT_PANEL * VROWS + 32 * kk % VT_PANEL);
        if constexpr (kRowsumMma) wg::op8<128>::rs_sum(oacc, lacc, pa[kk], db, kk ? 1 : keep);  // D = 128 (FP8)
        else wg::op8<D>::rs(oacc, pa[kk], db, kk ? 1 : keep);
      }
    } else {
      const u16* v16 = reinterpret_cast<const u16*>(sVs);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) wg::op<D, DT>::rs_t(oacc, pa[kk], wg::desc_mn<BN>(v16 + LKV::off(kk * 16, 0)));
    }
    wg::commit();
  }
};

// kSkipIdle: the turns and stages of the tiles k in [n_iter, n_unit) that this warpgroup dropped, as a
// round would take them: the first turn (S(0)'s) bare when it has none of its own, then per tile K and
// V waited, a turn, both freed.
ATOM_DEV void hand_back_idle(const stages& st, turns& turn, int n_iter, int n_unit) {
  if (n_iter == 0 && n_unit > 0) {
    turn.wait();
    turn.pass();
  }
  for (int k = n_iter; k < n_unit; ++k) {
    st.wait_k(k);
    st.wait_v(k);
    turn.wait();
    turn.pass();
    st.free_k(k);
    st.free_v(k);
  }
}
}  // namespace atom_prefill
#endif
