// Shared helpers for Turbo's kernels. Included by every kernels/*.cu (and spliced in for NVRTC).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define TURBO_WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / TURBO_WARP;
    v = lane < warps ? partial[lane] : 0.f;
    return warp_sum(v);
}

// 8 bf16 values in one 16-byte vector, unpacked to / packed from f32.
__device__ __forceinline__ void bf16x8_unpack(uint4 v, float f[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 bf16x8_pack(const float f[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// RoPE's rotation of one interleaved pair (a, b) by the angle pos * f:
//   (a, b) -> (a cos - b sin, a sin + b cos).
// The angle p * f is carried exactly as hi + lo (hi = fl(p * f), lo = fma(p, f, -hi)), so large
// positions lose no accuracy to the f32 product: sincosf(hi) (full range reduction, not the fast
// intrinsic) is corrected to first order in lo (|lo| <= ulp(hi) / 2, so the error is ~lo^2 / 2).
__device__ __forceinline__ float2 rope_rotate(float2 ab, float pos, float f) {
    const float hi = pos * f;
    const float lo = fmaf(pos, f, -hi);
    float s, c;
    sincosf(hi, &s, &c);
    const float sn = fmaf(lo, c, s);
    const float cs = fmaf(-lo, s, c);
    return make_float2(ab.x * cs - ab.y * sn, ab.x * sn + ab.y * cs);
}
