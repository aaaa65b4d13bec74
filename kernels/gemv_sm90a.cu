// One-token decode products fed through a shared-memory ring, for Hopper (compute_90a).
//
// gemv.cu's kernels start streaming a product's weights only when the kernel ahead of them has
// ended, and end with a tail in which fewer and fewer warps have loads in flight: a few µs a
// product in which the memory system idles, which weighs most where products are small (a
// tensor-parallel rank's, a quantized model's). Here each block owns a run of output units and
// one producer lane streams their weights into a ring of stages with bulk copies
// (cp.async.bulk, completing on an mbarrier); the kernel is launched as a programmatic dependent
// of the one ahead (cudaLaunchKernelEx with programmatic stream serialization), so the producer,
// which reads only weights, fills the ring while that kernel is still finishing. The consumer
// warps wait for it (griddepcontrol.wait) before they read x or write anything.
//
// Each consumer warp computes whole output units, lane by lane in the order gemv.cu's warp_dots
// uses (a lane's runs of 8 elements at lane·8 + 256 j, j rising, then the warp's shuffle sums),
// with the same arithmetic and epilogues (common.cuh), so both kernels give the same bits. x is
// staged in shared memory once a block (x · g in f32 where the product follows an RMSNorm, as
// gemv.cu forms it for every row), and the norm's 1/rms computed once a warp.
//
// Layout: a group is RING_WARPS consecutive units (one per consumer warp); a stage holds a chunk
// of `chunk` elements (a multiple of 256, or all of k) of each of the group's R rows per unit, at
// [warp][r][chunk]. Stages go group by group, chunk by chunk. Block b owns groups
// [b·groups/grid, (b+1)·groups/grid).
//
// Requirements (checked by the launcher): k % 8 == 0; W, x, g 16-byte aligned; the weights not
// written by any kernel that may still run when this one starts (model weights).
#include "common.cuh"

#define RING_WARPS 8
#define RING_THREADS ((RING_WARPS + 1) * TURBO_WARP)
#define RING_MAX_STAGES 8

__device__ __forceinline__ uint32_t ring_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ring_bar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ring_smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void ring_bar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(ring_smem(bar)), "r"(parity)
            : "memory");
    } while (!done);
}

__device__ __forceinline__ void ring_bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(ring_smem(bar)) : "memory");
}

__device__ __forceinline__ void ring_bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ring_smem(bar)), "r"(bytes) : "memory");
}

// `bytes` (a multiple of 16) from global to shared, counted on `bar` when they land.
__device__ __forceinline__ void ring_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     ring_smem(dst)),
                 "l"(src), "r"(bytes), "r"(ring_smem(bar))
                 : "memory");
}

// Row r of unit u: PAIRED units are rows 2u and 2u + 1 (the QKV product's RoPE pairs), others
// rows u and units + u (SwiGLU's gate and up; R == 1: row u).
template <bool PAIRED>
__device__ __forceinline__ size_t ring_row(int unit, int r, int units) {
    return PAIRED ? 2 * (size_t)unit + r : (size_t)unit + (size_t)r * units;
}

// Computes every unit of this block's groups and hands each warp's finished unit to `finish`
// (called by every lane of the warp with the reduced sums). Every consumer thread also calls
// finish.begin() once x may be read, finish.group_end(group) after each group and finish.end()
// after the last (for epilogues that act on a whole group: the all-reduce).
template <int R, bool NORM, bool PAIRED, class Finish>
__device__ __forceinline__ void gemv_ring(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ g, float eps, int units, int k,
                                          int chunk, int stages, Finish finish) {
    static_assert(RING_WARPS * R <= TURBO_WARP, "a producer lane per row of a group");
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) uint64_t full[RING_MAX_STAGES], empty[RING_MAX_STAGES];
    const int warp = threadIdx.x / TURBO_WARP, lane = threadIdx.x % TURBO_WARP;
    const int groups = (units + RING_WARPS - 1) / RING_WARPS;
    const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int g1 = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x);
    const int chunks = (k + chunk - 1) / chunk;
    const size_t stage_bytes = (size_t)RING_WARPS * R * chunk * sizeof(__nv_bfloat16);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            ring_bar_init(&full[s], 1);
            ring_bar_init(&empty[s], RING_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // The next product may be scheduled now: its blocks take the room this one leaves and fill
    // their own rings.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    if (warp == RING_WARPS) {
        // Lane 0 waits for a free stage and announces its bytes; lane q · R + r copies row r of
        // the group's unit q.
        int i = 0;
        for (int group = g0; group < g1; group++) {
            const int n = min(RING_WARPS, units - group * RING_WARPS);
            const int q = lane / R, r = lane % R;
            const size_t row = ring_row<PAIRED>(group * RING_WARPS + q, r, units);
            for (int c = 0; c < chunks; c++, i++) {
                const int s = i % stages;
                const int len = min(chunk, k - c * chunk);
                if (lane == 0) {
                    if (i >= stages) ring_bar_wait(&empty[s], (uint32_t)(i / stages - 1) & 1u);
                    ring_bar_expect(&full[s], (uint32_t)(n * R * len * sizeof(__nv_bfloat16)));
                }
                __syncwarp();
                if (q < n)
                    ring_copy(ring + s * stage_bytes + (size_t)lane * chunk * sizeof(__nv_bfloat16),
                              w + row * (size_t)k + (size_t)c * chunk, (uint32_t)(len * sizeof(__nv_bfloat16)),
                              &full[s]);
            }
        }
        return;
    }

    // x, g and every output may belong to the kernel ahead: nothing of them before it is done.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // x once for the block, after the ring: with the norm as x · g in f32 (the product gemv.cu
    // forms for every row), else as it is.
    float* xs = reinterpret_cast<float*>(ring + stages * stage_bytes);
    __nv_bfloat16* xb = reinterpret_cast<__nv_bfloat16*>(xs);
    for (int i = threadIdx.x * 8; i < k; i += RING_WARPS * TURBO_WARP * 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + i));
        if (NORM) {
            float xf[8], gf[8];
            bf16x8_unpack(v, xf);
            bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(g + i)), gf);
