// The Hopper kernel's scheduler: what a work unit is, which unit a claimed index is, the ring that
// hands units to the copier and the consumers, and the thread that claims them.
#pragma once

#include "hopper_config.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
// A work unit: a work item (request b, q tile t of BM tokens) and a query head h; or, packing
// GQA (G = q_per_kv query heads share a KV head), the item's sub-tile of BM / G tokens for all G
// heads of KV head g: tile row r is token r / G, head h0 + r % G. Either way an item has hq
// units (sub-tiles with more keys first), adjacent so that they share K/V in L2.
struct unit {
  int h0, g, q0, sq, k0, sk, m0, rows;  // first query head, KV head, request bounds, first token, tokens
  bool live;
};
constexpr int UNIT_INTS = 8;  // a unit as the producer hands it to the consumers (sq < 0: no more)
constexpr int USLOTS = 2;  // units claimed ahead of the consumers
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

// The problem's sizes as the scheduler and the walks see them (the kernel's arguments).
struct problem {
  int hq, batch, q_per_kv, max_tiles;
  bool causal;
  int W, S, G;  // window, sink tokens, query heads packed per tile
  int total;    // units: work items x hq (the host keeps it below 2^31)
};

// Units reach the copier and the consumers through a ring of USLOTS (full / empty mbarriers, the
// slots of UNIT_INTS ints): the n-th unit of this CTA sits in slot n % USLOTS. sq < 0 marks the end.
struct unit_ring {
  u64* full;
  u64* empty;
  int* slots;

  ATOM_DEV unit take(int n) const {
    const int s = n % USLOTS;
    wg::mbar_wait(full + s, (n / USLOTS) & 1);
    const int* d = slots + s * UNIT_INTS;
    unit u;
    u.h0 = d[0]; u.g = d[1]; u.q0 = d[2]; u.sq = d[3]; u.k0 = d[4]; u.sk = d[5]; u.m0 = d[6]; u.rows = d[7];
    u.live = u.sq >= 0;
    return u;
  }
  ATOM_DEV void release(int n) const { wg::mbar_arrive(empty + n % USLOTS); }
};

// Tile scheduler (one thread of the producer warpgroup): unit blockIdx.x, then one unit at a time from a
// global counter (sched), or w += gridDim.x without one. A unit is claimed only once its slot of the
// ring is free, so a CTA is committed to at most USLOTS units past the one it runs and the dynamic
// schedule stays longest first: with more claimed ahead (8), the CTAs that claimed where a request's
// long tiles start queued several of them, and 7% of the 4 x 4k time was idle SMs at the end.
ATOM_DEV void schedule_units(const unit_ring& ring, i32* __restrict__ sched, const problem& pb,
                             const i32* __restrict__ work, const i32* __restrict__ cu_q, const i32* __restrict__ cu_k,
                             const i32* __restrict__ cu_kp) {
  int un = 0;
  for (int w = -1;;) {
    const int s = un % USLOTS;
    wg::mbar_wait(ring.empty + s, ((un / USLOTS) & 1) ^ 1);
    w = w < 0 ? (int)bid_x() : sched != nullptr ? (int)gdim_x() + atomicAdd(sched, 1) : w + (int)gdim_x();
    int* d = ring.slots + s * UNIT_INTS;
    if (w >= pb.total) {
      d[3] = -1;  // no more units
      wg::mbar_arrive(ring.full + s);
      break;
    }
    const unit u = unit_of(w, work, cu_q, cu_k, cu_kp, pb.hq, pb.batch, pb.q_per_kv, pb.max_tiles, pb.G);
    if (!u.live) continue;  // past the request's end: the slot stays free
    d[0] = u.h0; d[1] = u.g; d[2] = u.q0; d[3] = u.sq;
    d[4] = u.k0; d[5] = u.sk; d[6] = u.m0; d[7] = u.rows;
    wg::mbar_arrive(ring.full + s);
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
}
}  // namespace atom_prefill
#endif
