// Paged attention kernels.
//
// Causal attention of each query row over its sequence's cached keys, which live in fixed-size
// blocks reached through the sequence's block table (the CPU reference is
// turbo_attention::paged_attention). Layouts:
//   q, out      [tokens][n_heads][head_dim]                 bf16
//   k/v cache   [block][slot in block][n_kv_heads][head_dim]  bf16
//   lse         [tokens][n_heads]                           f32, natural log of Σ exp(scaled score)
// Query head h reads KV head h / group (grouped-query attention, group = n_heads / n_kv_heads).
//
// Rows of few query tokens (decode) are computed "flash-decoding" style: a CTA computes the
// attention of one query row over one range of its keys, as a state (o, lse). A row whose keys
// are split into several ranges has its states written to f32 scratch and merged; a row with a
// single range is written to the output directly. Two kernels do this:
//   attn_decode_d*  tensor cores, all query heads of one KV head in one CTA (each K and V row is
//                   read once for the whole group): head_dim 64 and 128
//   attn_chunk_d*   CUDA cores, one CTA per query head: every supported head_dim
// Both merge split rows themselves: each range's CTA writes its state, and the last of a row's
// ranges to finish (an atomic count per first state slot and grid.y, which that CTA resets to 0
// for the next launch) merges all the row's states for its heads and writes the output, so a
// split step is one launch with no merge pass behind it.
//
// Host-made tables (all u32):
//   tables          the block tables of all sequences, concatenated
//   seq_table_start [seqs]   where each sequence's table starts in `tables` (prefill, cascade)
//   items           [n][8]   the row kernels' work items: query row, first key, end key
//                            (exclusive, at most the row's position + 1), state slot (0xffffffff:
//                            write the output), where the row's block table starts in `tables`,
//                            and for a split row: its first state slot, its number of states
//                            (prefix chunks of the cascade pass included), and how many items
//                            (ranges) it has
//   counters        [first state slot][grid.y] finished ranges of each split row, zero between
//                   launches
//
// Prefill spans (many query rows of one sequence) go instead to attn_prefill_d*, a tensor-core
// FlashAttention-2 kernel (at the end of this file).
#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * TURBO_WARP)
// Keys each lane group takes per step: their loads are all issued before any score is reduced.
#define ATTN_UNROLL 2
// CTAs per SM the chunk kernels are built for (so up to 128 registers a thread): without it
// ptxas caps them lower and spills.
#define ATTN_MIN_CTAS 4
// States attn_chunk's fused merge loads before using any (within those registers).
#define ATTN_MERGE_UNROLL 8

#define ATTN_LOG2E 1.4426950408889634f
// A work item's state slot meaning "write the output, not a state".
#define ATTN_NO_STATE 0xffffffffu
#define ATTN_LN2 0.6931471805599453f

__device__ __forceinline__ float attn_neg_inf() { return __int_as_float(0xff800000); }

// bf16 bit patterns to f32: a bf16 is the top half of an f32.
__device__ __forceinline__ float attn_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float attn_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// E consecutive bf16 at p to f32, in 16-, 8- or 4-byte loads as E allows (p must be aligned to
// that width: rows start at multiples of head_dim and lanes at multiples of E elements).
template <int E>
__device__ __forceinline__ void attn_load(const __nv_bfloat16* __restrict__ p, float (&f)[E]) {
    if constexpr (E % 8 == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
        for (int i = 0; i < E / 8; i++) {
            const uint4 w = __ldg(v + i);
            f[8 * i + 0] = attn_bf16_lo(w.x);
            f[8 * i + 1] = attn_bf16_hi(w.x);
            f[8 * i + 2] = attn_bf16_lo(w.y);
            f[8 * i + 3] = attn_bf16_hi(w.y);
            f[8 * i + 4] = attn_bf16_lo(w.z);
            f[8 * i + 5] = attn_bf16_hi(w.z);
            f[8 * i + 6] = attn_bf16_lo(w.w);
            f[8 * i + 7] = attn_bf16_hi(w.w);
        }
    } else if constexpr (E % 4 == 0) {
        const uint2* v = reinterpret_cast<const uint2*>(p);
#pragma unroll
        for (int i = 0; i < E / 4; i++) {
            const uint2 w = __ldg(v + i);
            f[4 * i + 0] = attn_bf16_lo(w.x);
            f[4 * i + 1] = attn_bf16_hi(w.x);
            f[4 * i + 2] = attn_bf16_lo(w.y);
            f[4 * i + 3] = attn_bf16_hi(w.y);
        }
    } else if constexpr (E % 2 == 0) {
        const unsigned int* v = reinterpret_cast<const unsigned int*>(p);
#pragma unroll
        for (int i = 0; i < E / 2; i++) {
            const uint32_t w = __ldg(v + i);
            f[2 * i + 0] = attn_bf16_lo(w);
            f[2 * i + 1] = attn_bf16_hi(w);
        }
    } else {
        const unsigned short* v = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
        for (int i = 0; i < E; i++) f[i] = attn_bf16_lo((uint32_t)__ldg(v + i));
    }
}

// E consecutive 8-bit codes of a quantized cache at p, decoded to kvq_decode4's exact values (the
// caller applies the row's scale times kvq_unit). Loaded 16, 8 or 4 bytes at a time as E allows
// (p aligned to that width).
template <int KIND, int E>
__device__ __forceinline__ void kvq_load(const uint8_t* __restrict__ p, float (&f)[E]) {
    static_assert(E % 4 == 0, "codes come four to a word");
    uint32_t w[E / 4];
    if constexpr (E % 16 == 0) {
#pragma unroll
        for (int i = 0; i < E / 16; i++) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
            w[4 * i] = v.x;
            w[4 * i + 1] = v.y;
            w[4 * i + 2] = v.z;
            w[4 * i + 3] = v.w;
        }
    } else if constexpr (E % 8 == 0) {
#pragma unroll
        for (int i = 0; i < E / 8; i++) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + i);
            w[2 * i] = v.x;
            w[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < E / 4; i++) w[i] = __ldg(reinterpret_cast<const uint32_t*>(p) + i);
    }
#pragma unroll
    for (int i = 0; i < E / 4; i++) {
        float d[4];
        kvq_decode4<KIND>(w[i], d);
#pragma unroll
        for (int j = 0; j < 4; j++) f[4 * i + j] = d[j];
    }
}