#pragma unroll
            for (int e = 0; e < 8; e++) xs[i + e] = xf[e] * gf[e];
        } else {
            *reinterpret_cast<uint4*>(xb + i) = v;
        }
    }
    // 1/rms, summed in gemv.cu's order (each lane's runs, then the warp's shuffles).
    float scale = 1.f;
    if (NORM) {
        float ss = 0.f;
        for (int i = lane * 8; i < k; i += TURBO_WARP * 8) {
            float xf[8];
            bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(x + i)), xf);
#pragma unroll
            for (int e = 0; e < 8; e++) ss = fmaf(xf[e], xf[e], ss);
        }
        scale = rsqrtf(warp_sum(ss) / (float)k + eps);
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(RING_WARPS * TURBO_WARP) : "memory");
    finish.begin();

    int i = 0;
    for (int group = g0; group < g1; group++) {
        const int unit = group * RING_WARPS + warp;
        const bool active = unit < units;  // uniform per warp
        float dot[1][R];
#pragma unroll
        for (int r = 0; r < R; r++) dot[0][r] = 0.f;
        for (int c = 0; c < chunks; c++, i++) {
            const int s = i % stages;
            ring_bar_wait(&full[s], (uint32_t)(i / stages) & 1u);
            if (active) {
                const int len = min(chunk, k - c * chunk);
                const __nv_bfloat16* rows =
                    reinterpret_cast<const __nv_bfloat16*>(ring + s * stage_bytes) + (size_t)warp * R * chunk;
#pragma unroll 4
                for (int j = lane * 8; j < len; j += TURBO_WARP * 8) {
                    float wf[R][8];
#pragma unroll
                    for (int r = 0; r < R; r++)
                        bf16x8_unpack(*reinterpret_cast<const uint4*>(rows + (size_t)r * chunk + j), wf[r]);
                    float xf[8];
                    const int at = c * chunk + j;
                    if (NORM) {
                        const float4 lo = *reinterpret_cast<const float4*>(xs + at);
                        const float4 hi = *reinterpret_cast<const float4*>(xs + at + 4);
                        xf[0] = lo.x, xf[1] = lo.y, xf[2] = lo.z, xf[3] = lo.w;
                        xf[4] = hi.x, xf[5] = hi.y, xf[6] = hi.z, xf[7] = hi.w;
                    } else {
                        bf16x8_unpack(*reinterpret_cast<const uint4*>(xb + at), xf);
                    }
#pragma unroll
                    for (int e = 0; e < 8; e++) {
#pragma unroll
                        for (int r = 0; r < R; r++) dot[0][r] = fmaf(wf[r][e], xf[e], dot[0][r]);
                    }
                }
            }
            __syncwarp();
            if (lane == 0) ring_bar_arrive(&empty[s]);
        }
        if (active) {
#pragma unroll
            for (int r = 0; r < R; r++) dot[0][r] = warp_sum(dot[0][r]) * scale;
            finish(unit, dot);
        }
        finish.group_end(group);
    }
    finish.end();
}

// Epilogues that act on units one at a time.
struct RingUnitEpilogue {
    __device__ __forceinline__ void begin() {}
    __device__ __forceinline__ void group_end(int) const {}
    __device__ __forceinline__ void end() const {}
};

struct RingStore : RingUnitEpilogue {
    void* out;
    int units, mode;
    template <int R>
    __device__ __forceinline__ void operator()(int unit, const float (&dot)[1][R]) const {
        if (threadIdx.x % TURBO_WARP == 0) gemv_store<1, R>(dot, out, units, unit, mode);
    }
};

struct RingQkvRope : RingUnitEpilogue {
    GemvQkvRope o;
    __device__ __forceinline__ void operator()(int unit, const float (&dot)[1][2]) const {
        if (threadIdx.x % TURBO_WARP == 0) gemv_qkv_rope_store<1>(dot, o, unit);
    }
};

