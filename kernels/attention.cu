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
// Work is split "flash-decoding" style: one CTA computes the attention of one query row and one
// head over one chunk of its visible keys (keys 0..=pos), as a state (o, lse). With a split, the
// states go to f32 scratch and attn_merge combines the chunks of each (token, head); without one
// (a single chunk per token covering all its keys), the CTA writes the final output itself.
//
// Host-side tables (all u32):
//   tables          the block tables of all sequences, concatenated
//   seq_table_start [seqs]   where each sequence's table starts in `tables`
//   token_seq       [tokens] the sequence of each query row
//   token_pos       [tokens] the position of each query row (it sees keys 0..=pos)
//   work            [n_work][2] (token, chunk index) per work item, or null: one item per token,
//                   chunk 0, with a chunk size that covers every key
//   token_work      [tokens + 1] work items token_work[t]..token_work[t + 1] belong to token t
#include "common.cuh"

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * TURBO_WARP)
// Keys each lane group takes per step: their loads are all issued before any score is reduced.
#define ATTN_UNROLL 2
#define ATTN_MERGE_THREADS 128
// CTAs per SM the chunk kernels are built for (so up to 128 registers a thread): without it
// ptxas caps them lower and spills.
#define ATTN_MIN_CTAS 4

#define ATTN_LOG2E 1.4426950408889634f
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

// One CTA: query row `token`, head blockIdx.y, keys [k0, k1) of that row's sequence, where
// k0 = chunk index * chunk and k1 = min(k0 + chunk, pos + 1).
//
// A warp is cut into KPW = 32 / G groups of G lanes; a group scores one key at a time, each lane
// owning E = HD / G consecutive dimensions of q, of the key and value rows, and of the output. A
// warp step covers KPW * ATTN_UNROLL consecutive keys (the warps interleave over the chunk): the
// lanes load their slices of the K and V rows (each element read once), reduce the partial dots
// within their group (log2 G shuffles), and each group folds its keys into its own online
// softmax (m, l, acc), in the log2 domain (q is pre-scaled by scale * log2(e), so exp2 of a score
// difference is exp of the scaled one). The ATTN_WARPS * KPW group states are then merged through
// shared memory.
template <int HD, int G>
__device__ __forceinline__ void attn_chunk(const __nv_bfloat16* __restrict__ q,
                                           const __nv_bfloat16* __restrict__ k_cache,
                                           const __nv_bfloat16* __restrict__ v_cache,
                                           const uint32_t* __restrict__ tables,
                                           const uint32_t* __restrict__ seq_table_start,
                                           const uint32_t* __restrict__ token_seq,
                                           const uint32_t* __restrict__ token_pos,
                                           const uint32_t* __restrict__ work, int n_heads, int group,
                                           int n_kv_heads, int block_size, int block_shift, uint32_t chunk,
                                           float scale, float* __restrict__ part_o,
                                           float* __restrict__ part_lse, __nv_bfloat16* __restrict__ out,
                                           float* __restrict__ lse_out) {
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

    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const int sub = lane / G, part = lane % G;
    const size_t item = blockIdx.x;
    const int head = blockIdx.y;
    uint32_t token, chunk_idx;
    if (work != nullptr) {
        token = work[2 * item];
        chunk_idx = work[2 * item + 1];
    } else {
        token = (uint32_t)item;
        chunk_idx = 0;
    }
    const uint32_t seq = token_seq[token];
    const uint32_t n_keys = token_pos[token] + 1;
    const uint32_t k0 = chunk_idx * chunk;  // < n_keys: the host makes no empty work items
    const uint32_t k1 = n_keys - k0 <= chunk ? n_keys : k0 + chunk;
    const uint32_t* table = tables + seq_table_start[seq];

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
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t key = base + (uint32_t)(u * KPW + sub);
            s[u] = 0.f;
            if (key < k1) {
                const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                const uint32_t slot = key - b * (uint32_t)block_size;
                const size_t row =
                    ((size_t)table[b] * (size_t)block_size + slot) * slot_stride + head_off;
                float kk[E];
                attn_load<E>(k_cache + row, kk);
                attn_load<E>(v_cache + row, vv[u]);
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
#pragma unroll
                for (int i = 0; i < E; i++) acc[i] = fmaf(p, vv[u][i], acc[i]);
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
    // An empty group weighs exactly 0; so do all when no key was seen (not reachable: every
    // work item has at least one key).
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < S; w++) sum += sm_m[w] == attn_neg_inf() ? 0.f : exp2f(sm_m[w] - mx) * sm_l[w];
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : 1.f / sum;
    const float lse = empty ? attn_neg_inf() : mx * ATTN_LN2 + logf(sum);

    const size_t state = part_o != nullptr ? item * (size_t)n_heads + (size_t)head : row_q;
    for (int d = threadIdx.x; d < HD; d += ATTN_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < S; w++) {
            if (sm_m[w] != attn_neg_inf()) o = fmaf(exp2f(sm_m[w] - mx), sm_o[w][d], o);
        }
        o *= inv;
        if (part_o != nullptr) {
            part_o[state * HD + d] = o;
        } else {
            out[state * HD + d] = __float2bfloat16_rn(o);
        }
    }
    if (threadIdx.x == 0) {
        if (part_o != nullptr) {
            part_lse[state] = lse;
        } else if (lse_out != nullptr) {
            lse_out[state] = lse;
        }
    }
}

