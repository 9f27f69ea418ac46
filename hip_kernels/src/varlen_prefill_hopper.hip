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
// BLOCK_N (64|128), STAGES (>= 2), Q_STAGES (1|2), UNIT_SLOTS (units claimed ahead: 2), PINGPONG
// (0|1, two or more consumers), EXP_POLY (key groups of 16 whose exp2 runs as a polynomial on the
// FMA pipe instead of the special-function unit; measured slower, kept for sweeps).
// Built for a target without wgmma (every arch but sm_90a) the kernel has no body: the launcher
// only selects it on sm_90a (hip_kernels/prefill.py), CI compiles it everywhere.
// KV_FP8: 0 (16-bit Q/K/V), 1 (e4m3, per-tensor K/V scales), 2 (e4m3, per-key scales), 3 (e4m3,
// scales per 16 keys, in KV_FP8 = 2's layout); FP8 needs
// HEAD_DIM 128 and BLOCK_N 64, 96, 128 or 192 (V^T rows of one 128-byte swizzle panel, or panels of
// 64 or 32 keys).
// LOCAL_MAX_CHECK (0|1, default 1): the warp vote that skips the rows' max shuffles (A/B switch).
// TWO_P (0|1, default BLOCK_N <= 128): two P operand buffers for FP8 with two consumer warpgroups.
// ROWSUM_MMA (0|1, default S_F16): FP8's row sums by the tensor cores (per tensor; per 16 keys with FOLD_V; below).
// FOLD_V (0|1, default 1): per 16 keys, V's group factors in P's exponent, not multiplied (below).
// UNIT_PROFILE (0|1|2, default 0): clock64 per segment of the consumers' unit loop into lse (bench.unit_profile;
// 2: a round's parts too).
// DIAG_ENERGY (0|1|2, default 0; timing only, wrong output): 1 no softmax for S_F16 (P = S), 2 no FP8 MMAs:
// where an FP8 tile's cycles and energy go (bench.clocks --define).
// O_PROMOTE (tiles, default 0: off): FP8 O's sums in fp32 shared memory, restarted in the tensor
// cores every O_PROMOTE tiles of a unit that sees more tiles than that (below); Q_STAGES 1.
// S_F16 (0|1): f16 scores for FP8 per tensor / per 16 keys with 128-key tiles (below).
// EXP_SHIFT (0|1, default 1): S_F16's exp2 by shifting bits on the integer pipe, not the MUFU (below).
// DIRECT_P (0|1, default 1), P_LAZY (3..8, default 5): with EXP_SHIFT, P's e4m3 bytes straight from the
// exp2's argument, P's reference moving past L log2 units (below).

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
#ifndef EXP_POLY
#define EXP_POLY 0
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
#ifndef EXP_SHIFT
#define EXP_SHIFT 1
#endif
#ifndef LOCAL_MAX_CHECK
#define LOCAL_MAX_CHECK 1
#endif
#ifndef CTAS
#define CTAS (CONSUMERS == 1 ? 2 : 1)
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
// builds cap first: per page spills with it, and 16-bit compute gains nothing (stop 37).
[[maybe_unused]] constexpr bool kLateCap = SOFTCAP && KV_FP8 == 1;
// Two P operand buffers (FP8: 16 more registers), which two consumer warpgroups have (per page a
// few words spill outside the loop; 1.04-1.10x on H100). The 16-bit P's 32 more spill 64-348
// bytes (d128), and three consumer warpgroups (160 registers) or CTAs of one have no room; nor
// does a 192-key tile (its S takes 32 more: ptxas serializes the wgmmas).
#ifndef TWO_P
#define TWO_P (BN <= 128)
#endif
constexpr bool kTwoP = NWG == 2 && kFp8 && TWO_P;
#ifndef ROWSUM_MMA
#define ROWSUM_MMA S_F16
#endif
// FP8 on f16 scores (ROWSUM_MMA, default on; off on the two warpgroups of fp32 scores, 0.82-0.84x
// on H200, where ptxas serializes the wgmmas for registers): P's row sums by the tensor cores, not
// one add per score: P V runs N = D + 8 over V^T panels of D + 8 rows (written once), so 4 more
// accumulator registers take each tile's sums of the same e4m3 P as O, added to l in fp32 per tile.
// Per tensor the 8 rows are e4m3 ones (every column a row's sum). Per 16 keys (kFoldV) P carries V's
// group factors f = 2^(c / 2^F): row i is 1 at the keys of group i, so column i sums group i's P f,
// and l adds each column times the group's weight 2^(-c / 2^F) (the pack's, f16): lane quad q holds
// groups 2q, 2q + 1, and l stays a lane's part until the row's shuffles.
constexpr bool kSF16 = S_F16 && KV_FP8 != 0 && (KV_FP8 == 1 || KV_FP8 == 3) && BLOCK_N == 128;
// FOLD_V (0|1, default 1), per 16 keys without the soft-cap, EXP_SHIFT: V's group factor f joins P's
// exponent instead of a multiply: the exp2's f16 addend B - 2^F msc plus the pack's c = 2^F log2 f
// (one HADD2 a group for both row slots, not one HMUL2 a pair), so P = 2^(x + c / 2^F) on the line of
// exp2 by bit shifts. f lies in (1/2, 1] (the gather moves a page's power of two into its bytes), so
// c in (-2^F, 0]; the sum rounds to the addend's f16 step, at most 1 where it is used (softmax16): f
// moves by at most 2^(1 / 2^(F+1)), 1.1% (0.54% for references within about [14, 79] log2 units).
#ifndef FOLD_V
#define FOLD_V 1
#endif
constexpr bool kFoldV = FOLD_V && KV_FP8 == 3 && kSF16 && !SOFTCAP && EXP_SHIFT;
constexpr bool kRowsumMma = ROWSUM_MMA && (KV_FP8 == 1 || kFoldV);
constexpr bool kRowsumGroups = kRowsumMma && KV_FP8 == 3;
constexpr int VROWS = D + (kRowsumMma ? 8 : 0);  // rows of an FP8 V^T panel
#ifndef O_PROMOTE
#define O_PROMOTE 0
#endif
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
// S_F16, EXP_SHIFT: P = 2^x without the MUFU (Hopper splits an f16x2 exp2 into two MUFU.EX2.F16
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
constexpr bool kExpShift = kSF16 && EXP_SHIFT;
// DIRECT_P (0|1, default 1), EXP_SHIFT per tensor and per 16 keys with FOLD_V: P's e4m3 bytes come
// straight out of t, with no f16 P and no conversion. B = 1024 + 2^F (15 - L) (- 2 for F = 5; L =
// P_LAZY, kLazyLog2) puts t = 2^F x + B in [1024, 2048), where f16's step is 1 and its mantissa holds
// 2^F (x + 15 - L): per tensor (F = 3) that is the byte round(8 (x + 15 - L)) itself, in bits 0..7 (the
// HFMA2's rounding is P's); per 16 keys F = 5 keeps V's fold at 1/32 (FOLD_V) and bits 2..9 hold
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
#ifndef DIRECT_P
#define DIRECT_P 1
#endif
#ifndef P_LAZY
#define P_LAZY 5
#endif
constexpr bool kDirectP = DIRECT_P && kExpShift && (KV_FP8 == 1 || kFoldV);
constexpr float kLazyLog2 = kDirectP ? float(P_LAZY) : 8.f;  // how far a row's max may pass its reference before O is rescaled
static_assert(!kDirectP || (P_LAZY >= 3 && P_LAZY <= 8), "DIRECT_P: e4m3 holds P <= 2^(L + 0.81) 2^(8 - L)");
static_assert(!kDirectP || kRowsumMma, "DIRECT_P: P's row sums by the tensor cores (no f16 P to add)");
constexpr int kShiftFrac = kGroupScales ? 5 : 3;
constexpr float kShiftScale = float(1 << kShiftFrac);
static_assert(!kFoldV || kShiftScale == kFp8FoldScale, "FOLD_V: the pack's exponents are in this exp2's units");
// the bytes' P over 2^x 2^(8 - L), averaged over x's fraction (F = 5's floor of - 1/2: 2^(-1/8) of F = 3's)
constexpr float kDirectMean = (kShiftFrac == 5 ? 0.96440197f : 1.04035904f) * float(1 << (8 - P_LAZY));
constexpr float kDirectK = kShiftFrac == 5 ? 247.743254f : 256.f;  // the bytes' scale over the f16 P's for the same t
constexpr int kShiftExp = kDirectP ? 15 - P_LAZY : 15;  // the f16 P's exponent for x = 0
constexpr int kShiftBase = kDirectP ? 1024 : 32 << kShiftFrac;  // t's binade: [kShiftBase, 2 kShiftBase)
constexpr float kShiftBias = float(kShiftBase + kShiftExp * (1 << kShiftFrac) - (kShiftFrac == 5 ? 2 : 0));
constexpr u32 kShiftFloor = (u32)(kDirectP ? 25 : 20 + kShiftFrac) << 10;  // kShiftBase as f16 bits (exponent biased by 15)
constexpr int kShiftLeft = kDirectP ? 10 - kShiftFrac : 5;  // t's mantissa holds 2^(10 - shift) x: the f16 P's exponent to bit 10
constexpr u32 kShiftMask = 0x7C00u | (((1u << kShiftFrac) - 1u) << (10 - kShiftFrac));
static_assert(kShiftFrac <= 5, "exp2_shifted: the mask clears what the shift moves from the low half into the high one");
// S_F16 per 16 keys: each group's K scale relative to the tile's largest joins the exp2's multiplier
// per group, the largest the row's; the row max is bounded on the unscaled S and taken exactly only
// when a row may move (below).
constexpr bool kRelGK = kSF16 && kGroupK;
// FP8: consumer warpgroups skip the tiles (or units) where none of their rows sees a key (below). The
// 16-bit builds keep the full walk: their tuned and calibrated tables (bench.tune, bench.calibrate)
// were measured on it.
constexpr bool kSkipIdle = kFp8;
// f16x2 arithmetic of the S_F16 softmax (sm_90a).
namespace h2 {
ATOM_DEV u32 max(u32 a, u32 b) { u32 d; asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 fma(u32 a, u32 b, u32 c) { u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d; }
ATOM_DEV u32 add(u32 a, u32 b) { u32 d; asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 mul(u32 a, u32 b) { u32 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
ATOM_DEV u32 exp2(u32 a) { u32 d; asm("ex2.approx.f16x2 %0, %1;" : "=r"(d) : "r"(a)); return d; }
// The low / high half in both (ptxas folds these into the f16x2 instruction's operand selects).
ATOM_DEV u32 lo_lo(u32 a) { u32 d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l};}" : "=r"(d) : "r"(a)); return d; }
ATOM_DEV u32 hi_hi(u32 a) { u32 d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h};}" : "=r"(d) : "r"(a)); return d; }
ATOM_DEV u32 pair(float lo, float hi) { u32 d; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); return d; }
// f16's finite range (a multiplier or an addend past it would be inf).
ATOM_DEV float in_range(float x) { return fmin_(fmax_(x, -65504.f), 65504.f); }
// EXP_SHIFT's f16 addend B - 2^F msc for the reference msc (log2 units), before its rounding to f16.
ATOM_DEV float shift_addend(float msc) { return in_range(kShiftBias - kShiftScale * msc); }
// 2^((t - B) / 2^F) per half with F mantissa bits (kExpShift above); 0 below t = kShiftBase.
ATOM_DEV u32 exp2_shifted(u32 t) {
  return (max(t, kShiftFloor * 0x10001u) << kShiftLeft) & (kShiftMask * 0x10001u);
}
ATOM_DEV float rcp(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
ATOM_DEV u32 splat(float x) { u32 d; asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(x)); return d; }
ATOM_DEV float lo(u32 a) { return f16_to_f32((u16)(a & 0xffffu)); }
ATOM_DEV float hi(u32 a) { return f16_to_f32((u16)(a >> 16)); }
// Two f16x2 pairs -> four e4m3 bytes (a's low, a's high, b's low, b's high), as f32x4_to_fp8x4.
ATOM_DEV u32 to_fp8x4(u32 a, u32 b) {
  u32 d;
  asm("{.reg .b16 x, y; cvt.rn.satfinite.e4m3x2.f16x2 x, %1; cvt.rn.satfinite.e4m3x2.f16x2 y, %2; mov.b32 %0, {x, y};}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// DIRECT_P: t's byte per half, at bits 0..7 and 16..23 (the bits around them are not read).
ATOM_DEV u32 bytes_of(u32 t) { return max(t, kShiftFloor * 0x10001u) >> (kShiftFrac - 3); }
// An f16x2 pair -> its two e4m3 bytes where bytes_of puts them.
ATOM_DEV u32 fp8_spread(u32 a) {
  u32 d;
  asm("{.reg .b16 x; .reg .b32 w; cvt.rn.satfinite.e4m3x2.f16x2 x, %1; mov.b32 w, {x, x}; prmt.b32 %0, w, 0, 0x4140;}"
      : "=r"(d) : "r"(a));
  return d;
}
// Two such pairs -> four e4m3 bytes (a's low, a's high, b's low, b's high), as to_fp8x4.
ATOM_DEV u32 pack_bytes(u32 a, u32 b) { u32 d; asm("prmt.b32 %0, %1, %2, 0x6420;" : "=r"(d) : "r"(a), "r"(b)); return d; }
}  // namespace h2

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
static_assert(!kRowsumGroups || VT_PANEL == 128, "ROWSUM_MMA per 16 keys: group i's keys are chunk i of a 128-byte row");
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
struct kv_tag {
  static constexpr bool value = V;
};
typedef kv_tag<false> is_k_tag;
typedef kv_tag<true> is_v_tag;

// Named barriers: 0 is the block's; turns 1..NWG; each consumer's epilogue NWG+1..2*NWG.
ATOM_DEV int turn_bar(int grp) { return 1 + grp; }
ATOM_DEV int epi_bar(int grp) { return 1 + NWG + grp; }

// A work unit: a work item (request b, q tile t of BM tokens) and a query head h; or, packing
// GQA (G = q_per_kv query heads share a KV head), the item's sub-tile of BM / G tokens for all G
// heads of KV head g: tile row r is token r / G, head h0 + r % G. Either way an item has hq
// units (sub-tiles with more keys first), adjacent so that they share K/V in L2.
struct unit {
  int h0, g, q0, sq, k0, sk, m0, rows;  // first query head, KV head, request bounds, first token, tokens
  bool live;
};
constexpr int UNIT_INTS = 8;  // a unit as the producer hands it to the consumers (sq < 0: no more)
#ifndef UNIT_SLOTS
#define UNIT_SLOTS 2
#endif
#ifndef UNIT_PROFILE
#define UNIT_PROFILE 0
#endif
#ifndef DIAG_ENERGY
#define DIAG_ENERGY 0
#endif
// UNIT_PROFILE: the segments of a unit (bench/unit_profile.py reads them in this order), the unit and
// tile counts, and a flag that the warpgroup's row is written.
// P_TILES: the tiles (UNIT_PROFILE = 2: their remainder: O's rescale, P's operand, the promotion); R_*
// (UNIT_PROFILE = 2): a round's K / V waits, its turn, its MMAs' issue, S's wait, the softmax, P V's wait
// (tile 0's S wait and softmax included). P_SETUP, P_QWAIT, P_QUANT: the unit's setup before Q's wait, that
// wait, FP8's quantization of Q (P_Q: the rest of Q's part, the quantization's barrier and row scales).
enum prof_seg { P_TAKE, P_Q, P_K0, P_TURN, P_S0, P_TILES, P_EPI, P_UNITS, P_ITERS, P_END,
                R_KV, R_TURN, R_ISSUE, R_SWAIT, R_SOFT, R_PVWAIT, P_SETUP, P_QWAIT, P_QUANT, P_ROW = 23, PROF_WORDS };
constexpr int USLOTS = UNIT_SLOTS;  // units claimed ahead of the consumers
// mbarriers (Q, K ring, V ring, unit ring) and the unit slots, in the host's 512 bytes past the tiles
static_assert((2 * QST + 4 * NST + 2 * USLOTS) * 8 + USLOTS * UNIT_INTS * 4 <= 512, "barrier area");
ATOM_DEV unit unit_of(int w, const i32* __restrict__ work, const i32* __restrict__ cu_q, const i32* __restrict__ cu_k,
                      const i32* __restrict__ cu_kp, int hq, int batch, int q_per_kv, int max_tiles, int G) {
  unit u;
  const int item = w / hq;
  const int rem = w - item * hq;
  u.h0 = rem / G * G;
  u.g = u.h0 / q_per_kv;
  u.rows = BM / G;
  const int sub = G - 1 - (rem - u.h0);
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
  u.k0 = kFp8 ? cu_kp[b] : cu_k[b];  // FP8: the 128-aligned layout of gather_kv_fp8
  u.sk = cu_k[b + 1] - cu_k[b];
  u.m0 = t * BM + sub * u.rows;
  u.live = u.m0 < u.sq;
  return u;
}
}  // namespace atom_prefill
#endif

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
  // Byte layout: Q ring, O's partials (O_PROMOTE), O, e4m3 Q, K ring, V ring, key-scale ring, Q's row
  // scales, barriers (every part 1024-aligned but the last three).
  unsigned char* sQ = static_cast<unsigned char*>(wg::align1024(smem_raw));
  unsigned char* sPro = sQ + 2 * QST * BM * D;
  u16* sO = reinterpret_cast<u16*>(sPro + PRO);
  unsigned char* sQ8 = reinterpret_cast<unsigned char*>(sO + BM * D);
  unsigned char* sK = sQ8 + Q8;
  unsigned char* sV = sK + EB * NST * TILE;
  float* sS = reinterpret_cast<float*>(sV + NST * VSTAGE);
  float* sQsc = sS + NST * SC_TILE;
  u64* bars = reinterpret_cast<u64*>(sQsc + (kFp8 ? BM : 0));
  u64 *fullQ = bars, *emptyQ = bars + QST, *fullK = bars + 2 * QST, *emptyK = fullK + NST, *fullV = emptyK + NST,
      *emptyV = fullV + NST, *fullU = emptyV + NST, *emptyU = fullU + USLOTS;
  int* sU = reinterpret_cast<int*>(emptyU + USLOTS);  // USLOTS slots of UNIT_INTS: the units handed over

