// Split-KV decode over the paged KV cache on tensor cores (docs/design.md, "Split-KV (decode)").
//
// Same contract, grid and split rule as decode.hip (the CUDA-core kernel): one CTA = (kv head g,
// row block rb) x request b x split s, grid (hk * row_blocks, batch, splits); split s covers keys
// [lo + s*per, lo + (s+1)*per) of the visible range, split 0 also takes the StreamingLLM sinks;
// each split writes fp32 o (normalised) and lse (-inf and 0 when empty). With one split and `out`
// given, the CTA writes the final o (q's dtype, sinks applied) and lse_out itself: no combine.
//
// Rows (query token x query head of g, up to 16 per CTA) are the M side of 16x16 MMA tiles
// (atom_mma.h): rows past the request's are zero padding (decode is memory bound, the waste is
// free). Every warp owns KPW = 16 * NKT keys of each chunk, copies them (16-byte asynchronous
// copies, page looked up by absolute token position) into its own slice of a STAGES-deep shared
// ring and computes S = Q K^T (keys = N, head_dim = K), an online softmax on S, and O += P V with
// P = S re-used in registers as the left operand (FA2). No block barrier in the loop; warps merge
// once at the end through shared memory.
//
// 16-bit KV: K and V rows sit in the ring in atom_mma's swizzled layout, fragments come from
// load_rows (K) and load_cols (V, transposed), MMAs in the KV dtype.
// FP8 KV: the ring holds the raw e4m3 bytes; fragments are built in registers by the hardware
// fp8x2 -> f16x2 conversion and the MMAs run in f16 (Q converted once, scaled). On mma.sync the
// byte layout is chosen so that each lane reads 16 bytes of a K row (one LDS.128 per 4 K tiles)
// and 8 bytes of 4 V rows (transposed in registers by byte permutes): head_dim is permuted
// consistently in Q and K (a dot product does not care) and in the V columns / O (undone when O
// is written). Per-key K factors scale S columns, per-key V factors scale P columns (relative to
// the warp's first V factor, which keeps P inside f16's range); per-tensor V scales multiply O.
//
// Defines: HEAD_DIM (64|128|256), Q_DTYPE (0 bf16, 1 fp16), KV_DTYPE (0 bf16, 1 fp16, 2 e4m3fn,
//          3 e4m3fnuz), NUM_WARPS (decode.py: 4 for 16-bit KV, 2 for FP8); tuning: KTILES (16-key
//          tiles per warp per chunk), STAGES, MIN_CTAS (CTAs per SM the registers allow).
// Dynamic shared memory: smem_bytes() below; hip_kernels/decode.py mirrors it (_mma_smem_bytes).

#include "atom_mma.h"
#include "splitkv_combine.h"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef Q_DTYPE
#define Q_DTYPE 0
#endif
#ifndef KV_DTYPE
#define KV_DTYPE 0
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif

namespace atom_dmma {
using atom::i64;
using atom::u16;
using atom::u32;
using atom::u32x2;
using atom::u32x4;
using atom::mma::acc_t;
using atom::mma::op_t;

constexpr int D = HEAD_DIM;
constexpr int KV_BYTES = KV_DTYPE >= 2 ? 1 : 2;
constexpr bool FP8 = KV_BYTES == 1;
constexpr int WARP = ATOM_WARP_SIZE;
constexpr int NW = NUM_WARPS;
constexpr int NT = NW * WARP;
constexpr int KT = D / 16;  // 16-wide tiles of head_dim
constexpr int M = 16;       // rows per CTA
static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
#ifdef KTILES
constexpr int NKT = KTILES;
#else
constexpr int NKT = 1;
#endif
constexpr int KPW = 16 * NKT;  // keys per warp per chunk
constexpr int CHUNK = NW * KPW;
constexpr int KEYB = D * KV_BYTES;  // bytes of one key row (K or V) of one head
constexpr int CPK = KEYB / 16;      // 16-byte copies per key row
// Copies: copy t of a lane moves part i % CPK of key i / CPK, i = lane + WARP * t, so that the
// lanes of one copy instruction cover whole key rows (whole 128-byte lines).
constexpr int NCP = KPW * CPK / WARP;  // copies per lane per chunk, for K and for V each
static_assert(2 * KPW <= WARP && KPW * CPK % WARP == 0,
              "a lane per K row and per V row; copies spread evenly over the lanes");
#ifdef STAGES
constexpr int NST = STAGES;
#else
constexpr int NST = FP8 ? 4 : 3;
#endif
static_assert(NST >= 2, "a ring needs two stages");
constexpr int FAC_BYTES = FP8 ? 2 * KPW * 4 : 0;
constexpr int STAGE_BYTES = 2 * KPW * KEYB + FAC_BYTES;
constexpr int RING_BYTES = NW * NST * STAGE_BYTES;
constexpr int Q_BYTES = M * D * 2;
// Merge rows are D + 8 floats apart: a warp's stores of its first 4 rows (decode's 4 GQA heads) hit
// 32 different banks (D floats apart, they all hit the same 4: 8-way conflicts, and FP8 decode
// 2.7-4.6% slower).
constexpr int MERGE_LD = D + 8;
// Balanced splits (slices claimed at run time) for 16-bit KV only: FP8's latency-bound loop
// loses more to the claims than the balance gains (docs/perf/decode.md), and compiled out its per-page
// loop is ~3% faster.
constexpr bool BALANCE = !FP8;
constexpr int MERGE_BYTES = NW * M * (MERGE_LD + 2) * 4;
constexpr int BODY_BYTES = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
constexpr int SMEM_BYTES = Q_BYTES + BODY_BYTES;  // == decode.py _mma_smem_bytes

// mma.sync gets the register-built FP8 fragments with permuted head_dim; other back ends build
// them element by element from the tile layout (correct, unpermuted, slower).
#if ATOM_MMA_SYNC
constexpr bool PERM = FP8;
#else
constexpr bool PERM = false;
#endif

// fp8 e4m3 of the platform's flavour -> value; a cache of the other flavour is converted as the
// native one and scaled: fnuz(x) == fn(x) / 2 for every finite code (0x80 and fn's NaNs aside).
constexpr bool KV_FNUZ = KV_DTYPE == 3;
constexpr float FMT = (KV_FNUZ == (bool)ATOM_FP8_FNUZ) ? 1.f : (KV_FNUZ ? 0.5f : 2.f);

// Two e4m3 bytes (low 16 bits of w, low byte first) -> packed f16x2 (low half = low byte).
ATOM_DEV u32 fp8x2_to_f16x2(u32 w) {
#if ATOM_NVIDIA && ATOM_HW_FP8_CVT
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
  return (u32)r.x | ((u32)r.y << 16);
#else
  float a, b;
  atom::fp8x2_to_f32x2<false>(w, a, b);
  return atom::pack_f16x2(a, b);
#endif
}

template <bool B>
struct flag {
  static constexpr bool value = B;
};

ATOM_DEV int imin(int a, int b) { return a < b ? a : b; }
ATOM_DEV int imax(int a, int b) { return a > b ? a : b; }
ATOM_DEV int shfl_i(int v, int src) { return (int)atom::f32_as_u32(atom::shfl(atom::u32_as_f32((u32)v), src)); }

ATOM_DEV unsigned int div_magic(unsigned int n, unsigned int magic, int shift) {
  const unsigned int hi = (unsigned int)(((unsigned long long)n * magic) >> 32);
  return (hi + n) >> shift;
}

// Byte offset of 16-byte chunk c of key row r in a K / V block of the ring.
//  16-bit: atom_mma's swizzle (chunk ^ (row & 7)), read by load_rows / load_cols.
//  FP8 K: a quarter warp reads 16-byte chunks 4h..4h+3 of rows 2p, 2p+1: row parity flips chunk bit 2.
//  FP8 V: a half warp reads 8 bytes at 32-byte unit u of rows c, c+2, c+4, c+6: unit ^= (row/2)&3.
ATOM_DEV int kchunk(int r, int c) {
  if constexpr (!FP8) return c ^ (r & 7);
  else return CPK >= 8 ? c ^ ((r & 1) << 2) : c;
}
ATOM_DEV int vchunk(int r, int c) {
  if constexpr (!FP8) return c ^ (r & 7);
  else return c ^ ((2 * ((r >> 1) & 3)) & (CPK - 1));
}
ATOM_DEV int kbyte(int r, int b) { return r * KEYB + kchunk(r, b >> 4) * 16 + (b & 15); }
ATOM_DEV int vbyte(int r, int b) { return r * KEYB + vchunk(r, b >> 4) * 16 + (b & 15); }

// Physical head_dim of logical K-index kk (0..15) of head_dim tile kt, in Q and K (FP8, mma.sync):
// lane t reads 16 bytes at 64h + 16t of a K row; its words i = 0..3 feed tiles kt = 4h + i.
ATOM_DEV int qdim(int kt, int kk) {
  if constexpr (PERM)
    return 64 * (kt >> 2) + 16 * ((kk & 7) >> 1) + 4 * (kt & 3) + 2 * (kk >> 3) + (kk & 1);
  else
    return 16 * kt + kk;
}
// Physical head_dim of column c (0..15) of O tile T (FP8, mma.sync): V column n of n8-tile j is
// dim 64 (j / 8) + 8 n + j % 8 (lane n reads 8 bytes at 64 (j / 8) + 8 n of each V row).
ATOM_DEV int odim(int T, int c) {
  if constexpr (PERM) {
    const int j = 2 * T + (c >> 3);
    return 64 * (j >> 3) + 8 * (c & 7) + (j & 7);
  } else {
    return 16 * T + c;
  }
}

}  // namespace atom_dmma

