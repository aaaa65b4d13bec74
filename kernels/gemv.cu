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

// A 16-byte load that is not kept in L1 (each weight is read once per step).
__device__ __forceinline__ uint4 load_streaming(const __nv_bfloat16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// One lane's step over elements i..i+7 of R weight rows (wv) and M tokens of x ([M, k]): the
// dot products, and with NORM the sums of x² and x scaled by the norm's weight g first.
template <int M, int R, bool NORM>
__device__ __forceinline__ void gemv_accumulate(const uint4 (&wv)[R], const __nv_bfloat16* __restrict__ x,
                                                const __nv_bfloat16* __restrict__ g, int k, int i,
                                                float (&ss)[M], float (&dot)[M][R]) {
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; r++) bf16x8_unpack(wv[r], wf[r]);
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
            for (int r = 0; r < R; r++) dot[m][r] = fmaf(wf[r][e], xf[e], dot[m][r]);
        }
    }
}

// The warp's sums of its lanes' steps, times token m's 1/rms with NORM: every lane gets them.
template <int M, int R, bool NORM>
__device__ __forceinline__ void gemv_reduce(float (&ss)[M], float (&dot)[M][R], int k, float eps) {
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float scale = NORM ? rsqrtf(warp_sum(ss[m]) / (float)k + eps) : 1.f;
#pragma unroll
        for (int r = 0; r < R; r++) dot[m][r] = warp_sum(dot[m][r]) * scale;
    }
}

// The warp's R weight rows times each of M tokens, summed over the warp: every lane gets
// dot[m][r] (times token m's 1/rms with NORM).
template <int M, int R, bool NORM>
__device__ __forceinline__ void warp_dots(const __nv_bfloat16* const (&row)[R], const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ g, float eps, int k,
                                          float (&dot)[M][R]) {
    const int lane = threadIdx.x % TURBO_WARP;
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        ss[m] = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++) dot[m][r] = 0.f;
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
            gemv_accumulate<M, R, NORM>(wv[u], x, g, k, i, ss, dot);
        }
    }

    gemv_reduce<M, R, NORM>(ss, dot, k, eps);
}

// R weight rows per warp (1, or 2 for SwiGLU's gate and up), M tokens.
template <int M, int R, bool NORM>
__device__ __forceinline__ void gemv(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                     const __nv_bfloat16* __restrict__ g, float eps, void* out, int units,
                                     int k, int mode) {
    const int unit = blockIdx.x * GEMV_WARPS + threadIdx.x / TURBO_WARP;
    if (unit >= units) return;  // uniform per warp; no barriers follow

    const __nv_bfloat16* row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = w + (size_t)(unit + r * units) * (size_t)k;
    float dot[M][R];
    warp_dots<M, R, NORM>(row, x, g, eps, k, dot);
    if (threadIdx.x % TURBO_WARP == 0) gemv_store<M, R>(dot, out, units, unit, mode);
}

// The attention block's first product fused with the step after it (elementwise.cu's
// qkv_rope_kv): W is the fused [W_q; W_k; W_v] (q_cols + 2 kv_cols rows, heads' dimensions as
// interleaved RoPE pairs), and the warp of unit u computes rows 2u and 2u + 1, one pair. Each
// product is rounded to bf16 as a stored QKV row would be, then q and k pairs are rotated at the
// token's position exactly as qkv_rope_kv rotates them; q goes to q ([M, q_cols]), k and v to
// slot slots[m] of the paged caches (kv_cols per slot; a slot >= cache_slots is skipped).
template <int M>
__device__ __forceinline__ void gemv_qkv_rope(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                              const __nv_bfloat16* __restrict__ g, float eps, __nv_bfloat16* q,
                                              __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                                              const unsigned* positions, const unsigned* slots,
                                              const float* inv_freq, int q_cols, int kv_cols, int head_dim,
                                              long long cache_slots, int k) {
    const int unit = blockIdx.x * GEMV_WARPS + threadIdx.x / TURBO_WARP;
    const int qp = q_cols / 2, kp = kv_cols / 2;
    if (unit >= qp + 2 * kp) return;  // uniform per warp
    const __nv_bfloat16* row[2] = {w + (size_t)(2 * unit) * (size_t)k, w + (size_t)(2 * unit + 1) * (size_t)k};
    float dot[M][2];
    warp_dots<M, 2, true>(row, x, g, eps, k, dot);
    if (threadIdx.x % TURBO_WARP != 0) return;
    const GemvQkvRope o = {q, k_cache, v_cache, positions, slots, inv_freq, q_cols, kv_cols, head_dim, cache_slots};
    gemv_qkv_rope_store<M>(dot, o, unit);
}