  const int hq = (int)hq_i, batch = (int)batch_i, q_per_kv = (int)q_per_kv_i, max_tiles = (int)max_tiles_i;
  const bool causal = causal_i != 0;
  const int W = (int)window_i, S = (int)sink_tok_i, G = (int)pack_i;
  const int total = (int)(n_items * hq);  // the host keeps it below 2^31

  if (tid_x() == 0) {
    wg::tma_prefetch_desc(&tm_q);
    wg::tma_prefetch_desc(&tm_k);
    wg::tma_prefetch_desc(&tm_v);
    if (kKeyScales) wg::tma_prefetch_desc(&tm_s);
    for (int s = 0; s < QST; ++s) {
      wg::mbar_init(fullQ + s, 1);
      wg::mbar_init(emptyQ + s, 4 * NWG);  // one arrival per consumer warp
    }
    for (int s = 0; s < USLOTS; ++s) {
      wg::mbar_init(fullU + s, 1);
      wg::mbar_init(emptyU + s, 4 * NWG + 1);  // the consumer warps and the copier
    }
    for (int s = 0; s < NST; ++s) {
      wg::mbar_init(fullK + s, 1);
      wg::mbar_init(fullV + s, 1);
      wg::mbar_init(emptyK + s, 4 * NWG);
      wg::mbar_init(emptyV + s, 4 * NWG);
    }
    wg::mbar_init_fence();
  }
  if constexpr (kRowsumMma) {  // every V^T panel's last 8 rows, never overwritten
    // Per tensor e4m3 ones (0x38); per 16 keys row i has ones at group i's keys: 16-byte chunk i of
    // the row (the P operand's key order keeps each group's keys in its 16 positions), which the
    // 128-byte swizzle moves to chunk i ^ (row & 7) = 0.
    constexpr int PANELS = NST * BN / VT_PANEL, WORDS = 8 * VT_PANEL / 4;
    for (int i = (int)tid_x(); i < PANELS * WORDS; i += NTB)
      reinterpret_cast<u32*>(sV + i / WORDS * VT_PANEL * VROWS + D * VT_PANEL)[i % WORDS] =
          !kRowsumGroups || i % (VT_PANEL / 4) < 4 ? 0x38383838u : 0u;
    wg::fence_proxy_async();
  }
  sync_block();