// Copies 4 bytes to shared memory asynchronously (zeros when !valid).
__device__ __forceinline__ void kvq_cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(pf_smem(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

// Two f32 as a bf16 pair (lo in the low half, as mma fragments and memory order want).
__device__ __forceinline__ uint32_t pf_pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Merges states [first, first + n) of query heads h0 .. h0 + nh of query row `token` into out
// (and lse_out when given), run by all THREADS threads of the CTA that counted last
// (attn_last_range). Thread c of group g sums float4 column c (head c / (HD / 4)) of states g,
// g + G, .. as an online softmax (max-shifted, loading U states before using any, so that they
// are one round trip rather than one per state); the groups' sums are combined through `smem`
// (THREADS · 6 floats). Empty states (lse = -inf) weigh exactly 0; with none finite, o = 0 and
// lse = -inf; a single state passes through exactly (weight 1). The states were written by other
// CTAs of this launch: they are read from L2 (ld.cg), after attn_last_range's acquire.
template <int HD, int THREADS, int U>
__device__ __forceinline__ void attn_merge_row(const float* __restrict__ part_o,
                                                 const float* __restrict__ part_lse, uint32_t first,
                                                 uint32_t n, int n_heads, int h0, int nh, size_t token,
                                                 __nv_bfloat16* __restrict__ out,
                                                 float* __restrict__ lse_out, float* smem) {
    constexpr int C = HD / 4;  // float4 columns per head
    const int tid = threadIdx.x;
    const int cols = nh * C;
    const int width = min(cols, THREADS);  // columns per pass
    const int groups = THREADS / width;
    float4* const sm_acc = reinterpret_cast<float4*>(smem);
    float* const sm_m = smem + 4 * THREADS;
    float* const sm_l = sm_m + THREADS;
    for (int col0 = 0; col0 < cols; col0 += width) {
        const int c = col0 + tid % width, g = tid / width;
        const bool active = g < groups && c < cols;
        const int head = h0 + c / C;
        float m = attn_neg_inf(), l = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (active) {
            for (uint32_t s0 = (uint32_t)g; s0 < n; s0 += U * (uint32_t)groups) {
                float x[U];
                float4 v[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const uint32_t sidx = s0 + (uint32_t)(u * groups);
                    x[u] = attn_neg_inf();
                    v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (sidx < n) {
                        const size_t st = (size_t)(first + sidx) * (size_t)n_heads + (size_t)head;
                        x[u] = __ldcg(part_lse + st);
                        v[u] = __ldcg(reinterpret_cast<const float4*>(part_o + st * HD) + c % C);
                    }
                }
                float mx = m;
#pragma unroll
                for (int u = 0; u < U; u++) mx = fmaxf(mx, x[u]);
                if (mx == attn_neg_inf()) continue;  // nothing but empty states so far
                const float corr = __expf(m - mx);    // 0 while m is -inf
                l *= corr;
                acc.x *= corr;
                acc.y *= corr;
                acc.z *= corr;
                acc.w *= corr;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const float w = __expf(x[u] - mx);  // 0 for an empty state
                    l += w;
                    acc.x = fmaf(w, v[u].x, acc.x);
                    acc.y = fmaf(w, v[u].y, acc.y);
                    acc.z = fmaf(w, v[u].z, acc.z);
                    acc.w = fmaf(w, v[u].w, acc.w);
                }
                m = mx;
            }
        }
        if (groups > 1) {
            sm_acc[tid] = acc;
            sm_m[tid] = m;
            sm_l[tid] = l;
            __syncthreads();
            if (g == 0) {
                float mx = m;
                for (int k = 1; k < groups; k++) mx = fmaxf(mx, sm_m[k * width + tid]);
                if (mx != attn_neg_inf()) {
                    const float c0 = __expf(m - mx);
                    l *= c0;
                    acc.x *= c0;
                    acc.y *= c0;
                    acc.z *= c0;
                    acc.w *= c0;
                    for (int k = 1; k < groups; k++) {
                        const float ck = __expf(sm_m[k * width + tid] - mx);
                        const float4 a = sm_acc[k * width + tid];
                        l = fmaf(ck, sm_l[k * width + tid], l);
                        acc.x = fmaf(ck, a.x, acc.x);
                        acc.y = fmaf(ck, a.y, acc.y);
                        acc.z = fmaf(ck, a.z, acc.z);
                        acc.w = fmaf(ck, a.w, acc.w);
                    }
                }
                m = mx;
            }
            __syncthreads();  // the buffers are reused by the next pass
        }
        if (active && g == 0) {
            // l == 0 only when every state is empty: o = 0, lse = -inf.
            const bool empty = !(l > 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            const size_t row = token * (size_t)n_heads + (size_t)head;
            uint2 packed;
            packed.x = pf_pack(acc.x * inv, acc.y * inv);
            packed.y = pf_pack(acc.z * inv, acc.w * inv);
            *reinterpret_cast<uint2*>(out + row * HD + 4 * (c % C)) = packed;
            if (c % C == 0 && lse_out != nullptr) lse_out[row] = empty ? attn_neg_inf() : m + logf(l);
        }
    }
}

// Counts the CTA's range as finished for its row (counter first_slot · grid.y + blockIdx.y);
// true, in every thread, in the CTA that counts last, which then merges the row. The barrier
// orders every thread's state writes before thread 0's count, whose release (cumulative)
// publishes them to the GPU and whose acquire, in the last CTA, makes the other CTAs' states
// visible to it; the second barrier passes that on to the CTA's threads (in place of a
// __threadfence, an SC fence, in every thread). The last CTA resets the counter for the next
// launch. The flag is a barrier's result, not static shared memory: with a __shared__ flag, decode
// steps measured 8-40% slower, also those that never merge (docs/perf/h100.md).
__device__ __forceinline__ bool attn_last_range(uint32_t* __restrict__ counters, uint32_t first_slot,
                                                uint32_t ranges) {
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
        uint32_t* const count = counters + (size_t)first_slot * gridDim.y + blockIdx.y;
        uint32_t before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
        last = before == ranges - 1;
        if (last) *count = 0;
    }
    return __syncthreads_or(last);
}

// One CTA: work item blockIdx.x (query row `token`, keys [k0, k1) of that row's sequence, a state
// slot), head blockIdx.y.
//
// A warp is cut into KPW = 32 / G groups of G lanes; a group scores one key at a time, each lane
// owning E = HD / G consecutive dimensions of q, of the key and value rows, and of the output. A
// warp step covers KPW * ATTN_UNROLL consecutive keys (the warps interleave over the chunk): the
// lanes load their slices of the K and V rows (each element read once), reduce the partial dots
// within their group (log2 G shuffles), and each group folds its keys into its own online
// softmax (m, l, acc), in the log2 domain (q is pre-scaled by scale * log2(e), so exp2 of a score
// difference is exp of the scaled one). The ATTN_WARPS * KPW group states are then merged through
// shared memory.
template <int HD, int G, int KIND>
__device__ __forceinline__ void attn_chunk(const __nv_bfloat16* __restrict__ q,
                                           const __nv_bfloat16* __restrict__ k_cache,
                                           const __nv_bfloat16* __restrict__ v_cache,
                                           const uint32_t* __restrict__ tables,
                                           const uint32_t* __restrict__ items, int n_heads, int group,
                                           int n_kv_heads, int block_size, int block_shift, float scale, float* __restrict__ part_o,
                                           float* __restrict__ part_lse, uint32_t* __restrict__ counters,
                                           __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {
    static_assert(G >= 1 && G <= TURBO_WARP && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(HD % G == 0 && HD <= 256, "head_dim must be a multiple of G, at most 256");
    constexpr int E = HD / G;
    constexpr int KPW = TURBO_WARP / G;
    constexpr int U = ATTN_UNROLL;
    constexpr uint32_t STEP = KPW * U;
    constexpr int S = ATTN_WARPS * KPW;
    __shared__ float sm_m[S];
    __shared__ float sm_l[S];
    __shared__ float sm_o[S][HD];
    static_assert(S * HD >= 6 * ATTN_THREADS, "sm_o doubles as the fused merge's buffer");

    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const int sub = lane / G, part = lane % G;
    const int head = blockIdx.y;
    // An empty range (k0 == k1, as a fixed split makes) gives o = 0 and lse = -inf.
    const uint4 it = reinterpret_cast<const uint4*>(items)[2 * blockIdx.x];
    const uint4 it2 = reinterpret_cast<const uint4*>(items)[2 * blockIdx.x + 1];
    const uint32_t token = it.x, k0 = it.y, k1 = it.z, state = it.w;
    const uint32_t* table = tables + it2.x;

    const size_t row_q = (size_t)token * (size_t)n_heads + (size_t)head;
    float qv[E];
    attn_load<E>(q + row_q * HD + part * E, qv);
    const float qscale = scale * ATTN_LOG2E;
#pragma unroll
    for (int i = 0; i < E; i++) qv[i] *= qscale;

    const size_t slot_stride = (size_t)n_kv_heads * HD;
    const size_t head_off = (size_t)(head / group) * HD + (size_t)part * E;

    // This group's online softmax over the keys it has seen; m = -inf until the first.
    float m = attn_neg_inf(), l = 0.f;
    float acc[E];
#pragma unroll
    for (int i = 0; i < E; i++) acc[i] = 0.f;

    for (uint32_t base = k0 + (uint32_t)warp * STEP; base < k1; base += ATTN_WARPS * STEP) {
        float s[U];
        float vv[U][E];
        float ksc[U], vsc[U];  // quantized: the keys' and values' scales (1 for bf16)
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t key = base + (uint32_t)(u * KPW + sub);
            s[u] = 0.f;
            ksc[u] = vsc[u] = 0.f;
            if (key < k1) {
                const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                const uint32_t slot = key - b * (uint32_t)block_size;
                float kk[E];
                if constexpr (KIND == KV_BF16) {
                    const size_t row =
                        ((size_t)table[b] * (size_t)block_size + slot) * slot_stride + head_off;
                    attn_load<E>(k_cache + row, kk);
                    attn_load<E>(v_cache + row, vv[u]);
                } else {
                    const uint8_t* kq = reinterpret_cast<const uint8_t*>(k_cache);
                    const uint8_t* vq = reinterpret_cast<const uint8_t*>(v_cache);
                    const int kvh = head / group;
                    const size_t code = kvq_code_at(table[b], slot, kvh, block_size, n_kv_heads, HD) + (size_t)part * E;
                    const size_t sc = kvq_scale_at(table[b], slot, kvh, block_size, n_kv_heads, HD);
                    // The scales multiply the key's dot product and the value's softmax weight
                    // instead of each element.
                    constexpr float unit = kvq_unit<KIND>();
                    ksc[u] = __ldg(reinterpret_cast<const float*>(kq + sc)) * unit;
                    vsc[u] = __ldg(reinterpret_cast<const float*>(vq + sc)) * unit;
                    kvq_load<KIND, E>(kq + code, kk);
                    kvq_load<KIND, E>(vq + code, vv[u]);
                }
#pragma unroll
                for (int i = 0; i < E; i++) s[u] = fmaf(qv[i], kk[i], s[u]);
            } else {
#pragma unroll
                for (int i = 0; i < E; i++) vv[u][i] = 0.f;
            }
        }
        // Every lane of the warp gets here (the loop condition is the same for the whole warp),
        // so the full-mask shuffles are safe; xor offsets below G stay within a group.
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int o = G / 2; o > 0; o >>= 1) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
            if constexpr (KIND != KV_BF16) s[u] *= ksc[u];
        }
        float m_new = m;
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (base + (uint32_t)(u * KPW + sub) >= k1) s[u] = attn_neg_inf();
            m_new = fmaxf(m_new, s[u]);
        }
        // -inf only while this group has seen no key at all: then there is nothing to fold in
        // (and exp2(-inf - -inf) would be NaN).
        if (m_new != attn_neg_inf()) {
            const float corr = exp2f(m - m_new);  // 0 while m is still -inf
            l *= corr;
#pragma unroll
            for (int i = 0; i < E; i++) acc[i] *= corr;
#pragma unroll
            for (int u = 0; u < U; u++) {
                const float p = exp2f(s[u] - m_new);  // 0 for keys past the chunk
                l += p;
                const float pv = KIND == KV_BF16 ? p : p * vsc[u];
#pragma unroll
                for (int i = 0; i < E; i++) acc[i] = fmaf(pv, vv[u][i], acc[i]);
            }
            m = m_new;
        }
    }

    // Merge the S group states. A group that saw no key has m = -inf, l = 0, acc = 0.
    const int st = warp * KPW + sub;
    if (part == 0) {
        sm_m[st] = m;
        sm_l[st] = l;
    }
#pragma unroll
    for (int i = 0; i < E; i++) sm_o[st][part * E + i] = acc[i];
    __syncthreads();
    float mx = attn_neg_inf();