// A row-parallel product of a tensor-parallel decode step fused with its all-reduce: rank 0's
// partial is bf16(residual + x · Wᵀ), every other rank's bf16(x · Wᵀ), exactly as the unfused
// products store them; each block pushes its GEMV_WARPS outputs a token as two flagged lines into
// every peer's inbox (comm.cu's all_reduce_flagged_bf16 layout: line = element / 4), waits for the
// same lines of every peer, and writes the rank-order f32 sum, rounded once, into the residual
// stream: the bits of the separate product and all-reduce, with one launch and one crossing of the
// link. Needs units % GEMV_WARPS == 0 and the whole grid resident at once (checked by the
// launcher): a block waits only for peers' blocks of the same index, which wait for nothing before
// they push.
template <int M>
__device__ __forceinline__ void gemv_all_reduce(const __nv_bfloat16* __restrict__ w,
                                                const __nv_bfloat16* __restrict__ x, __nv_bfloat16* residual,
                                                int units, int k, int rank, int world,
                                                const unsigned long long* table, long long slot_lines,
                                                const volatile int* abort_flag) {
    __shared__ float part[M][GEMV_WARPS];
    const CommCall call = comm_begin_call(table, rank);
    const unsigned epoch = call.epoch;
    const int warp = threadIdx.x / TURBO_WARP;
    const int unit = blockIdx.x * GEMV_WARPS + warp;
    const __nv_bfloat16* row[1] = {w + (size_t)unit * (size_t)k};
    float dot[M][1];
    warp_dots<M, 1, false>(row, x, nullptr, 0.f, k, dot);
    if (threadIdx.x % TURBO_WARP == 0) {
#pragma unroll
        for (int m = 0; m < M; m++) {
            const float v = rank == 0 ? __bfloat162float(residual[(size_t)m * units + unit]) + dot[m][0] : dot[m][0];
            part[m][warp] = round_bf16(v);
        }
    }
    __syncthreads();
    if (threadIdx.x < 2 * M) {
        const int m = threadIdx.x / 2, j = threadIdx.x % 2;
        const long long element = (long long)m * units + (long long)blockIdx.x * GEMV_WARPS + 4 * j;
        const long long line = element / 4;
        const float* mine = &part[m][4 * j];
        comm_all_reduce_line(table, rank, world, slot_lines, epoch, abort_flag, line, mine, residual + element);
    }
    comm_end_call(call);
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

// Grid: ceil((q_cols / 2 + kv_cols) / GEMV_WARPS) blocks of GEMV_WARPS warps.
#define GEMV_QKV_ROPE_KERNEL(M)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * TURBO_WARP) gemv_norm_qkv_rope_m##M(          \
        const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps, __nv_bfloat16* q, \
        __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const unsigned* positions, const unsigned* slots,    \
        const float* inv_freq, int q_cols, int kv_cols, int head_dim, long long cache_slots, int k) {        \
        gemv_qkv_rope<M>(w, x, g, eps, q, k_cache, v_cache, positions, slots, inv_freq, q_cols, kv_cols,     \
                         head_dim, cache_slots, k);                                                         \
    }

// Grid: units / GEMV_WARPS blocks of GEMV_WARPS warps.
#define GEMV_ALL_REDUCE_KERNEL(M)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * TURBO_WARP) gemv_all_reduce_m##M(             \
        const __nv_bfloat16* w, const __nv_bfloat16* x, __nv_bfloat16* residual, int units, int k, int rank,  \
        int world, const unsigned long long* table, long long slot_lines, const volatile int* abort_flag) {   \
        gemv_all_reduce<M>(w, x, residual, units, k, rank, world, table, slot_lines, abort_flag);           \
    }

GEMV_ALL_REDUCE_KERNEL(1)
GEMV_ALL_REDUCE_KERNEL(2)
GEMV_ALL_REDUCE_KERNEL(3)
GEMV_ALL_REDUCE_KERNEL(4)

GEMV_QKV_ROPE_KERNEL(1)
GEMV_QKV_ROPE_KERNEL(2)
GEMV_QKV_ROPE_KERNEL(3)
GEMV_QKV_ROPE_KERNEL(4)

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(3)
GEMV_KERNELS(4)
