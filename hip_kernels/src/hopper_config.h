// The Hopper prefill kernel's build: its defines (defaults; src/varlen_prefill_hopper.hip lists them),
// tile constants, shared-memory sizes, the register split, and which FP8 forms a build takes.
#pragma once

#include "atom_mma.h"
#include "fp8_pack.h"
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
#define PINGPONG (CONSUMERS > 1)
#endif
#ifndef Q_STAGES
#define Q_STAGES 2
#endif
#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef S_F16
#define S_F16 0
#endif
#ifndef CTAS
#define CTAS (CONSUMERS == 1 ? 2 : 1)
#endif
#ifndef O_PROMOTE
#define O_PROMOTE 0
#endif

namespace atom_prefill {
constexpr int NWG = CONSUMERS;
constexpr int NTB = 128 * (NWG + 1);  // threads: producer warpgroup + consumers
// One consumer warpgroup leaves room for two or three CTAs on the SM: their turns replace
// ping-pong (short work units, e.g. small windows, then overlap one another's latency; three
// hold d64 with 64-key tiles: 40 producer and 120 consumer registers, no spills).
constexpr int CTAS_PER_SM = CTAS;
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
constexpr int QST = Q_STAGES;
constexpr int CPR = D / 8;  // 16-byte chunks of an output row
constexpr bool kFp8 = KV_FP8 != 0;
constexpr bool kKeyScales = KV_FP8 >= 2;
// Scales shared by each 16 keys, read as scalars before S is waited for; K's then leave the path
// from S to the row max, except with the soft-cap (which takes the scaled S).
constexpr bool kGroupScales = KV_FP8 == 3;
constexpr bool kGroupK = kGroupScales && !SOFTCAP;
constexpr bool kLateFreeK = kKeyScales && !kGroupScales;  // K's stage holds scales the softmax reads
// Per-tensor FP8 with the soft-cap: a tile without masked keys takes its row maxes on S as it
// stands (tanh increases), caps each row's max once and each score in the exp2 loop, where the
// MUFU.TANH sits beside the exp2 instead of before the max tree (1.05-1.07x on H100). Other
// builds cap first: per page spills with it, and 16-bit compute gains nothing.
[[maybe_unused]] constexpr bool kLateCap = SOFTCAP && KV_FP8 == 1;
// Two P operand buffers (FP8: 16 more registers), which two consumer warpgroups have (per page a
// few words spill outside the loop; 1.04-1.10x on H100). The 16-bit P's 32 more spill 64-348
// bytes (d128), and three consumer warpgroups (160 registers) or CTAs of one have no room; nor
// does a 192-key tile (its S takes 32 more: ptxas serializes the wgmmas).
constexpr bool kTwoP = NWG == 2 && kFp8 && BN <= 128;
// FP8 on f16 scores (kRowsumMma; not on the two warpgroups of fp32 scores, 0.82-0.84x on H200,
// where ptxas serializes the wgmmas for registers): P's row sums by the tensor cores, not
// one add per score: P V runs N = D + 8 over V^T panels of D + 8 rows (written once), so 4 more
// accumulator registers take each tile's sums of the same e4m3 P as O, added to l in fp32 per tile.
// Per tensor the 8 rows are e4m3 ones (every column a row's sum). Per 16 keys (kFoldV) P carries V's
// group factors f = 2^(c / 2^F): row i is 1 at the keys of group i, so column i sums group i's P f,
// and l adds each column times the group's weight 2^(-c / 2^F) (the pack's, f16): lane quad q holds
// groups 2q, 2q + 1, and l stays a lane's part until the row's shuffles.
constexpr bool kSF16 = S_F16 && KV_FP8 != 0 && (KV_FP8 == 1 || KV_FP8 == 3) && BLOCK_N == 128;
// kFoldV, per 16 keys on f16 scores without the soft-cap: V's group factor f joins P's
// exponent instead of a multiply: the exp2's f16 addend B - 2^F msc plus the pack's c = 2^F log2 f
// (one HADD2 a group for both row slots, not one HMUL2 a pair), so P = 2^(x + c / 2^F) on the line of
// exp2 by bit shifts. f lies in (1/2, 1] (the gather moves a page's power of two into its bytes), so
// c in (-2^F, 0]; the sum rounds to the addend's f16 step, at most 1 where it is used (softmax::f16): f
// moves by at most 2^(1 / 2^(F+1)), 1.1% (0.54% for references within about [14, 79] log2 units).
constexpr bool kFoldV = KV_FP8 == 3 && kSF16 && !SOFTCAP;
constexpr bool kRowsumMma = S_F16 && (KV_FP8 == 1 || kFoldV);
constexpr bool kRowsumGroups = kRowsumMma && KV_FP8 == 3;
constexpr int VROWS = D + (kRowsumMma ? 8 : 0);  // rows of an FP8 V^T panel
// FP8 wgmma adds into its accumulator keeping ~14 bits (docs/fp8.md "Long requests"): with V's mean
// in it, O grows like l and a long request's later products lose their low bits against it (rel
// 0.15 at 16k keys). Two-level accumulation: each O_PROMOTE tiles' P V start from zero in the
// tensor cores (scale-d 0) and are added in fp32 to O's partial in shared memory (16 bytes per
// thread and chunk, consecutive threads adjacent: no bank conflicts), in units of the row factors
// part_f that later rescales multiply. Units of one such chunk or less skip it (8 x 128 keys
// measured ~0.01 rel). The partial of a consumer warpgroup is 16 KB of its own (the Q stage that
// Q_STAGES 1 leaves) and its 64 rows of sO, which the epilogue reads back before it writes O there.
constexpr int kPromote = kFp8 ? O_PROMOTE : 0;
// S_F16: S = Q K^T into an f16 accumulator (32 registers instead of 64: three consumer warpgroups
// of 128-key tiles fit 160 registers without spills) and the softmax on f16 pairs. Q is quantized
// to |q| <= 1, so |S| <= D * 448 = 57344 stays inside f16's range for any K bytes; S's f16
// rounding (2^-11 relative) is far under e4m3's of Q and K (2^-4).
static_assert(!S_F16 || kSF16 || !kFp8, "S_F16: FP8 per tensor or per 16 keys, 128-key tiles");
// S_F16 (kExpShift): P = 2^x without the MUFU (Hopper splits an f16x2 exp2 into two MUFU.EX2.F16
// and a PRMT; the MUFU is ~half busy on an FP8 round and each exp2 a long-latency step of the
// softmax's chain). With F fraction bits, the argument's HFMA2 gives t = 2^F x + B instead of x, with
// t in [2^(F+5), 2^(F+6)) for x in [-15, 17), where f16's mantissa holds k = 2^F (x + 15) in its top
// 5 + F bits (the HFMA2 rounds it once; the bits below are dropped): shifted left by 5, k's bits are an
// f16's exponent and top F mantissa bits, 2^n (1 + j / 2^F) for x = n + j / 2^F + ... (docs/fp8.md),
// a finite P for x < 16 (the lazy reference keeps x <= 8 plus the f16 roundings: <= ~10 for logits up
// to 2000 log2 units). x < -15 (t clamped at 2^(F+5), masked keys and NaN too) gives 0. The same issue
// slots as the MUFU form (HFMA2, HMNMX2, SHF, LOP3 against HFMA2, 2 MUFU, PRMT). Per tensor F = 3: P lies on e4m3's grid,
// the one rounding of P (rel -7.3%..+7.2%, rms 0.032 against e4m3 rounding's 5.9% / 0.026). Per 16
// keys P is multiplied by V's factors and rounded to e4m3 after: F = 5 leaves the line's own error
// (1 + j / 32 against 2^(j / 32 + ...): 0..+6.1%, centred by B's -2: 2^(-1/16)) under that rounding.
constexpr bool kExpShift = kSF16;
// kDirectP, f16 scores per tensor and per 16 keys with kFoldV: P's e4m3 bytes come
// straight out of t, with no f16 P and no conversion. B = 1024 + 2^F (15 - L) (- 2 for F = 5; L =
// kPLazy, kLazyLog2) puts t = 2^F x + B in [1024, 2048), where f16's step is 1 and its mantissa holds
// 2^F (x + 15 - L): per tensor (F = 3) that is the byte round(8 (x + 15 - L)) itself, in bits 0..7 (the
// HFMA2's rounding is P's); per 16 keys F = 5 keeps V's fold at 1/32 (kFoldV) and bits 2..9 hold
// floor(8 (x + 15 - L) - 1/2), moved down by one shift a pair. Either is an e4m3 byte (exponent biased
// by 7, 3 mantissa bits) on exp2 by bit shifts' line, and one PRMT a pair of pairs packs four bytes:
// 3 (per tensor) and 2 (per 16 keys) instructions a pair fewer than the f16 P's shift, mask and cvt.
// P's spread about its mean is the earlier per-tensor form's (rel -8.0%..+6.5%, rms 0.031); P is
// encoded as P 2^(8 - L) kDirectMean on average, which O / l cancels and lse and the sinks take out. P
// is 0 below x = L - 14.8 and its subnormal bytes (up to x = L - 13.9) read low: L = 5 keeps e4m3's
// normals down to x = -8.9, where the f16 form's rounding keeps them down to -6 (L = 8 put per page's
// long and small-row cases past the bound, docs/fp8.md). Bytes stay e4m3 (at most 126: 448) for
// x < L + 0.81; the lazy reference keeps x <= L plus the f16 roundings of the multipliers (<= 0.2 for
// references within the vote's band, |B - 2^F msc| < 2048: [-22, 106] log2 units per 16 keys, [-118,
// 394] per tensor): a warp with a row outside takes the f16 P from the same t instead (shifted by
// 10 - F), times kDirectK (the bytes' scale over the f16 P's: 256 exactly for F = 3), and converts it.
constexpr bool kDirectP = kExpShift && (KV_FP8 == 1 || kFoldV);
enum : int { kPLazy = 5 };  // L (an enumerator, as NPF: a constexpr variable would be a device global)
constexpr float kLazyLog2 = kDirectP ? float(kPLazy) : 8.f;  // how far a row's max may pass its reference before O is rescaled
static_assert(!kDirectP || (kPLazy >= 3 && kPLazy <= 8), "kDirectP: e4m3 holds P <= 2^(L + 0.81) 2^(8 - L)");
static_assert(!kDirectP || kRowsumMma, "kDirectP: P's row sums by the tensor cores (no f16 P to add)");
constexpr int kShiftFrac = kGroupScales ? 5 : 3;
constexpr float kShiftScale = float(1 << kShiftFrac);
static_assert(!kFoldV || kShiftScale == kFp8FoldScale, "kFoldV: the pack's exponents are in this exp2's units");
// the bytes' P over 2^x 2^(8 - L), averaged over x's fraction (F = 5's floor of - 1/2: 2^(-1/8) of F = 3's)
constexpr float kDirectMean = (kShiftFrac == 5 ? 0.96440197f : 1.04035904f) * float(1 << (8 - kPLazy));
constexpr float kDirectK = kShiftFrac == 5 ? 247.743254f : 256.f;  // the bytes' scale over the f16 P's for the same t
constexpr int kShiftExp = kDirectP ? 15 - kPLazy : 15;  // the f16 P's exponent for x = 0
constexpr int kShiftBase = kDirectP ? 1024 : 32 << kShiftFrac;  // t's binade: [kShiftBase, 2 kShiftBase)
constexpr float kShiftBias = float(kShiftBase + kShiftExp * (1 << kShiftFrac) - (kShiftFrac == 5 ? 2 : 0));
constexpr u32 kShiftFloor = (u32)(kDirectP ? 25 : 20 + kShiftFrac) << 10;  // kShiftBase as f16 bits (exponent biased by 15)
constexpr int kShiftLeft = kDirectP ? 10 - kShiftFrac : 5;  // t's mantissa holds 2^(10 - shift) x: the f16 P's exponent to bit 10
constexpr u32 kShiftMask = 0x7C00u | (((1u << kShiftFrac) - 1u) << (10 - kShiftFrac));
static_assert(kShiftFrac <= 5, "exp2_shifted: the mask clears what the shift moves from the low half into the high one");
// S_F16 per 16 keys: each group's K scale relative to the tile's largest joins the exp2's multiplier
// per group, the largest the row's; the row max is bounded on the unscaled S and taken exactly only
// when a row may move (softmax::f16).
constexpr bool kRelGK = kSF16 && kGroupK;
// FP8: consumer warpgroups skip the tiles (or units) where none of their rows sees a key (the consumer
// loop, hand_back_idle). The 16-bit builds keep the full walk: their tuned and calibrated tables
// (bench.tune, bench.calibrate) were measured on it.
constexpr bool kSkipIdle = kFp8;

static_assert(!kPromote || (QST == 1 && D == 128), "O_PROMOTE: Q_STAGES 1, head_dim 128");
// S_F16 builds keep the partial as f16 in units of the row's sum l (|O| <= 448 l: every P V term is
// p v with |v| <= 448), each warpgroup's 64 rows in its own rows of sO: no area of their own.
constexpr bool kHalfPart = kPromote != 0 && kSF16;
constexpr int PRO = kPromote && !kHalfPart ? 2 * BM * D : 0;  // bytes of the partials' own area, before sO
constexpr int VSTAGE = kFp8 ? VROWS * BN : 2 * BN * D;  // bytes of a V stage
constexpr int EB = kFp8 ? 1 : 2;  // bytes per K, V element (Q arrives 16-bit; FP8 quantizes it in shared memory)
constexpr int Q8 = kFp8 ? BM * D : 0;  // bytes of the e4m3 Q tile (FP8)
constexpr int TILE = BN * D;      // elements of a K or V tile
// Floats of a stage's key scales: K's and V's of the pack's 128-key blocks that hold the tile (a
// 64-key tile reads half of one; a 96- or 192-key tile may start in one and end in the next).
constexpr int SC_BLOCKS = kFp8Align % BN == 0 || BN == kFp8Align ? 1 : 2;
constexpr int SC_TILE = kKeyScales ? 2 * kFp8Align * SC_BLOCKS : 0;
static_assert(!kFp8 || (D == 128 && (BN == 64 || BN == 96 || BN == 128 || BN == 192)),
              "FP8 prefill: head_dim 128, BLOCK_N 64, 96, 128 or 192");
// FP8 V^T tiles [D][BN bytes]: rows of one 128-byte swizzle panel, or BN / VT_PANEL panels
// [D][VT_PANEL bytes] of 64 or 32 keys (64- / 32-byte swizzle: wgmma layout 2 / 3, 8-row groups
// 8 VT_PANEL bytes apart), one TMA box each.
constexpr int VT_PANEL = BN == 128 ? 128 : BN % 64 == 0 ? 64 : 32;
static_assert(!kRowsumGroups || VT_PANEL == 128, "row sums by the tensor cores per 16 keys: group i's keys are chunk i of a 128-byte row");
constexpr u32 VT_LAYOUT = VT_PANEL == 128 ? 1 : VT_PANEL == 64 ? 2 : 3;
static_assert(D == 64 || D == 128, "Hopper prefill: head_dim 64 or 128");
static_assert(BN == 64 || BN == 128 || (kFp8 && (BN == 96 || BN == 192)), "Hopper prefill: BLOCK_N 64 or 128 (FP8: or 96, 192)");
static_assert(NWG >= 1 && NWG <= 3, "Hopper prefill: 1 to 3 consumer warpgroups");
static_assert(!PINGPONG || NWG >= 2, "ping-pong needs two consumer warpgroups");
static_assert(NST >= 2, "the K/V rings need two stages");
// Registers per thread after the hand-over (setmaxnreg). The CTA keeps what it was launched with
// (the register file over the threads of CTAS_PER_SM CTAs, in units of 8 per thread): an increase
// past that pool never completes. Fewest producer registers without spills (NVRTC sm_90a), except
// with three consumers: there the producer spills a few words (two threads, off the critical
// path), since 8 more for it would make the consumers spill.
constexpr int ENTRY_REGS = 65536 / (NTB * CTAS_PER_SM) / 8 * 8;
constexpr int PRODUCER_REGS = NWG == 1 ? (CTAS_PER_SM == 3 ? 40 : 56) : NWG == 2 ? (kKeyScales ? 56 : 40) : 32;
constexpr int CONSUMER_REGS = NWG == 1 ? (CTAS_PER_SM == 3 ? 120 : 200) : NWG == 2 ? (kKeyScales ? 224 : 232) : 160;
static_assert(CTAS_PER_SM == 1 || (NWG == 1 && CTAS_PER_SM <= 3), "several CTAs per SM: one consumer warpgroup");
static_assert(128 * (PRODUCER_REGS + NWG * CONSUMER_REGS) <= NTB * ENTRY_REGS, "register pool of the CTA");
// Q ring (16-bit), O's partials (O_PROMOTE), O (16-bit), e4m3 Q (FP8), K ring, V ring, key-scale ring, Q's row scales (FP8)
constexpr int SMEM_BYTES =
    2 * QST * BM * D + PRO + 2 * BM * D + Q8 + EB * NST * TILE + NST * VSTAGE + 4 * NST * SC_TILE + (kFp8 ? 4 * BM : 0);
// + 1024 bytes of alignment slack and 512 of barriers per CTA; the SM has 228 KB, 1 KB of it
// reserved per resident CTA, and a CTA may have 227 KB.
static_assert(SMEM_BYTES + 1024 + 512 <= 227 * 1024 && CTAS_PER_SM * (SMEM_BYTES + 2048 + 512) <= 228 * 1024,
              "shared memory");
typedef wg::sw128<BM> LQ;   // Q and O: [D/64][BM][64]
typedef wg::sw128<BN> LKV;  // K and V tiles: [D/64][BN][64]
// BLOCK_N of the 16-bit MMAs: an FP8 build never runs them (96 and 192 keys: FP8 only), but its discarded
// 16-bit branches still name a type.
constexpr int BN16 = kFp8 ? 128 : BN;

template <bool V>
struct kv_tag {  // a compile-time choice passed as a value
  static constexpr bool value = V;
};
typedef kv_tag<false> is_k_tag;
typedef kv_tag<true> is_v_tag;

// Named barriers: 0 is the block's; turns 1..NWG; each consumer's epilogue NWG+1..2*NWG.
ATOM_DEV int turn_bar(int grp) { return 1 + grp; }
ATOM_DEV int epi_bar(int grp) { return 1 + NWG + grp; }
}  // namespace atom_prefill
#endif