#pragma unroll
    for (int w = 0; w < S; w++) mx = fmaxf(mx, sm_m[w]);
    // An empty group weighs exactly 0; so do all when no key was seen (an empty range).
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < S; w++) sum += sm_m[w] == attn_neg_inf() ? 0.f : exp2f(sm_m[w] - mx) * sm_l[w];
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : 1.f / sum;
    const float lse = empty ? attn_neg_inf() : mx * ATTN_LN2 + logf(sum);

    const bool direct = state == ATTN_NO_STATE;
    const size_t dst = direct ? row_q : (size_t)state * (size_t)n_heads + (size_t)head;
    for (int d = threadIdx.x; d < HD; d += ATTN_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < S; w++) {
            if (sm_m[w] != attn_neg_inf()) o = fmaf(exp2f(sm_m[w] - mx), sm_o[w][d], o);
        }
        o *= inv;
        if (direct) {
            out[dst * HD + d] = __float2bfloat16_rn(o);
        } else {
            part_o[dst * HD + d] = o;
        }
    }
    if (threadIdx.x == 0) {
        if (!direct) {
            part_lse[dst] = lse;
        } else if (lse_out != nullptr) {
            lse_out[dst] = lse;
        }
    }
    if (direct) return;
    // The row's last range to finish merges its states (sm_o, read above, becomes the buffer).
    if (!attn_last_range(counters, it2.y, it2.w)) return;
    attn_merge_row<HD, ATTN_THREADS, ATTN_MERGE_UNROLL>(part_o, part_lse, it2.y, it2.z, n_heads, head, 1, token,
                                                        out, lse_out, &sm_o[0][0]);
}

#define ATTN_CHUNK_KERNEL(HD, G) ATTN_CHUNK_KERNEL_OF(HD, G, KV_BF16, d) ATTN_CHUNK_KERNEL_OF(HD, G, KV_INT8, q8_d) \
    ATTN_CHUNK_KERNEL_OF(HD, G, KV_FP8, f8_d)
// attn_chunk_d*: bf16 cache; attn_chunk_q8_d*, attn_chunk_f8_d*: INT8 and FP8 caches (same arguments,
// the cache ranges holding codes and scales as common.cuh lays them out).
#define ATTN_CHUNK_KERNEL_OF(HD, G, KIND, NAME)                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_CTAS) attn_chunk_##NAME##HD(                    \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                  \
        const __nv_bfloat16* __restrict__ v_cache, const uint32_t* __restrict__ tables,                  \
        const uint32_t* __restrict__ items, int n_heads, int group, int n_kv_heads, int block_size,      \
        int block_shift, float scale, float* __restrict__ part_o, float* __restrict__ part_lse,          \
        uint32_t* __restrict__ counters, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) { \
        attn_chunk<HD, G, KIND>(q, k_cache, v_cache, tables, items, n_heads, group, n_kv_heads, block_size, \
                          block_shift, scale, part_o, part_lse, counters, out, lse_out);                \
    }

// (head_dim, lanes per key): 8 or 16 bf16 per lane (12 for 96 and 192), loaded 16 or 8 bytes at a time.
ATTN_CHUNK_KERNEL(32, 4)
ATTN_CHUNK_KERNEL(64, 8)
ATTN_CHUNK_KERNEL(96, 8)
ATTN_CHUNK_KERNEL(128, 8)
ATTN_CHUNK_KERNEL(192, 16)
ATTN_CHUNK_KERNEL(256, 16)

// ------------------------------------------------------------------------------------------------
// Prefill: tensor-core FlashAttention-2 over the paged KV.
//
// One CTA (WARPS warps of MT 16-row m-tiles each) computes 16 · MT · WARPS consecutive query rows
// of one span (one sequence) for one head. Q goes to shared memory (and, with MT = 1, from there
// once into mma fragments in registers). The CTA then walks its keys in tiles of BN, from key 0 up
// to the last row's position, gathering each tile's K and V rows (BN × head_dim bf16 each) from
// the paged cache into shared memory with 16-byte cp.async copies (each key's cache row found
// through the block table, so any block size works; keys past the span's last position are
// zero-filled). Per tile:
//   S = Q·Kᵀ      mma.sync m16n8k16 (bf16 in, f32 accumulate), Q and K fragments by ldmatrix
//   causal mask   only on tiles that reach past the first row's position
//   online softmax in the log2 domain (scores times scale·log2 e in f32), running max m and sum l
//                 per row, the output rescaled by exp2(m_old - m_new)
//   O += P·V      P rounded to bf16 as the A operand, V fragments by ldmatrix.trans
// and at the end O / l is written as bf16 and lse = m·ln 2 + ln l.
//
// Pipelining: V(j) is copied while S(j) and its softmax are computed, K(j+1) while P(j)·V(j) is
// (and the next tile's block-table look-ups are in flight during S(j)). With MT = 1, sQ is only
// needed until the Q fragments are in registers, so it shares its space with sV.
// Shared rows are stored with their 16-byte chunks XOR-swizzled by (row mod 8), so that the eight
// row addresses of every ldmatrix 8×8 matrix fall in distinct banks.
//
// Work items (host-made, u32): items[4 i .. 4 i + 4] = first query row (token), number of rows
// (1..16 · MT · WARPS), position of the first row, sequence; row r of the item is token + r at
// position pos + r. blockIdx.x = item * n_heads + head.
//
// The same body, with SHARED, computes the shared-prefix part of cascade attention: the rows of a
// CTA are (query row, query head) pairs of several sequences that all see the same leading keys
// (held in the same blocks), for the query heads of one KV head, over keys [k0, k1) of the shared
// prefix, with no causal mask (every row lies after the prefix). Each key tile is then read once
// for up to 16 · MT · WARPS query rows and heads, instead of once per row. Items there are
// items[8 i .. 8 i + 8] = first flattened row f0, rows, k0, k1, the sequence whose table holds
// the prefix, prefix chunk index, KV head, unused; flattened row f is query row
// shared_tokens[f / group], query head kv · group + f % group. The CTA writes f32 states to slot
// token_state[row] + chunk of part_o / part_lse (the layout attn_merge_row reads).

// The prefill kernels' shared memory (dynamic: above 48 KiB for some shapes).
extern __shared__ __align__(16) unsigned char pf_dyn_smem[];

// -- PREFILL KERNEL BODY BEGIN --
// Bytes of attn_prefill<HD, WARPS, MT, BN>'s Q, K and V tiles.
template <int HD, int WARPS, int MT, int BN>
__host__ __device__ constexpr int pf_tile_bytes() {
    // MT == 1: K, and Q then V in one buffer; else Q, K, V.
    return MT == 1 ? (BN + (16 * WARPS > BN ? 16 * WARPS : BN)) * HD * 2 : (16 * MT * WARPS + 2 * BN) * HD * 2;
}
// Shared memory of attn_prefill<HD, WARPS, MT, BN> over a cache of KIND, in bytes: the tiles, and
// with a quantized cache the K tile's scales.
template <int HD, int WARPS, int MT, int BN, int KIND>
__host__ __device__ constexpr int pf_smem_bytes() {
    return pf_tile_bytes<HD, WARPS, MT, BN>() + (KIND == KV_BF16 ? 0 : BN * 4);
}