#ifndef MIN_CTAS
#define MIN_CTAS 1
#endif
extern "C" __global__ void ATOM_LAUNCH_BOUNDS2(atom_dmma::NT, MIN_CTAS) splitkv_decode_mma(
    const unsigned short* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const char* __restrict__ k_cache, const char* __restrict__ v_cache,
    long long k_page_bytes, long long k_tok_bytes, long long k_head_bytes,
    long long v_page_bytes, long long v_tok_bytes, long long v_head_bytes, int num_blocks,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
    const int* __restrict__ block_table, long long bt_stride, int bt_width,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
    const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    float k_factor, float v_factor,
    float* __restrict__ o_partial, float* __restrict__ lse_partial,
    unsigned short* __restrict__ out, long long out_stride_t, long long out_stride_h,
    float* __restrict__ lse_out, const float* __restrict__ sinks, int total_q, int num_q_heads,
    int num_kv_heads, int group, int row_blocks, int num_splits, int block_size, unsigned int bs_magic, int bs_shift,
    float q_scale, float softcap_l2e, float inv_softcap, int window, int sink_tokens, int min_split_keys,
    int fill_splits, int long_split_keys, int split_ctas, int split_slots, int wave_fill, int* __restrict__ sem,
    int balanced) {
  using namespace atom_dmma;
  using atom::mma::mma;
  typedef atom::mma::acc_t acc_t;
#if Q_DTYPE == 0
  typedef atom::bf16_t QT;
#else
  typedef atom::f16_t QT;
#endif
  // MMA input type: the KV dtype for 16-bit KV (== q's), f16 for FP8 KV.
#if KV_DTYPE == 0
  typedef atom::bf16_t DT;
#else
  typedef atom::f16_t DT;
#endif
#if ATOM_NVIDIA
  extern __shared__ __align__(16) unsigned char smem[];
#else
  extern __shared__ unsigned char smem[];
#endif
  const float NEG_INF = atom::neg_inf();
  const int g = (int)atom::bid_x() / row_blocks;
  const int rb = (int)atom::bid_x() - g * row_blocks;
  const int b = (int)atom::bid_y();
  const int s = (int)atom::bid_z();
  const int tid = (int)atom::tid_x();
  const int lane = tid % WARP;
  const int warp = tid / WARP;

  // The request's bounds, all loaded at once (one latency, not two, before the page ids).
  const int q0 = cu_seqlens_q[b];
  const int sq = cu_seqlens_q[b + 1] - q0;
  int sk = seq_lens[b];
  int ip0 = 0;
  int avail;
  if (kv_indptr != nullptr) {
    ip0 = kv_indptr[b];
    avail = kv_indptr[b + 1] - ip0;
  } else {
    avail = bt_width;
  }
  if (sq <= 0) return;

  // Keys beyond the pages the table holds are ignored (never read), whatever seq_lens says.
  {
    const long long cap = (long long)(avail > 0 ? avail : 0) * block_size;
    sk = sk < 0 ? 0 : (sk > cap ? (int)cap : sk);
  }
  const int pos0 = sk - sq;
  const int lo = window > 0 ? imax(0, pos0 - window + 1) : 0;
  const int main_len = sk > lo ? sk - lo : 0;
  // Splits of this request: ns = atom::request_splits (the planner's SplitRule), docs/design.md's
  // ranges of ceil(main_len / ns) keys over ns (the last may be short). num_splits is the grid's
  // bound, sized for the longest context a launch may see (a CUDA graph keeps it); a shorter
  // request leaves splits ns.. idle. An idle split returns at once: with the combine kernel to
  // follow (no `out`) it writes an empty split's partials (o = 0, lse = -inf); with `out` the
  // request's first CTA writes the answer (ns == 1) or its last active CTA combines ns partials.
  const int ns = atom::request_splits(main_len, num_splits, min_split_keys, fill_splits, long_split_keys,
                                       split_ctas, split_slots, wave_fill);
  if (s >= ns) {
    if (out == nullptr) {
      const int rows = imin(M, sq * group - rb * M);
      for (int i = tid; i < rows * D; i += NT) {
        const int r = i / D, d = i - r * D;
        const int rg = rb * M + r;
        const int t = rg / group;
        const long long row = ((long long)s * total_q + (q0 + t)) * num_q_heads + g * group + (rg - t * group);
        o_partial[row * D + d] = 0.f;
        if (d == 0) lse_partial[row] = NEG_INF;
      }
    }
    return;
  }
  // Balanced (`balanced`, counters given, several splits): the CTAs of one (kv head, row block,
  // request) share its whole visible range, cut into KPW-key slices that warps claim from a
  // counter; a split's partial then covers the slices its warps took. Static: split s owns a
  // contiguous range. The host turns balancing on for a grid that fills the GPU; a request that
  // leaves splits idle does not fill its share of it, so it keeps fixed ranges (the claims cost
  // more than they save there: docs/perf/decode.md).
  const bool dyn = BALANCE && balanced != 0 && sem != nullptr && ns > 1 && ns == num_splits;
  const int n_sink = (window > 0 && (s == 0 || dyn)) ? imin(sink_tokens, lo) : 0;
  const int per = dyn ? main_len : (main_len + ns - 1) / ns;
  const int st = dyn ? lo : imin(lo + s * per, sk > lo ? sk : lo);
  const int en = imin(st + per, sk > lo ? sk : lo);
  const int vcount = n_sink + (en - st);
  auto key_of = [&](int v) { return v < n_sink ? v : st + (v - n_sink); };

  // Query position of each row slot of this lane (-1: padding row, sees nothing).
  int qpos[acc_t::row_slots];
#pragma unroll
  for (int sl = 0; sl < acc_t::row_slots; ++sl) {
    const int rg = rb * M + acc_t::slot_row(sl);
    const int t = rg / group;
    qpos[sl] = t < sq ? pos0 + t : -1;
  }

  const bool per_page = k_descale != nullptr;
  const char* kb = k_cache + (long long)g * k_head_bytes;
  const char* vb = v_cache + (long long)g * v_head_bytes;
  const int* table = kv_indptr != nullptr ? kv_indices + ip0 : block_table + (long long)b * bt_stride;
  // Scores in log2 units: 16-bit Q is raw (scale applied to S in fp32), FP8 Q carries q_scale.
  const float s_scale = FP8 ? k_factor * FMT : q_scale;
  const float v_fmt = FP8 ? FMT : 1.f;

  char* body = reinterpret_cast<char*>(smem) + Q_BYTES;
  char* ring = body + warp * NST * STAGE_BYTES;

  // Row offsets are computed one chunk ahead: lane k < KPW holds the byte offset of key k's K row,
  // lane WARP/2 + k that of its V row (page clamped into the pool; -1 past the split), and hands
  // it to the copying lanes by shuffles: one 64-bit multiply-add per lane per chunk, not one per
  // copy. Per-page FP8: the same lane fetches its row's descale.
  constexpr int HALF = WARP / 2;
  const bool v_role = lane >= HALF;
  const int role_key = lane - (v_role ? HALF : 0);
  const long long page_bytes = v_role ? v_page_bytes : k_page_bytes;
  const long long tok_bytes = v_role ? v_tok_bytes : k_tok_bytes;
  const float* descale = v_role ? v_descale : k_descale;
  long long off = -1, fidx = 0;
  bool full = false;  // every key of the slice in `off` is in range: its copies need no predicate
  // The page id of a chunk is loaded one chunk before its offset is formed: the load's latency
  // passes under a chunk's math instead of stalling the warp in lookup (FP8 -2.5 to -4%).
  int pid = -1;
  auto fetch = [&](int u) {
    const int v = u * KPW + role_key;
    pid = -1;
    if (role_key < KPW && v < vcount) pid = table[(int)div_magic((unsigned int)key_of(v), bs_magic, bs_shift)];
  };
  auto lookup = [&](int u) {
    const int v = u * KPW + role_key;
    full = u * KPW + KPW <= vcount;
    off = -1;
    if (role_key < KPW && v < vcount) {
      const int j = key_of(v);
      const int lp = (int)div_magic((unsigned int)j, bs_magic, bs_shift);
      const int p = imin(imax(pid, 0), num_blocks - 1);
      off = (long long)p * page_bytes + (long long)(j - lp * block_size) * tok_bytes;
      fidx = (long long)p * num_kv_heads + g;
    }
  };
  auto issue = [&](int c) {
    char* stg = ring + (c % NST) * STAGE_BYTES;
    const u32 off_lo = (u32)off, off_hi = (u32)((unsigned long long)off >> 32);
    auto copies = [&](auto checked) {
#pragma unroll
      for (int t = 0; t < NCP; ++t) {
        const int i = lane + WARP * t;
        const int k = i / CPK, part = i % CPK;
        const long long ko = (long long)(((unsigned long long)(u32)shfl_i((int)off_hi, k) << 32) | (u32)shfl_i((int)off_lo, k));
        const long long vo = (long long)(((unsigned long long)(u32)shfl_i((int)off_hi, HALF + k) << 32) |
                                         (u32)shfl_i((int)off_lo, HALF + k));
        char* kd = stg + k * KEYB + kchunk(k, part) * 16;
        char* vd = stg + KPW * KEYB + k * KEYB + vchunk(k, part) * 16;
        if constexpr (decltype(checked)::value) {
          atom::copy16_async(kd, kb + (ko >= 0 ? ko : 0) + part * 16, ko >= 0);
          atom::copy16_async(vd, vb + (vo >= 0 ? vo : 0) + part * 16, vo >= 0);
        } else {
          atom::copy16_async(kd, kb + ko + part * 16);
          atom::copy16_async(vd, vb + vo + part * 16);
        }
      }
    };
    if (full) copies(flag<false>{});
    else copies(flag<true>{});
    if (FP8 && per_page && role_key < KPW) {
      float* fac = reinterpret_cast<float*>(stg + 2 * KPW * KEYB);
      atom::copy4_async(fac + (v_role ? KPW : 0) + role_key, descale + (off >= 0 ? fidx : 0), off >= 0);
    }
  };

  // ---- Q: rows rb*16 + r (token r / group, head g * group + r % group) staged, then fragments.
  // Start-up is a chain of dependent loads (request bounds -> page ids -> KV rows); Q's copy
  // rides beside the page-id loads instead of adding a link, and the first chunks are in flight
  // before the fragments are built.
  u16* qs = reinterpret_cast<u16*>(smem);
  for (int i = tid; i < M * D / 8; i += NT) {
    const int r = i / (D / 8), c = i - r * (D / 8);
    const int rg = rb * M + r;
    const int t = rg / group, hh = rg - t * group;
    const bool ok = t < sq;
    const unsigned short* src = ok ? q + (long long)(q0 + t) * q_stride_t + (long long)(g * group + hh) * q_stride_h + c * 8 : q;
    const int dst = FP8 ? r * D + c * 8 : atom::mma::swizzled<D>::off(r, c * 8);
    atom::copy16_async(qs + dst, src, ok);
  }
  atom::copy_commit();
  // slice(c, k): the slice (KPW keys: v = u * KPW + 0..KPW-1) of the warp's chunk c + k, from the
  // chunk being computed (k = 0) up to the one whose page ids load (k = NST + 1). Fixed ranges: the
  // warp's slices of its split are warp, warp + NW, ... Balanced (uq[k], shifted every chunk;
  // uq[NQ - 1] is lane 0's claim in flight): the first NQ - 1 are fixed (every warp of every split
  // of the group a different one, no claim on the start-up path), later ones are claimed a chunk
  // before their page ids load.
  constexpr int NQ = NST + 3;
  const int nsl = (vcount + KPW - 1) / KPW;
  const int per_round = dyn ? ns * NW : NW;
  int* const counter = sem != nullptr ? sem + 2 * ((long long)b * atom::gdim_x() + atom::bid_x()) : nullptr;
  const int claimed0 = (NQ - 1) * per_round;  // first slice handed out by the counter
  int uq[NQ];
  if constexpr (BALANCE) {
#pragma unroll
    for (int k = 0; k < NQ - 1; ++k) uq[k] = (dyn ? s * NW : 0) + warp + k * per_round;
    uq[NQ - 1] = dyn && lane == 0 ? (uq[NQ - 2] < nsl ? atom::atomic_add(counter, 1) : nsl) : 0;
  }
  auto slice = [&](int c, int k) -> int {
    if constexpr (BALANCE) return uq[k];
    else return (c + k) * NW + warp;
  };
  fetch(slice(0, 0));
#pragma unroll
  for (int c = 0; c < NST - 1; ++c) {
    lookup(slice(0, c));
    fetch(slice(0, c + 1));
    if (slice(0, c) < nsl) issue(c);
    atom::copy_commit();
  }
  lookup(slice(0, NST - 1));
  fetch(slice(0, NST));
  atom::copy_wait<NST - 1>();  // Q's group (the oldest) has landed
  atom::sync_block();
  op_t qa[KT];
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    if constexpr (FP8) {
      // f16(q * q_scale): the scale is folded in before the f16 rounding (keeps q in range).
#pragma unroll
      for (int k = 0; k < op_t::ne; ++k) {
        const int i0 = acc_t::get_i(2 * k), j0 = acc_t::get_j(2 * k);
        const int i1 = acc_t::get_i(2 * k + 1), j1 = acc_t::get_j(2 * k + 1);
        const float a = atom::to_f32(QT{}, qs[i0 * D + qdim(kt, j0)]) * q_scale;
        const float c = atom::to_f32(QT{}, qs[i1 * D + qdim(kt, j1)]) * q_scale;
        qa[kt].x[k] = atom::pack_f16x2(a, c);
      }
    } else {
      atom::mma::load_rows<D>(qa[kt], qs, 0, 16 * kt);
    }
  }
  acc_t o[KT];
