// Pieces every varlen prefill body shares (varlen_prefill.hip, varlen_prefill_hopper.hip): which
// KV tiles a block of query rows visits and which elements of a tile are visible (docs/design.md).
// Bodies differ in how they move and multiply tiles, never in these rules.
#pragma once

#include "atom_device.h"

namespace atom_prefill {

using namespace atom;

ATOM_DEV int imin(int a, int b) { return a < b ? a : b; }
ATOM_DEV int imax(int a, int b) { return a > b ? a : b; }

// The KV tiles (of BN keys) that query rows [m0, m0 + rows) of a request with sq queries and sk
// keys can see: the StreamingLLM sink-token tiles first, then the causal / window band. Work is
// proportional to visible pairs: fully masked tiles are never visited.
struct kv_walk {
  int n_sink, first, n_iter;
  int last;  // one past the last tile: rows that end earlier drop a suffix of the walk
  ATOM_DEV kv_walk(int sq, int sk, int m0, int rows, int bn, bool causal, int window, int sink_tokens) {
    const int off = sk - sq;  // query row i sits at key position off + i
    const int p_first = off + m0, p_last = off + imin(m0 + rows, sq) - 1;
    const int hi_key = causal ? imin(sk, p_last + 1) : sk;
    const int lo_key = window > 0 ? imax(0, p_first - window + 1) : 0;
    last = 0;
    n_sink = first = 0;
    if (hi_key > 0) {
      last = (hi_key + bn - 1) / bn;
      n_sink = (window > 0 && sink_tokens > 0) ? imin((sink_tokens + bn - 1) / bn, last) : 0;
      first = imax(n_sink, lo_key / bn);
    }
    n_iter = n_sink + imax(0, last - first);
  }
  ATOM_DEV int tile(int it) const { return it < n_sink ? it : first + (it - n_sink); }
};

// Key j is visible from the query at position p (docs/design.md "Visibility").
ATOM_DEV bool visible(int j, int p, int sk, bool causal, int window, int sink_tokens) {
  return j < sk && (!causal || j <= p) && (window <= 0 || j > p - window || j < sink_tokens);
}
// visible() for one query row over a tile's keys jb + c, c a constant of the fragment layout: c < hi,
// and with a window (kWindow) c >= lo or c < sinks (a window past sk is none: clamped, so that lo
// cannot overflow for a window near 2^31). One compare per element (three with a window),
// the row's limits in registers: on sm_90a visible() per element took ~10 instructions and reloaded
// the window, which made the diagonal tiles of the FP8 kernel much dearer than the others. (The
// portable body keeps visible(): gfx942 hoists these compares' lane masks and spills SGPRs.)
struct row_limits {
  int hi, lo, sinks;
  ATOM_DEV row_limits() {}
  ATOM_DEV row_limits(int jb, int p, int sk, bool causal, int window, int sink_tokens)
      : hi((causal ? imin(sk, p + 1) : sk) - jb), lo(p - imin(window, sk) + 1 - jb), sinks(sink_tokens - jb) {}
  template <bool kWindow>
  ATOM_DEV bool visible(int c) const { return (c < hi) & (!kWindow | (c >= lo) | (c < sinks)); }
};
// S = -inf where a key of the fragments s (16 columns each, from the lane's first key) is not
// visible from the lane's rows (lim per row slot).
template <bool kWindow, class Acc, int N>
ATOM_DEV void mask_cols(Acc (&s)[N], const row_limits (&lim)[Acc::row_slots]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < Acc::ne; ++e)
      if (!lim[Acc::row_slot(e)].template visible<kWindow>(nt * 16 + Acc::get_j(e) - Acc::get_j(0))) s[nt].x[e] = neg_inf();
}
// The same on f16 pairs of the fragments (an f16 accumulator: pair i holds elements 2 (i % (ne / 2))
// and the next of tile i / (ne / 2)): f16 -inf (0xfc00) where not visible.
template <bool kWindow, class Acc, int N>
ATOM_DEV void mask_cols(u32 (&s)[N], const row_limits (&lim)[Acc::row_slots]) {
  constexpr int P = Acc::ne / 2;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = 2 * (i % P), c = (i / P) * 16 + Acc::get_j(e) - Acc::get_j(0);
    const row_limits& l = lim[Acc::row_slot(e)];
    const u32 m = (l.template visible<kWindow>(c) ? 0xffffu : 0u) | (l.template visible<kWindow>(c + 1) ? 0xffff0000u : 0u);
    s[i] = (s[i] & m) | (0xfc00fc00u & ~m);
  }
}
// Either for the tile from key j0, the lane's rows at key positions pos[row slot].
template <class Acc, class Frag>
ATOM_DEV void mask_cols(Frag& s, int j0, const int (&pos)[Acc::row_slots], int sk, bool causal, int window,
                        int sink_tokens) {
  row_limits lim[Acc::row_slots];
#pragma unroll
  for (int r = 0; r < Acc::row_slots; ++r) lim[r] = row_limits(j0 + Acc::get_j(0), pos[r], sk, causal, window, sink_tokens);
  if (window > 0) mask_cols<true, Acc>(s, lim);
  else mask_cols<false, Acc>(s, lim);
}
// Some key of [j0, j1) is masked for some query of positions [p_first, p_last].
ATOM_DEV bool tile_needs_mask(int j0, int j1, int p_first, int p_last, int sk, bool causal, int window,
                              int sink_tokens) {
  return j1 > sk || (causal && j1 - 1 > p_first) || (window > 0 && j0 <= p_last - window && j1 > sink_tokens);
}

// fma: NVRTC has no __builtin_fmaf.
#if ATOM_NVIDIA
ATOM_DEV float fma_(float a, float b, float c) { return fmaf(a, b, c); }
#else
ATOM_DEV float fma_(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#endif

}  // namespace atom_prefill
