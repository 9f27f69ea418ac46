// The Hopper kernel's epilogue: a warpgroup's rows of a unit normalised (sink in the denominator), their
// lse, O through the warpgroup's rows of sO (once the previous unit's O has left them), then to global
// memory: by one TMA store per 64 columns when the rows are whole tokens of the request, else (the last
// tile of a request, or 64 rows not a multiple of G) 16-byte stores of the rows in it. The TMA store
// frees the warpgroup at once: the 16-byte stores of a d128 tile took ~2000 cycles per unit on H100.
#pragma once

#include "hopper_consumer.h"
#include "hopper_softmax.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
struct epilogue {
  const unit& u;
  const row_i& tok;
  const row_i& head;
  const row_f& a_eff;
  const row_f& m_run;
  const o_regs& oacc;
  const row_sums& sums;
  float v_o;  // O's scale: V's per tensor, or O's unit v_ref per key / per 16 keys
  u16* sO;
  const tma_desc& tm_o;
  u16* __restrict__ o;
  i64 o_st, o_sh;
  float* __restrict__ lse;
  const float* __restrict__ sinks;
  int hq, grp, warp, G;
  bool o_issuer;

  // tma_o: the rows are whole tokens of the request (64 % G == 0 and none past its end). inv: the rows'
  // factors (the caller's registers).
  ATOM_DEV void run(bool tma_o, row_f& inv) const {
    if (o_issuer) wg::bulk_wait_read<0>();
    wg::bar_sync(epi_bar(grp), 128);
    {
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) {
        const float l = sums.row_l(s);  // kDirectP: in units of kDirectMean (lse and the sink take P's)
        float lse_v = neg_inf();
        inv[s] = 0.f;
        if (l > 0.f) {
          const float m2 = m_run[s] * a_eff[s];
          lse_v = (m2 + log2_(kDirectP ? l * (1.f / kDirectMean) : l)) * kLn2;
          float den = l;
          if (sinks != nullptr) den += exp2_(sinks[head[s]] * kLog2e - m2) * (kDirectP ? kDirectMean : 1.f);
          inv[s] = v_o / den;
        }
        if (lse != nullptr && acc_t::row_leader() && tok[s] < u.sq) lse[(i64)(u.q0 + tok[s]) * hq + head[s]] = lse_v;
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
    if (tma_o) wg::fence_proxy_async();  // sO's writes, visible to the copy engine
    wg::bar_sync(epi_bar(grp), 128);
    if (tma_o) {
      if (o_issuer) {
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
          wg::tma_store_3d(&tm_o, wg::smem_addr(sO + p * BM * 64 + 64 * grp * 64), p * 64, u.h0,
                           u.q0 + u.m0 + 64 * grp / G);
        wg::bulk_commit();
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < 64 * CPR / 128; ++i) {
      const int c = (int)(tid_x() % 128) + i * 128;
      const int r = 64 * grp + c / CPR, ch = c % CPR;
      const int t = u.m0 + r / G;
      if (t < u.sq) {
        u16* dst = o + (i64)(u.q0 + t) * o_st + (i64)(u.h0 + r % G) * o_sh + ch * 8;
        store16(dst, load16(sO + LQ::off(r, ch * 8)));
      }
    }
  }
};
}  // namespace atom_prefill
#endif