#pragma unroll
  for (int T = 0; T < KT; ++T) atom::mma::zero(o[T]);
  float m[acc_t::row_slots], l[acc_t::row_slots];
#pragma unroll
  for (int sl = 0; sl < acc_t::row_slots; ++sl) {
    m[sl] = NEG_INF;
    l[sl] = 0.f;
  }
  float v_ref = 1.f, inv_v_ref = 1.f;  // per-page FP8: P columns carry v_descale / v_ref

  auto compute = [&](int c) {
    const char* stg = ring + (c % NST) * STAGE_BYTES;
    const char* ks = stg;
    const char* vs = stg + KPW * KEYB;
    const float* fac = reinterpret_cast<const float*>(stg + 2 * KPW * KEYB);
    // ---- S = Q K^T for the warp's KPW keys.
    acc_t sc[NKT];
#pragma unroll
    for (int n = 0; n < NKT; ++n) {
      atom::mma::zero(sc[n]);
      if constexpr (!FP8) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          op_t kf;
          atom::mma::load_rows<D>(kf, reinterpret_cast<const u16*>(ks), 16 * n, 16 * kt);
          mma<DT>(sc[n], qa[kt], kf);
        }
      } else if constexpr (PERM) {
#if ATOM_MMA_SYNC
        const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
        for (int h = 0; h < D / 64; ++h) {
          const u32x4 w0 = atom::load16(ks + kbyte(16 * n + gq, 64 * h + 16 * tq));
          const u32x4 w8 = atom::load16(ks + kbyte(16 * n + gq + 8, 64 * h + 16 * tq));
          const u32 a0[4] = {w0.x, w0.y, w0.z, w0.w};
          const u32 a8[4] = {w8.x, w8.y, w8.z, w8.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            op_t kf;
            kf.x[0] = fp8x2_to_f16x2(a0[i]);
            kf.x[2] = fp8x2_to_f16x2(a0[i] >> 16);
            kf.x[1] = fp8x2_to_f16x2(a8[i]);
            kf.x[3] = fp8x2_to_f16x2(a8[i] >> 16);
            mma<DT>(sc[n], qa[4 * h + i], kf);
          }
        }
#endif
      } else {
        // Generic FP8: element (i, j) of the operand is K[key 16n + i][dim 16kt + j].
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          op_t kf;
#pragma unroll
          for (int k = 0; k < op_t::ne; ++k) {
            const int i = acc_t::get_i(2 * k), j = acc_t::get_j(2 * k);
            const unsigned char* p = reinterpret_cast<const unsigned char*>(ks) + kbyte(16 * n + i, 16 * kt + j);
            kf.x[k] = fp8x2_to_f16x2((u32)p[0] | ((u32)p[1] << 8));
          }
          mma<DT>(sc[n], qa[kt], kf);
        }
      }
    }
    // ---- Scale, soft-cap, mask (only where some key of the warp's chunk may be hidden).
    const int vbase = slice(c, 0) * KPW;
    const bool all_visible = vbase >= n_sink && vbase + KPW <= vcount && key_of(vbase + KPW - 1) <= pos0 &&
                             (window <= 0 || key_of(vbase) > pos0 + sq - 1 - window);
