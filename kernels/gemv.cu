// Matrix-vector products for steps of a few tokens (decode): out = epilogue(x · Wᵀ).
//
// W is [rows, k] bf16 row-major (an nn.Linear weight), x is [M, k] bf16 with 1 <= M <= 4 (beyond 4
// tokens, re-reading x from L1 for every weight row costs more than cuBLAS's tiled GEMM). A step of
// few tokens reads every weight once and does little arithmetic on it, so the kernel is a stream
// over W: one warp per output unit, each lane loading 16 bytes of a row at a time, GEMV_UNROLL loads
// in flight before any is used, weights read past L1 (they are used once) while x stays cached in
// it. The warp reduces its lanes' sums with shuffles; no shared memory, no block barrier.
//
// Options, each replacing a kernel of its own at decode:
// - NORM: x is the residual stream and the product is of its RMSNorm, rms_norm(x) · g. The warp
//   sums x² along with the dot product and applies the row's 1/rms at the end:
//   out = (W · (x ∘ g)) · rsqrt(mean(x²) + eps). (The unfused path rounds rms_norm(x) · g to bf16
//   before the product; this one does not, a difference below the output's own bf16 rounding.)
// - epilogue `mode` of the one-row kernels: store bf16, store f32 (logits), or add to the
//   residual stream in place (out[m, j] = bf16(out[m, j] + product), rounded once).
// - SwiGLU kernels: W is the fused [gate; up] weight of 2 · units rows; the warp of unit j
//   computes rows j and units + j and stores silu(gate) · up, each rounded to bf16 first as the
//   unfused path stores them.
//
// Requirements (checked by the launcher): k % 8 == 0, W, x, g 16-byte aligned.
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4
// Elements a warp covers with one 16-byte load per lane.
#define GEMV_SPAN (TURBO_WARP * 8)

enum : int { GEMV_STORE_BF16 = 0, GEMV_STORE_F32 = 1, GEMV_ADD_RESIDUAL = 2 };

// A 16-byte load that is not kept in L1 (each weight is read once per step).
__device__ __forceinline__ uint4 load_streaming(const __nv_bfloat16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// R weight rows per warp (1, or 2 for SwiGLU's gate and up), M tokens.
template <int M, int R, bool NORM>
__device__ __forceinline__ void gemv(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                     const __nv_bfloat16* __restrict__ g, float eps, void* out, int units,
                                     int k, int mode) {
    const int lane = threadIdx.x % TURBO_WARP;
    const int unit = blockIdx.x * GEMV_WARPS + threadIdx.x / TURBO_WARP;
    if (unit >= units) return;  // uniform per warp; no barriers follow

    const __nv_bfloat16* row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = w + (size_t)(unit + r * units) * (size_t)k;

    float acc[M][R], ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        ss[m] = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = 0.f;
    }

    for (int base = lane * 8; base < k; base += GEMV_SPAN * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL][R];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int i = base + u * GEMV_SPAN;
#pragma unroll
            for (int r = 0; r < R; r++) wv[u][r] = i < k ? load_streaming(row[r] + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int i = base + u * GEMV_SPAN;
            if (i >= k) break;
            float wf[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) bf16x8_unpack(wv[u][r], wf[r]);
            float gf[8];
            if (NORM) bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(g + i)), gf);
#pragma unroll
            for (int m = 0; m < M; m++) {
                float xf[8];
                bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * k + i)), xf);
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    if (NORM) {
                        ss[m] = fmaf(xf[e], xf[e], ss[m]);
                        xf[e] *= gf[e];
                    }
#pragma unroll
                    for (int r = 0; r < R; r++) acc[m][r] = fmaf(wf[r][e], xf[e], acc[m][r]);
                }
            }
        }
    }

#pragma unroll
    for (int m = 0; m < M; m++) {
        if (NORM) ss[m] = warp_sum(ss[m]);
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = warp_sum(acc[m][r]);
    }
    if (lane != 0) return;
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float scale = NORM ? rsqrtf(ss[m] / (float)k + eps) : 1.f;
        const size_t at = (size_t)m * units + unit;
        if (R == 2) {
            const float gate = round_bf16(acc[m][0] * scale);
            const float up = round_bf16(acc[m][R - 1] * scale);
            static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
        } else {
            const float v = acc[m][0] * scale;
            if (mode == GEMV_STORE_F32) {
                static_cast<float*>(out)[at] = v;
            } else {
                __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
                o[at] = __float2bfloat16_rn(mode == GEMV_ADD_RESIDUAL ? __bfloat162float(o[at]) + v : v);
            }
        }
    }
}

// Grid: ceil(units / GEMV_WARPS) blocks of GEMV_WARPS warps. `g` and `eps` are ignored without NORM,
// `mode` by the SwiGLU kernels.
#define GEMV_KERNELS(M)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * TURBO_WARP)                                   \
        gemv_m##M(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,        \
                  void* out, int units, int k, int mode) {                                                  \
        gemv<M, 1, false>(w, x, g, eps, out, units, k, mode);                                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * TURBO_WARP)                                   \
        gemv_norm_m##M(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,   \
                       void* out, int units, int k, int mode) {                                             \
        gemv<M, 1, true>(w, x, g, eps, out, units, k, mode);                                                \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * TURBO_WARP)                                   \
        gemv_norm_swiglu_m##M(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g,      \
                              float eps, void* out, int units, int k, int mode) {                           \
        gemv<M, 2, true>(w, x, g, eps, out, units, k, mode);                                                \
    }

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(3)
GEMV_KERNELS(4)
