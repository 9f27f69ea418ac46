// atom_device.h: the one vendor-aware header of hip_kernels.
//
// Kernel sources include this file and nothing vendor-specific: they use atom:: functions and
// the ATOM_* capability macros, never __CUDA_ARCH__ / __gfx*__ / threadIdx directly.
//
// Three compile modes, chosen by the runtime (hip_kernels/runtime/toolchains.py):
//   NVRTC (NVIDIA)            __CUDACC_RTC__ / __CUDACC__ defined; cuda_bf16/fp16/fp8 headers
//                             come from the nvidia-cuda-runtime wheel's include dir.
//   hiprtc on a ROCm install  HIP runtime headers are implicit.
//   clang-22 -nogpuinc (CI)   no HIP headers at all: ATOM_NOGPUINC=1, and this header defines
//                             the few device keywords and intrinsics the kernels need.
//
// Capability macros (kernels test these, not chips):
//   ATOM_NVIDIA / ATOM_AMD     vendor
//   ATOM_WARP_SIZE             32 (NVIDIA, RDNA) or 64 (CDNA: gfx9xx)
//   ATOM_FP8_FNUZ              1 when the native e4m3 is e4m3fnuz (gfx942), 0 for e4m3fn
//   ATOM_HW_FP8_CVT            1 when fp8 -> f32 conversion is a hardware instruction
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define ATOM_NVIDIA 1
#define ATOM_AMD 0
#elif defined(__HIP__) || defined(__HIPCC_RTC__) || defined(__AMDGCN__)
#define ATOM_NVIDIA 0
#define ATOM_AMD 1
#else
#error "atom_device.h: unknown device compiler (expected NVRTC/nvcc, hiprtc or clang -x hip)"
#endif

// ---------------------------------------------------------------------------------------------
// Vendor includes / keyword shims
// ---------------------------------------------------------------------------------------------
#if ATOM_NVIDIA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define ATOM_WARP_SIZE 32
#define ATOM_FP8_FNUZ 0
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define ATOM_HW_FP8_CVT 1
#else
#define ATOM_HW_FP8_CVT 0
#endif
#define ATOM_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#else  // AMD
#if defined(ATOM_NOGPUINC) && ATOM_NOGPUINC
// The subset of hip_runtime.h that our kernels use. Kept tiny on purpose: anything beyond
// these goes through atom:: functions below, which are defined from clang builtins.
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
#endif
#if defined(__GFX9__)
#define ATOM_WARP_SIZE 64
#else
#define ATOM_WARP_SIZE 32
#endif
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define ATOM_FP8_FNUZ 1
#define ATOM_HW_FP8_CVT 1
#elif defined(__gfx950__) || defined(__gfx1200__) || defined(__gfx1201__) || defined(__gfx1250__)
#define ATOM_FP8_FNUZ 0
#define ATOM_HW_FP8_CVT 1
#else
#define ATOM_FP8_FNUZ 0
#define ATOM_HW_FP8_CVT 0
#endif
#define ATOM_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#endif

#define ATOM_DEV __device__ __forceinline__

