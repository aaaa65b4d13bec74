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
//   token_work      [rows + 1] work items token_work[r]..token_work[r + 1] belong to merge row r
//   rows            [rows] the query row of each merge row, or null: merge row r is query row r
//
// Prefill spans (many query rows of one sequence) go instead to attn_prefill_d*, a tensor-core
// FlashAttention-2 kernel (at the end of this file).
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
// Merge row blockIdx.x is query row rows[blockIdx.x], or blockIdx.x itself when rows is null;
// token_work is indexed by merge row.
extern "C" __global__ void __launch_bounds__(ATTN_MERGE_THREADS)
attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
           const uint32_t* __restrict__ token_work, const uint32_t* __restrict__ rows, int n_heads,
           int head_dim, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {
    const size_t token = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
    const int head = blockIdx.y;
    const size_t w0 = token_work[blockIdx.x], w1 = token_work[blockIdx.x + 1];
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

// The prefill kernels' shared memory (dynamic: above 48 KiB for some shapes).
extern __shared__ __align__(16) unsigned char pf_dyn_smem[];

// -- PTX primitives (sm_80+) --
__device__ __forceinline__ uint32_t pf_smem(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared; with valid == false nothing is read and 16 zero bytes written.
__device__ __forceinline__ void pf_cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(pf_smem(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void pf_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits for all of this thread's cp.async groups.
__device__ __forceinline__ void pf_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void pf_ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pf_smem(p)));
}

__device__ __forceinline__ void pf_ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pf_smem(p)));
}

// d += a·b for one 16×8×16 tile: a 16×16 row-major (4 regs), b 16×8 column-major (2 regs).
__device__ __forceinline__ void pf_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 as a bf16 pair (lo in the low half, as mma fragments and memory order want).
__device__ __forceinline__ uint32_t pf_pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// -- PREFILL KERNEL BODY BEGIN --
// Element offset of 16-byte chunk c of row r in a swizzled shared tile with rows of HD bf16.
template <int HD>
__device__ __forceinline__ int pf_swz(int r, int c) {
    return r * HD + ((c ^ (r & 7)) << 3);
}

// Shared memory of attn_prefill<HD, WARPS, MT, BN>, in bytes.
template <int HD, int WARPS, int MT, int BN>
constexpr int pf_smem_bytes() {
    // MT == 1: K, and Q then V in one buffer; else Q, K, V.
    return MT == 1 ? (BN + (16 * WARPS > BN ? 16 * WARPS : BN)) * HD * 2 : (16 * MT * WARPS + 2 * BN) * HD * 2;
}

