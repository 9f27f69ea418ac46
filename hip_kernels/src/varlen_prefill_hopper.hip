// Varlen prefill attention on Hopper (sm_90a): the FlashAttention-3 structure, written for this
// package. Same semantics as varlen_prefill.hip (docs/design.md; the tile walk and masks come from
// prefill_tiles.h), different machinery:
//
//   warp specialization  warpgroup 0 is the producer: it gives its registers away (setmaxnreg);
//                        one of its threads schedules work units, another issues every copy.
//                        Warpgroups 1..NWG are consumers (64 query rows each, BLOCK_M = 64 * NWG)
//                        that only compute.
//   TMA                  Q, K and V tiles of the packed [total, heads, d] tensors arrive by bulk
//                        tensor copies (tensor maps encoded on the host, 128-byte swizzle done by
//                        the copy engine), each completing on a full mbarrier; consumers hand a
//                        stage back on its empty mbarrier once the MMAs reading it are done. K and
//                        V have rings of STAGES tiles, Q one of Q_STAGES: the next unit's Q loads
//                        while this one computes (a unit of a small window sees few tiles).
//   intra-warpgroup      round i issues S(i) = Q K(i)^T and O += P(i-1) V(i-1), waits for S(i)
//   overlap              only, and runs the softmax of tile i while the tensor cores do P V; FP8
//                        with two consumers puts P(i) into the other of two operand buffers then.
//   lazy rescaling       a row's reference max moves only when the tile's max passes it by more
//                        than 2^8: most tiles leave O alone, and a warp whose lanes all stay under
//                        it (one vote) skips the shuffles of the rows' maxes.
//   ping-pong            consumer warpgroups take turns to issue their MMAs (named barriers), so
//                        one's softmax runs under the other's MMAs.
//   persistent grid      one CTA per SM; its producer claims work units from a global counter as
//                        the CTA gets through them (longest first, so the tail evens out) and
//                        hands them to the consumers through a shared-memory ring: each
//                        work item (the host's longest-first list, or q tiles last to first) has
//                        hq units, (item, query head), or with GQA packing (pack = G) (sub-tile,
//                        KV head): the G query heads that share a KV head fill the tile's rows
//                        together, so a short request's few rows still fill the MMAs.
//   output               normalised O goes to its own shared buffer, then out by TMA stores
//                        (one thread per warpgroup); a warpgroup whose rows run past the request
//                        (a TMA box would write over the next request's rows) uses 16-byte
//                        coalesced stores of the rows that belong to it.
//   FP8 (KV_FP8)         e4m3 operands on the tensor cores (wgmma k32), over the layout that
//                        hip_kernels/gather.py's gather_kv_fp8 writes: K [total, hk, d] bytes,
//                        V^T [hk, d, total] (FP8 wgmma takes B K-major only) with the keys of
//                        every 16 permuted so that P's accumulator registers are the A fragment
//                        as they stand (to_operand_fp8), requests 128-key aligned. Q arrives
//                        16-bit and the consumers quantize it in shared memory, one scale per
//                        (token, head) that joins the row's softmax scale. K/V scales: per
//                        tensor (K's in the softmax scale, V's in the epilogue) or per key
//                        (KV_FP8 = 2: a page's scale copied to its keys): S's columns are
//                        multiplied by K's, P's by V's relative to the request's largest V
//                        scale (the gather's; so P stays <= 2^8 in e4m3), in whose units O's
//                        accumulator is kept (KV_FP8 = 2: the tile's block's, rescaled per tile).
//                        KV_FP8 = 3 (pages of a multiple of 16 keys): every 16 keys share their
//                        scales, so K's joins the exp2's multiplier and the row max is taken per
//                        16 keys on the unscaled S (no multiply per element: the one on the path
//                        from S to the max cost 20-30% of the kernel as KV_FP8 = 2).
//                        O_PROMOTE: the FP8 accumulator adds with ~14 bits, so a unit of
//                        many keys moves O to fp32 shared memory every O_PROMOTE tiles.
//                        S_F16 (per tensor, per 16 keys): S in an f16 accumulator (Q quantized
//                        to |q| <= 1, so |S| <= 128 * 448 fits f16), the softmax on f16 pairs,
//                        and O's promoted partial f16 in units of the row sum inside sO: 32
//                        registers and 16 KB per consumer less, which three consumers of
//                        128-key tiles need (docs/fp8.md has the error terms).
// Rows that a TMA box reads past a request (the next request's, or zero past the tensor) are
// masked (keys) or never stored (queries); masked keys get P = 0 exactly.
//
// Defines: DTYPE (0 bf16, 1 fp16), HEAD_DIM (64|128), SOFTCAP (0|1), CONSUMERS (warpgroups of 64
// rows: 1, 2 or 3), CTAS (CTAs per SM with one consumer: 2, or 3 where shared memory allows),
// BLOCK_N (64|128), STAGES (>= 2), Q_STAGES (1|2), PINGPONG (0|1, two or more consumers).
// Built for a target without wgmma (every arch but sm_90a) the kernel has no body: the launcher
// only selects it on sm_90a (hip_kernels/prefill.py), CI compiles it everywhere.
// KV_FP8: 0 (16-bit Q/K/V), 1 (e4m3, per-tensor K/V scales), 2 (e4m3, per-key scales), 3 (e4m3,
// scales per 16 keys, in KV_FP8 = 2's layout); FP8 needs
// HEAD_DIM 128 and BLOCK_N 64, 96, 128 or 192 (V^T rows of one 128-byte swizzle panel, or panels of
// 64 or 32 keys).
// O_PROMOTE (tiles, default 0: off): FP8 O's sums in fp32 shared memory, restarted in the tensor
// cores every O_PROMOTE tiles of a unit that sees more tiles than that (hopper_config.h); Q_STAGES 1.
// S_F16 (0|1): f16 scores for FP8 per tensor / per 16 keys with 128-key tiles (hopper_config.h): the
// softmax's exp2 by shifting bits on the integer pipe, not the MUFU, P's e4m3 bytes straight from the
// exp2's argument, V's group factors in P's exponent, P's row sums by the tensor cores.

