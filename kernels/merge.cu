// Merging attention states.
//
// A state (o, lse) is the attention of one query head over a subset of the keys: o the
// softmax-weighted mean of the subset's values, lse = ln Σ exp(score). States over disjoint
// subsets merge into the state over their union (the CPU reference is turbo_attention's
// merge_states / merge_into):
//   M = max_i lse_i,   o = Σ_i exp(lse_i − M) o_i / Σ_i exp(lse_i − M),   lse = M + ln Σ_i exp(lse_i − M)
// Shifting by M keeps every exponent at most 0. A state with lse = -inf is empty: it is skipped
// and its o is never read (it may hold anything, NaN included); when every state is empty the
// result is exactly o = 0, lse = -inf, and when exactly one is not, the result is that state bit
// for bit (its weight is exp(0) = 1 and the sum 1).
//
// Layouts (f32 in, "pair" = row · heads + head, pairs = rows · heads):
//   o    [n][pairs][head_dim]    lse [n][pairs]    (merge_states: n states per pair, chunk-major,
//                                                   as a split-KV pass writes them)
//   o_a, o_b [pairs][head_dim]   lse_a, lse_b [pairs]   (merge_state, merge_state_inplace)
//   out  [pairs][head_dim] f32 or bf16              out_lse [pairs] f32, or null
//
// Threads: each thread owns VEC consecutive dimensions of one pair (VEC = 4, 16-byte loads, when
// head_dim is a multiple of 4; else 1), so a pair takes head_dim / VEC threads, blockDim.x, and a
// block holds blockDim.y pairs. Every thread walks the pair's lse values itself (they are few and
// cached), so no thread waits on another, except in the in-place merge, where a pair's lse may only
// be overwritten once all of its threads have read it.
#include "common.cuh"

__device__ __forceinline__ float merge_neg_inf() { return __int_as_float(0xff800000); }

template <int VEC>
__device__ __forceinline__ void merge_load(const float* __restrict__ p, float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 x = *reinterpret_cast<const float4*>(p);
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) v[k] = p[k];
    }
}

template <int VEC>
__device__ __forceinline__ void merge_store(float* __restrict__ p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = v[k];
    }
}

template <int VEC>
__device__ __forceinline__ void merge_store(__nv_bfloat16* __restrict__ p, const float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        uint2 w;
        *reinterpret_cast<__nv_bfloat162*>(&w.x) = __floats2bfloat162_rn(v[0], v[1]);
        *reinterpret_cast<__nv_bfloat162*>(&w.y) = __floats2bfloat162_rn(v[2], v[3]);
        *reinterpret_cast<uint2*>(p) = w;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = __float2bfloat16_rn(v[k]);
    }
}

// n states per pair, state i of pair p at o[(i · pairs + p) · head_dim], lse[i · pairs + p].
template <int VEC, typename Out>
__device__ __forceinline__ void merge_states_impl(const float* __restrict__ o, const float* __restrict__ lse,
                                                  int n, size_t pairs, int head_dim, Out* __restrict__ out,
                                                  float* __restrict__ out_lse) {
    const size_t pair = (size_t)blockIdx.x * blockDim.y + threadIdx.y;
    if (pair >= pairs) return;
    const int c = threadIdx.x * VEC;
    float m = merge_neg_inf();
    for (int i = 0; i < n; i++) m = fmaxf(m, lse[(size_t)i * pairs + pair]);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.f;
    float sum = 0.f;
    if (m != merge_neg_inf()) {
#pragma unroll 4
        for (int i = 0; i < n; i++) {
            const size_t s = (size_t)i * pairs + pair;
            const float x = lse[s];
            if (x == merge_neg_inf()) continue;
            const float w = expf(x - m);
            sum += w;
            float v[VEC];
            merge_load<VEC>(o + s * head_dim + c, v);
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[k] = fmaf(w, v[k], acc[k]);
        }
        const float inv = 1.f / sum;
#pragma unroll
        for (int k = 0; k < VEC; k++) acc[k] *= inv;
    }
    merge_store<VEC>(out + pair * head_dim + c, acc);
    if (threadIdx.x == 0 && out_lse != nullptr)
        out_lse[pair] = m == merge_neg_inf() ? merge_neg_inf() : m + logf(sum);
}