// WARPS warps, each owning MT 16-row m-tiles (rows 16·MT·w .. 16·MT·(w+1)), keys in tiles of BN.
// With MT == 1 the Q fragments stay in registers; with MT > 1 they are re-read from shared memory
// at each k-step, and each K and V fragment serves MT m-tiles (half the shared-memory traffic per
// FLOP at MT = 2). Shared memory: the dynamic buffer pf_dyn_smem, pf_smem_bytes<...>() bytes.
template <int HD, int WARPS, int MT, int BN>
__device__ __forceinline__ void attn_prefill(const __nv_bfloat16* __restrict__ q,
                                             const __nv_bfloat16* __restrict__ k_cache,
                                             const __nv_bfloat16* __restrict__ v_cache,
                                             const uint32_t* __restrict__ tables,
                                             const uint32_t* __restrict__ seq_table_start,
                                             const uint32_t* __restrict__ items, int n_heads, int group,
                                             int n_kv_heads, int block_size, int block_shift, float scale,
                                             __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {
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
    const int head = (int)(blockIdx.x % (unsigned)n_heads);
    const size_t item = blockIdx.x / (unsigned)n_heads;
    const uint32_t token0 = items[4 * item], n_rows = items[4 * item + 1];
    const uint32_t pos0 = items[4 * item + 2], seq = items[4 * item + 3];
    const uint32_t n_keys = pos0 + n_rows;  // keys 0..=last row's position
    const int n_tiles = (int)((n_keys + BN - 1) / BN);
    const uint32_t* table = tables + seq_table_start[seq];
    const size_t slot_stride = (size_t)n_kv_heads * HD;
    const size_t head_off = (size_t)(head / group) * HD;
    const int cc = tid % CPR;  // the 16-byte chunk of each row this thread copies

    // Q rows (zeros past the item's rows).
#pragma unroll
    for (int p = 0; p < Q_PASSES; p++) {
        const int r = tid / CPR + RPP * p;
        const bool valid = (uint32_t)r < n_rows;
        const __nv_bfloat16* src =
            valid ? q + ((size_t)(token0 + r) * (size_t)n_heads + (size_t)head) * HD + cc * 8 : q;
        pf_cp_async16(&sQ[pf_swz<HD>(r, cc)], src, valid);
    }
    pf_cp_async_commit();

    // Cache rows (block * block_size + slot) of the keys this thread copies for tile j; ~0u past
    // the last key.
    uint32_t kv_rows[PASSES];
    auto find_rows = [&](int j) {
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const uint32_t key = (uint32_t)(j * BN + tid / CPR + RPP * p);
            uint32_t row = ~0u;
            if (key < n_keys) {
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

    find_rows(0);
    copy_tile(k_cache, sK);
    pf_cp_async_wait_all();
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
        if (j > 0) pf_cp_async_wait_all();  // K(j)
        __syncthreads();                      // K(j) visible; every warp done with sV (or sQ)
        copy_tile(v_cache, sV);               // V(j), same keys as K(j)
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
        // reach past the first row's position have any).
        const uint32_t key0 = (uint32_t)j * BN;
        const bool masked = key0 + BN - 1 > pos0;
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int n = 0; n < NTILES; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[i][n][e] *= scale_log2;
                    if (masked && key0 + (uint32_t)(n * 8 + 2 * t + (e & 1)) > row_pos(i, e >> 1))
                        s[i][n][e] = attn_neg_inf();
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

        pf_cp_async_wait_all();  // V(j)
        __syncthreads();         // V(j) visible; every warp done with sK
        if (j + 1 < n_tiles) copy_tile(k_cache, sK);

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
                const size_t row = (size_t)(token0 + r) * (size_t)n_heads + (size_t)head;
                __nv_bfloat16* dst = out + row * HD + 2 * t;
#pragma unroll
                for (int d = 0; d < DTILES; d++) {
                    *reinterpret_cast<uint32_t*>(dst + 8 * d) = pf_pack(o[i][d][2 * h] * inv, o[i][d][2 * h + 1] * inv);
                }
                if (lse_out != nullptr && t == 0) lse_out[row] = m[i][h] * ATTN_LN2 + logf(sum);
            }
        }
    }
}
// -- PREFILL KERNEL BODY END --

// attn_prefill_d<HD>: WARPS warps of MT m-tiles, key tiles of BN, registers budgeted for MIN_CTAS
// CTAs per SM; the host launches it with pf_smem_bytes<HD, WARPS, MT, BN>() of dynamic shared memory.
// The host's table of these shapes (prefill_kernel in crates/turbo-kernels/src/ops/attention.rs)
// must agree with the instantiations below.
#define ATTN_PREFILL_KERNEL(HD, WARPS, MT, BN, MIN_CTAS)                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * TURBO_WARP, MIN_CTAS) attn_prefill_d##HD(        \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                  \
        const __nv_bfloat16* __restrict__ v_cache, const uint32_t* __restrict__ tables,                  \
        const uint32_t* __restrict__ seq_table_start, const uint32_t* __restrict__ items, int n_heads,   \
        int group, int n_kv_heads, int block_size, int block_shift, float scale,                         \
        __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {                                  \
        attn_prefill<HD, WARPS, MT, BN>(q, k_cache, v_cache, tables, seq_table_start, items, n_heads,    \
                                        group, n_kv_heads, block_size, block_shift, scale, out, lse_out); \
    }

// Measured on an H100 (causal, 32 heads, S = 2048 / 8192): at d128, two m-tiles per warp (K and V
// fragments each serve two m-tiles: half the shared-memory traffic of one) with 32-key tiles
// (255 registers, no spills, 48 KiB) beat one m-tile with 64-key tiles (212 registers, 32 KiB, two
// CTAs per SM) by 4-8%, and match two m-tiles with 64-key tiles (which spill, 64 KiB); at d64,
// two m-tiles with 64-key tiles (32 KiB) beat both others by 10-20%. 4 warps beat 8.
ATTN_PREFILL_KERNEL(64, 4, 2, 64, 2)
ATTN_PREFILL_KERNEL(128, 4, 2, 32, 2)
