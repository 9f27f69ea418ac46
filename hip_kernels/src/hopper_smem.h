// The Hopper kernel's shared memory: where each part lies, and its barriers and constant rows set up
// before the warpgroups start.
#pragma once

#include "hopper_config.h"
#include "hopper_scheduler.h"

#if ATOM_HAS_WGMMA
namespace atom_prefill {
// Byte layout: Q ring, O's partials (O_PROMOTE), O, e4m3 Q, K ring, V ring, key-scale ring, Q's row
// scales, barriers (every part 1024-aligned but the last three).
struct smem {
  unsigned char *sQ, *sPro;
  u16* sO;
  unsigned char *sQ8, *sK, *sV;
  float *sS, *sQsc;
  u64 *fullQ, *emptyQ, *fullK, *emptyK, *fullV, *emptyV, *fullU, *emptyU;
  int* sU;  // USLOTS slots of UNIT_INTS: the units handed over

  ATOM_DEV explicit smem(unsigned char* raw) {
    sQ = static_cast<unsigned char*>(wg::align1024(raw));
    sPro = sQ + 2 * QST * BM * D;
    sO = reinterpret_cast<u16*>(sPro + PRO);
    sQ8 = reinterpret_cast<unsigned char*>(sO + BM * D);
    sK = sQ8 + Q8;
    sV = sK + EB * NST * TILE;
    sS = reinterpret_cast<float*>(sV + NST * VSTAGE);
    sQsc = sS + NST * SC_TILE;
    u64* bars = reinterpret_cast<u64*>(sQsc + (kFp8 ? BM : 0));
    fullQ = bars, emptyQ = bars + QST, fullK = bars + 2 * QST, emptyK = fullK + NST, fullV = emptyK + NST;
    emptyV = fullV + NST, fullU = emptyV + NST, emptyU = fullU + USLOTS;
    sU = reinterpret_cast<int*>(emptyU + USLOTS);
  }

  // Thread 0 prefetches the tensor maps and sets up the mbarriers; with P's row sums by the tensor cores
  // every thread writes the constant rows of V^T's panels. The caller syncs the block after.
  ATOM_DEV void init(const tma_desc& tm_q, const tma_desc& tm_k, const tma_desc& tm_v, const tma_desc& tm_s) const {
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
  }
};
}  // namespace atom_prefill
#endif
