// Split-KV decode over the paged KV cache (docs/design.md, "Split-KV (decode)").
//
// One CTA = (kv head g, row block rb) x request b x split s, grid (hk * row_blocks, batch, splits).
// A row is one (query token, query head of g) pair: every query head of a kv head and every
// speculative token of the request is served from the same read of each KV tile, up to ROWS rows
// per CTA (more rows => more row blocks, which re-read the tile mostly from L2).
//
// Memory layout of the work: each key is one contiguous head_dim vector of K (and of V) in its
// page. Each warp owns KPW keys of every chunk: its lanes copy them, 16 bytes per lane per copy,
// from the pages into the warp's own slice of an NST-deep shared-memory ring (asynchronous
// copies where the device layer has them), then read them back as key groups of L lanes, 8
// elements per lane. Copying and computing are warp-local: no block barrier in the loop. Every
// key group runs its own online softmax over its keys; groups are merged once at the end
// (shuffles within a warp, shared memory across warps).
//
// Pipelining: NST-1 chunks of copies are in flight while a chunk is computed, without holding
// registers; page ids are looked up one chunk ahead of the copies that need them.
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
constexpr int VEC = 8;                       // KV elements per lane per key (compute)
constexpr int CB = VEC * KV_BYTES;           // bytes per lane per key (compute)
constexpr int NWORDS = CB / 4;
constexpr int L = D / VEC;                   // lanes per key group
constexpr int WARP = ATOM_WARP_SIZE;
static_assert(D % VEC == 0 && L <= WARP && WARP % L == 0, "head_dim does not map onto a warp");
constexpr int GPW = WARP / L;                // key groups per warp
constexpr int NW = NUM_THREADS / WARP;
static_assert(NUM_THREADS % WARP == 0, "whole warps only");
// Keys per group per chunk (U) and ring depth (NST): registers hold q and the accumulator (16 x ROWS),
// UNROLL x ROWS scores; shared memory holds the copies in flight (measured: docs/perf/decode.md).
constexpr int U = ROWS == 8 ? 2 : (ROWS == 4 && KV_BYTES == 2) ? 3 : 4;
constexpr int NST = KV_BYTES == 1 ? (ROWS <= 2 ? 5 : 4) : (ROWS >= 4 ? 4 : 3);
static_assert(NST >= 2, "a ring needs two stages");
constexpr int KPW = GPW * U;                 // keys per warp per chunk
constexpr int CHUNK = NW * KPW;              // keys per CTA per chunk
constexpr int KEYB = D * KV_BYTES;           // bytes of one key of one head (K or V)
constexpr int CPK = KEYB / 16;               // 16-byte copies per key
constexpr int NCP = KPW * CPK / WARP;        // copies per lane per chunk, for K and for V each
static_assert(KPW * CPK % WARP == 0, "copies must spread evenly over the lanes");
constexpr bool KV_NEEDS_FACTOR = KV_DTYPE != 0;
constexpr bool FP8 = KV_BYTES == 1;
// Shared memory: per warp and stage, K then V of KPW keys, then (FP8) their K and V factors.
constexpr int STAGE_BYTES = 2 * KPW * KEYB + (FP8 ? 2 * KPW * 4 : 0);
constexpr int RING_BYTES = NW * NST * STAGE_BYTES;
constexpr int MERGE_BYTES = NW * ROWS * (D + 2) * 4;
constexpr int SMEM_BYTES = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory limit");
static_assert(ROWS * VEC <= 64, "q and the accumulator would not fit in registers: use row blocks");

