// Split-KV decode over the paged KV cache (DESIGN.md, "Split-KV (decode)").
//
// One CTA = (kv head g, row block rb) x request b x split s, grid (hk * row_blocks, batch, splits).
// A row is one (query token, query head of g) pair: every query head of a kv head and every
// speculative token of the request is served from the same read of each KV tile, up to ROWS rows
// per CTA (more rows => more row blocks, which re-read the tile mostly from L2).
//
// Memory layout of the work: each key is one contiguous head_dim vector of K (and of V) in its
// page, so a key is read by L lanes with one 16-byte load each (a "key group"). Every key group
// runs its own online softmax over the keys it owns; groups are merged once at the end (shuffles
// within a warp, shared memory across warps). Nothing is exchanged between groups in the loop.
//
// Pipelining: page ids are looked up one chunk ahead of the KV loads, and the KV loads of chunk
// c+1 are in flight while chunk c is computed (two register stages, ping-pong).
//
// KV decode without conversion instructions: bf16 is the top half of an fp32; fp16 and fp8 are
// moved into the fp32 exponent/mantissa fields by integer shifts, which yields the value times a
// power of two (2^-112 for fp16, 2^-120 for e4m3fn, 2^-119 for e4m3fnuz). That power of two is
// folded into the per-key K factor (applied to the dot product) and V factor (applied to p), so
// the inner loops are integer ALU + FMA only. Requires denormals kept (no flush-to-zero).
//
// Defines: HEAD_DIM (64|128|256), ROWS (1|2|4|8), Q_DTYPE (0 bf16, 1 fp16),
//          KV_DTYPE (0 bf16, 1 fp16, 2 fp8 e4m3fn, 3 fp8 e4m3fnuz), NUM_THREADS (128).

#include "atom_device.h"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef ROWS
#define ROWS 4
#endif
#ifndef Q_DTYPE
#define Q_DTYPE 0
#endif
#ifndef KV_DTYPE
#define KV_DTYPE 0
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif

namespace atom_decode {

constexpr int D = HEAD_DIM;
constexpr int KV_BYTES = KV_DTYPE >= 2 ? 1 : 2;
// Bytes of one key each lane loads: 16 (default); 8 halves q/accumulator registers for FP8.
#ifndef KV_LOAD_BYTES
#define KV_LOAD_BYTES 16
#endif
constexpr int LOAD_BYTES = KV_LOAD_BYTES;
static_assert(LOAD_BYTES == 16 || LOAD_BYTES == 8, "KV_LOAD_BYTES is 16 or 8");
constexpr int NWORDS = LOAD_BYTES / 4;
constexpr int VEC = LOAD_BYTES / KV_BYTES;  // KV elements per lane per load
static_assert(VEC % 8 == 0, "q is loaded 8 elements (16 bytes) at a time: 8-byte loads are for FP8 only");
constexpr int L = D / VEC;          // lanes per key
constexpr int WARP = ATOM_WARP_SIZE;
static_assert(D % VEC == 0 && L <= WARP && WARP % L == 0, "head_dim does not map onto a warp");
constexpr int GPW = WARP / L;  // key groups per warp
constexpr int NW = NUM_THREADS / WARP;
static_assert(NUM_THREADS % WARP == 0, "whole warps only");
constexpr int NG = NW * GPW;                   // key groups per CTA
// Keys per group per chunk: as many loads in flight as the registers allow without spilling.
#ifdef UNROLL
constexpr int U = UNROLL;
#else
constexpr int U = (KV_BYTES == 2 && ROWS == 8) ? 1 : (ROWS * VEC >= 64 ? 2 : 4);
#endif
static_assert(ROWS * VEC <= 64, "q and the accumulator would not fit in registers: use row blocks");
constexpr int CHUNK = NG * U;                  // keys per CTA per chunk
constexpr bool KV_NEEDS_FACTOR = KV_DTYPE != 0;


ATOM_DEV unsigned int word(const atom::u32x4& v, int i) {  // i is a constant after unrolling
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One lane's slice of one key: a single 16- (or 8-) byte vector load.
struct alignas(LOAD_BYTES) KVec {
  unsigned int w[NWORDS];
};
ATOM_DEV KVec load_kv(const char* p) { return *reinterpret_cast<const KVec*>(p); }

// Decode 4 packed words into VEC floats, scaled by the format's power of two (see header).
ATOM_DEV void decode_kv(const KVec& x, float (&f)[VEC]) {
#pragma unroll
  for (int i = 0; i < NWORDS; ++i) {
    const unsigned int w = x.w[i];
    if constexpr (KV_DTYPE == 0) {
      f[2 * i] = atom::u32_as_f32(w << 16);
      f[2 * i + 1] = atom::u32_as_f32(w & 0xffff0000u);
    } else if constexpr (KV_DTYPE == 1) {
      f[2 * i] = atom::u32_as_f32(((w & 0x7fffu) << 13) | ((w & 0x8000u) << 16));
      f[2 * i + 1] = atom::u32_as_f32(((w >> 3) & 0x0fffe000u) | (w & 0x80000000u));
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int t = (int)(w << (24 - 8 * b));
        f[4 * i + b] = atom::u32_as_f32((unsigned int)(t >> 4) & 0x87f00000u);
      }
    }
  }
}

// fp32 value of a 16-bit query element (exact).
ATOM_DEV float q_to_float(unsigned short h) {
  const unsigned int w = h;
  if constexpr (Q_DTYPE == 0) {
    return atom::u32_as_f32(w << 16);
  } else {
    return atom::u32_as_f32(((w & 0x7fffu) << 13) | ((w & 0x8000u) << 16)) * 0x1p112f;
  }
}

ATOM_DEV int imin(int a, int b) { return a < b ? a : b; }
ATOM_DEV int imax(int a, int b) { return a > b ? a : b; }

ATOM_DEV unsigned int div_magic(unsigned int n, unsigned int magic, int shift) {
  // n / d for n < 2^31: (umulhi(n, magic) + n) >> shift (host computes magic and shift).
  const unsigned int hi = (unsigned int)(((unsigned long long)n * magic) >> 32);
  return (hi + n) >> shift;
}

}  // namespace atom_decode