// WARPS warps, each owning MT 16-row m-tiles (rows 16·MT·w .. 16·MT·(w+1)), keys in tiles of BN.
// With MT == 1 the Q fragments stay in registers; with MT > 1 they are re-read from shared memory
// at each k-step, and each K and V fragment serves MT m-tiles (half the shared-memory traffic per
// FLOP at MT = 2). Shared memory: the dynamic buffer pf_dyn_smem, pf_smem_bytes<...>() bytes.
template <int HD, int WARPS, int MT, int BN, bool SHARED, int KIND>
__device__ __forceinline__ void attn_prefill(const __nv_bfloat16* __restrict__ q,
                                             const __nv_bfloat16* __restrict__ k_cache,
                                             const __nv_bfloat16* __restrict__ v_cache,
                                             const uint32_t* __restrict__ tables,
                                             const uint32_t* __restrict__ seq_table_start,
                                             const uint32_t* __restrict__ items, int n_heads, int group,
                                             int n_kv_heads, int block_size, int block_shift, float scale,
                                             __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out,
                                             const uint32_t* __restrict__ shared_tokens,
                                             const uint32_t* __restrict__ token_state,
                                             float* __restrict__ part_o, float* __restrict__ part_lse) {
    static_assert(HD % 16 == 0 && HD >= 64 && HD <= 128, "head_dim 64..128, a multiple of 16");
    static_assert(BN % 16 == 0 && (MT == 1 || MT == 2), "tile shape");
    constexpr int KSTEPS = HD / 16;           // k-steps of Q·Kᵀ
    constexpr int DTILES = HD / 8;            // 8-wide n-tiles of the output
    constexpr int NTILES = BN / 8;            // 8-wide n-tiles of S
    constexpr int THREADS = WARPS * TURBO_WARP;
    constexpr int ROWS = 16 * MT * WARPS;     // query rows per CTA
    constexpr int CPR = HD / 8;               // 16-byte chunks per row
    constexpr int RPP = THREADS / CPR;        // rows the CTA copies per pass
    constexpr int PASSES = BN / RPP;          // passes per key tile
    constexpr int Q_PASSES = ROWS / RPP;      // passes for the Q tile
    static_assert(THREADS % CPR == 0 && BN % RPP == 0 && ROWS % RPP == 0, "copy shape");

    __nv_bfloat16* const sK = reinterpret_cast<__nv_bfloat16*>(pf_dyn_smem);
    __nv_bfloat16* const sQ = sK + BN * HD;
    __nv_bfloat16* const sV = MT == 1 ? sQ : sQ + ROWS * HD;

    const int tid = threadIdx.x, lane = tid % TURBO_WARP, warp = tid / TURBO_WARP;
    const int g = lane >> 2, t = lane & 3;  // mma fragment row group and column pair
    // Prefill: one head, rows token0 + r at positions pos0 + r, keys [0, pos0 + n_rows).
    // SHARED: one KV head, flattened rows f0 + r, keys [k0, k1).
    int head;
    uint32_t token0, n_rows, pos0, seq, k0, k1, f0 = 0, chunk = 0;
    if constexpr (SHARED) {
        const uint32_t* it = items + 8 * (size_t)blockIdx.x;
        f0 = it[0];
        n_rows = it[1];
        k0 = it[2];
        k1 = it[3];
        seq = it[4];
        chunk = it[5];
        head = (int)it[6] * group;  // the KV head's first query head
        token0 = pos0 = 0;
    } else {
        head = (int)(blockIdx.x % (unsigned)n_heads);
        const size_t item = blockIdx.x / (unsigned)n_heads;
        token0 = items[4 * item];
        n_rows = items[4 * item + 1];
        pos0 = items[4 * item + 2];
        seq = items[4 * item + 3];
        k0 = 0;
        k1 = pos0 + n_rows;  // keys 0..=last row's position
    }
    // Query row and head of CTA row r (r < n_rows).
    auto row_of = [&](uint32_t r, uint32_t& token, int& h) {
        if constexpr (SHARED) {
            token = shared_tokens[(f0 + r) / (uint32_t)group];
            h = head + (int)((f0 + r) % (uint32_t)group);
        } else {
            token = token0 + r;
            h = head;
        }
    };
    const int n_tiles = (int)((k1 - k0 + BN - 1) / BN);
    const uint32_t* table = tables + seq_table_start[seq];
    const size_t slot_stride = (size_t)n_kv_heads * HD;
    const size_t head_off = (size_t)(head / group) * HD;
    const int cc = tid % CPR;  // the 16-byte chunk of each row this thread copies

    // Q rows (zeros past the item's rows).
#pragma unroll
    for (int p = 0; p < Q_PASSES; p++) {
        const int r = tid / CPR + RPP * p;
        const bool valid = (uint32_t)r < n_rows;
        const __nv_bfloat16* src = q;
        if (valid) {
            uint32_t token;
            int h;
            row_of((uint32_t)r, token, h);
            src = q + ((size_t)token * (size_t)n_heads + (size_t)h) * HD + cc * 8;
        }
        pf_cp_async16(&sQ[pf_swz<HD>(r, cc)], src, valid);
    }
    pf_cp_async_commit();

    // Cache rows (block * block_size + slot) of the keys this thread copies for tile j; ~0u past
    // the last key.
    uint32_t kv_rows[PASSES];
    auto find_rows = [&](int j) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const uint32_t key = k0 + (uint32_t)(j * BN + tid / CPR + RPP * p);
            uint32_t row = ~0u;
            if (key < k1) {
                const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                row = table[b] * (uint32_t)block_size + (key - b * (uint32_t)block_size);
            }
            kv_rows[p] = row;
        }
    };
    auto copy_tile = [&](const __nv_bfloat16* __restrict__ cache, __nv_bfloat16* dst) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = tid / CPR + RPP * p;
            const bool valid = kv_rows[p] != ~0u;
            const __nv_bfloat16* src = valid ? cache + (size_t)kv_rows[p] * slot_stride + head_off + cc * 8 : cache;
            pf_cp_async16(&dst[pf_swz<HD>(r, cc)], src, valid);
        }
        pf_cp_async_commit();
    };
    // A quantized cache: a tile's codes (8 per thread and row) and scales are loaded into registers
    // when it is issued and decoded into the shared bf16 tile when it is due, so that the loads are
    // in flight during the work between (as the bf16 tiles' cp.async copies are). K tiles hold
    // the codes' exact values, their scales beside them in k_scales, applied to the scores (a
    // rounding of each decoded key to bf16 would be amplified by sharp softmaxes); V tiles hold
    // the decoded values rounded to bf16, as a bf16 cache would.
    constexpr bool QUANT = KIND != KV_BF16;
    uint2 tile_codes[QUANT ? PASSES : 1];
    float tile_scales[QUANT ? PASSES : 1];
    // After the tiles in the dynamic buffer (pf_smem_bytes counts them).
    float* const k_scales = reinterpret_cast<float*>(pf_dyn_smem + pf_tile_bytes<HD, WARPS, MT, BN>());
    auto load_tile = [&](const __nv_bfloat16* __restrict__ cache) {
        const uint8_t* base = reinterpret_cast<const uint8_t*>(cache);
        const int kvh = head / group;
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            tile_codes[p] = make_uint2(0u, 0u);
            tile_scales[p] = 0.f;
            if (kv_rows[p] != ~0u) {
                const uint32_t blk = block_shift >= 0 ? kv_rows[p] >> block_shift : kv_rows[p] / (uint32_t)block_size;
                const uint32_t slot = kv_rows[p] - blk * (uint32_t)block_size;
                tile_codes[p] = __ldg(reinterpret_cast<const uint2*>(
                    base + kvq_code_at(blk, slot, kvh, block_size, n_kv_heads, HD) + cc * 8));
                tile_scales[p] = __ldg(reinterpret_cast<const float*>(
                    base + kvq_scale_at(blk, slot, kvh, block_size, n_kv_heads, HD)));
            }
        }
    };
    auto store_tile = [&](__nv_bfloat16* dst) {
        const bool keys = dst == sK;
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = tid / CPR + RPP * p;
            float sc = tile_scales[p] * kvq_unit<KIND>();
            if (keys) {
                if (cc == 0) k_scales[r] = sc;
                sc = 1.f;
            }
            float lo[4], hi[4], f[8];
            kvq_decode4<KIND>(tile_codes[p].x, lo);
            kvq_decode4<KIND>(tile_codes[p].y, hi);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                f[e] = lo[e] * sc;
                f[4 + e] = hi[e] * sc;
            }
            *reinterpret_cast<uint4*>(&dst[pf_swz<HD>(r, cc)]) = bf16x8_pack(f);
        }
    };
    // Starts tile copies into dst; land(dst) waits for them (bf16: cp.async into dst at once;
    // quantized: into registers, written to dst by land).
    auto issue = [&](const __nv_bfloat16* __restrict__ cache, __nv_bfloat16* dst) {
        if constexpr (QUANT) {
            load_tile(cache);
        } else {
            copy_tile(cache, dst);
        }
    };
    auto land = [&](__nv_bfloat16* dst) {
        pf_cp_async_wait_all();
        if constexpr (QUANT) store_tile(dst);
    };

    find_rows(0);
    issue(k_cache, sK);
    land(sK);
    __syncthreads();

    // A fragments of Q for m-tile i, k-step ks: lanes 0-15 address rows 0-15 at dims 16ks..,
    // lanes 16-31 the same rows at dims 16ks+8.. (the a0..a3 order of m16n8k16).
    const int qr = warp * 16 * MT + (lane & 15);
    auto load_q = [&](uint32_t (&a)[4], int i, int ks) {
        pf_ldmatrix_x4(a, &sQ[pf_swz<HD>(qr + 16 * i, 2 * ks + (lane >> 4))]);
    };
    constexpr int QREG = MT == 1 ? KSTEPS : 1;  // Q fragments kept in registers (MT == 1)
    uint32_t qf[QREG][4];
    if constexpr (MT == 1) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) load_q(qf[ks], 0, ks);
    }

    const float scale_log2 = scale * ATTN_LOG2E;
    // Position of this thread's row g (h = 0) or g + 8 (h = 1) of m-tile i. Rows past the item's
    // rows get positions past the last key: they only see zero-filled keys there, stay finite and
    // are not written.
    auto row_pos = [&](int i, int h) { return pos0 + (uint32_t)(warp * 16 * MT + 16 * i + g + 8 * h); };
    float m[MT][2], l[MT][2];  // l: this thread's columns only; the quad's sum is taken at the end
    float o[MT][DTILES][4];
#pragma unroll
    for (int i = 0; i < MT; i++) {
        m[i][0] = m[i][1] = attn_neg_inf();
        l[i][0] = l[i][1] = 0.f;
#pragma unroll
        for (int d = 0; d < DTILES; d++) o[i][d][0] = o[i][d][1] = o[i][d][2] = o[i][d][3] = 0.f;
    }

    for (int j = 0; j < n_tiles; j++) {
        if (j > 0) land(sK);                  // K(j)
        __syncthreads();                      // K(j) visible; every warp done with sV (or sQ)
        issue(v_cache, sV);                   // V(j), same keys as K(j)
        if (j + 1 < n_tiles) find_rows(j + 1);  // table look-ups in flight during S(j)

        float s[MT][NTILES][4];
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int n = 0; n < NTILES; n++) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
        }
        // Lanes 0-7 address keys 0-7 at dims 16ks.., 8-15 keys 0-7 at 16ks+8.., 16-23 keys 8-15
        // at 16ks.., 24-31 keys 8-15 at 16ks+8..: b0, b1 of n-tile 2np, then of 2np + 1.
        const int kr = (lane & 7) + ((lane >> 4) << 3);
        const int kc = (lane >> 3) & 1;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            uint32_t qa[MT][4];
            if constexpr (MT > 1) {
#pragma unroll
                for (int i = 0; i < MT; i++) load_q(qa[i], i, ks);
            }
#pragma unroll
            for (int np = 0; np < NTILES / 2; np++) {
                uint32_t b[4];
                pf_ldmatrix_x4(b, &sK[pf_swz<HD>(np * 16 + kr, 2 * ks + kc)]);
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    const uint32_t(&a)[4] = MT == 1 ? qf[ks < QREG ? ks : 0] : qa[i];
                    pf_mma(s[i][2 * np], a, b[0], b[1]);
                    pf_mma(s[i][2 * np + 1], a, b[2], b[3]);
                }
            }
        }

        // Scale to the log2 domain, then mask keys past each row's position (only tiles that
        // reach past the first row's position have any); SHARED: keys at or past k1 (only in
        // the last tile).
        const uint32_t key0 = k0 + (uint32_t)j * BN;
        const bool masked = SHARED ? key0 + BN > k1 : key0 + BN - 1 > pos0;
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int n = 0; n < NTILES; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[i][n][e] *= QUANT ? scale_log2 * k_scales[n * 8 + 2 * t + (e & 1)] : scale_log2;
                    const uint32_t key = key0 + (uint32_t)(n * 8 + 2 * t + (e & 1));
                    if (masked && (SHARED ? key >= k1 : key > row_pos(i, e >> 1))) s[i][n][e] = attn_neg_inf();
                }
            }
        }

        // Online softmax per row; the four lanes of a quad hold one row's BN scores.
        uint32_t pa[MT][BN / 16][4];
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float mx = m[i][h];
#pragma unroll
                for (int n = 0; n < NTILES; n++) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // -inf only while the row has seen no key (not reachable: tile 0 holds key 0,
                // which every row sees); then everything below is 0 instead of NaN.
                const float mu = mx == attn_neg_inf() ? 0.f : mx;
                const float corr = exp2f(m[i][h] - mu);  // 0 while m is -inf
                m[i][h] = mx;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
                    s[i][n][2 * h] = exp2f(s[i][n][2 * h] - mu);
                    s[i][n][2 * h + 1] = exp2f(s[i][n][2 * h + 1] - mu);
                    sum += s[i][n][2 * h] + s[i][n][2 * h + 1];
                }
                l[i][h] = l[i][h] * corr + sum;