// Grid: at most ceil(units / RING_WARPS) blocks of RING_THREADS threads; dynamic shared memory
// stages · RING_WARPS · R · chunk · 2 bytes (R = 2 for SwiGLU) for the ring, then x: 4k bytes
// with a norm, else 2k. `g` and `eps` are ignored without a norm, `mode` by SwiGLU.
extern "C" __global__ void __launch_bounds__(RING_THREADS)
    gemv_ring_m1(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps, void* out,
                 int units, int k, int mode, int chunk, int stages) {
    gemv_ring<1, false, false>(w, x, g, eps, units, k, chunk, stages, RingStore{{}, out, units, mode});
}

extern "C" __global__ void __launch_bounds__(RING_THREADS)
    gemv_ring_norm_m1(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps, void* out,
                      int units, int k, int mode, int chunk, int stages) {
    gemv_ring<1, true, false>(w, x, g, eps, units, k, chunk, stages, RingStore{{}, out, units, mode});
}

extern "C" __global__ void __launch_bounds__(RING_THREADS)
    gemv_ring_norm_swiglu_m1(const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,
                             void* out, int units, int k, int mode, int chunk, int stages) {
    gemv_ring<2, true, false>(w, x, g, eps, units, k, chunk, stages, RingStore{{}, out, units, mode});
}

// gemv.cu's gemv_norm_qkv_rope_m1 fed through the ring: units = q_cols / 2 + kv_cols RoPE pairs.
extern "C" __global__ void __launch_bounds__(RING_THREADS) gemv_ring_norm_qkv_rope_m1(
    const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps, __nv_bfloat16* q,
    __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const unsigned* positions, const unsigned* slots,
    const float* inv_freq, int q_cols, int kv_cols, int head_dim, long long cache_slots, int k, int chunk,
    int stages) {
    const GemvQkvRope o = {q, k_cache, v_cache, positions, slots, inv_freq, q_cols, kv_cols, head_dim, cache_slots};
    gemv_ring<2, true, true>(w, x, g, eps, q_cols / 2 + kv_cols, k, chunk, stages, RingQkvRope{{}, o});
}

// gemv.cu's gemv_all_reduce_m1 fed through the ring: a row-parallel product of a tensor-parallel
// decode step and its all-reduce. Each group is the eight consecutive outputs a block of that
// kernel computes, and is summed as it sums them: rank 0's part bf16(residual + x · Wᵀ), every
// other rank's bf16(x · Wᵀ), pushed as two flagged lines into every peer's inbox, the peers'
// lines pulled, and the rank-order f32 sum written once into the residual stream; the same bits.
// Every rank runs the same grid and groups, and the launcher checks that the grid is resident
// at once (a block waits only for its peers' block of the same index).
struct RingAllReduce {
    __nv_bfloat16* residual;
    int rank, world;
    const unsigned long long* table;
    long long slot_lines;
    const volatile int* abort_flag;
    float (*part)[RING_WARPS];  // [2][RING_WARPS] in shared memory, by group parity
    CommCall call;

    // The call's epoch is what the collective kernel ahead wrote: read once that kernel is done.
    __device__ __forceinline__ void begin() { call = comm_begin_call(table, rank); }

    __device__ __forceinline__ void operator()(int unit, const float (&dot)[1][1]) const {
        if (threadIdx.x % TURBO_WARP != 0) return;
        const float v = rank == 0 ? __bfloat162float(residual[unit]) + dot[0][0] : dot[0][0];
        part[(unit / RING_WARPS) & 1][unit % RING_WARPS] = round_bf16(v);
    }

    __device__ __forceinline__ void group_end(int group) const {
        asm volatile("bar.sync 1, %0;\n" ::"n"(RING_WARPS * TURBO_WARP) : "memory");
        if (threadIdx.x >= 2) return;
        const int j = threadIdx.x;
        const unsigned epoch = call.epoch;
        const long long element = (long long)group * RING_WARPS + 4 * j;
        const long long line = element / 4;
        const float* mine = &part[group & 1][4 * j];
        comm_all_reduce_line(table, rank, world, slot_lines, epoch, abort_flag, line, mine, residual + element);
    }

    // comm_end_call among the consumer warps (the producer warp has left).
    __device__ __forceinline__ void end() const {
        asm volatile("bar.sync 1, %0;\n" ::"n"(RING_WARPS * TURBO_WARP) : "memory");
        unsigned* blocks_done = call.own_epoch + 1;
        if (threadIdx.x == 0 && atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
            *blocks_done = 0;
            *call.own_epoch = call.epoch;
        }
    }
};

// Grid: as the other ring kernels, every block resident at once, units % RING_WARPS == 0.
extern "C" __global__ void __launch_bounds__(RING_THREADS) gemv_ring_all_reduce_m1(
    const __nv_bfloat16* w, const __nv_bfloat16* x, __nv_bfloat16* residual, int units, int k, int rank, int world,
    const unsigned long long* table, long long slot_lines, const volatile int* abort_flag, int chunk, int stages) {
    __shared__ float part[2][RING_WARPS];
    RingAllReduce epilogue{residual, rank, world, table, slot_lines, abort_flag, part, CommCall{}};
    gemv_ring<1, false, false>(w, x, nullptr, 0.f, units, k, chunk, stages, epilogue);
}