extern "C" __global__ void ATOM_LAUNCH_BOUNDS(NUM_THREADS) splitkv_decode(
    const unsigned short* __restrict__ q, long long q_stride_t, long long q_stride_h,
    const char* __restrict__ k_cache, const char* __restrict__ v_cache,
    long long k_page_bytes, long long k_tok_bytes, long long k_head_bytes,
    long long v_page_bytes, long long v_tok_bytes, long long v_head_bytes, int num_blocks,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ seq_lens,
    const int* __restrict__ block_table, long long bt_stride, int bt_width,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
    const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    float k_factor, float v_factor, float fmt_factor,
    float* __restrict__ o_partial, float* __restrict__ lse_partial, int total_q, int num_q_heads,
    int num_kv_heads, int group, int row_blocks, int num_splits, int block_size, unsigned int bs_magic, int bs_shift,
    float q_scale, float softcap_l2e, float inv_softcap, int window, int sink_tokens) {
  using namespace atom_decode;
  const float NEG_INF = atom::neg_inf();
  const int g = (int)atom::bid_x() / row_blocks;
  const int rb = (int)atom::bid_x() - g * row_blocks;
  const int b = (int)atom::bid_y();
  const int s = (int)atom::bid_z();
  const int tid = (int)atom::tid_x();
  const int lane = tid % WARP;
  const int warp = tid / WARP;
  const int li = lane % L;                  // lane within the key group: which 16 bytes of the key
  const int gid = warp * GPW + lane / L;    // key group id within the CTA

  const int q0 = cu_seqlens_q[b];
  const int sq = cu_seqlens_q[b + 1] - q0;
  if (sq <= 0) return;  // nothing to write: the request has no query row

  // Keys beyond the pages the table holds are ignored (never read), whatever seq_lens says.
  int sk = seq_lens[b];
  int ip0 = 0;
  int avail;
  if (kv_indptr != nullptr) {
    ip0 = kv_indptr[b];
    avail = kv_indptr[b + 1] - ip0;
  } else {
    avail = bt_width;
  }
  {
    const long long cap = (long long)(avail > 0 ? avail : 0) * block_size;
    sk = sk < 0 ? 0 : (sk > cap ? (int)cap : sk);
  }
  const int pos0 = sk - sq;  // absolute position of the first query token (bottom-right)

  // Visible keys of the whole request: [lo, sk) plus the StreamingLLM sinks [0, n_sink).
  // Only [lo, sk) is split; split 0 also takes the sinks.
  const int lo = window > 0 ? imax(0, pos0 - window + 1) : 0;
  const int n_sink = (window > 0 && s == 0) ? imin(sink_tokens, lo) : 0;
  const int main_len = sk > lo ? sk - lo : 0;
  const int per = (main_len + num_splits - 1) / num_splits;
  const int st = imin(lo + s * per, sk > lo ? sk : lo);
  const int en = imin(st + per, sk > lo ? sk : lo);
  const int vcount = n_sink + (en - st);  // keys of this split, sinks first

  // Query rows of this CTA: row r -> token t, head g * group + hh.
  float qr[ROWS][VEC];
  int qpos[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int rg = rb * ROWS + r;
    const int t = rg / group;
    const int hh = rg - t * group;
    const bool ok = t < sq && hh < group;
    qpos[r] = ok ? pos0 + t : -1;  // -1: sees no key
    if (ok) {
      const unsigned short* qp = q + (long long)(q0 + t) * q_stride_t + (long long)(g * group + hh) * q_stride_h + li * VEC;
#pragma unroll
      for (int c = 0; c < VEC / 8; ++c) {
        const atom::u32x4 x = atom::load16(reinterpret_cast<const char*>(qp + 8 * c));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          qr[r][8 * c + 2 * i] = q_to_float((unsigned short)(word(x, i) & 0xffffu)) * q_scale;
          qr[r][8 * c + 2 * i + 1] = q_to_float((unsigned short)(word(x, i) >> 16)) * q_scale;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) qr[r][e] = 0.f;
    }
  }

  float m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.f;
  }

  const bool per_page = k_descale != nullptr;
  const char* kb = k_cache + (long long)g * k_head_bytes + li * LOAD_BYTES;
  const char* vb = v_cache + (long long)g * v_head_bytes + li * LOAD_BYTES;
  const int* table = kv_indptr != nullptr ? kv_indices + ip0 : block_table + (long long)b * bt_stride;

  auto key_of = [&](int v) { return v < n_sink ? v : st + (v - n_sink); };

  // Page id and slot of this group's keys of chunk c (page ids clamped into the pool).
  auto lookup = [&](int c, int (&pid)[U], int (&slot)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = c * CHUNK + u * NG + gid;
      pid[u] = 0;
      slot[u] = 0;
      if (v < vcount) {
        const int j = key_of(v);
        const int lp = (int)div_magic((unsigned int)j, bs_magic, bs_shift);
        const int p = table[lp];
        pid[u] = imin(imax(p, 0), num_blocks - 1);
        slot[u] = j - lp * block_size;
      }
    }
  };

  struct Stage {
    KVec k[U], v[U];
    float kf[U], vf[U];
  };

  auto load = [&](int c, const int (&pid)[U], const int (&slot)[U], Stage& S) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = c * CHUNK + u * NG + gid;
      S.kf[u] = k_factor;
      S.vf[u] = v_factor;
      if (v < vcount) {
        S.k[u] = load_kv(kb + (long long)pid[u] * k_page_bytes + (long long)slot[u] * k_tok_bytes);
        S.v[u] = load_kv(vb + (long long)pid[u] * v_page_bytes + (long long)slot[u] * v_tok_bytes);
        if (KV_NEEDS_FACTOR && per_page) {
          const long long di = (long long)pid[u] * num_kv_heads + g;
          S.kf[u] = k_descale[di] * fmt_factor;
          S.vf[u] = v_descale[di] * fmt_factor;
        }
      } else {
        // Zeros, not stale registers: p = 0 times a NaN would poison the accumulator.
#pragma unroll
        for (int i = 0; i < NWORDS; ++i) S.k[u].w[i] = S.v[u].w[i] = 0u;
      }
    }
  };

  auto compute = [&](int c, const Stage& S) {
    float sc[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      decode_kv(S.k[u], kf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float d0 = 0.f, d1 = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
          d0 += qr[r][e] * kf[e];
          d1 += qr[r][e + 1] * kf[e + 1];
        }
        sc[u][r] = d0 + d1;
      }
    }
    // Sum the partial dot products over the L lanes of the key group.