#pragma unroll
                for (int d = 0; d < DTILES; d++) {
                    o[i][d][2 * h] *= corr;
                    o[i][d][2 * h + 1] *= corr;
                }
            }
            // P as A fragments: k-step kk covers keys 16kk.. = n-tiles 2kk (a0, a1) and 2kk+1
            // (a2, a3).
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                pa[i][kk][0] = pf_pack(s[i][2 * kk][0], s[i][2 * kk][1]);
                pa[i][kk][1] = pf_pack(s[i][2 * kk][2], s[i][2 * kk][3]);
                pa[i][kk][2] = pf_pack(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
                pa[i][kk][3] = pf_pack(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
            }
        }

        land(sV);                // V(j)
        __syncthreads();         // V(j) visible; every warp done with sK
        if (j + 1 < n_tiles) issue(k_cache, sK);

        // O += P·V. ldmatrix.trans: lanes 0-7 address keys 0-7 at dims 16dp.., 8-15 keys 8-15 at
        // 16dp.., 16-23 keys 0-7 at 16dp+8.., 24-31 keys 8-15 at 16dp+8..: b0, b1 of d-tile 2dp,
        // then of 2dp + 1.
        const int vr = (lane & 7) + (((lane >> 3) & 1) << 3);
        const int vc = lane >> 4;
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
            for (int dp = 0; dp < DTILES / 2; dp++) {
                uint32_t b[4];
                pf_ldmatrix_x4_trans(b, &sV[pf_swz<HD>(kk * 16 + vr, 2 * dp + vc)]);
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    pf_mma(o[i][2 * dp], pa[i][kk], b[0], b[1]);
                    pf_mma(o[i][2 * dp + 1], pa[i][kk], b[2], b[3]);
                }
            }
        }
    }

    // Normalize and write this thread's rows: columns 8d + 2t, 8d + 2t + 1 of each d-tile.
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = l[i][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const uint32_t r = (uint32_t)(warp * 16 * MT + 16 * i + g + 8 * h);
            if (r < n_rows) {
                const float inv = 1.f / sum;
                const float lse = m[i][h] * ATTN_LN2 + logf(sum);
                uint32_t token;
                int hr;
                row_of(r, token, hr);
                if constexpr (SHARED) {
                    const size_t st = (size_t)(token_state[token] + chunk) * (size_t)n_heads + (size_t)hr;
                    float* dst = part_o + st * HD + 2 * t;
#pragma unroll
                    for (int d = 0; d < DTILES; d++) {
                        *reinterpret_cast<float2*>(dst + 8 * d) = make_float2(o[i][d][2 * h] * inv, o[i][d][2 * h + 1] * inv);
                    }
                    if (t == 0) part_lse[st] = lse;
                } else {
                    const size_t row = (size_t)token * (size_t)n_heads + (size_t)hr;
                    __nv_bfloat16* dst = out + row * HD + 2 * t;
#pragma unroll
                    for (int d = 0; d < DTILES; d++) {
                        *reinterpret_cast<uint32_t*>(dst + 8 * d) = pf_pack(o[i][d][2 * h] * inv, o[i][d][2 * h + 1] * inv);
                    }
                    if (lse_out != nullptr && t == 0) lse_out[row] = lse;
                }
            }
        }
    }
}
// -- PREFILL KERNEL BODY END --

// attn_prefill_d<HD> (and attn_shared_d<HD>, the cascade prefix): WARPS warps of MT m-tiles, key tiles of BN, registers budgeted for MIN_CTAS
// CTAs per SM; the host launches it with pf_smem_bytes<HD, WARPS, MT, BN, KIND>() of dynamic shared memory.
// The host's table of these shapes (prefill_kernel in crates/turbo-kernels/src/ops/attention.rs)
// must agree with the instantiations below.
#define ATTN_PREFILL_KERNEL(HD, WARPS, MT, BN, MIN_CTAS)                                                  \
    ATTN_PREFILL_KERNEL_OF(HD, WARPS, MT, BN, MIN_CTAS, KV_BF16, d)                                       \
    ATTN_PREFILL_KERNEL_OF(HD, WARPS, MT, BN, MIN_CTAS, KV_INT8, q8_d)                                    \
    ATTN_PREFILL_KERNEL_OF(HD, WARPS, MT, BN, MIN_CTAS, KV_FP8, f8_d)
// The q8 and f8 kernels read INT8 and FP8 caches (same arguments).
#define ATTN_PREFILL_KERNEL_OF(HD, WARPS, MT, BN, MIN_CTAS, KIND, NAME)                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * TURBO_WARP, MIN_CTAS) attn_prefill_##NAME##HD(   \
        ATTN_PREFILL_ARGS, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {              \
        attn_prefill<HD, WARPS, MT, BN, false, KIND>(q, k_cache, v_cache, tables, seq_table_start, items,      \
                                               n_heads, group, n_kv_heads, block_size, block_shift, scale,  \
                                               out, lse_out, nullptr, nullptr, nullptr, nullptr);        \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * TURBO_WARP, MIN_CTAS) attn_shared_##NAME##HD(    \
        ATTN_PREFILL_ARGS, ATTN_SHARED_ARGS) {                                                            \
        attn_prefill<HD, WARPS, MT, BN, true, KIND>(q, k_cache, v_cache, tables, seq_table_start, items,       \
                                              n_heads, group, n_kv_heads, block_size, block_shift, scale,   \
                                              nullptr, nullptr, shared_tokens, token_state, part_o,      \
                                              part_lse);                                                 \
    }

// Measured on an H100 (causal, 32 heads, S = 2048 / 8192): at d128, two m-tiles per warp (K and V
// fragments each serve two m-tiles: half the shared-memory traffic of one) with 32-key tiles
// (255 registers, no spills, 48 KiB) beat one m-tile with 64-key tiles (212 registers, 32 KiB, two
// CTAs per SM) by 4-8%, and match two m-tiles with 64-key tiles (which spill, 64 KiB); at d64,
// two m-tiles with 64-key tiles (32 KiB) beat both others by 10-20%. 4 warps beat 8.
ATTN_PREFILL_KERNEL(64, 4, 2, 64, 2)
ATTN_PREFILL_KERNEL(128, 4, 2, 32, 2)

// ------------------------------------------------------------------------------------------------
// Decode: tensor-core attention of all the query heads of one KV head, for one query row.
//
// One CTA: work item blockIdx.x (query row `token`, keys [k0, k1), a state slot) and up to 16
// query heads of one KV head (blockIdx.y = sub · n_kv_heads + kv head; heads kv·group + 16·sub
// onwards). The heads are the rows of one 16-row mma tile (rows past the group are zero and never
// written), so each key and value row is read from memory once for all of them: at GQA 4 a
// quarter of what one CTA per query head reads. The tile's unused rows cost only tensor-core
// issue slots, which decode has to spare.
//
// The 4 warps take 16-key steps in turn (warp w: keys k0 + 16 (w + 4 i) ..), each with its own
// online softmax (log2 domain), merged through shared memory at the end. Each warp streams its
// steps' K and V rows through a private ring of DEC_STAGES shared-memory stages with 16-byte
// cp.async copies (each key's cache row found through the block table), so that two steps are in
// flight while one is computed, without holding them in registers; fragments come from the ring
// by ldmatrix (V transposed), rows swizzled as in the prefill kernel:
//   S = Q·Kᵀ  (16 heads × 16 keys), scaled, masked past k1, online softmax
//   O += P·V  P repacked from S's accumulators as the A operand
// Shared memory: DEC_WARPS · DEC_STAGES · 2 · 16 · head_dim bf16 (96 KiB at d 128: two CTAs per
// SM), with a quantized cache DEC_WARPS · DEC_STAGES_Q stages of 16 keys' codes and 32 scales
// (66 KiB at d 128), reused at the end for the warps' states and the fused merge.
//
// Items carry the row's block-table start: two dependent loads fewer before the first copy than
// finding it through the row's sequence. Split rows are merged by their last range (see the top
// of this file).
#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * TURBO_WARP)
#define DEC_ROWS 16
#define DEC_KEYS 16
#define DEC_STAGES 3
// The logits kernels load K and V with an L2 evict-first policy: the step reads them once, and
// the logits they write (~7 MB a layer at 13 rows of 4k keys) then stay in L2 for the passes that
// read them next (attn_logits_gumbel, kv_score_logit_add) instead of being pushed out by the
// ~230 MB of KV streamed after them. On an H200 this took the logits' DRAM writes from 6.3 MB a
// layer to 35 KB and a scored decode step 0.8-1.2% faster.

// pf_cp_async16 with an L2 eviction policy (from dec_l2_evict_first): for data read once, so that
// it leaves L2 before what a later kernel of the step reads again.
__device__ __forceinline__ void dec_cp_async16_hint(void* dst, const void* src, bool valid,
                                                    unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(pf_smem(dst)), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy)
                 : "memory");
}