#pragma unroll
    for (int n = 0; n < NKT; ++n) {
#pragma unroll
      for (int e = 0; e < acc_t::ne; ++e) {
        const int kc = 16 * n + acc_t::get_j(e);
        float x = sc[n].x[e] * s_scale;
        if (FP8 && per_page) x *= fac[kc];
        if (softcap_l2e > 0.f) x = softcap_l2e * atom::tanh_(x * inv_softcap);  // c * tanh(x / c), in log2 units
        if (!all_visible) {
          const int v = vbase + kc;
          const int j = key_of(v);
          const int qp = qpos[acc_t::row_slot(e)];
          const bool vis = v < vcount && j <= qp && (window <= 0 || j > qp - window || j < sink_tokens);
          x = vis ? x : NEG_INF;
        }
        sc[n].x[e] = x;
      }
    }
    // ---- Online softmax (row sums kept per lane, reduced once at the end).
    float alpha[acc_t::row_slots], mref[acc_t::row_slots];
    bool rescale = false;
#pragma unroll
    for (int sl = 0; sl < acc_t::row_slots; ++sl) {
      float mx = m[sl];
#pragma unroll
      for (int n = 0; n < NKT; ++n)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e)
          if (acc_t::row_slot(e) == sl) mx = atom::fmax_(mx, sc[n].x[e]);
      mx = acc_t::row_max(mx);
      mref[sl] = mx == NEG_INF ? 0.f : mx;
      alpha[sl] = atom::exp2_(m[sl] - mref[sl]);
      rescale |= mx != m[sl];
      m[sl] = mx;
      l[sl] *= alpha[sl];
    }
    if (atom::mma::warp_any(rescale)) {
#pragma unroll
      for (int T = 0; T < KT; ++T)
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) o[T].x[e] *= alpha[acc_t::row_slot(e)];
    }