#pragma unroll
    for (int off = 1; off < L; off <<= 1) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) sc[u][r] += atom::shfl_xor(sc[u][r], off);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = c * CHUNK + u * NG + gid;
      const int j = key_of(v);
      const bool kvalid = v < vcount;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float x = sc[u][r];
        if (KV_NEEDS_FACTOR) x *= S.kf[u];
        if (softcap_l2e > 0.f) {
          // c * tanh(x / c), in log2 units; tanh(y) = 1 - 2 / (exp(2y) + 1) saturates cleanly.
          const float e2 = atom::exp2_(x * inv_softcap * 2.8853900817779268f);
          x = softcap_l2e * (1.f - 2.f / (e2 + 1.f));
        }
        const int qp = qpos[r];
        const bool vis = kvalid && j <= qp && (window <= 0 || j > qp - window || j < sink_tokens);
        sc[u][r] = vis ? x : NEG_INF;
      }
    }
    float w[U][ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = atom::fmax_(mx, sc[u][r]);
      const float mref = mx == NEG_INF ? 0.f : mx;  // all masked so far: keep exp2 away from NaN
      const float alpha = atom::exp2_(m[r] - mref);
      float ls = l[r] * alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = atom::exp2_(sc[u][r] - mref);
        ls += p;
        w[u][r] = KV_NEEDS_FACTOR ? p * S.vf[u] : p;
      }
      l[r] = ls;
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[VEC];
      decode_kv(S.v[u], vf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] = w[u][r] * vf[e] + acc[r][e];
    }
  };

  const int nchunks = (vcount + CHUNK - 1) / CHUNK;
  if (nchunks > 0) {
    int pid[U], slot[U];
    Stage A, B;
    lookup(0, pid, slot);
    load(0, pid, slot, A);
    lookup(1, pid, slot);
    for (int c = 0; c < nchunks; c += 2) {
      const bool more = c + 1 < nchunks;
      if (more) load(c + 1, pid, slot, B);
      lookup(c + 2, pid, slot);
      compute(c, A);
      if (!more) break;
      if (c + 2 < nchunks) load(c + 2, pid, slot, A);
      lookup(c + 3, pid, slot);
      compute(c + 1, B);
    }
  }

  // Merge the key groups of a warp (lanes L apart hold the same slice of head_dim).