#define ATTN_CHUNK_KERNEL(HD, G)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_CTAS) attn_chunk_d##HD(                         \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                  \
        const __nv_bfloat16* __restrict__ v_cache, const uint32_t* __restrict__ tables,                  \
        const uint32_t* __restrict__ seq_table_start, const uint32_t* __restrict__ token_seq,            \
        const uint32_t* __restrict__ token_pos, const uint32_t* __restrict__ work, int n_heads,          \
        int group, int n_kv_heads, int block_size, int block_shift, uint32_t chunk, float scale,         \
        float* __restrict__ part_o, float* __restrict__ part_lse, __nv_bfloat16* __restrict__ out,       \
        float* __restrict__ lse_out) {                                                                   \
        attn_chunk<HD, G>(q, k_cache, v_cache, tables, seq_table_start, token_seq, token_pos, work,         \
                       n_heads, group, n_kv_heads, block_size, block_shift, chunk, scale, part_o,        \
                       part_lse, out, lse_out);                                                          \
    }

// (head_dim, lanes per key): 8 or 16 bf16 per lane (12 for 96 and 192), loaded 16 or 8 bytes at a time.
ATTN_CHUNK_KERNEL(32, 4)
ATTN_CHUNK_KERNEL(64, 8)
ATTN_CHUNK_KERNEL(96, 8)
ATTN_CHUNK_KERNEL(128, 8)
ATTN_CHUNK_KERNEL(192, 16)
ATTN_CHUNK_KERNEL(256, 16)

// Merges the chunk states of query row blockIdx.x, head blockIdx.y:
//   M = max_i lse_i,  S = Σ_i exp(lse_i - M),  o = Σ_i exp(lse_i - M) o_i / S,  lse = M + ln S.
// Empty chunks (lse_i = -inf) weigh exactly 0; with no finite lse_i at all, o = 0 and lse = -inf.
// A single chunk passes through exactly (weight 1, S = 1).
extern "C" __global__ void __launch_bounds__(ATTN_MERGE_THREADS)
attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
           const uint32_t* __restrict__ token_work, int n_heads, int head_dim,
           __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {
    const size_t token = blockIdx.x;
    const int head = blockIdx.y;
    const size_t w0 = token_work[token], w1 = token_work[token + 1];
    float mx = attn_neg_inf();
    for (size_t w = w0; w < w1; w++) mx = fmaxf(mx, part_lse[w * n_heads + head]);
    const bool empty = mx == attn_neg_inf();
    float sum = 0.f;
    if (!empty) {
        for (size_t w = w0; w < w1; w++) {
            const float x = part_lse[w * n_heads + head];
            sum += x == attn_neg_inf() ? 0.f : expf(x - mx);
        }
    }
    const float inv = empty ? 0.f : 1.f / sum;
    const size_t row = token * (size_t)n_heads + (size_t)head;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        if (!empty) {
            for (size_t w = w0; w < w1; w++) {
                const float x = part_lse[w * n_heads + head];
                if (x != attn_neg_inf()) o = fmaf(expf(x - mx), part_o[(w * n_heads + head) * head_dim + d], o);
            }
        }
        out[row * head_dim + d] = __float2bfloat16_rn(o * inv);
    }
    if (threadIdx.x == 0 && lse_out != nullptr) lse_out[row] = empty ? attn_neg_inf() : mx + logf(sum);
}