  // Units reach the copier and the consumers through a ring of USLOTS (fullU / emptyU): the n-th
  // unit of this CTA sits in slot n % USLOTS. sq < 0 marks the end.
  auto take_unit = [&](int n) {
    const int s = n % USLOTS;
    wg::mbar_wait(fullU + s, (n / USLOTS) & 1);
    const int* d = sU + s * UNIT_INTS;
    unit u;
    u.h0 = d[0]; u.g = d[1]; u.q0 = d[2]; u.sq = d[3]; u.k0 = d[4]; u.sk = d[5]; u.m0 = d[6]; u.rows = d[7];
    u.live = u.sq >= 0;
    return u;
  };
  auto release_unit = [&](int n) { wg::mbar_arrive(emptyU + n % USLOTS); };

  const int wgi = wg::warpgroup_index();
  if (wgi == 0) {
    // ---- producer warpgroup: one thread schedules, one issues every copy ----
    wg::regs_dec<PRODUCER_REGS>();
    if (tid_x() == 1) {  // lane 1 of the copier's warp: one warp of the SM spins on barriers, not two
      // Tile scheduler: unit blockIdx.x, then one unit at a time from a global counter (sched), or
      // w += gridDim.x without one. A unit is claimed only once its slot of the ring is free, so
      // a CTA is committed to at most USLOTS units past the one it runs and the dynamic schedule
      // stays longest first: with more claimed ahead (8), the CTAs that claimed where a request's
      // long tiles start queued several of them, and 7% of the 4 x 4k time was idle SMs at the end.
      int un = 0;
      for (int w = -1;;) {
        const int s = un % USLOTS;
        wg::mbar_wait(emptyU + s, ((un / USLOTS) & 1) ^ 1);
        w = w < 0 ? (int)bid_x() : sched != nullptr ? (int)gdim_x() + atomicAdd(sched, 1) : w + (int)gdim_x();
        int* d = sU + s * UNIT_INTS;
        if (w >= total) {
          d[3] = -1;  // no more units
          wg::mbar_arrive(fullU + s);
          break;
        }
        const unit u = unit_of(w, work, cu_q, cu_k, cu_kp, hq, batch, q_per_kv, max_tiles, G);
        if (!u.live) continue;  // past the request's end: the slot stays free
        d[0] = u.h0; d[1] = u.g; d[2] = u.q0; d[3] = u.sq;
        d[4] = u.k0; d[5] = u.sk; d[6] = u.m0; d[7] = u.rows;
        wg::mbar_arrive(fullU + s);
        ++un;
      }
      if (sched != nullptr) {
        // The last CTA past the end resets the counters for the next launch on this stream.
        __threadfence();
        if (atomicAdd(sched + 1, 1) == (int)gdim_x() - 1) {
          sched[0] = 0;
          sched[1] = 0;
        }
      }
    } else if (tid_x() == 0) {
      int base = 0, qn = 0;  // K/V tiles and Q tiles loaded so far (ring stages, phases)
      // Shared-memory addresses as one 32-bit base and constant offsets: this thread has few registers.
      const u32 a_q = wg::smem_addr(sQ), a_k = a_q + 2 * QST * BM * D + PRO + 2 * BM * D + Q8, a_v = a_k + EB * NST * TILE,
                a_s = a_v + NST * VSTAGE, a_bar = a_s + 4 * NST * SC_TILE + (kFp8 ? 4 * BM : 0);
      const u32 a_fullQ = a_bar, a_emptyQ = a_bar + 8 * QST, a_fullK = a_bar + 16 * QST, a_emptyK = a_fullK + 8 * NST,
                a_fullV = a_emptyK + 8 * NST, a_emptyV = a_fullV + 8 * NST;
      // A K tile (with its key scales, KV_FP8 >= 2) or V tile of BN keys from `row` of KV head g.
      auto load_kv = [&](auto which, u32 full, u32 empty, int idx, int row, int g) {
        constexpr bool is_v = decltype(which)::value;  // a compile-time choice: this thread is short of registers
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
      };
      for (int un = 0;; ++un) {
        const unit u = take_unit(un);
        release_unit(un);
        if (!u.live) break;
        const kv_walk kw(u.sq, u.sk, u.m0, u.rows, BN, causal, W, S);
        // K(0) first: its stage is free long before the consumers hand Q back.
        if (kw.n_iter > 0) load_kv(is_k_tag{}, a_fullK, a_emptyK, base, u.k0 + kw.tile(0) * BN, u.g);
        const int qs = qn % QST;
        wg::mbar_wait(a_emptyQ + 8 * qs, ((qn / QST) & 1) ^ 1);
        wg::mbar_arrive_expect_tx(a_fullQ + 8 * qs, BM * D * 2);
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
          wg::tma_load_3d(a_q + 2 * (qs * BM * D + p * BM * 64), &tm_q, a_fullQ + 8 * qs, p * 64, u.h0, u.q0 + u.m0);
        ++qn;
        // K(i) runs ahead of V(i - 1): round i of the consumers needs both.
        for (int it = 1; it < kw.n_iter; ++it) {
          load_kv(is_k_tag{}, a_fullK, a_emptyK, base + it, u.k0 + kw.tile(it) * BN, u.g);
          load_kv(is_v_tag{}, a_fullV, a_emptyV, base + it - 1, u.k0 + kw.tile(it - 1) * BN, u.g);
        }
        if (kw.n_iter > 0) load_kv(is_v_tag{}, a_fullV, a_emptyV, base + kw.n_iter - 1, u.k0 + kw.tile(kw.n_iter - 1) * BN, u.g);
        base += kw.n_iter;
      }
    }
  } else {
    // ---- consumers ----
    wg::regs_inc<CONSUMER_REGS>();
    const int grp = wgi - 1;
    const int warp = (int)((tid_x() / 32) % 4);  // warp in the warpgroup
    const bool releaser = lane_id() == 0;
    const bool o_issuer = tid_x() % 128 == 0;  // issues this warpgroup's TMA stores of O
    int base = 0, qn = 0, un = 0;
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
    // Per-tensor FP8 scales: K's joins the softmax scale, V's the epilogue's.
    const float k_scale = KV_FP8 == 1 ? kv_scale[0] : 1.f, v_scale = KV_FP8 == 1 ? kv_scale[1] : 1.f;
#if UNIT_PROFILE
    // The cycles since the last mark, added to segment seg of this warpgroup's row of lse (as
    // [CTA][warpgroup][PROF_WORDS] u64; lse's values are not written) by its first thread: a reduction, no wait.
    u64* const prof = reinterpret_cast<u64*>(lse) + ((i64)bid_x() * NWG + grp) * PROF_WORDS;
    auto now = []() { u64 t; asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory"); return t; };
    u64 prof_t = now();
    auto prof_add = [&](int seg, u64 v) { if (lse != nullptr && tid_x() % 128 == 0) atomicAdd(prof + seg, v); };
    auto mark = [&](int seg) {
      const u64 t = now();
      prof_add(seg, t - prof_t);
      prof_t = t;
    };
    // UNIT_PROFILE = 2: a round's parts too (R_*; the marks cost a tile ~25%: the split is relative)
    auto rmark = [&](int seg) { if (UNIT_PROFILE >= 2) mark(seg); };
#else
    auto prof_add = [](int, u64) {};
    auto mark = [](int) {};
    auto rmark = [](int) {};
#endif

    for (;; ++un) {
      mark(P_EPI);  // the last unit's epilogue, to here
      const unit u = take_unit(un);
      mma::warp_sync();  // every lane has read the slot
      if (releaser) release_unit(un);
      if (!u.live) break;  // the end marker's wait counts to P_END, not to a unit
      mark(P_TAKE);
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
      // the unit's turns and stage hand-backs (below) so that the ring and the barriers' counts stay whole.
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
      // ROWSUM_MMA: P V's 8 extra columns (2 per row slot: the row's sum twice per tensor, groups 2q and
      // 2q + 1 per 16 keys): one tile's sums, zeroed before each P V and added to l_run in fp32 (FP8
      // wgmma accumulates with ~14 bits: summed across the tiles of a 64k-key request, l lost most of
      // its terms).
      float lacc[4] = {};
      // O_PROMOTE: O = part * part_f + oacc (part: this thread's 64 floats in shared memory, once has_part).
      float part_f[acc_t::row_slots];
      bool has_part = false;
      constexpr int NPF = kFp8 ? BN / 32 : BN / 16;
      // P as the A operand of P V (k16 16-bit or k32 e4m3 fragments). Two buffers (kTwoP): the
      // softmax of tile i writes one while O += P V of tile i - 1 reads the other, so converting P
      // is off the path from that P V's end to the next round's MMAs.
      op_t pf[NPF], pg[NPF];
      float m_run[acc_t::row_slots], l_run[acc_t::row_slots];
      // S_F16: the exp2's f16 multipliers and addends of both row slots (pairs) and whether the warp's
      // references lie in the band of the fast exp2 (FOLD_V, DIRECT_P), set with the references (softmax16).
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

      auto stage = [&](int it) { return (base + it) % NST; };
      auto parity = [&](int it) { return ((base + it) / NST) & 1; };
      auto wait_k = [&](int it) { wg::mbar_wait(fullK + stage(it), parity(it)); };
      auto wait_v = [&](int it) { wg::mbar_wait(fullV + stage(it), parity(it)); };
      auto free_k = [&](int it) { if (releaser) wg::mbar_arrive(emptyK + stage(it)); };
      auto free_v = [&](int it) { if (releaser) wg::mbar_arrive(emptyV + stage(it)); };
      const int qs = qn % QST;
      const unsigned char* sQs = sQ + 2 * qs * BM * D;
      auto free_q = [&]() { if (releaser) wg::mbar_arrive(emptyQ + qs); };
      auto issue_s = [&](int it) {  // S = Q K^T of tile it
        const unsigned char* sKs = sK + EB * stage(it) * TILE;
        if constexpr (kFp8) {  // rows of 128 bytes: K steps of 32 bytes inside the swizzle atom
          // The steps' descriptors by desc_add (one add each, not the address's encoding, between the turns).
          const u64 dq0 = wg::desc_bits(sQ8 + 64 * grp * D, 16, 1024), dk0 = wg::desc_bits(sKs, 16, 1024);
#pragma unroll
          for (int kc = 0; kc < D / 32; ++kc) {
            const u64 dq = wg::desc_add(dq0, kc * 32), dk = wg::desc_add(dk0, kc * 32);
            if (DIAG_ENERGY == 2) continue;  // timing only: no MMA
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
      };
      // O_PROMOTE: P V(j) starts O's registers from zero after a promotion (restart(j)).
      const bool promo = kPromote && n_iter > kPromote;
      auto restart = [&](int j) { return promo && j > 0 && j % (kPromote ? kPromote : 1) == 0; };
      auto issue_pv = [&](int it, const op_t (&pa)[NPF]) {  // O += P V of tile it
        const unsigned char* sVs = sV + stage(it) * VSTAGE;
        if constexpr (kFp8) {  // V^T panels [D][VT_PANEL]: K-major, keys in steps of 32 bytes
          const int keep = restart(it) ? 0 : 1;
          const u64 dv0 = wg::desc_bits(sVs, 16, 8 * VT_PANEL, VT_LAYOUT);
#pragma unroll
          for (int kk = 0; kk < BN / 32; ++kk) {
            const u64 db = wg::desc_add(dv0, 32 * kk / VT_PANEL * VT_PANEL * VROWS + 32 * kk % VT_PANEL);
            if (DIAG_ENERGY == 2) continue;  // timing only: no MMA
            if constexpr (kRowsumMma) wg::op8<128>::rs_sum(oacc, lacc, pa[kk], db, kk ? 1 : keep);  // D = 128 (FP8)
            else wg::op8<D>::rs(oacc, pa[kk], db, kk ? 1 : keep);
          }
        } else {
          const u16* v16 = reinterpret_cast<const u16*>(sVs);
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) wg::op<D, DT>::rs_t(oacc, pa[kk], wg::desc_mn<BN>(v16 + LKV::off(kk * 16, 0)));
        }
        wg::commit();
      };
      // Mask and online softmax (log2 units) of tile it: sacc becomes P; alpha rescales O and l,
      // rs holds this lane's part of P's row sums; vfac: O's extra factor (KV_FP8 = 2: the previous
      // tile's v_max in units of this one's; 1 otherwise).
      // Key scales (KV_FP8 >= 2) sit in the stage as SC_BLOCKS x [K's, V's] x 128, each in lane
      // order: lane quad q reads the 32 columns 16 n + 8 h + 2 q + b of its block at
      // 32 q + 4 n + 2 h + b, as 8 float4. The tile's group nt is its first block's group
      // n = nt + (the tile's first key in that block) / 16; n >= 8: group n - 8 of the next block.
      // The tile's 16-key group nt, counted from its first 128-key block's first group.
      auto block_group = [&](int it, int nt) { return (kw.tile(it) * BN) % kFp8Align / 16 + nt; };
      auto group_at = [&](int it, int which, int nt) {
        const int n = block_group(it, nt);
        return sS + stage(it) * SC_TILE + (SC_BLOCKS > 1 ? (n >> 3) * 2 * kFp8Align : 0) + which * kFp8Align + 4 * (n & 7);
      };
      auto key_scales = [&](int it, int which, int nt) {
        return *reinterpret_cast<const float4*>(group_at(it, which, nt) + 32 * (int)(lane_id() & 3));
      };
      // The tile's group nt lies in its second 128-key block.
      auto in_second = [&](int it, int nt) { return SC_BLOCKS > 1 && block_group(it, nt) >= 8; };
      auto pick = [](const float4& v, int e) {
        const int i = (e >> 2) * 2 + (e & 1);
        return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
      };
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
      auto load_groups = [&](int it) {
        if constexpr (kRowsumGroups) {
          rv_prev = rv_cur;
          rv_cur = f32_as_u32(sS[stage(it) * SC_TILE + kFp8GroupBlock + kFp8GroupRecip + (int)(lane_id() & 3)]);
        }
        if constexpr (kRelGK) {
          const float* b = sS + stage(it) * SC_TILE + kFp8GroupBlock;
#pragma unroll
          for (int i = 0; i < 4; ++i)  // kFoldV: V's exponents in place of its factors
            grel[i] = *reinterpret_cast<const u32x4*>(b + 4 * i + (kFoldV && i >= 2 ? kFp8GroupFold - 8 : 0));
          gscale_t = fmax_(b[16], 1e-30f);  // the gather floors it already: a zero here would make -inf * 0
        } else if constexpr (kGroupScales) {
#pragma unroll
          for (int nt = 0; nt < BN / 16; ++nt) {
            gk[nt] = fmax_(*group_at(it, 0, nt), 1e-30f);
            gv[nt] = *group_at(it, 1, nt);
          }
        }
      };
      // The row's reference max moves only when the new one exceeds it by more than kLazyLog2 (log2
      // units), so most tiles leave O and l as they are (finish skips the rescale); P <= 2^8
      // meanwhile (DIRECT_P: 2^L, encoded times 2^(8 - L)), which e4m3 (448) and 16-bit P hold, and
      // O, l are fp32. Most tiles move no row's
      // reference: this lane's maxes (lmax) and one vote of the warp tell, so the rows' maxes
      // (shuffles between the lanes of a row) are only taken when one may move. msc: the reference
      // in log2 units; alpha: O's and l's rescale. lmax may be an upper bound of the lane's maxes: refine
      // then makes it exact, only when a row may move.
      // Returns whether the warp took the rows' maxes (only then may msc differ from the last tile's).
      auto move_reference = [&](float (&lmax)[acc_t::row_slots], float* msc, float* alpha, auto&& refine) {
        bool grow = false;
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) grow |= m_run[s] == neg_inf() || (lmax[s] - m_run[s]) * a_eff[s] > kLazyLog2;
        if (!LOCAL_MAX_CHECK || mma::warp_any(grow)) {
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
      };
      auto softmax = [&](int it, float* alpha, float* rs, float& vfac) {
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
            const float4 ks = key_scales(it, 0, nt);
#pragma unroll
            for (int e = 0; e < acc_t::ne; ++e) sacc[nt].x[e] *= pick(ks, e);
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
          const float vcn = in_second(it, nt) ? vc[SC_BLOCKS - 1] : vc[0];
          float4 vr;
          if constexpr (kKeyScales && !kGroupScales) {
            vr = key_scales(it, 1, nt);
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
            const float pv = nt < EXP_POLY ? exp2_fma(arg) : exp2_(arg);
            if constexpr (!kRowsumMma) rs[s] += pv;
            if constexpr (kGroupScales) sacc[nt].x[e] = pv * (gv[nt] * vcn);
            else if constexpr (kKeyScales) sacc[nt].x[e] = pv * pick(vr, e);
            else sacc[nt].x[e] = pv;
          }
        }
      };
      // P -> the operand registers of its P V (before the P V in flight completes: another buffer).
      auto to_operand = [&](op_t (&pa)[NPF]) {
        if constexpr (kFp8) {
#pragma unroll
          for (int kk = 0; kk < NPF; ++kk) wg::to_operand_fp8(pa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
        } else {
#pragma unroll
          for (int nt = 0; nt < NPF; ++nt) mma::to_operand<DT>(pa[nt], sacc[nt]);
        }
      };
      // S_F16: the softmax above on S's f16x2 pairs, P in place of S (s16), keys masked in f16. Pair
      // 4 nt + j of tile nt holds row slot j & 1's columns 16 nt + {2q, 2q + 1} (j < 2) or
      // 16 nt + {8 + 2q, 9 + 2q} (j >= 2).
      auto softmax16 = [&](int it, float* alpha, float* rs, float& vfac) {
        wg::fence_regs(s16);
        if (DIAG_ENERGY == 1) {  // timing only: no softmax, P = S
          vfac = 1.f;
#pragma unroll
          for (int sl = 0; sl < 2; ++sl) alpha[sl] = rs[sl] = 1.f;
          return;
        }
        const int j0 = kw.tile(it) * BN;
        if constexpr (kSoftcap) {  // S = tanh(S a_row) (times K's group scale), each pair through fp32
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
        auto grel_at = [&](int w) {  // word w of the group block's first 16
          const u32x4& v = grel[w / 4];
          return w % 4 == 0 ? v.x : w % 4 == 1 ? v.y : w % 4 == 2 ? v.z : v.w;
        };
        if constexpr (kRelGK) gscale = gscale_t;
        // A group factor that f16 rounds to zero counts as 2^-24 (0x0001): -inf * 0 would make a NaN of a
        // masked key; an unmasked one moves by at most 57344 * 2^-24 of the tile's scale.
        constexpr u32 kTiny = 0x00010001u;
        if (tile_needs_mask(j0, j0 + BN, wp_first, wp_last, u.sk, causal, W, S)) mask_cols<acc_t>(s16, j0, pos, u.sk, causal, W, S);
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
        // Both row slots' multipliers (mul_pair) and addends (add_pair, EXP_SHIFT: t = 2^F x + B) as pairs,
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
        // references within about [-22, 106] log2 units with DIRECT_P's B, [-17, 111] without); a warp
        // with a row past that multiplies P by 2^(c / 2^F) instead, as exact as the factors of the pack
        // (DIRECT_P: the same band for the bytes, and that warp's P goes through the f16 form).
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
      };
      // S_F16: P (s16) -> the operand registers of its P V.
      auto to_operand16 = [&](op_t (&pd)[NPF]) {
#pragma unroll
        for (int kk = 0; kk < NPF; ++kk) {  // DIRECT_P: s16 holds the bytes already
          const auto pk = [](u32 a, u32 b) { return kDirectP ? h2::pack_bytes(a, b) : h2::to_fp8x4(a, b); };
          pd[kk].x[0] = pk(s16[8 * kk], s16[8 * kk + 2]);
          pd[kk].x[1] = pk(s16[8 * kk + 1], s16[8 * kk + 3]);
          pd[kk].x[2] = pk(s16[8 * kk + 4], s16[8 * kk + 6]);
          pd[kk].x[3] = pk(s16[8 * kk + 5], s16[8 * kk + 7]);
        }
      };
      // After O += P V of the previous tile completed: rescale O, update l.
      // A row's sum l so far (ROWSUM_MMA: every lane holds it; else this lane's part, summed over the row).
      auto row_l = [&](int s) { return kRowsumMma && !kRowsumGroups ? l_run[s] : acc_t::row_sum(l_run[s]); };
      // kRowsumMma: a finished P V's sums in l's units (per 16 keys: each group's times its weight)
      auto tile_l = [&](int s, u32 rv) {
        return kRowsumGroups ? h2::lo(rv) * lacc[2 * s] + h2::hi(rv) * lacc[2 * s + 1] : lacc[2 * s];
      };
      auto finish = [&](const float* alpha, const float* rs, float vfac) {
        bool moved = false;
        float of[acc_t::row_slots];
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) {
          l_run[s] = kRowsumMma ? (l_run[s] + tile_l(s, rv_prev)) * alpha[s] : l_run[s] * alpha[s] + rs[s];
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
      };

      // O_PROMOTE: this thread's chunk i (0..15: oacc[i / 2].x[4 (i % 2) ..]) of O's partial: 8 in
      // the warpgroup's own 16 KB, 4 in each 64-column panel of its rows of sO.
      auto part_chunk = [&](int i) {
        const int t = (int)(tid_x() % 128);
        unsigned char* p = i < 8 ? sPro + grp * 128 * D + (i * 128 + t) * 16
                                 : reinterpret_cast<unsigned char*>(sO) + (i - 8) / 4 * BM * 128 + grp * 64 * 128 +
                                       ((i - 8) % 4 * 128 + t) * 16;
        return reinterpret_cast<float4*>(p);
      };
      auto with_part = [&](int i, const float4& a) {  // O's chunk i plus a partial: x[0..1] of row slot 0, x[2..3] of slot 1
        const float* x = oacc[i / 2].x + 4 * (i % 2);
        return float4{fmaf(a.x, part_f[0], x[0]), fmaf(a.y, part_f[0], x[1]), fmaf(a.z, part_f[1], x[2]),
                      fmaf(a.w, part_f[1], x[3])};
      };
      // S_F16: chunk i (0..7) of the f16 partial holds oacc[i] (pairs x[0..1], x[2..3], x[4..5], x[6..7]).
      auto half_chunk = [&](int i) {
        const int t = (int)(tid_x() % 128);
        return reinterpret_cast<u32x4*>(reinterpret_cast<unsigned char*>(sO) + i / 4 * BM * 128 + grp * 64 * 128 +
                                        (i % 4 * 128 + t) * 16);
      };
      // O's registers (complete P V's) into the partial: part = part * part_f + oacc, part_f = 1 (S_F16:
      // the f16 partial in units of the row sum lam, part_f = lam). The first of a unit waits until the
      // previous unit's O has left sO (TMA stores, other threads' reads).
      auto promote = [&]() {
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
            lam[sl] = fmax_(row_l(sl), 1e-30f);
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
      };
      // Before P V(j) restarts O's registers: under S(j + 1) in the tensor cores (O's registers are
      // complete since the last round's wait), then a fence orders those reads before the P V's writes.
      auto promote_before = [&](int j) {
        if (!kHalfPart && restart(j)) {
          promote();
          wg::fence();
        }
      };

      mark(P_SETUP);
      wg::mbar_wait(fullQ + qs, (qn / QST) & 1);
      mark(P_QWAIT);
      ++qn;
      if (kFp8 && n_iter == 0) free_q();  // no S to issue: the 16-bit stage goes back unread
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
          store16(sQ8 + r * D + 16 * ((4 * h + j) ^ (r & 7)), u32x4{w[0], w[1], w[2], w[3]});
        }
        if (h == 0) sQsc[r] = qsc;
        mark(P_QUANT);
        wg::fence_proxy_async();  // the e4m3 tile, visible to wgmma
        wg::bar_sync(epi_bar(grp), 128);
        free_q();
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) a_row[s] *= sQsc[64 * grp + 16 * warp + acc_t::slot_row(s)] * k_scale;
      }
      mark(P_Q);
      prof_add(P_UNITS, 1);
      prof_add(P_ITERS, (u64)n_iter);
#pragma unroll
      for (int s = 0; s < acc_t::row_slots; ++s) a_eff[s] = kSoftcap ? c_log2 : a_row[s];
      if (n_iter == 0) {
        if (!kFp8) free_q();
      } else {
        float alpha[acc_t::row_slots], rs[acc_t::row_slots], vfac;
        wait_k(0);
        mark(P_K0);
        turn_wait();
        mark(P_TURN);
        wg::fence();
        issue_s(0);
        turn_pass();
        mark(P_S0);
        load_groups(0);
        wg::wait<0>();
        rmark(R_SWAIT);
        if (!kLateFreeK) free_k(0);
        if (!kFp8 && n_iter == 1) free_q();
        if constexpr (kSF16) {
          softmax16(0, alpha, rs, vfac);
          to_operand16(pf);
        } else {
          softmax(0, alpha, rs, vfac);
          if (kLateFreeK) free_k(0);
          to_operand(pf);
        }
        rmark(R_SOFT);
        finish(alpha, rs, vfac);
        rmark(P_TILES);
        // Round it: S(it) and O += P(it - 1) V(it - 1) issued, the softmax of tile it under the latter;
        // P(it - 1) in pa, P(it) into pb. Rounds go in pairs so that the buffers alternate by name.
        auto round = [&](int it, op_t (&pa)[NPF], op_t (&pb)[NPF]) {
          wait_k(it);
          wait_v(it - 1);
          rmark(R_KV);
          turn_wait();
          rmark(R_TURN);
          wg::fence();
          issue_s(it);
          promote_before(it - 1);
          issue_pv(it - 1, pa);
          turn_pass();
          rmark(R_ISSUE);
          load_groups(it);
          wg::wait<1>();  // S(it) done; the softmax overlaps O += P V of tile it - 1
          rmark(R_SWAIT);
          if (!kLateFreeK) free_k(it);  // KV_FP8 = 2: the key scales in K's stage are read by the softmax
          if (!kFp8 && it == n_iter - 1) free_q();
          if constexpr (kSF16) {
            softmax16(it, alpha, rs, vfac);
            if (kTwoP) to_operand16(pb);
          } else {
            softmax(it, alpha, rs, vfac);
            if (kLateFreeK) free_k(it);
            if (kTwoP) to_operand(pb);
          }
          rmark(R_SOFT);
          wg::wait<0>();
          rmark(R_PVWAIT);
          free_v(it - 1);
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
          if (kHalfPart && restart(it)) promote();
          rmark(P_TILES);
        };
        auto last_pv = [&](op_t (&pa)[NPF]) {
          wait_v(n_iter - 1);
          rmark(R_KV);
          turn_wait();
          rmark(R_TURN);
          wg::fence();
          promote_before(n_iter - 1);
          issue_pv(n_iter - 1, pa);
          turn_pass();
          rmark(R_ISSUE);
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
        rmark(R_PVWAIT);
        free_v(n_iter - 1);
        wg::fence_regs(oacc);
        if constexpr (kRowsumMma) {
          wg::fence_regs(lacc);
#pragma unroll
          for (int s = 0; s < acc_t::row_slots; ++s) l_run[s] += tile_l(s, rv_cur);  // the last tile's
        }
        wg::fence_regs(pf);
        if (kTwoP) wg::fence_regs(pg);
      }
      if constexpr (kSkipIdle) {
        // The turns and stages of the tiles this warpgroup dropped, as a round would take them: the first
        // turn (S(0)'s) bare when it has none of its own, then per tile K and V waited, a turn, both freed.
        if (n_iter == 0 && n_unit > 0) {
          turn_wait();
          turn_pass();
        }
        for (int k = n_iter; k < n_unit; ++k) {
          wait_k(k);
          wait_v(k);
          turn_wait();
          turn_pass();
          free_k(k);
          free_v(k);
        }
      }
      base += n_unit;
      mark(P_TILES);
      if (idle) continue;  // no row of the request: nothing to store

      // Epilogue: normalise (sink in the denominator), lse, O through this warpgroup's rows of sO
      // (once the previous unit's O has left them), then to global memory: by one TMA store per
      // 64 columns when the rows are whole tokens of the request, else (the last tile of a request,
      // or 64 rows not a multiple of G) 16-byte stores of the rows in it. The TMA store frees the
      // warpgroup at once: the 16-byte stores of a d128 tile took ~2000 cycles per unit on H100.
      const bool tma_o = 64 % G == 0 && u.m0 + (64 * grp + 64) / G <= u.sq;
      if (kHalfPart && has_part) {  // read back before the barrier: the rows of sO are written after it
        u32x4 a[D / 16];
#pragma unroll
        for (int i = 0; i < D / 16; ++i) a[i] = *half_chunk(i);
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
          const float4 r = with_part(i, *part_chunk(i));
          float* x = oacc[i / 2].x + 4 * (i % 2);
          x[0] = r.x;
          x[1] = r.y;
          x[2] = r.z;
          x[3] = r.w;
        }
      if (o_issuer) wg::bulk_wait_read<0>();
      wg::bar_sync(epi_bar(grp), 128);
      {
        float inv[acc_t::row_slots];
#pragma unroll
        for (int s = 0; s < acc_t::row_slots; ++s) {
          const float l = row_l(s);  // DIRECT_P: in units of kDirectMean (lse and the sink take P's)
          float lse_v = neg_inf();
          inv[s] = 0.f;
          if (l > 0.f) {
            const float m2 = m_run[s] * a_eff[s];
            lse_v = (m2 + log2_(kDirectP ? l * (1.f / kDirectMean) : l)) * kLn2;
            float den = l;
            if (sinks != nullptr) den += exp2_(sinks[head[s]] * kLog2e - m2) * (kDirectP ? kDirectMean : 1.f);
            inv[s] = (KV_FP8 == 1 ? v_scale : kKeyScales ? v_ref : 1.f) / den;
          }
          if (!UNIT_PROFILE && lse != nullptr && acc_t::row_leader() && tok[s] < u.sq) lse[(i64)(u.q0 + tok[s]) * hq + head[s]] = lse_v;
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
        continue;
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
    if (o_issuer) wg::bulk_wait_read<0>();  // shared memory stays until the last store has read it
    mark(P_END);
    prof_add(P_ROW, 1);
#if PINGPONG
    // Consumer 0 skipped the wait of its first round; the last consumer's final pass is
    // consumed here so that every hardware barrier ends balanced.
    if (grp == 0 && !first_round) wg::bar_sync(turn_bar(0), 256);
#endif
  }
#else
  (void)tm_q; (void)tm_k; (void)tm_v; (void)tm_s; (void)tm_o; (void)kv_scale; (void)v_max; (void)v_max_blocks; (void)cu_kp;
  (void)o; (void)lse; (void)cu_q; (void)cu_k; (void)work; (void)sched; (void)sinks;
  (void)o_st; (void)o_sh; (void)n_items; (void)hq_i; (void)batch_i; (void)q_per_kv_i; (void)max_tiles_i;
  (void)causal_i; (void)window_i; (void)sink_tok_i; (void)pack_i; (void)a_log2; (void)c_log2;
  trap_();  // no wgmma / TMA on this target: the launcher never selects this kernel here
#endif
}