#pragma unroll
  for (int off = L; off < WARP; off <<= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float mo = atom::shfl_xor(m[r], off);
      const float lo_ = atom::shfl_xor(l[r], off);
      const float mx = atom::fmax_(m[r], mo);
      const float mref = mx == NEG_INF ? 0.f : mx;
      const float a = atom::exp2_(m[r] - mref), bb = atom::exp2_(mo - mref);
      l[r] = l[r] * a + lo_ * bb;
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float ao = atom::shfl_xor(acc[r][e], off);
        acc[r][e] = acc[r][e] * a + ao * bb;
      }
    }
  }

  // Merge across warps through shared memory, normalise and write the split's partials.
  __shared__ float sm_acc[NW][ROWS][D];
  __shared__ float sm_m[NW][ROWS], sm_l[NW][ROWS];
  if (lane < L) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) sm_acc[warp][r][li * VEC + e] = acc[r][e];
      if (li == 0) {
        sm_m[warp][r] = m[r];
        sm_l[warp][r] = l[r];
      }
    }
  }
  atom::sync_block();
  for (int i = tid; i < ROWS * D; i += NUM_THREADS) {
    const int r = i / D;
    const int d = i - r * D;
    const int rg = rb * ROWS + r;
    const int t = rg / group;
    const int hh = rg - t * group;
    if (t >= sq || hh >= group) continue;
    float mx = NEG_INF;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) mx = atom::fmax_(mx, sm_m[ww][r]);
    const float mref = mx == NEG_INF ? 0.f : mx;
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) {
      const float a = atom::exp2_(sm_m[ww][r] - mref);
      lsum += sm_l[ww][r] * a;
      o += sm_acc[ww][r][d] * a;
    }
    const long long row = ((long long)s * total_q + (q0 + t)) * num_q_heads + g * group + hh;
    o_partial[row * D + d] = lsum > 0.f ? o / lsum : 0.f;
    if (d == 0) lse_partial[row] = lsum > 0.f ? (mref + atom::log2_(lsum)) * 0.6931471805599453f : NEG_INF;
  }
}