__device__ __forceinline__ unsigned long long dec_l2_evict_first() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// Ring stages with a quantized cache (K and V codes and scales of 16 keys: 4.2 KB at d 128). Six
// measured 4-10% slower than four on an H100 (docs/kv-quant.md).
#define DEC_STAGES_Q 4
// States the fused merge loads before using any: at d 128 the 4 heads of GQA 4 fill the CTA's
// columns, so each thread walks all of a row's states (32 at batch 1); at d 64 two groups share
// them.
#define DEC_MERGE_UNROLL(HD) ((HD) == 128 ? 32 : 16)

// Waits until at most N of this thread's cp.async groups are pending.
template <int N>
__device__ __forceinline__ void dec_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <int HD, bool LOGITS, int KIND>
__device__ __forceinline__ void attn_decode(const __nv_bfloat16* __restrict__ q,
                                            const __nv_bfloat16* __restrict__ k_cache,
                                            const __nv_bfloat16* __restrict__ v_cache,
                                            const uint32_t* __restrict__ tables,
                                            const uint32_t* __restrict__ items, int n_heads, int group,
                                            int n_kv_heads, int block_size, int block_shift, float scale,
                                            float* __restrict__ part_o, float* __restrict__ part_lse,
                                            uint32_t* __restrict__ counters,
                                            __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out,
                                            const uint32_t* __restrict__ logit_at, float* __restrict__ logits,
                                            float* __restrict__ score_lse,
                                            float2* __restrict__ part_score) {
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    constexpr int KSTEPS = HD / 16;            // k-steps of Q·Kᵀ
    constexpr int NT = HD / 8;                 // 8-wide n-tiles of the output
    constexpr int CPR = HD / 8;                // 16-byte chunks per K or V row
    constexpr int TILE = DEC_KEYS * HD;        // elements of one step's K (or V)
    constexpr int STAGE = 2 * TILE;            // K then V
    constexpr int ROWS_PER_PASS = TURBO_WARP / CPR;  // key rows a warp copies per pass
    constexpr int PASSES = DEC_KEYS / ROWS_PER_PASS;
    constexpr int OSTRIDE = HD + 1;            // merge rows padded: a store's lanes hit distinct banks
    // A quantized cache (kernels/common.cuh's layout): 8-bit K and V rows and their scales in the
    // ring, one stage deeper than bf16's (a stage is about half the bytes).
    constexpr bool QUANT = KIND != KV_BF16;
    constexpr int STAGES = QUANT ? DEC_STAGES_Q : DEC_STAGES;
    constexpr int CPRQ = HD / 16;              // 16-byte chunks per code row
    constexpr int STAGE_Q = 2 * DEC_KEYS * HD + 2 * DEC_KEYS * 4;  // bytes: K codes, V codes, scales

    const int tid = threadIdx.x, lane = tid % TURBO_WARP, warp = tid / TURBO_WARP;
    const int g = lane >> 2, t = lane & 3;
    __nv_bfloat16* const ring = reinterpret_cast<__nv_bfloat16*>(pf_dyn_smem) + warp * DEC_STAGES * STAGE;
    unsigned char* const ring_q = pf_dyn_smem + warp * STAGES * STAGE_Q;

    const uint4 it = reinterpret_cast<const uint4*>(items)[2 * blockIdx.x];
    const uint4 it2 = reinterpret_cast<const uint4*>(items)[2 * blockIdx.x + 1];
    const uint32_t token = it.x, k0 = it.y, k1 = it.z, state = it.w;
    const int kvh = (int)(blockIdx.y % (unsigned)n_kv_heads), sub = (int)(blockIdx.y / (unsigned)n_kv_heads);
    const int h0 = kvh * group + DEC_ROWS * sub;  // the tile's first query head
    const int nh = min(DEC_ROWS, group - DEC_ROWS * sub);
    const uint32_t* table = tables + it2.x;
    const size_t slot_stride = (size_t)n_kv_heads * HD;
    // Where this row's logits go (LOGITS only): [head][stride] f32 from logit_base, or nowhere.
    // The kernel writes the plain scaled logits x whatever the scoring policy: a Gumbel policy's
    // f(x) = (x + g) / tau and its normaliser are attn_logits_gumbel's, a pass of full occupancy
    // after this one (here the draws' arithmetic would stall a kernel that runs 2 CTAs an SM).
    // Rows g and g + 8 of the tile (this lane's rows in the fragments) have their heads' rows
    // of logits at lrow[0] and lrow[1] (null: not written). Rows are an even number of floats
    // apart and start even (`ops::attention::logit_row_stride`), and the keys a lane holds come
    // in even-aligned pairs, so the writes below are float2s.
    uint32_t logit_base = ATTN_NO_STATE;
    float* lrow[2] = {nullptr, nullptr};
    if constexpr (LOGITS) {
        const uint4 la = reinterpret_cast<const uint4*>(logit_at)[2 * token];
        logit_base = la.x;
        if (logit_base != ATTN_NO_STATE) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (g + 8 * h < nh) lrow[h] = logits + (size_t)logit_base + (size_t)(h0 + g + 8 * h) * la.y;
            }
        }
    }
    const __nv_bfloat16* kb = k_cache + (size_t)kvh * HD;
    const __nv_bfloat16* vb = v_cache + (size_t)kvh * HD;

    // This warp's steps: keys base(i) = k0 + 16 (warp + 4 i), for i < n_steps.
    const uint32_t first = k0 + DEC_KEYS * (uint32_t)warp;
    const int n_steps = first < k1 ? (int)((k1 - first + DEC_KEYS * DEC_WARPS - 1) / (DEC_KEYS * DEC_WARPS)) : 0;

    // Copies step i's K and V rows into ring stage i % DEC_STAGES (zeros past k1) as one group.
    const int cc = lane % CPR;
    const unsigned long long kv_policy = LOGITS ? dec_l2_evict_first() : 0ull;
    auto issue = [&](int i) {
        const uint32_t base = first + (uint32_t)(DEC_KEYS * DEC_WARPS * i);
        if constexpr (QUANT) {
            // Code rows: 16-byte chunk c of key row r at chunk c ^ (r mod CPRQ) (the fragment
            // loads below then hit distinct banks); the step's 16 K scales, then its 16 V scales.
            unsigned char* st = ring_q + (i % STAGES) * STAGE_Q;
            const uint8_t* kq = reinterpret_cast<const uint8_t*>(k_cache);
            const uint8_t* vq = reinterpret_cast<const uint8_t*>(v_cache);
            constexpr int RPPQ = TURBO_WARP / CPRQ;
            const int cq = lane % CPRQ;
#pragma unroll
            for (int p = 0; p < DEC_KEYS / RPPQ; p++) {
                const int r = lane / CPRQ + RPPQ * p;
                const uint32_t key = base + (uint32_t)r;
                const bool valid = key < k1;
                size_t off = 0;
                if (valid) {
                    const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                    off = kvq_code_at(table[b], key - b * (uint32_t)block_size, kvh, block_size, n_kv_heads, HD) + cq * 16;
                }
                const int at = r * HD + ((cq ^ (r % CPRQ)) << 4);
                pf_cp_async16(st + at, kq + off, valid);
                pf_cp_async16(st + DEC_KEYS * HD + at, vq + off, valid);
            }
            {
                const uint32_t key = base + (uint32_t)(lane % DEC_KEYS);
                const bool valid = key < k1;
                size_t off = 0;
                if (valid) {
                    const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                    off = kvq_scale_at(table[b], key - b * (uint32_t)block_size, kvh, block_size, n_kv_heads, HD);
                }
                kvq_cp_async4(st + 2 * DEC_KEYS * HD + 4 * lane, (lane < DEC_KEYS ? kq : vq) + off, valid);
            }
            pf_cp_async_commit();
            return;
        }
        __nv_bfloat16* st = ring + (i % DEC_STAGES) * STAGE;
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = lane / CPR + ROWS_PER_PASS * p;
            const uint32_t key = base + (uint32_t)r;
            const bool valid = key < k1;
            size_t off = 0;
            if (valid) {
                const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                off = ((size_t)table[b] * (size_t)block_size + (key - b * (uint32_t)block_size)) * slot_stride + cc * 8;
            }
            if constexpr (LOGITS) {
                dec_cp_async16_hint(st + pf_swz<HD>(r, cc), kb + off, valid, kv_policy);
                dec_cp_async16_hint(st + TILE + pf_swz<HD>(r, cc), vb + off, valid, kv_policy);
                continue;
            }
            pf_cp_async16(st + pf_swz<HD>(r, cc), kb + off, valid);
            pf_cp_async16(st + TILE + pf_swz<HD>(r, cc), vb + off, valid);
        }
        pf_cp_async_commit();
    };
    // Two steps in flight before the first is used (an empty group where there is no step, so
    // that the group count stays uniform for the waits below).
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) {
        if (i < n_steps) {
            issue(i);
        } else {
            pf_cp_async_commit();
        }
    }

    // Q's A fragments (rows g and g + 8 = heads h0 + g and h0 + g + 8; zero past the group).
    uint32_t qa[KSTEPS][4];
    {
        const uint32_t* qrow = reinterpret_cast<const uint32_t*>(q + ((size_t)token * (size_t)n_heads + (size_t)h0) * HD);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            // bf16: k-step ks covers dims 16ks..16ks+15 in order. Quantized: the dot product's
            // dims are permuted so that each lane's K codes are one run of its key row: lane t's
            // pairs (2t, 2t+1) and (2t+8, 2t+9) of k-step ks are dims HD/4·t + 4ks + (0, 1) and
            // (2, 3).
            const int c = QUANT ? (HD / 4 * t + 4 * ks) / 2 : (16 * ks + 2 * t) / 2;  // u32 index
            const int c2 = QUANT ? c + 1 : c + 4;
            qa[ks][0] = g < nh ? __ldg(qrow + g * (HD / 2) + c) : 0u;
            qa[ks][1] = g + 8 < nh ? __ldg(qrow + (g + 8) * (HD / 2) + c) : 0u;
            qa[ks][2] = g < nh ? __ldg(qrow + g * (HD / 2) + c2) : 0u;
            qa[ks][3] = g + 8 < nh ? __ldg(qrow + (g + 8) * (HD / 2) + c2) : 0u;
        }
    }

    const float scale_log2 = scale * ATTN_LOG2E;
    float m[2] = {attn_neg_inf(), attn_neg_inf()}, l[2] = {0.f, 0.f};
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    // ldmatrix addressing (as in the prefill kernel): K rows for B of Q·Kᵀ, V rows transposed
    // for B of P·V.
    const int kr = (lane & 7) + ((lane >> 4) << 3), kc = (lane >> 3) & 1;
    const int vr = (lane & 7) + (((lane >> 3) & 1) << 3), vc = lane >> 4;

    for (int i = 0; i < n_steps; i++) {
        if (i + STAGES - 1 < n_steps) {
            issue(i + STAGES - 1);  // into the stage step i - 1 used, read before the last __syncwarp
        } else {
            pf_cp_async_commit();
        }
        dec_cp_async_wait<STAGES - 1>();  // step i's group has landed
        __syncwarp();                     // and every lane's copies are visible
        const __nv_bfloat16* sK = ring + (i % DEC_STAGES) * STAGE;
        const __nv_bfloat16* sV = sK + TILE;
        const unsigned char* qK = ring_q + (i % STAGES) * STAGE_Q;
        const unsigned char* qV = qK + DEC_KEYS * HD;
        const float* qS = reinterpret_cast<const float*>(qK + 2 * DEC_KEYS * HD);  // K scales, V scales
        const uint32_t base = first + (uint32_t)(DEC_KEYS * DEC_WARPS * i);

        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        if constexpr (QUANT) {
            // Keys g and g + 8 (n-tiles 0 and 1): lane t's HD/4 codes of each, one word per
            // k-step; the codes' values are exact in bf16, the keys' scales applied to S.
            constexpr int KW = HD / 16;
            uint32_t kw[2][KW];
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const int r = g + 8 * n;
#pragma unroll
                for (int j = 0; j < KW / 4; j++) {
                    const int chunk = (KW / 4) * t + j;
                    const uint4 w = *reinterpret_cast<const uint4*>(qK + r * HD + ((chunk ^ (r % CPRQ)) << 4));
                    kw[n][4 * j] = w.x;
                    kw[n][4 * j + 1] = w.y;
                    kw[n][4 * j + 2] = w.z;
                    kw[n][4 * j + 3] = w.w;
                }
            }
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    uint32_t b0, b1;
                    kvq_decode4_bf16x2<KIND>(kw[n][ks], b0, b1);
                    pf_mma(s[n], qa[ks], b0, b1);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const float2 ksc = *reinterpret_cast<const float2*>(qS + 8 * n + 2 * t);
                constexpr float u = kvq_bf16_half_unit<KIND>();
                const float kx = ksc.x * u, ky = ksc.y * u;
                s[n][0] *= kx * u;
                s[n][1] *= ky * u;
                s[n][2] *= kx * u;
                s[n][3] *= ky * u;
            }
        } else {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                uint32_t b[4];
                pf_ldmatrix_x4(b, &sK[pf_swz<HD>(kr, 2 * ks + kc)]);
                pf_mma(s[0], qa[ks], b[0], b[1]);
                pf_mma(s[1], qa[ks], b[2], b[3]);
            }
        }
        if constexpr (LOGITS) {
            // This row's scored keys' logits x = scale q.k, for the eviction scores: keys
            // key and key + 1 of rows g (h = 0) and g + 8 (h = 1).
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const uint32_t key = base + (uint32_t)(8 * n + 2 * t);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (lrow[h] == nullptr) continue;
                    const float x0 = s[n][2 * h] * scale, x1 = s[n][2 * h + 1] * scale;
                    if (key + 1 < k1) {
                        *reinterpret_cast<float2*>(lrow[h] + key) = make_float2(x0, x1);
                    } else if (key < k1) {
                        lrow[h][key] = x0;
                    }
                }
            }
        }
        // Scale to the log2 domain; keys at or past k1 get -inf.