namespace atom {

typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef unsigned char u8;

// 16 bytes: the unit of every global load/store in the memory-bound kernels.
struct alignas(16) u32x4 {
  u32 x, y, z, w;
};
struct alignas(8) u32x2 {
  u32 x, y;
};

// ---------------------------------------------------------------------------------------------
// Thread / block indices (kernels never touch threadIdx & co. directly: no HIP headers in CI)
// ---------------------------------------------------------------------------------------------
#if ATOM_NVIDIA
ATOM_DEV u32 tid_x() { return threadIdx.x; }
ATOM_DEV u32 tid_y() { return threadIdx.y; }
ATOM_DEV u32 bid_x() { return blockIdx.x; }
ATOM_DEV u32 bid_y() { return blockIdx.y; }
ATOM_DEV u32 bid_z() { return blockIdx.z; }
ATOM_DEV u32 bdim_x() { return blockDim.x; }
ATOM_DEV u32 bdim_y() { return blockDim.y; }
ATOM_DEV u32 gdim_x() { return gridDim.x; }
ATOM_DEV u32 gdim_y() { return gridDim.y; }
ATOM_DEV u32 lane_id() { return threadIdx.x & (ATOM_WARP_SIZE - 1); }
ATOM_DEV void sync_block() { __syncthreads(); }
#else
ATOM_DEV u32 tid_x() { return __builtin_amdgcn_workitem_id_x(); }
ATOM_DEV u32 tid_y() { return __builtin_amdgcn_workitem_id_y(); }
ATOM_DEV u32 bid_x() { return __builtin_amdgcn_workgroup_id_x(); }
ATOM_DEV u32 bid_y() { return __builtin_amdgcn_workgroup_id_y(); }
ATOM_DEV u32 bid_z() { return __builtin_amdgcn_workgroup_id_z(); }
ATOM_DEV u32 bdim_x() { return __builtin_amdgcn_workgroup_size_x(); }
ATOM_DEV u32 bdim_y() { return __builtin_amdgcn_workgroup_size_y(); }
ATOM_DEV u32 gdim_x() { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }
ATOM_DEV u32 gdim_y() { return __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(); }
ATOM_DEV u32 lane_id() { return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
ATOM_DEV void sync_block() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#endif

// ---------------------------------------------------------------------------------------------
// Bit casts and float math (AMD -nogpulib has no libm: only builtins that lower to instructions)
// ---------------------------------------------------------------------------------------------
ATOM_DEV float u32_as_f32(u32 u) {
#if ATOM_NVIDIA
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}
ATOM_DEV u32 f32_as_u32(float f) {
#if ATOM_NVIDIA
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(u32, f);
#endif
}

#if ATOM_NVIDIA
ATOM_DEV float neg_inf() { return __uint_as_float(0xff800000u); }
ATOM_DEV float fmax_(float a, float b) { return fmaxf(a, b); }
ATOM_DEV float fmin_(float a, float b) { return fminf(a, b); }
ATOM_DEV float fabs_(float a) { return fabsf(a); }
ATOM_DEV float rint_(float a) { return rintf(a); }  // round to nearest even
#else
ATOM_DEV float neg_inf() { return -__builtin_huge_valf(); }
ATOM_DEV float fmax_(float a, float b) { return __builtin_fmaxf(a, b); }
ATOM_DEV float fmin_(float a, float b) { return __builtin_fminf(a, b); }
ATOM_DEV float fabs_(float a) { return __builtin_fabsf(a); }
ATOM_DEV float rint_(float a) { return __builtin_rintf(a); }
#endif

// Abort the kernel: a code path the host never selects on this target (NVRTC has no
// __builtin_trap; clang's AMDGPU back end has no __trap).
ATOM_DEV void trap_() {
#if ATOM_NVIDIA
  __trap();
#else
  __builtin_trap();
#endif
}

// 2^x, fast hardware approximation (~1 ulp); exp2(-inf) = 0.
ATOM_DEV float exp2_(float x) {
#if ATOM_NVIDIA
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return __builtin_amdgcn_exp2f(x);
#endif
}
// log2(x), fast hardware approximation; log2(0) = -inf.
ATOM_DEV float log2_(float x) {
#if ATOM_NVIDIA
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return __builtin_amdgcn_logf(x);
#endif
}
// tanh(x) for the soft-cap. NVIDIA: the special-function unit's approximation (MUFU.TANH, relative
// error <= 2^-11 by the PTX ISA, 1.1e-5 measured on H100), as FlashAttention and FlashInfer take it; an IEEE division per
// element (1 - 2 / (e + 1)) instead made the soft-cap prefill 3x slower (its slow-path branches cut
// the softmax into blocks ptxas cannot interleave). AMD: from exp2 and a hardware reciprocal.
ATOM_DEV float tanh_(float x) {
#if ATOM_NVIDIA
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float e = __builtin_amdgcn_exp2f(__builtin_fminf(__builtin_fabsf(x), 15.f) * 2.8853900817779268f);
  const float t = 1.f - 2.f * __builtin_amdgcn_rcpf(e + 1.f);
  return x != x ? x : x < 0.f ? -t : t;  // NaN stays NaN, as NVIDIA's
#endif
}
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
ATOM_DEV float exp_(float x) { return exp2_(x * kLog2e); }
ATOM_DEV float log_(float x) { return log2_(x) * kLn2; }

// ---------------------------------------------------------------------------------------------
// Warp shuffles (full-warp; no masks, as AMD has none)
// ---------------------------------------------------------------------------------------------
ATOM_DEV float shfl_xor(float v, int mask) {
#if ATOM_NVIDIA
  return __shfl_xor_sync(0xffffffffu, v, mask);
#else
  int src = (int)lane_id() ^ mask;
  return u32_as_f32((u32)__builtin_amdgcn_ds_bpermute(src << 2, (int)f32_as_u32(v)));
#endif
}
ATOM_DEV float shfl(float v, int src_lane) {
#if ATOM_NVIDIA
  return __shfl_sync(0xffffffffu, v, src_lane);
#else
  return u32_as_f32((u32)__builtin_amdgcn_ds_bpermute(src_lane << 2, (int)f32_as_u32(v)));
#endif
}
// Reductions across groups of `width` consecutive lanes (width: power of two <= warp size).
template <int width = ATOM_WARP_SIZE>
ATOM_DEV float warp_sum(float v) {
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
  return v;
}
template <int width = ATOM_WARP_SIZE>
ATOM_DEV float warp_max(float v) {
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1) v = fmax_(v, shfl_xor(v, m));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Vector memory access (16 bytes per thread; callers guarantee 16-byte alignment)
// ---------------------------------------------------------------------------------------------
ATOM_DEV u32x4 load16(const void* p) { return *reinterpret_cast<const u32x4*>(p); }
ATOM_DEV void store16(void* p, const u32x4& v) { *reinterpret_cast<u32x4*>(p) = v; }
ATOM_DEV u32x2 load8(const void* p) { return *reinterpret_cast<const u32x2*>(p); }
ATOM_DEV void store8(void* p, const u32x2& v) { *reinterpret_cast<u32x2*>(p) = v; }
// Streaming variants for data touched exactly once (a gather's source and destination):
// keeps them from evicting data that is reused, like the page table.
ATOM_DEV u32x4 load16_stream(const void* p) {
#if ATOM_NVIDIA
  uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
  return u32x4{v.x, v.y, v.z, v.w};
#else
  const u32x4* q = reinterpret_cast<const u32x4*>(p);
  return u32x4{__builtin_nontemporal_load(&q->x), __builtin_nontemporal_load(&q->y),
               __builtin_nontemporal_load(&q->z), __builtin_nontemporal_load(&q->w)};
#endif
}
ATOM_DEV u32x2 load8_stream(const void* p) {
#if ATOM_NVIDIA
  uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  return u32x2{v.x, v.y};
#else
  const u32x2* q = reinterpret_cast<const u32x2*>(p);
  return u32x2{__builtin_nontemporal_load(&q->x), __builtin_nontemporal_load(&q->y)};
#endif
}
ATOM_DEV void store16_stream(void* p, const u32x4& v) {
#if ATOM_NVIDIA
  __stcs(reinterpret_cast<uint4*>(p), make_uint4(v.x, v.y, v.z, v.w));
#else
  u32x4* q = reinterpret_cast<u32x4*>(p);
  __builtin_nontemporal_store(v.x, &q->x);
  __builtin_nontemporal_store(v.y, &q->y);
  __builtin_nontemporal_store(v.z, &q->z);
  __builtin_nontemporal_store(v.w, &q->w);
#endif
}

// ---------------------------------------------------------------------------------------------
// Device-wide counters and ordering (split-KV: slice counters shared by the CTAs of one group).
// ---------------------------------------------------------------------------------------------
// load*_device: loads that see other CTAs' stores published by fence_device + a counter (they
// bypass the SM's L1, which is not coherent and may hold a line read earlier by another CTA).
#if ATOM_NVIDIA
ATOM_DEV int atomic_add(int* p, int v) { return atomicAdd(p, v); }
ATOM_DEV u32 atomic_max(u32* p, u32 v) { return atomicMax(p, v); }
ATOM_DEV void fence_device() { __threadfence(); }
ATOM_DEV float loadf_device(const float* p) { return __ldcg(p); }
ATOM_DEV u32x4 load16_device(const void* p) {
  uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
  return u32x4{v.x, v.y, v.z, v.w};
}
#else
ATOM_DEV int atomic_add(int* p, int v) { return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
ATOM_DEV u32 atomic_max(u32* p, u32 v) { return __hip_atomic_fetch_max(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
ATOM_DEV void fence_device() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
ATOM_DEV u32 load4_device(const u32* p) { return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
ATOM_DEV float loadf_device(const float* p) { return u32_as_f32(load4_device(reinterpret_cast<const u32*>(p))); }
ATOM_DEV u32x4 load16_device(const void* p) {
  const u32* q = reinterpret_cast<const u32*>(p);
  return u32x4{load4_device(q), load4_device(q + 1), load4_device(q + 2), load4_device(q + 3)};
}
#endif

// ---------------------------------------------------------------------------------------------
// Global -> shared copies that overlap with compute where the hardware allows.
// NVIDIA (sm_80+): cp.async, completion tracked per thread in commit groups; pred == false
// zero-fills the destination without reading the source (the predicated form costs ~0.3% of a
// memory-bound stream against the plain one: bench/stream_probe.cu, MIMIC). Elsewhere: a plain
// load and store (correct, not overlapped), and commit / wait are no-ops.
// ---------------------------------------------------------------------------------------------
#if ATOM_NVIDIA
ATOM_DEV void copy16_async(void* smem_dst, const void* gsrc, bool pred) {
  const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gsrc), "r"(pred ? 16 : 0));
}
ATOM_DEV void copy16_async(void* smem_dst, const void* gsrc) {
  const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gsrc));
}
ATOM_DEV void copy4_async(void* smem_dst, const void* gsrc, bool pred) {
  const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(gsrc), "r"(pred ? 4 : 0));
}
ATOM_DEV void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
ATOM_DEV void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
ATOM_DEV void warp_sync() { __syncwarp(); }
#else
ATOM_DEV void copy16_async(void* smem_dst, const void* gsrc, bool pred) {
  *reinterpret_cast<u32x4*>(smem_dst) = pred ? *reinterpret_cast<const u32x4*>(gsrc) : u32x4{0u, 0u, 0u, 0u};
}
ATOM_DEV void copy16_async(void* smem_dst, const void* gsrc) {
  *reinterpret_cast<u32x4*>(smem_dst) = *reinterpret_cast<const u32x4*>(gsrc);
}
ATOM_DEV void copy4_async(void* smem_dst, const void* gsrc, bool pred) {
  *reinterpret_cast<u32*>(smem_dst) = pred ? *reinterpret_cast<const u32*>(gsrc) : 0u;
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

// ---------------------------------------------------------------------------------------------
// 16-bit floats as raw bits (u16): kernels store and move bits, convert at the edges.
// ---------------------------------------------------------------------------------------------
ATOM_DEV float bf16_to_f32(u16 b) { return u32_as_f32((u32)b << 16); }
ATOM_DEV u16 f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
#if ATOM_NVIDIA
  __nv_bfloat16 h = __float2bfloat16_rn(f);
  return *reinterpret_cast<u16*>(&h);
#else
  return __builtin_bit_cast(u16, (__bf16)f);
#endif
}
ATOM_DEV float f16_to_f32(u16 b) {
#if ATOM_NVIDIA
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
#else
  return (float)__builtin_bit_cast(_Float16, b);
#endif
}
ATOM_DEV u16 f32_to_f16(float f) {
#if ATOM_NVIDIA
  __half h = __float2half_rn(f);
  return *reinterpret_cast<u16*>(&h);
#else
  return __builtin_bit_cast(u16, (_Float16)f);
#endif
}
// Two floats -> two packed 16-bit values in one u32 (low half = a).
ATOM_DEV u32 pack_bf16x2(float a, float b) { return (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16); }
ATOM_DEV u32 pack_f16x2(float a, float b) { return (u32)f32_to_f16(a) | ((u32)f32_to_f16(b) << 16); }

// Storage-type tags, so a kernel can be written once over the output / input dtype.
struct bf16_t {};
struct f16_t {};
struct f32_t {};
template <class T> struct dtype_traits;
template <> struct dtype_traits<bf16_t> { typedef u16 storage; static constexpr int bytes = 2; };
template <> struct dtype_traits<f16_t> { typedef u16 storage; static constexpr int bytes = 2; };
template <> struct dtype_traits<f32_t> { typedef float storage; static constexpr int bytes = 4; };

ATOM_DEV float to_f32(bf16_t, u16 b) { return bf16_to_f32(b); }
ATOM_DEV float to_f32(f16_t, u16 b) { return f16_to_f32(b); }
ATOM_DEV float to_f32(f32_t, float b) { return b; }
ATOM_DEV u16 from_f32(bf16_t, float f) { return f32_to_bf16(f); }
ATOM_DEV u16 from_f32(f16_t, float f) { return f32_to_f16(f); }
ATOM_DEV float from_f32(f32_t, float f) { return f; }
ATOM_DEV u32 pack2(bf16_t, float a, float b) { return pack_bf16x2(a, b); }
ATOM_DEV u32 pack2(f16_t, float a, float b) { return pack_f16x2(a, b); }

// ---------------------------------------------------------------------------------------------
// FP8 e4m3: the platform's native flavour (e4m3fn on NVIDIA / gfx950, e4m3fnuz on gfx942).
// The host checks that the tensor's dtype is that flavour (runtime.native_fp8_dtype).
// ---------------------------------------------------------------------------------------------
// The flavour's largest finite value. The AMD conversion instructions do not saturate: values
// past it must be clamped before they are converted.
constexpr float kFp8Max = ATOM_FP8_FNUZ ? 240.f : 448.f;
// Software decode, exact for both flavours; used where there is no conversion instruction.
ATOM_DEV float fp8_e4m3_to_f32_sw(u32 b, bool fnuz) {
  u32 sign = (b & 0x80u) << 24;
  u32 e = (b >> 3) & 0xfu, m = b & 0x7u;
  if (fnuz) {
    if (b == 0x80u) return u32_as_f32(0x7fc00000u);  // the only NaN of fnuz
  } else if ((b & 0x7fu) == 0x7fu) {
    return u32_as_f32(0x7fc00000u);
  }
  const int bias = fnuz ? 8 : 7;
  float mag;
  if (e == 0) {
    mag = (float)m * u32_as_f32((u32)(127 - bias - 2) << 23);  // m * 2^(1-bias-3)
  } else {
    mag = u32_as_f32(((e + 127 - bias) << 23) | (m << 20));
  }
  return u32_as_f32(f32_as_u32(mag) | sign);
}

// Two fp8 values (low byte first; the low 16 bits of w, or the high 16 when HI) -> two floats.
template <bool HI>
ATOM_DEV void fp8x2_to_f32x2(u32 w, float& a, float& b) {
  constexpr bool hi = HI;
#if ATOM_NVIDIA && ATOM_HW_FP8_CVT
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(hi ? (w >> 16) : (w & 0xffffu)), __NV_E4M3);
  __half2 h(r);
  float2 f = __half22float2(h);
  a = f.x;
  b = f.y;
#elif ATOM_AMD && ATOM_HW_FP8_CVT
  auto v = __builtin_amdgcn_cvt_pk_f32_fp8((int)w, hi);
  a = v[0];
  b = v[1];
#else
  u32 s = hi ? (w >> 16) : w;
  a = fp8_e4m3_to_f32_sw(s & 0xffu, ATOM_FP8_FNUZ);
  b = fp8_e4m3_to_f32_sw((s >> 8) & 0xffu, ATOM_FP8_FNUZ);
#endif
}
// Four fp8 values packed in a u32 (byte 0 first) -> f[0..3].
ATOM_DEV void fp8x4_to_f32x4(u32 w, float* f) {
  fp8x2_to_f32x2<false>(w, f[0], f[1]);
  fp8x2_to_f32x2<true>(w, f[2], f[3]);
}
// f32 -> e4m3, round to nearest even, saturating to the largest finite value (NaN stays NaN).
ATOM_DEV u32 f32_to_fp8_e4m3_sw(float f, bool fnuz) {
  const u32 sign = (f32_as_u32(f) >> 24) & 0x80u;
  const float a = fabs_(f);
  if (!(a == a)) return fnuz ? 0x80u : 0x7fu;
  if (a >= (fnuz ? 240.f : 448.f)) return sign | (fnuz ? 0x7fu : 0x7eu);
  const int bias = fnuz ? 8 : 7;
  int E = (int)((f32_as_u32(a) >> 23) & 0xffu) - 127;
  u32 mag;
  if (E < 1 - bias) {  // subnormal: multiples of 2^(1 - bias - 3)
    mag = (u32)rint_(a * u32_as_f32((u32)(127 + bias + 2) << 23));  // 0..8; 8 is the smallest normal
  } else {
    u32 q = (u32)rint_(a * u32_as_f32((u32)(127 + 3 - E) << 23));  // 8..16
    if (q == 16u) { q = 8u; ++E; }
    mag = ((u32)(E + bias) << 3) | (q - 8u);
  }
  return mag ? (sign | mag) : 0u;
}
// Two floats -> two e4m3 (the platform's flavour) in the low 16 bits, a in byte 0.
ATOM_DEV u32 f32x2_to_fp8x2(float a, float b) {
#if ATOM_NVIDIA && ATOM_HW_FP8_CVT
  return (u32)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
#elif ATOM_AMD && ATOM_HW_FP8_CVT
  return (u32)__builtin_amdgcn_cvt_pk_fp8_f32(a, b, 0, false) & 0xffffu;
#else
  return f32_to_fp8_e4m3_sw(a, ATOM_FP8_FNUZ) | (f32_to_fp8_e4m3_sw(b, ATOM_FP8_FNUZ) << 8);
#endif
}
// Four floats -> four e4m3 in a u32, a in byte 0.
ATOM_DEV u32 f32x4_to_fp8x4(float a, float b, float c, float d) { return f32x2_to_fp8x2(a, b) | (f32x2_to_fp8x2(c, d) << 16); }
ATOM_DEV float fp8_to_f32(u8 b) {
  float a, c;
  fp8x2_to_f32x2<false>((u32)b, a, c);
  return a;
}

