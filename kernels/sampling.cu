// sampling kernels.
#include "common.cuh"

#define ARGMAX_NONE 0xffffffffu

// Whether candidate (v, i) beats the current best (bv, bi): a larger value, or an equal value at
// a lower index; ARGMAX_NONE marks "no candidate". NaN is mapped to -inf before it gets here, so
// this is a strict total order and every reduction order gives the same winner.
__device__ __forceinline__ bool argmax_better(float v, unsigned i, float bv, unsigned bi) {
    return i != ARGMAX_NONE && (bi == ARGMAX_NONE || v > bv || (v == bv && i < bi));
}

__device__ __forceinline__ void argmax_take(float v, unsigned i, float& bv, unsigned& bi) {
    v = isnan(v) ? -INFINITY : v;
    if (argmax_better(v, i, bv, bi)) {
        bv = v;
        bi = i;
    }
}

// Block-wide reduction of (bv, bi); the result is written to out[row] by thread 0.
__device__ __forceinline__ void argmax_finish(float bv, unsigned bi, unsigned* out, int row) {
    __shared__ float sv[32];
    __shared__ unsigned si[32];
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x / TURBO_WARP;
        bv = lane < warps ? sv[lane] : -INFINITY;
        bi = lane < warps ? si[lane] : ARGMAX_NONE;
#pragma unroll
        for (int o = TURBO_WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (argmax_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) out[row] = bi == ARGMAX_NONE ? 0u : bi;
    }
}

// out[r] = the lowest index of the largest value of row r of logits ([rows, cols], cols >= 1);
// NaN counts as -inf. One block per row (blockDim.x a multiple of 32, at most 1024); 16-byte loads
// when cols % 8 == 0 and the buffer is 16-byte aligned.
extern "C" __global__ void __launch_bounds__(1024)
argmax_bf16(const __nv_bfloat16* logits, int rows, int cols, unsigned* out) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const __nv_bfloat16* x = logits + (size_t)row * (size_t)cols;
    float bv = -INFINITY;
    unsigned bi = ARGMAX_NONE;
    if ((cols % 8) == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
            const uint4 v = xv[c];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 t = __bfloat1622float2(h[k]);
                argmax_take(t.x, (unsigned)(c * 8 + 2 * k), bv, bi);
                argmax_take(t.y, (unsigned)(c * 8 + 2 * k + 1), bv, bi);
            }
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) argmax_take(__bfloat162float(x[c]), (unsigned)c, bv, bi);
    }
    argmax_finish(bv, bi, out, row);
}

// As argmax_bf16, for f32 logits (16-byte loads when cols % 4 == 0).
extern "C" __global__ void __launch_bounds__(1024)
argmax_f32(const float* logits, int rows, int cols, unsigned* out) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* x = logits + (size_t)row * (size_t)cols;
    float bv = -INFINITY;
    unsigned bi = ARGMAX_NONE;
    if ((cols % 4) == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 v = xv[c];
            argmax_take(v.x, (unsigned)(c * 4), bv, bi);
            argmax_take(v.y, (unsigned)(c * 4 + 1), bv, bi);
            argmax_take(v.z, (unsigned)(c * 4 + 2), bv, bi);
            argmax_take(v.w, (unsigned)(c * 4 + 3), bv, bi);
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) argmax_take(x[c], (unsigned)c, bv, bi);
    }
    argmax_finish(bv, bi, out, row);
}