ATOM_DEV unsigned int word(const atom::u32x4& v, int i) {  // i is a constant after unrolling
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One lane's slice of one key, as read back from shared memory.
struct alignas(CB) KVec {
  unsigned int w[NWORDS];
};

// Decode NWORDS packed words into VEC floats, scaled by the format's power of two (see header).
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

// ---- Global -> shared copies. Belong in atom_device.h (asked for); kept here until it has them.
// NVIDIA: cp.async (sm_80+), completion tracked per thread in commit groups; a false predicate
// zero-fills without reading. Elsewhere: a plain load and store (correct, not overlapped).
#if ATOM_NVIDIA
ATOM_DEV void copy16_async(void* dst, const void* src, bool pred) {
  const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(pred ? 16 : 0));
}
ATOM_DEV void copy4_async(void* dst, const void* src, bool pred) {
  const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(pred ? 4 : 0));
}
ATOM_DEV void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
ATOM_DEV void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
ATOM_DEV void warp_sync() { __syncwarp(); }
#else
ATOM_DEV void copy16_async(void* dst, const void* src, bool pred) {
  *reinterpret_cast<atom::u32x4*>(dst) = pred ? atom::load16(src) : atom::u32x4{0u, 0u, 0u, 0u};
}
ATOM_DEV void copy4_async(void* dst, const void* src, bool pred) {
  *reinterpret_cast<float*>(dst) = pred ? *reinterpret_cast<const float*>(src) : 0.f;
}
ATOM_DEV void copy_commit() {}
template <int N>
ATOM_DEV void copy_wait() {}
ATOM_DEV void warp_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#endif

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
    float q_scale, float softcap_l2e, float inv_softcap, int window, int sink_tokens, int min_split_keys,
    int fill_splits, int long_split_keys, int split_ctas, int split_slots, int wave_fill) {
  using namespace atom_decode;
  const float NEG_INF = atom::neg_inf();
  const int g = (int)atom::bid_x() / row_blocks;
  const int rb = (int)atom::bid_x() - g * row_blocks;
  const int b = (int)atom::bid_y();
  const int s = (int)atom::bid_z();
  const int tid = (int)atom::tid_x();
  const int lane = tid % WARP;
  const int warp = tid / WARP;
  const int li = lane % L;                  // lane within the key group: which 8 elements
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
  const int main_len = sk > lo ? sk - lo : 0;
  // Splits of this request: ranges over ns = atom::request_splits (decode_mma.hip); splits ns..
  // get empty ranges (an early return here costs the FP8 variants spills).
  const int ns = atom::request_splits(main_len, num_splits, min_split_keys, fill_splits, long_split_keys,
                                       split_ctas, split_slots, wave_fill);
  const int n_sink = (window > 0 && s == 0) ? imin(sink_tokens, lo) : 0;
  const int per = (main_len + ns - 1) / ns;
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
  const char* kb = k_cache + (long long)g * k_head_bytes;
  const char* vb = v_cache + (long long)g * v_head_bytes;
  const int* table = kv_indptr != nullptr ? kv_indices + ip0 : block_table + (long long)b * bt_stride;

  __shared__ alignas(16) char smem[SMEM_BYTES];
  char* ring = smem + warp * NST * STAGE_BYTES;

  auto key_of = [&](int v) { return v < n_sink ? v : st + (v - n_sink); };

  // Copies of this lane: copy t of a chunk moves bytes (i % CPK) * 16 of the warp's key i / CPK,
  // with i = lane + WARP * t. Page ids are clamped into the pool; keys past the split zero-fill.
  int pid[NCP], slot[NCP];
  auto lookup = [&](int c) {
#pragma unroll
    for (int t = 0; t < NCP; ++t) {
      const int v = c * CHUNK + warp * KPW + (lane + WARP * t) / CPK;
      pid[t] = -1;
      slot[t] = 0;
      if (v < vcount) {
        const int j = key_of(v);
        const int lp = (int)div_magic((unsigned int)j, bs_magic, bs_shift);
        pid[t] = imin(imax(table[lp], 0), num_blocks - 1);
        slot[t] = j - lp * block_size;
      }
    }
  };
  auto issue = [&](int c) {
    char* stg = ring + (c % NST) * STAGE_BYTES;
#pragma unroll
    for (int t = 0; t < NCP; ++t) {
      const int i = lane + WARP * t;
      const int k = i / CPK, part = (i % CPK) * 16;
      const bool ok = pid[t] >= 0;
      const long long pk = ok ? (long long)pid[t] * k_page_bytes + (long long)slot[t] * k_tok_bytes : 0;
      const long long pv = ok ? (long long)pid[t] * v_page_bytes + (long long)slot[t] * v_tok_bytes : 0;
      copy16_async(stg + k * KEYB + part, kb + pk + part, ok);
      copy16_async(stg + KPW * KEYB + k * KEYB + part, vb + pv + part, ok);
      if (FP8 && part == 0) {
        // The page's factors, copied by the lane that copies the key's first 16 bytes.
        float* fac = reinterpret_cast<float*>(stg + 2 * KPW * KEYB);
        const long long di = ok ? (long long)pid[t] * num_kv_heads + g : 0;
        if (per_page) {
          copy4_async(fac + k, k_descale + di, ok);
          copy4_async(fac + KPW + k, v_descale + di, ok);
        }
      }
    }
  };

  auto compute = [&](int c) {
    const char* stg = ring + (c % NST) * STAGE_BYTES;
    const float* fac = reinterpret_cast<const float*>(stg + 2 * KPW * KEYB);
    float sc[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = u * GPW + lane / L;
      float kf[VEC];
      decode_kv(*reinterpret_cast<const KVec*>(stg + k * KEYB + li * CB), kf);
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
    float vfac[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = u * GPW + lane / L;
      float kfac = k_factor;
      vfac[u] = v_factor;
      if (FP8 && per_page) {
        kfac = fac[k] * fmt_factor;
        vfac[u] = fac[KPW + k] * fmt_factor;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float x = sc[u][r];
        if (KV_NEEDS_FACTOR) x *= kfac;
        if (softcap_l2e > 0.f) x = softcap_l2e * atom::tanh_(x * inv_softcap);  // c * tanh(x / c), in log2 units
        sc[u][r] = x;
      }
    }
    // Masks only where some key of the warp's chunk may be hidden from some row (warp-uniform):
    // the tail of the split, the sinks, the newest keys (causal among the new tokens), the window.
    const int vbase = c * CHUNK + warp * KPW;
    const bool all_visible = vbase >= n_sink && vbase + KPW <= vcount && key_of(vbase + KPW - 1) <= pos0 &&
                             (window <= 0 || key_of(vbase) > pos0 + sq - 1 - window);
    if (!all_visible) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = vbase + u * GPW + lane / L;
        const int j = key_of(v);
        const bool kvalid = v < vcount;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const int qp = qpos[r];
          const bool vis = kvalid && j <= qp && (window <= 0 || j > qp - window || j < sink_tokens);
          sc[u][r] = vis ? sc[u][r] : NEG_INF;
        }
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
        w[u][r] = KV_NEEDS_FACTOR ? p * vfac[u] : p;
      }
      l[r] = ls;
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = u * GPW + lane / L;
      float vf[VEC];
      decode_kv(*reinterpret_cast<const KVec*>(stg + KPW * KEYB + k * KEYB + li * CB), vf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] = w[u][r] * vf[e] + acc[r][e];
    }
  };

  // Every warp runs the same number of chunks (copies of keys past the split zero-fill), so the
  // commit-group counting below is uniform.
  const int nchunks = (vcount + CHUNK - 1) / CHUNK;
  if (nchunks > 0) {
#pragma unroll
    for (int c = 0; c < NST - 1; ++c) {
      if (c < nchunks) {
        lookup(c);
        issue(c);
      }
      copy_commit();
    }
    lookup(NST - 1);
    for (int c = 0; c < nchunks; ++c) {
      if (c + NST - 1 < nchunks) issue(c + NST - 1);  // refills the stage computed last iteration
      copy_commit();
      lookup(c + NST);
      copy_wait<NST - 1>();  // this lane's copies of chunk c have landed
      warp_sync();           // ... and every lane's
      compute(c);
      warp_sync();           // nobody reads stage c % NST when it is refilled next iteration
    }
  }
  copy_wait<0>();
  atom::sync_block();  // the ring becomes the merge buffer

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
  float (*sm_acc)[ROWS][D] = reinterpret_cast<float (*)[ROWS][D]>(smem);
  float (*sm_m)[ROWS] = reinterpret_cast<float (*)[ROWS]>(smem + NW * ROWS * D * 4);
  float (*sm_l)[ROWS] = reinterpret_cast<float (*)[ROWS]>(smem + NW * ROWS * (D + 1) * 4);
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