#pragma unroll
    for (int n = 0; n < NKT; ++n) {
      op_t pa;
      {
        acc_t p;
#pragma unroll
        for (int e = 0; e < acc_t::ne; ++e) {
          const int sl = acc_t::row_slot(e);
          const float pe = atom::exp2_(sc[n].x[e] - mref[sl]);
          l[sl] += pe;
          p.x[e] = (FP8 && per_page) ? pe * (fac[KPW + 16 * n + acc_t::get_j(e)] * inv_v_ref) : pe;
        }
        atom::mma::to_operand<DT>(pa, p);
      }
      // ---- O += P V.
      if constexpr (!FP8) {
#pragma unroll
        for (int T = 0; T < KT; ++T) {
          op_t vf;
          atom::mma::load_cols<D>(vf, reinterpret_cast<const u16*>(vs), 16 * n, 16 * T);
          mma<DT>(o[T], pa, vf);
        }
      } else if constexpr (PERM) {
#if ATOM_MMA_SYNC
        const int gq = lane >> 2, tq = lane & 3;
        const int r0 = 16 * n + 2 * tq;
#pragma unroll
        for (int jb = 0; jb < D / 64; ++jb) {
          const int byte = 64 * jb + 8 * gq;
          const u32x2 A = atom::load8(vs + vbyte(r0, byte));
          const u32x2 B = atom::load8(vs + vbyte(r0 + 1, byte));
          const u32x2 C = atom::load8(vs + vbyte(r0 + 8, byte));
          const u32x2 E = atom::load8(vs + vbyte(r0 + 9, byte));
#pragma unroll
          for (int hw = 0; hw < 2; ++hw) {
            const u32 a = hw ? A.y : A.x, bb = hw ? B.y : B.x, cc = hw ? C.y : C.x, ee = hw ? E.y : E.x;
            // [a0 b0 a1 b1] and [a2 b2 a3 b3]: key pairs (2t, 2t+1) of dims 4hw + 0..3
            const u32 lo01 = __byte_perm(a, bb, 0x5140), hi01 = __byte_perm(a, bb, 0x7362);
            const u32 lo89 = __byte_perm(cc, ee, 0x5140), hi89 = __byte_perm(cc, ee, 0x7362);
            // n8 tiles jj = 4hw + 0..3 of this 64-dim block: O tiles T = 4 jb + 2 hw + {0, 1}
            op_t v0, v1;
            v0.x[0] = fp8x2_to_f16x2(lo01);        // jj = 4hw + 0, keys 2t, 2t+1
            v0.x[2] = fp8x2_to_f16x2(lo89);        //                keys 2t+8, 2t+9
            v0.x[1] = fp8x2_to_f16x2(lo01 >> 16);  // jj = 4hw + 1
            v0.x[3] = fp8x2_to_f16x2(lo89 >> 16);
            v1.x[0] = fp8x2_to_f16x2(hi01);        // jj = 4hw + 2
            v1.x[2] = fp8x2_to_f16x2(hi89);
            v1.x[1] = fp8x2_to_f16x2(hi01 >> 16);  // jj = 4hw + 3
            v1.x[3] = fp8x2_to_f16x2(hi89 >> 16);
            mma<DT>(o[4 * jb + 2 * hw], pa, v0);
            mma<DT>(o[4 * jb + 2 * hw + 1], pa, v1);
          }
        }
#endif
      } else {
        // Generic FP8: element (i, j) of the operand is V[key 16n + j][dim 16T + i].
        const unsigned char* vbp = reinterpret_cast<const unsigned char*>(vs);
#pragma unroll
        for (int T = 0; T < KT; ++T) {
          op_t vf;
#pragma unroll
          for (int k = 0; k < op_t::ne; ++k) {
            const int i = acc_t::get_i(2 * k), j = acc_t::get_j(2 * k);
            const u32 x0 = vbp[vbyte(16 * n + j, 16 * T + i)];
            const u32 x1 = vbp[vbyte(16 * n + j + 1, 16 * T + i)];
            vf.x[k] = fp8x2_to_f16x2(x0 | (x1 << 8));
          }
          mma<DT>(o[T], pa, vf);
        }
      }
    }
  };

  if (slice(0, 0) < nsl) {
    for (int c = 0; slice(c, 0) < nsl; ++c) {
      if (slice(c, NST - 1) < nsl) issue(c + NST - 1);
      atom::copy_commit();
      lookup(slice(c, NST));
      fetch(slice(c, NST + 1));
      atom::copy_wait<NST - 1>();
      atom::warp_sync();
      if (FP8 && per_page && c == 0) {
        // Reference for the P columns: the V factor of the warp's first key (if it has keys).
        const float f = reinterpret_cast<const float*>(ring + 2 * KPW * KEYB)[KPW];
        v_ref = f > 0.f ? f : 1.f;
        inv_v_ref = 1.f / v_ref;
      }
      compute(c);
      atom::warp_sync();
      if constexpr (BALANCE) {
        // Next chunk's slices; a claim is only made while the counter may still hold slices.
        const int next = dyn ? claimed0 + shfl_i(uq[NQ - 1], 0) : uq[NQ - 2] + per_round;
#pragma unroll
        for (int k = 0; k < NQ - 2; ++k) uq[k] = uq[k + 1];
        uq[NQ - 2] = next;
        if (dyn && lane == 0) uq[NQ - 1] = next < nsl ? atom::atomic_add(counter, 1) : nsl;
      }
    }
  }
  atom::copy_wait<0>();
  atom::sync_block();  // the ring becomes the merge buffer

  // ---- Merge the warps through shared memory, normalise, write the split's partials.