#pragma unroll
        for (int n = 0; n < 2; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const uint32_t key = base + (uint32_t)(8 * n + 2 * t + (e & 1));
                s[n][e] = key < k1 ? s[n][e] * scale_log2 : attn_neg_inf();
            }
        }
        // Online softmax of rows g (h = 0) and g + 8 (h = 1); a quad holds a row's 16 scores.
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = fmaxf(m[h], fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1])));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // Key `base` < k1 is in every step, so mx is finite; the guard keeps -inf from
            // turning into NaN all the same.
            const float mu = mx == attn_neg_inf() ? 0.f : mx;
            const float corr = exp2f(m[h] - mu);  // 0 while m is -inf
            m[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < 2; n++) {
                s[n][2 * h] = exp2f(s[n][2 * h] - mu);
                s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - mu);
                sum += s[n][2 * h] + s[n][2 * h + 1];
            }
            l[h] = l[h] * corr + sum;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                o[n][2 * h] *= corr;
                o[n][2 * h + 1] *= corr;
            }
        }
        // O += P·V over the step's 16 keys.
        uint32_t pa[4];
        if constexpr (QUANT) {
            // The values' scales go into P (each key's weight times its row's scale), the codes
            // into B exactly. Output n-tile n, column g is dim g·NT + n (so that lane g's V codes
            // are one run of NT bytes of each of its keys 2t, 2t + 1, 2t + 8, 2t + 9); the states
            // are written back in dim order below, times the second factor of kvq_bf16_half_unit.
            const float2 v0 = *reinterpret_cast<const float2*>(qS + DEC_KEYS + 2 * t);
            const float2 v1 = *reinterpret_cast<const float2*>(qS + DEC_KEYS + 8 + 2 * t);
            constexpr float unit = kvq_bf16_half_unit<KIND>();
            pa[0] = pf_pack(s[0][0] * v0.x * unit, s[0][1] * v0.y * unit);
            pa[1] = pf_pack(s[0][2] * v0.x * unit, s[0][3] * v0.y * unit);
            pa[2] = pf_pack(s[1][0] * v1.x * unit, s[1][1] * v1.y * unit);
            pa[3] = pf_pack(s[1][2] * v1.x * unit, s[1][3] * v1.y * unit);
            constexpr int VW = NT / 4;  // words of codes per key and lane
            uint32_t vw[4][VW];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int r = 2 * t + (k & 1) + 8 * (k >> 1);
                const int at = g * NT;  // byte of the row
                const unsigned char* src = qV + r * HD + (((at >> 4) ^ (r % CPRQ)) << 4) + (at & 15);
                if constexpr (VW == 4) {
                    const uint4 w = *reinterpret_cast<const uint4*>(src);
                    vw[k][0] = w.x;
                    vw[k][1] = w.y;
                    vw[k][2] = w.z;
                    vw[k][3] = w.w;
                } else {
                    const uint2 w = *reinterpret_cast<const uint2*>(src);
                    vw[k][0] = w.x;
                    vw[k][1] = w.y;
                }
            }
