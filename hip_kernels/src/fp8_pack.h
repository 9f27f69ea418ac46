// The FP8 pack: hip_kernels.gather.gather_kv_fp8 writes it (src/gather.hip), the FP8 prefill
// bodies read it (varlen_prefill.hip with KV_FP8, varlen_prefill_hopper.hip). e4m3 bytes as the
// cache holds them, every request starting at a multiple of kFp8Align rows (cu_kp), rows past a
// request's keys zero (a NaN byte there would leak through P = 0):
//   k8   [total_pad, H, D]   the keys
//   vt8  [H, D, total_pad]   V transposed (the e4m3 MMAs take their B operand K-major), each
//                            position p of a block holding key fp8_vt_key(p): the order in which
//                            the target's P operand holds its keys (atom_mma.h to_operand_fp8)
//   per page: kvs [H][total_pad / 128][2][128] fp32, each 128-key block's K scales and its V
//   scales divided by v_max [H][total_pad / 128] (each block: its request's largest V scale, the
//   unit of O in the FP8 bodies), key j of a block at fp8_scale_pos(j) (the Hopper kernel's lane
//   order; the portable body indexes it). Pages of a multiple of 16 keys (per_page16, KV_FP8 = 3):
//   every body reads a 16-key group's scales at its first key (position 4 n of each half), and
//   K's positions 32..63 hold the group block (the other positions keep their keys' scales), the
//   block's factors as the Hopper kernel's f16-score softmax takes them: words 0..7 each group's K scale (floored at 1e-30) over the block's largest,
//   words 8..15 each group's V scale (over v_max), both f16 in both halves of the word; word 16 the
//   largest K scale (fp32); words 24..31 each group's V factor as an exponent, c = 32 log2 f (f16,
//   both halves: the Hopper kernel (kFoldV) adds it to the exp2's addend), and words 18..21 the
//   weights 2^(-c / 32) of the groups' row sums (f16; groups 2q and 2q + 1 in word 18 + q: lane quad
//   q's). Ready-made, they take a division and a max tree off the path from S to the row max.
//   Per 16 keys every group's V factor lies in (1/2, 1]: a page whose scale over v_max is f = 2^-e f'
//   (f' in (1/2, 1]) has its V bytes multiplied by 2^-e (exact but for bytes that fall under e4m3's
//   normals: an error under 2^-10 of the request's V unit) and f' as its factor, so that P f' keeps
//   e4m3's precision (the Hopper kernel sums the rows of those products) whatever the page's scale.
#pragma once

#include "atom_mma.h"

namespace atom {

constexpr int kFp8Align = 128;
constexpr int kFp8GroupBlock = 32;  // per_page16: the group block's first position in K's half
constexpr int kFp8GroupWords = 32;  // and its words: 8 K factors, 8 V factors, the largest K scale, -, 4 weight pairs, -, 8 V exponents
constexpr int kFp8GroupRecip = 18;  // the row sums' weights, first word
constexpr int kFp8GroupFold = 24;   // the V exponents, first word (16-byte aligned)
constexpr float kFp8FoldScale = 32.f;  // c per log2 unit: 2^F of the per-16-key exp2 by bit shifts

// The key (0..127) of a kFp8Align block that V^T holds at position p.
ATOM_DEV int fp8_vt_key(int p) { return 32 * (p >> 5) + mma::fp8_p_key(p & 31); }

// Where key j (0..127) of a block has its scales: lane quad q of a Hopper consumer reads keys
// 16 nt + {2q, 2q+1, 8+2q, 9+2q} as one float4 at 32 q + 4 nt; key 16 n (a 16-key group's
// scale, KV_FP8 = 3) sits at 4 n.
ATOM_DEV int fp8_scale_pos(int j) { return 32 * ((j >> 1) & 3) + 4 * (j >> 4) + 2 * ((j >> 3) & 1) + (j & 1); }

}  // namespace atom