#pragma unroll
  for (int sl = 0; sl < acc_t::row_slots; ++sl) l[sl] = acc_t::row_sum(l[sl]);
  const float ofac = FP8 ? (per_page ? v_ref * v_fmt : v_factor * v_fmt) : 1.f;
  float* sm_o = reinterpret_cast<float*>(body);                     // [NW][M][MERGE_LD]
  float* sm_m = sm_o + NW * M * MERGE_LD;                           // [NW][M]
  float* sm_l = sm_m + NW * M;                                      // [NW][M]
  // Rows past the request's (padding of the 16-row tile) are neither stored nor merged.
  const int rows = imin(M, sq * group - rb * M);
#pragma unroll
  for (int T = 0; T < KT; ++T)
#pragma unroll
    for (int e = 0; e < acc_t::ne; ++e)
      if (acc_t::get_i(e) < rows)
        sm_o[(warp * M + acc_t::get_i(e)) * MERGE_LD + odim(T, acc_t::get_j(e))] = o[T].x[e] * ofac;
  if (acc_t::row_leader()) {
#pragma unroll
    for (int sl = 0; sl < acc_t::row_slots; ++sl) {
      sm_m[warp * M + acc_t::slot_row(sl)] = m[sl];
      sm_l[warp * M + acc_t::slot_row(sl)] = l[sl];
    }
  }
  atom::sync_block();
  for (int i = tid; i < rows * D; i += NT) {
    const int r = i / D;
    const int d = i - r * D;
    const int rg = rb * M + r;
    const int t = rg / group;
    const int hh = rg - t * group;
    float mx = NEG_INF;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) mx = atom::fmax_(mx, sm_m[ww * M + r]);
    const float mr = mx == NEG_INF ? 0.f : mx;
    float lsum = 0.f, ov = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) {
      const float a = atom::exp2_(sm_m[ww * M + r] - mr);
      lsum += sm_l[ww * M + r] * a;
      ov += sm_o[(ww * M + r) * MERGE_LD + d] * a;
    }
    const float o_val = lsum > 0.f ? ov / lsum : 0.f;
    const float lse = lsum > 0.f ? (mr + atom::log2_(lsum)) * 0.6931471805599453f : NEG_INF;
    const int h = g * group + hh;
    if (out != nullptr && ns == 1) {
      // One split: this is the answer (the combine's sink factor sigmoid(lse - sink) included).
      const float w = lsum > 0.f ? atom::sink_factor(lse, sinks, h) : 1.f;
      out[(long long)(q0 + t) * out_stride_t + (long long)h * out_stride_h + d] = atom::from_f32(QT{}, o_val * w);
      if (d == 0 && lse_out != nullptr) lse_out[(long long)(q0 + t) * num_q_heads + h] = lse;
    } else {
      const long long row = ((long long)s * total_q + (q0 + t)) * num_q_heads + h;
      o_partial[row * D + d] = o_val;
      if (d == 0) lse_partial[row] = lse;
    }
  }
  if (sem != nullptr && ns > 1) {
    // Completion count of the group (the splits of this kv head, row block and request): its last
    // CTA resets the counters for the next launch (CUDA graphs replay the same buffer; each lane
    // 0's slice claims are performed before its CTA is counted) and, with `out`, combines the
    // group's partials itself (docs/design.md's combine, sinks once), so no combine kernel follows.
    // The flag lives in the merge buffer (read by now): a static __shared__ variable cost 7% on
    // every shape, taken or not.
    int* last = reinterpret_cast<int*>(body);
    atom::fence_device();
    atom::sync_block();
    if (tid == 0) {
      *last = atom::atomic_add(counter + 1, 1) == ns - 1;
      if (*last) {
        counter[0] = 0;
        counter[1] = 0;
      }
    }
    atom::sync_block();
    if (*last && out != nullptr) {
      atom::fence_device();
      const long long split_rows = (long long)total_q * num_q_heads;
      for (int i = tid; i < rows * (D / 4); i += NT) {
        const int r = i / (D / 4);
        const int d = (i - r * (D / 4)) * 4;
        const int rg = rb * M + r;
        const int t = rg / group;
        const int h = g * group + (rg - t * group);
        const long long row = (long long)(q0 + t) * num_q_heads + h;
        float mx, lsum, acc[4];
        atom::combine_splits4<true, 8>(lse_partial + row, split_rows, o_partial + row * D + d, split_rows * D, 0, 1,
                                        ns, mx, lsum, acc);
        const float lse = atom::finish_combined4(mx, lsum, acc, sinks, h);
        unsigned short* o = out + (long long)(q0 + t) * out_stride_t + (long long)h * out_stride_h + d;
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = atom::from_f32(QT{}, acc[j]);
        if (d == 0 && lse_out != nullptr) lse_out[row] = lse;
      }
    }
  }
}