#pragma unroll
            for (int w = 0; w < VW; w++) {
                // Keys 2t and 2t + 1 (b0), 2t + 8 and 2t + 9 (b1) of dims 4w..4w+3 of the lane's
                // run: interleave their bytes, then decode pairs.
                uint32_t b0[4], b1[4];
                kvq_decode4_bf16x2<KIND>(__byte_perm(vw[0][w], vw[1][w], 0x5140u), b0[0], b0[1]);
                kvq_decode4_bf16x2<KIND>(__byte_perm(vw[0][w], vw[1][w], 0x7362u), b0[2], b0[3]);
                kvq_decode4_bf16x2<KIND>(__byte_perm(vw[2][w], vw[3][w], 0x5140u), b1[0], b1[1]);
                kvq_decode4_bf16x2<KIND>(__byte_perm(vw[2][w], vw[3][w], 0x7362u), b1[2], b1[3]);
#pragma unroll
                for (int j = 0; j < 4; j++) pf_mma(o[4 * w + j], pa, b0[j], b1[j]);
            }
        } else {
            pa[0] = pf_pack(s[0][0], s[0][1]);
            pa[1] = pf_pack(s[0][2], s[0][3]);
            pa[2] = pf_pack(s[1][0], s[1][1]);
            pa[3] = pf_pack(s[1][2], s[1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                uint32_t b[4];
                pf_ldmatrix_x4_trans(b, &sV[pf_swz<HD>(vr, 2 * dp + vc)]);
                pf_mma(o[2 * dp], pa, b[0], b[1]);
                pf_mma(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    pf_cp_async_wait_all();  // only empty groups are left, but none may land after the reuse below
    __syncthreads();         // every warp is done with the ring: it becomes the merge buffer

    // Merge the warps' states. A warp that saw no key has m = -inf, l = 0, o = 0.
    float* const sm_o = reinterpret_cast<float*>(pf_dyn_smem);       // [warp][row][OSTRIDE]
    float* const sm_m = sm_o + DEC_WARPS * DEC_ROWS * OSTRIDE;        // [warp][row]
    float* const sm_l = sm_m + DEC_WARPS * DEC_ROWS;                  // [warp][row]
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = g + 8 * h;
        if (t == 0) {
            sm_m[warp * DEC_ROWS + r] = m[h];
            sm_l[warp * DEC_ROWS + r] = sum;
        }
        float* dst = sm_o + (warp * DEC_ROWS + r) * OSTRIDE;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            // Column 2t (+1) of n-tile n: dim 8n + 2t (+1), or with a quantized cache 2t·NT + n.
            constexpr float ou = QUANT ? kvq_bf16_half_unit<KIND>() : 1.f;
            dst[QUANT ? 2 * t * NT + n : 8 * n + 2 * t] = o[n][2 * h] * ou;
            dst[QUANT ? (2 * t + 1) * NT + n : 8 * n + 2 * t + 1] = o[n][2 * h + 1] * ou;
        }
    }
    __syncthreads();
    const bool direct = state == ATTN_NO_STATE;
    for (int idx = tid; idx < nh * HD; idx += DEC_THREADS) {
        const int r = idx / HD, d = idx % HD;
        float mx = attn_neg_inf();
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) mx = fmaxf(mx, sm_m[w * DEC_ROWS + r]);
        float sum = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) {
            const float mw = sm_m[w * DEC_ROWS + r];
            if (mw != attn_neg_inf()) {
                const float c = exp2f(mw - mx);
                sum = fmaf(c, sm_l[w * DEC_ROWS + r], sum);
                acc = fmaf(c, sm_o[(w * DEC_ROWS + r) * OSTRIDE + d], acc);
            }
        }
        // sum == 0 only for an empty range: o = 0, lse = -inf.
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const float lse = sum > 0.f ? mx * ATTN_LN2 + logf(sum) : attn_neg_inf();
        const size_t head = (size_t)(h0 + r);
        if (direct) {
            const size_t row = (size_t)token * (size_t)n_heads + head;
            out[row * HD + d] = __float2bfloat16_rn(acc * inv);
            if (d == 0 && lse_out != nullptr) lse_out[row] = lse;
        } else {
            const size_t dst = (size_t)state * (size_t)n_heads + head;
            part_o[dst * HD + d] = acc * inv;
            if (d == 0) part_lse[dst] = lse;
        }
        if constexpr (LOGITS) {
            // The softmax of the logits has this lse as its normaliser (a split row's pairs
            // (lse, 1) merge to the row's).
            if (logit_base != ATTN_NO_STATE && d == 0) {
                if (direct) {
                    score_lse[(size_t)token * (size_t)n_heads + head] = lse;
                } else {
                    part_score[(size_t)state * (size_t)n_heads + head] = make_float2(lse, 1.f);
                }
            }
        }
    }
    if (direct) return;

    // The row's last range to finish merges its states.
    if (!attn_last_range(counters, it2.y, it2.w)) return;
    attn_merge_row<HD, DEC_THREADS, DEC_MERGE_UNROLL(HD)>(part_o, part_lse, it2.y, it2.z, n_heads, h0, nh, token,
                                                          out, lse_out, reinterpret_cast<float*>(pf_dyn_smem));
    if constexpr (LOGITS) {
        // And the normaliser's (max, sum) pairs (other CTAs' writes: read from L2, after the
        // acquire in attn_last_range).
        if (logit_base != ATTN_NO_STATE && tid < nh) {
            const size_t head = (size_t)(h0 + tid);
            float mx = attn_neg_inf(), sum = 0.f;
            for (uint32_t i = 0; i < it2.z; i++) {
                const float2 p = __ldcg(part_score + (size_t)(it2.y + i) * (size_t)n_heads + head);
                if (p.x == attn_neg_inf()) continue;
                const float nm = fmaxf(mx, p.x);
                sum = sum * __expf(mx - nm) + p.y * __expf(p.x - nm);
                mx = nm;
            }
            score_lse[(size_t)token * (size_t)n_heads + head] = sum > 0.f ? mx + logf(sum) : attn_neg_inf();
        }
    }
}

#define ATTN_DECODE_KERNEL(HD)                                                                            \
    ATTN_DECODE_KERNEL_OF(HD, KV_BF16, d) ATTN_DECODE_KERNEL_OF(HD, KV_INT8, q8_d) ATTN_DECODE_KERNEL_OF(HD, KV_FP8, f8_d)
#define ATTN_DECODE_KERNEL_OF(HD, KIND, NAME)                                                             \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2) attn_decode_##NAME##HD(                  \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                  \
        const __nv_bfloat16* __restrict__ v_cache, const uint32_t* __restrict__ tables,                  \
        const uint32_t* __restrict__ items, int n_heads, int group, int n_kv_heads, int block_size,      \
        int block_shift, float scale, float* __restrict__ part_o, float* __restrict__ part_lse,          \
        uint32_t* __restrict__ counters, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) { \
        attn_decode<HD, false, KIND>(q, k_cache, v_cache, tables, items, n_heads, group, n_kv_heads, block_size, \
                               block_shift, scale, part_o, part_lse, counters, out, lse_out, nullptr,      \
                               nullptr, nullptr, nullptr);                                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, 2) attn_decode_logits_##NAME##HD(           \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                  \
        const __nv_bfloat16* __restrict__ v_cache, const uint32_t* __restrict__ tables,                  \
        const uint32_t* __restrict__ items, int n_heads, int group, int n_kv_heads, int block_size,      \
        int block_shift, float scale, float* __restrict__ part_o, float* __restrict__ part_lse,          \
        uint32_t* __restrict__ counters, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out,   \
        const uint32_t* __restrict__ logit_at, float* __restrict__ logits, float* __restrict__ score_lse, \
        float2* __restrict__ part_score) {                                                                \
        attn_decode<HD, true, KIND>(q, k_cache, v_cache, tables, items, n_heads, group, n_kv_heads, block_size, \
                              block_shift, scale, part_o, part_lse, counters, out, lse_out, logit_at,     \
                              logits, score_lse, part_score);                                             \
    }

// attn_decode_logits_d*: the same, and for rows whose logit_at entry (8 words a token: logits
// offset, row stride, function (1 softmax, 2 Gumbel softmax), tau (f32 bits), seed lo, seed hi,
// position, keys the row sees) has an offset other than ATTN_NO_STATE, each CTA also writes its
// keys' scaled logits x to logits[offset + head * stride + key], and the row's lse per head to
// score_lse[token][head] (split rows through part_score, merged by the last range): the
// eviction scores' inputs, so that scoring a decode step reads no key twice and its logits once.
// For softmax scores (H2O) these are f(x) = x and its normaliser; Gumbel rows are finished by
// attn_logits_gumbel.
ATTN_DECODE_KERNEL(64)
ATTN_DECODE_KERNEL(128)

// Keyformer's f(x) = (x + g) / tau over the logits attn_decode_logits_d* wrote: one CTA per
// (query row of `rows`, head); rows whose logit_at entry is not a Gumbel softmax (function 2)
// return at once. The CTA replaces each of the row's logits x by f(x), g the Gumbel draw of
// (seed, position, layer, head, key) (turbo_keyformer::gumbel), and writes the row's normaliser
// logsumexp_j f(x_j) to score_lse[token][head] in place of the attention's lse. A pass of its
// own because it runs at full occupancy: drawn inside the 2-CTA attention kernel, the hashes and
// logs added a fifth to that kernel's time (on an H200, 512 threads a CTA measured 1% faster a
// step than 256 or 1024, and 4 keys a round as fast as 8 or 16). The grid is fixed by the step's
// rows, so a recorded step replays it for any key counts.
#define GUMBEL_THREADS 512
#define GUMBEL_UNROLL 4

extern "C" __global__ void __launch_bounds__(GUMBEL_THREADS)
    attn_logits_gumbel(const uint32_t* __restrict__ logit_at, const uint32_t* __restrict__ rows,
                       float* __restrict__ logits, float* __restrict__ score_lse, int n_heads, int layer) {
    __shared__ float red_m[GUMBEL_THREADS / TURBO_WARP], red_l[GUMBEL_THREADS / TURBO_WARP];
    const unsigned token = rows[blockIdx.x], head = blockIdx.y;
    const uint4 la = reinterpret_cast<const uint4*>(logit_at)[2 * token];
    if (la.x == ATTN_NO_STATE || la.z != 2u) return;
    const uint4 lb = reinterpret_cast<const uint4*>(logit_at)[2 * token + 1];
    const float inv_tau = 1.f / __uint_as_float(la.w);
    const unsigned long long gb =
        score_gumbel_base((unsigned long long)lb.x | ((unsigned long long)lb.y << 32), lb.z, (unsigned)layer);
    const unsigned n = lb.w;
    float* row = logits + (size_t)la.x + (size_t)head * la.y;
    // The thread's running (max, sum of exp) over its keys, GUMBEL_UNROLL keys a round (one
    // correction of the sum per round).
    float m = attn_neg_inf(), l = 0.f;
    for (unsigned j0 = threadIdx.x; j0 < n; j0 += GUMBEL_THREADS * GUMBEL_UNROLL) {
        float v[GUMBEL_UNROLL];
        float mx = m;
#pragma unroll
        for (int u = 0; u < GUMBEL_UNROLL; u++) {
            const unsigned j = j0 + (unsigned)u * GUMBEL_THREADS;
            v[u] = attn_neg_inf();
            if (j < n) {
                v[u] = (row[j] + score_gumbel_at(gb, head, j)) * inv_tau;
                row[j] = v[u];
                mx = fmaxf(mx, v[u]);
            }
        }
        // mx is finite: key j0 < n is in this round.
        float sum = l * __expf(m - mx);  // 0 while m is -inf
#pragma unroll
        for (int u = 0; u < GUMBEL_UNROLL; u++) sum += __expf(v[u] - mx);
        m = mx;
        l = sum;
    }
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const float wm = warp_max(m);
    const float wl = warp_sum(wm == attn_neg_inf() ? 0.f : l * __expf(m - wm));
    if (lane == 0) {
        red_m[warp] = wm;
        red_l[warp] = wl;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = attn_neg_inf();
        for (int w = 0; w < GUMBEL_THREADS / TURBO_WARP; w++) mx = fmaxf(mx, red_m[w]);
        float sum = 0.f;
        for (int w = 0; w < GUMBEL_THREADS / TURBO_WARP; w++) {
            if (red_m[w] != attn_neg_inf()) sum += red_l[w] * __expf(red_m[w] - mx);
        }
        score_lse[(size_t)token * (size_t)n_heads + head] = sum > 0.f ? mx + logf(sum) : attn_neg_inf();
    }
}