// Two states per pair, from separate buffers; the same arithmetic as merge_states with n = 2.
template <int VEC, typename Out>
__device__ __forceinline__ void merge_state_impl(const float* __restrict__ o_a, const float* __restrict__ lse_a,
                                                 const float* __restrict__ o_b, const float* __restrict__ lse_b,
                                                 size_t pairs, int head_dim, Out* __restrict__ out,
                                                 float* __restrict__ out_lse) {
    const size_t pair = (size_t)blockIdx.x * blockDim.y + threadIdx.y;
    if (pair >= pairs) return;
    const int c = threadIdx.x * VEC;
    const float la = lse_a[pair], lb = lse_b[pair];
    const float m = fmaxf(la, lb);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.f;
    float sum = 0.f;
    if (m != merge_neg_inf()) {
        float v[VEC];
        if (la != merge_neg_inf()) {
            const float w = expf(la - m);
            sum += w;
            merge_load<VEC>(o_a + pair * head_dim + c, v);
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[k] = fmaf(w, v[k], acc[k]);
        }
        if (lb != merge_neg_inf()) {
            const float w = expf(lb - m);
            sum += w;
            merge_load<VEC>(o_b + pair * head_dim + c, v);
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[k] = fmaf(w, v[k], acc[k]);
        }
        const float inv = 1.f / sum;
#pragma unroll
        for (int k = 0; k < VEC; k++) acc[k] *= inv;
    }
    merge_store<VEC>(out + pair * head_dim + c, acc);
    if (threadIdx.x == 0 && out_lse != nullptr)
        out_lse[pair] = m == merge_neg_inf() ? merge_neg_inf() : m + logf(sum);
}

// b merged into a, with turbo_attention::merge_into's arithmetic: an empty b leaves a untouched,
// an empty a becomes a copy of b.
template <int VEC>
__device__ __forceinline__ void merge_state_inplace_impl(float* __restrict__ o_a, float* __restrict__ lse_a,
                                                         const float* __restrict__ o_b,
                                                         const float* __restrict__ lse_b, size_t pairs,
                                                         int head_dim) {
    const size_t pair = (size_t)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = pair < pairs;
    const float la = active ? lse_a[pair] : merge_neg_inf();
    const float lb = active ? lse_b[pair] : merge_neg_inf();
    float merged = la;
    if (lb != merge_neg_inf()) {
        const int c = threadIdx.x * VEC;
        float b[VEC];
        merge_load<VEC>(o_b + pair * head_dim + c, b);
        if (la == merge_neg_inf()) {
            merge_store<VEC>(o_a + pair * head_dim + c, b);
            merged = lb;
        } else {
            const float m = fmaxf(la, lb);
            const float wa = expf(la - m), wb = expf(lb - m);
            const float sum = wa + wb;
            const float na = wa / sum, nb = wb / sum;
            float a[VEC];
            merge_load<VEC>(o_a + pair * head_dim + c, a);
#pragma unroll
            for (int k = 0; k < VEC; k++) a[k] = fmaf(a[k], na, b[k] * nb);
            merge_store<VEC>(o_a + pair * head_dim + c, a);
            merged = m + logf(sum);
        }
    }
    // Every thread of the pair has read lse_a[pair] before it is overwritten.
    __syncthreads();
    if (active && threadIdx.x == 0) lse_a[pair] = merged;
}

#define MERGE_KERNELS(VEC)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) merge_states_f32_v##VEC(                             \
        const float* __restrict__ o, const float* __restrict__ lse, int n, size_t pairs, int head_dim,      \
        float* __restrict__ out, float* __restrict__ out_lse) {                                             \
        merge_states_impl<VEC>(o, lse, n, pairs, head_dim, out, out_lse);                                   \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) merge_states_bf16_v##VEC(                            \
        const float* __restrict__ o, const float* __restrict__ lse, int n, size_t pairs, int head_dim,      \
        __nv_bfloat16* __restrict__ out, float* __restrict__ out_lse) {                                     \
        merge_states_impl<VEC>(o, lse, n, pairs, head_dim, out, out_lse);                                   \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) merge_state_f32_v##VEC(                              \
        const float* __restrict__ o_a, const float* __restrict__ lse_a, const float* __restrict__ o_b,      \
        const float* __restrict__ lse_b, size_t pairs, int head_dim, float* __restrict__ out,               \
        float* __restrict__ out_lse) {                                                                      \
        merge_state_impl<VEC>(o_a, lse_a, o_b, lse_b, pairs, head_dim, out, out_lse);                       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) merge_state_bf16_v##VEC(                             \
        const float* __restrict__ o_a, const float* __restrict__ lse_a, const float* __restrict__ o_b,      \
        const float* __restrict__ lse_b, size_t pairs, int head_dim, __nv_bfloat16* __restrict__ out,       \
        float* __restrict__ out_lse) {                                                                      \
        merge_state_impl<VEC>(o_a, lse_a, o_b, lse_b, pairs, head_dim, out, out_lse);                       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) merge_state_inplace_v##VEC(                          \
        float* __restrict__ o_a, float* __restrict__ lse_a, const float* __restrict__ o_b,                  \
        const float* __restrict__ lse_b, size_t pairs, int head_dim) {                                      \
        merge_state_inplace_impl<VEC>(o_a, lse_a, o_b, lse_b, pairs, head_dim);                             \
    }

MERGE_KERNELS(1)
MERGE_KERNELS(4)