// The kernel's units, one header each; this file is their skeleton: it declares each thread's state
// (the units hold references to it) and calls the units in the pipeline's order.
#include "hopper_config.h"     // defines, tile constants, the FP8 forms a build takes
#include "hopper_f16x2.h"      // f16x2 arithmetic, exp2 by bit shifts
#include "hopper_smem.h"       // shared-memory layout, barriers
#include "hopper_scheduler.h"  // work units, their ring, the scheduling thread
#include "hopper_producer.h"   // the copier thread (TMA)
#include "hopper_consumer.h"   // consumers' rings, turns, MMAs, register types
#include "hopper_softmax.h"    // online softmax on fp32 scores, O's and l's rescale
#include "hopper_softmax16.h"  // online softmax on f16 scores (FP8 per tensor, per 16 keys)
#include "hopper_promotion.h"  // O's promotion to shared memory (FP8, long units)
#include "hopper_epilogue.h"   // normalise, lse, O out

// q, k, v: tensor maps of [total, heads, d] (boxes {64, G, BLOCK_M / G} for q, {64, 1, BLOCK_N}
// for k and v, 128-byte swizzle); o's map tm_o: boxes {64, G, 64 / G} of out, 128-byte swizzle
// (read only when 64 % G == 0); pack: G, 1 or q_per_kv (GQA packing, BLOCK_M % G == 0);
// o [total_q, hq, d] (strides in elements); lse [total_q, hq] fp32 or null; sinks [hq] fp32 or
// null; work [n_items, 2] int32 (b, t) or null (then n_items = batch * max_tiles); sched: two
// zeroed int32 counters (dynamic tile scheduler, left zeroed) or null (static round robin).
// a_log2: scale * log2(e) (or scale / softcap with SOFTCAP); c_log2: softcap * log2(e).
// FP8 only (else unused): tm_s, map of the key scales [hk][blocks of 128 keys][2][128] fp32
// (KV_FP8 >= 2); kv_scale: the per-tensor K and V scales (2 fp32, KV_FP8 = 1); v_max [hk][blocks]
// fp32, each 128-key block its request's largest V scale (KV_FP8 >= 2); cu_kp: the requests' first rows
// in the 128-aligned K / V^T layout (keys: cu_k).
extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(NTB, CTAS_PER_SM)
varlen_prefill_hopper(const ATOM_GRID_CONSTANT tma_desc tm_q, const ATOM_GRID_CONSTANT tma_desc tm_k,
                      const ATOM_GRID_CONSTANT tma_desc tm_v, const ATOM_GRID_CONSTANT tma_desc tm_s,
                      const ATOM_GRID_CONSTANT tma_desc tm_o,
                      u16* __restrict__ o, float* __restrict__ lse,
                      const i32* __restrict__ cu_q, const i32* __restrict__ cu_k, const i32* __restrict__ work,
                      const float* __restrict__ kv_scale,
                      const float* __restrict__ v_max, i64 v_max_blocks, const i32* __restrict__ cu_kp,
                      i32* __restrict__ sched, const float* __restrict__ sinks, i64 o_st, i64 o_sh, i64 n_items, i64 hq_i, i64 batch_i,
                      i64 q_per_kv_i, i64 max_tiles_i, i64 causal_i, i64 window_i, i64 sink_tok_i, i64 pack_i,
                      float a_log2, float c_log2) {
#if ATOM_HAS_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const smem sh(smem_raw);
  const int hq = (int)hq_i, batch = (int)batch_i, q_per_kv = (int)q_per_kv_i, max_tiles = (int)max_tiles_i;
  const bool causal = causal_i != 0;
  const int W = (int)window_i, S = (int)sink_tok_i, G = (int)pack_i;
  const int total = (int)(n_items * hq);  // the host keeps it below 2^31
  const problem pb{hq, batch, q_per_kv, max_tiles, causal, W, S, G, total};
  sh.init(tm_q, tm_k, tm_v, tm_s);
  sync_block();

  const unit_ring units{sh.fullU, sh.emptyU, sh.sU};
  const int wgi = wg::warpgroup_index();
  if (wgi == 0) {
    // ---- producer warpgroup: one thread schedules, one issues every copy ----
    wg::regs_dec<PRODUCER_REGS>();
    if (tid_x() == 1)  // lane 1 of the copier's warp: one warp of the SM spins on barriers, not two
      schedule_units(units, sched, pb, work, cu_q, cu_k, cu_kp);
    else if (tid_x() == 0) {
      int base = 0, qn = 0;  // K/V tiles and Q tiles loaded so far (ring stages, phases)
      const copier cp(tm_q, tm_k, tm_v, tm_s, sh.sQ);
      for (int un = 0;; ++un) {
        const unit u = units.take(un);
        units.release(un);
        if (!u.live) break;
        const kv_walk kw(u.sq, u.sk, u.m0, u.rows, BN, causal, W, S);
        cp.first(u, kw, base, qn);
        ++qn;
        cp.rest(u, kw, base);
        base += kw.n_iter;
      }
    }
  } else {
    // ---- consumers: each warpgroup 64 rows of every unit ----
    wg::regs_inc<CONSUMER_REGS>();
    const int grp = wgi - 1;
    const int warp = (int)((tid_x() / 32) % 4);  // warp in the warpgroup
    const bool releaser = lane_id() == 0;
    const bool o_issuer = tid_x() % 128 == 0;  // issues this warpgroup's TMA stores of O
    int base = 0, qn = 0, un = 0;
    turns turn{grp};
    // Per-tensor FP8 scales: K's joins the softmax scale, V's the epilogue's.
    const float k_scale = KV_FP8 == 1 ? kv_scale[0] : 1.f, v_scale = KV_FP8 == 1 ? kv_scale[1] : 1.f;

    for (;; ++un) {
      const unit u = units.take(un);
      mma::warp_sync();  // every lane has read the slot
      if (releaser) units.release(un);
      if (!u.live) break;
      const kv_walk kw(u.sq, u.sk, u.m0, u.rows, BN, causal, W, S);
      const int off = u.sk - u.sq;
      // Key positions of this warpgroup's first and last query row, and of this lane's rows.
      const int wp_first = off + u.m0 + 64 * grp / G, wp_last = off + u.m0 + (64 * grp + 63) / G;
      int tok[acc_t::row_slots], head[acc_t::row_slots], pos[acc_t::row_slots];
      // a_row: the row's scale of S in log2 units (FP8: times Q's scale and K's per-tensor one, once
      // Q is quantized); a_eff: S's multiplier to log2 units after the soft-cap (S = tanh(S a_row)
      // there, times the cap c_log2).
      float a_row[acc_t::row_slots], a_eff[acc_t::row_slots];
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) {
        const int r = 64 * grp + 16 * warp + acc_t::slot_row(s);
        tok[s] = u.m0 + r / G;
        head[s] = u.h0 + r % G;
        pos[s] = off + tok[s];
        a_row[s] = a_log2;
      }
      // KV_FP8 >= 2: O's accumulator is in units of v_ref: KV_FP8 = 3, the request's largest V scale
      // (the gather writes it to every block of the request: read once, and the stage's V scales
      // are relative to it); KV_FP8 = 2, the last tile's block's.
      float v_ref = 1.f;
      if (kGroupScales && u.sk > 0) v_ref = v_max[(i64)u.g * v_max_blocks + u.k0 / kFp8Align];
      // The unit's tiles (n_unit: the copier's) and this warpgroup's (n_iter). kSkipIdle: a warpgroup whose
      // rows all lie past the request (the last tile of a request that BLOCK_M does not divide) computes
      // nothing, and one whose rows' last key (causal) ends before the unit's drops the tiles after it
      // (every key there is masked for its rows: P = 0, no move of a row's max); either keeps its part in
      // the unit's turns and stage hand-backs (hand_back_idle) so that the ring and the barriers' counts stay
      // whole.
      const int n_unit = kw.n_iter;
      const bool idle = kSkipIdle && u.m0 + 64 * grp / G >= u.sq;
      int n_iter = n_unit;
      if constexpr (kSkipIdle) {
        const int t0 = u.m0 + 64 * grp / G;  // this warpgroup's tokens: t0 .. t0 + rows - 1
        const kv_walk own(u.sq, u.sk, t0, u.m0 + (64 * grp + 63) / G + 1 - t0, BN, causal, W, S);
        n_iter = idle ? 0 : imax(0, n_unit - (kw.last - own.last));
      }

      acc_t oacc[D / 16], sacc[BN / 16];
      u32 s16[kSF16 ? BN / 4 : 1];  // S_F16: S as f16x2 pairs
      // kRowsumMma: P V's 8 extra columns (2 per row slot: the row's sum twice per tensor, groups 2q and
      // 2q + 1 per 16 keys): one tile's sums, zeroed before each P V and added to l_run in fp32 (FP8
      // wgmma accumulates with ~14 bits: summed across the tiles of a 64k-key request, l lost most of
      // its terms).
      float lacc[4] = {};
      // O_PROMOTE: O = part * part_f + oacc (part: this thread's 64 floats in shared memory, once has_part).
      float part_f[acc_t::row_slots];
      bool has_part = false;
      // P as the A operand of P V (k16 16-bit or k32 e4m3 fragments). Two buffers (kTwoP): the
      // softmax of tile i writes one while O += P V of tile i - 1 reads the other, so converting P
      // is off the path from that P V's end to the next round's MMAs.
      op_t pf[NPF], pg[NPF];
      float m_run[acc_t::row_slots], l_run[acc_t::row_slots];
      // S_F16: the exp2's f16 multipliers and addends of both row slots (pairs) and whether the warp's
      // references lie in the band of the fast exp2 (kFoldV, kDirectP), set with the references (softmax16).
      u32 mul_pair = 0u, add_pair = 0u;
      bool in_band = true;
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) mma::zero(oacc[dt]);
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) {
        m_run[s] = neg_inf();
        l_run[s] = 0.f;
        part_f[s] = 1.f;
      }

      const int qs = qn % QST;
      const unsigned char* sQs = sh.sQ + 2 * qs * BM * D;
      const stages st{sh.fullK, sh.emptyK, sh.fullV, sh.emptyV, sh.emptyQ, base, qs, releaser};
      const mma_issue mma{st, s16, sacc, oacc, lacc, sQs, sh.sQ8, sh.sK, sh.sV, grp, kPromote && n_iter > kPromote};
      const stage_scales ss{kw, st, sh.sS};
      // KV_FP8 = 3: a tile's 16-key group scales (K's, V's), one broadcast read each, loaded
      // before S is waited for. K's > 0: a zero-scale page's bytes are zero (the floor keeps
      // -inf * 0 from making a NaN of a masked key).
      float gk[kGroupScales ? BN / 16 : 1], gv[kGroupScales ? BN / 16 : 1];
      // kRelGK: the pack's group block (src/fp8_pack.h), four 16-byte reads and a word: K's group factors, V's (f16
      // pairs), then the block's largest K scale; gk / gv unused.
      u32x4 grel[kRelGK ? 4 : 1];
      float gscale_t = 1.f;
      // kRowsumGroups: the weights 2^(-c / 2^F) of groups 2q, 2q + 1 (lane quad q): this tile's, and the
      // tile before's (whose P V's sums finish adds to l)
      u32 rv_cur = 0u, rv_prev = 0u;  // f16 pairs
      const group_scales gs{ss, gk, gv, grel, gscale_t, rv_cur, rv_prev};
      const reference_max move_reference{m_run, a_eff};
      const softmax_fp32 softmax{sacc, kw, u, v_max, v_max_blocks, gk, ss, wp_first, wp_last, causal, W, S, a_row, pos,
                                 v_ref, move_reference, a_eff, gv};
      const p_operand to_operand{sacc};
      const softmax_f16 softmax16{s16, kw, a_row, gk, grel, gscale_t, wp_first, wp_last, u, causal, W, S, pos,
                                  move_reference, a_eff, add_pair, in_band, mul_pair, gv};
      const p_operand16 to_operand16{s16};
      const row_sums sums{l_run, lacc};
      const rescale finish{l_run, sums, rv_prev, oacc, part_f, lacc};

      const promotion pro{oacc, part_f, has_part, sums, mma, sh.sPro, sh.sO, grp, o_issuer};

      wg::mbar_wait(sh.fullQ + qs, (qn / QST) & 1);
      ++qn;
      if (kFp8 && n_iter == 0) st.free_q();  // no S to issue: the 16-bit stage goes back unread
      if (kFp8 && n_iter > 0) {
        // Q -> e4m3 in shared memory, one scale per row (token, head): s = max|q| / 448 (1 for a
        // zero row), x8 = rn_satfinite(q * (1 / s)) (docs/fp8.md): two threads per row of this
        // warpgroup, each one 64-column panel of the 16-bit tile. The 16-bit stage is handed back
        // at once.
        const int t = (int)(tid_x() % 128), r = 64 * grp + t / 2, h = t & 1;
        const unsigned char* src = sQs + 2 * (h * BM * 64 + r * 64);
        float x[64], amax = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const u32x4 w = load16(src + 16 * (c ^ (r & 7)));
          const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            x[8 * c + 2 * i] = to_f32(DT{}, (u16)(ws[i] & 0xffffu));
            x[8 * c + 2 * i + 1] = to_f32(DT{}, (u16)(ws[i] >> 16));
            amax = fmax_(amax, fmax_(fabs_(x[8 * c + 2 * i]), fabs_(x[8 * c + 2 * i + 1])));
          }
        }
        amax = fmax_(amax, shfl_xor(amax, 1));
        const float qsc = amax > 0.f ? amax / (kSF16 ? 1.f : 448.f) : 1.f, inv = 1.f / qsc;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          u32 w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float* y = x + 16 * j + 4 * k;
            w[k] = f32x4_to_fp8x4(y[0] * inv, y[1] * inv, y[2] * inv, y[3] * inv);
          }
          store16(sh.sQ8 + r * D + 16 * ((4 * h + j) ^ (r & 7)), u32x4{w[0], w[1], w[2], w[3]});
        }
        if (h == 0) sh.sQsc[r] = qsc;
        wg::fence_proxy_async();  // the e4m3 tile, visible to wgmma
        wg::bar_sync(epi_bar(grp), 128);
        st.free_q();
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) a_row[s] *= sh.sQsc[64 * grp + 16 * warp + acc_t::slot_row(s)] * k_scale;
      }
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) a_eff[s] = SOFTCAP ? c_log2 : a_row[s];
      if (n_iter == 0) {
        if (!kFp8) st.free_q();
      } else {
        float alpha[acc_t::row_slots], rs[acc_t::row_slots], vfac;
        st.wait_k(0);
        turn.wait();
        wg::fence();
        mma.s(0);
        turn.pass();
        gs.load(0);
        wg::wait<0>();
        if (!kLateFreeK) st.free_k(0);
        if (!kFp8 && n_iter == 1) st.free_q();
        if constexpr (kSF16) {
          softmax16(0, alpha, rs, vfac);
          to_operand16(pf);
        } else {
          softmax(0, alpha, rs, vfac);
          if (kLateFreeK) st.free_k(0);
          to_operand(pf);
        }
        finish(alpha, rs, vfac);
        // Round it: S(it) and O += P(it - 1) V(it - 1) issued, the softmax of tile it under the latter;
        // P(it - 1) in pa, P(it) into pb. Rounds go in pairs so that the buffers alternate by name.
        auto round = [&](int it, op_t (&pa)[NPF], op_t (&pb)[NPF]) {
          st.wait_k(it);
          st.wait_v(it - 1);
          turn.wait();
          wg::fence();
          mma.s(it);
          pro.before(it - 1);
          mma.pv(it - 1, pa);
          turn.pass();
          gs.load(it);
          wg::wait<1>();  // S(it) done; the softmax overlaps O += P V of tile it - 1
          if (!kLateFreeK) st.free_k(it);  // KV_FP8 = 2: the key scales in K's stage are read by the softmax
          if (!kFp8 && it == n_iter - 1) st.free_q();
          if constexpr (kSF16) {
            softmax16(it, alpha, rs, vfac);
            if (kTwoP) to_operand16(pb);
          } else {
            softmax(it, alpha, rs, vfac);
            if (kLateFreeK) st.free_k(it);
            if (kTwoP) to_operand(pb);
          }
          wg::wait<0>();
          st.free_v(it - 1);
          wg::fence_regs(oacc);
          if constexpr (kRowsumMma) wg::fence_regs(lacc);
          wg::fence_regs(pa);  // read by the P V until here: not a register the softmax may reuse
          if (!kTwoP) {
            if constexpr (kSF16) to_operand16(pb);
            else to_operand(pb);
          }
          finish(alpha, rs, vfac);
          // S_F16: P V(it) restarts next round; its promotion here, before that round's turn, leaves the
          // other warpgroups' MMAs free to issue meanwhile (O holds the tiles before it).
          if (kHalfPart && mma.restart(it)) pro.promote();
        };
        auto last_pv = [&](op_t (&pa)[NPF]) {
          st.wait_v(n_iter - 1);
          turn.wait();
          wg::fence();
          pro.before(n_iter - 1);
          mma.pv(n_iter - 1, pa);
          turn.pass();
        };
        if constexpr (kTwoP) {
          int it = 1;
          for (; it + 1 < n_iter; it += 2) {
            round(it, pf, pg);
            round(it + 1, pg, pf);
          }
          if (it < n_iter) {  // one round left: P of the last tile ends in pg
            round(it, pf, pg);
            last_pv(pg);
          } else {
            last_pv(pf);
          }
        } else {
          for (int it = 1; it < n_iter; ++it) round(it, pf, pf);
          last_pv(pf);
        }
        wg::wait<0>();
        st.free_v(n_iter - 1);
        wg::fence_regs(oacc);
        if constexpr (kRowsumMma) {
          wg::fence_regs(lacc);
#pragma unroll
          for (int s = 0; s < acc_t::row_slots; ++s) l_run[s] += sums.tile_l(s, rv_cur);  // the last tile's
        }
        wg::fence_regs(pf);
        if (kTwoP) wg::fence_regs(pg);
      }
      if constexpr (kSkipIdle) hand_back_idle(st, turn, n_iter, n_unit);
      base += n_unit;
      if (idle) continue;  // no row of the request: nothing to store

      // Epilogue (hopper_epilogue.h): O by TMA stores where its rows are whole tokens of the request.
      const bool tma_o = 64 % G == 0 && u.m0 + (64 * grp + 64) / G <= u.sq;
      // O_PROMOTE: O's partial added back into the registers, read before the epilogue's barrier (the rows
      // of sO are written after it).
      if (kHalfPart && has_part) {
        u32x4 a[D / 16];
#pragma unroll
        for (int i = 0; i < D / 16; ++i) a[i] = *pro.half_chunk(i);
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          const u32 w[4] = {a[i].x, a[i].y, a[i].z, a[i].w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            oacc[i].x[2 * k] = fmaf(h2::lo(w[k]), part_f[k & 1], oacc[i].x[2 * k]);
            oacc[i].x[2 * k + 1] = fmaf(h2::hi(w[k]), part_f[k & 1], oacc[i].x[2 * k + 1]);
          }
        }
      } else if (kPromote && has_part)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float4 v = pro.with_part(i, *pro.part_chunk(i));
          float* x = oacc[i / 2].x + 4 * (i % 2);
          x[0] = v.x;
          x[1] = v.y;
          x[2] = v.z;
          x[3] = v.w;
        }
      const epilogue epi{u, tok, head, a_eff, m_run, oacc, sums, KV_FP8 == 1 ? v_scale : kKeyScales ? v_ref : 1.f,
                         sh.sO, tm_o, o, o_st, o_sh, lse, sinks, hq, grp, warp, G, o_issuer};
      float inv[acc_t::row_slots];
      epi.run(tma_o, inv);
    }
    if (o_issuer) wg::bulk_wait_read<0>();  // shared memory stays until the last store has read it
    turn.finish();
  }
#else
  (void)tm_q; (void)tm_k; (void)tm_v; (void)tm_s; (void)tm_o; (void)kv_scale; (void)v_max; (void)v_max_blocks; (void)cu_kp;
  (void)o; (void)lse; (void)cu_q; (void)cu_k; (void)work; (void)sched; (void)sinks;
  (void)o_st; (void)o_sh; (void)n_items; (void)hq_i; (void)batch_i; (void)q_per_kv_i; (void)max_tiles_i;
  (void)causal_i; (void)window_i; (void)sink_tok_i; (void)pack_i; (void)a_log2; (void)c_log2;
  trap_();  // no wgmma / TMA on this target: the launcher never selects this kernel here
#endif
}