// ---------------------------------------------------------------------------------------------
// 64-bit paged addressing: pools over 4 GiB are normal, so every offset is computed in i64.
// ---------------------------------------------------------------------------------------------
// Element offset of (page, slot, head) in a pool whose strides are given in elements.
ATOM_DEV i64 page_offset(i64 page, i64 slot, i64 head, i64 page_stride, i64 slot_stride, i64 head_stride) {
  return page * page_stride + slot * slot_stride + head * head_stride;
}
// Physical page of absolute token position `pos` (never a tile count: tile != page size).
ATOM_DEV i32 page_of(const i32* __restrict__ pages, i64 pos, i32 page_size) { return pages[pos / page_size]; }

// Sequence index b with cu[b] <= row < cu[b + 1], by binary search over cu[0..n] (cu[0] = 0).
ATOM_DEV i32 find_seq(const i32* __restrict__ cu, i32 n, i64 row) {
  i32 lo = 0, hi = n;  // invariant: cu[lo] <= row < cu[hi]
  while (hi - lo > 1) {
    i32 mid = (lo + hi) >> 1;
    if ((i64)cu[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

// Splits of a launch's num_splits that a split-KV request of `keys` visible keys uses: the count
// the planner would give a batch of requests of its length (atom_backend.planner.request_splits,
// the one definition; SplitRule holds the six bounds, zeros off):
// - at most keys / min_keys;
// - the fill target when its splits hold at most long_keys keys and its CTAs run in one wave, or
//   when its CTAs fill their last wave to wave_fill % anyway;
// - else the fewest splits, at most max(fill, keys / long_keys), whose CTAs fill their last wave
//   to wave_fill %; none does: the fill target.
ATOM_DEV i32 request_splits(i32 keys, i32 num_splits, i32 min_keys, i32 fill, i32 long_keys, i32 ctas, i32 slots,
                            i32 wave_fill) {
  i32 cap = num_splits;
  if (min_keys > 0 && keys / min_keys < cap) cap = keys / min_keys;
  if (cap < 1) cap = 1;
  if (fill <= 0) return cap;
  if (fill > cap) fill = cap;
  if (long_keys <= 0 || ctas <= 0 || slots <= 0) return fill;
  const i64 fc = (i64)ctas * fill;
  const bool one_wave = (i64)keys <= (i64)fill * long_keys && fc <= slots;
  if (one_wave || 100 * fc >= (i64)wave_fill * ((fc + slots - 1) / slots) * slots) return fill;
  i32 grow_cap = keys / long_keys > fill ? keys / long_keys : fill;
  if (grow_cap > cap) grow_cap = cap;
  for (i64 k = (ctas + slots - 1) / slots;; ++k) {  // whole_wave_splits
    i64 s = ((i64)wave_fill * k * slots + 100 * (i64)ctas - 1) / (100 * (i64)ctas);
    if (s < 1) s = 1;
    if (s > grow_cap) return fill;
    if ((i64)ctas * s <= k * slots) return (i32)s;
  }
}

}  // namespace atom
