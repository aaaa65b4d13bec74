// KV eviction scores (Keyformer, H2O): every query row of a scored sequence adds, per query head,
// softmax(f(x)) of its attention logits x = scale * q.k over the keys it sees into those keys'
// scores, summed over the query heads of each KV head. f(x) = x (H2O) or (x + g) / tau
// (Keyformer, g a Gumbel draw). The CPU reference is turbo_core::cpu::scores with
// turbo_keyformer::ScoreFunction::accumulate; the noise is turbo_keyformer::gumbel, bit for bit
// up to logf's rounding.
//
// Three kernels, after the step's keys are written, all spread over tiles of SCORE_TILE keys
// (for head_dim 64 and 128 the two tile kernels run on tensor cores: kv_score_*_mma_d*, below):
//   kv_score_partial_bf16  one CTA per (key tile of a scored sequence, KV head): for every row
//                          that sees the tile and each query head of the group, the tile's
//                          (max, sum of exp) of f(x) over the keys the row sees
//   kv_score_merge         one CTA per scored row: merges the row's tile partials into its
//                          normaliser logsumexp_j f(x_j), per query head
//   kv_score_add_bf16      one CTA per (key tile, KV head): each thread owns one key and sums
//                          exp(f(x) - lse) over the rows and query heads that see it, then adds
//                          that into the key's score (a key written in this step starts from 0).
//                          No atomics: the sums are deterministic.
// Layouts: q [tokens][n_heads][head_dim] bf16 (rotated); k_cache [slot][n_kv_heads][head_dim]
// bf16; scores [slot][n_kv_heads] f32; lse [scored rows][n_heads] f32; partials, per span,
// [row][tile][n_heads] (max, sum) f32 pairs.
// Host tables (u32):
//   spans [n][SPAN_WORDS]  q_start, n_q, kv_len, where its block table starts in `tables`,
//                          function (1 softmax, 2 Gumbel softmax), tau (f32 bits), seed lo,
//                          seed hi, its first row in lse, its number of key
//                          tiles, where its partials start (in (row, tile) entries of n_heads
//                          pairs)
//   rows  [n][2]           span, row within the span
//   tiles [n][2]           span, first key of the tile
// A row r of a span of n_q rows and kv_len keys sees keys 0 .. kv_len - n_q + r (causal).
#include "common.cuh"

#define SPAN_WORDS 11
#define SCORE_TILE 64
#define SCORE_MAX_GROUP 8
#define SCORE_MAX_HD 256

struct ScoreSpan {
    unsigned q_start, n_q, kv_len, table_start, function;
    float tau;
    unsigned long long seed;
    unsigned row_base, n_tiles, partial_base;
};

__device__ __forceinline__ ScoreSpan score_span(const unsigned* __restrict__ spans, unsigned s) {
    const unsigned* w = spans + (size_t)s * SPAN_WORDS;
    ScoreSpan p;
    p.q_start = w[0];
    p.n_q = w[1];
    p.kv_len = w[2];
    p.table_start = w[3];
    p.function = w[4];
    p.tau = __uint_as_float(w[5]);
    p.seed = (unsigned long long)w[6] | ((unsigned long long)w[7] << 32);
    p.row_base = w[8];
    p.n_tiles = w[9];
    p.partial_base = w[10];
    return p;
}

// The policy's f of one logit.
__device__ __forceinline__ float score_adjust(const ScoreSpan& p, float x, unsigned pos, unsigned layer,
                                              unsigned head, unsigned key) {
    if (p.function == 2) return (x + score_gumbel_at(score_gumbel_base(p.seed, pos, layer), head, key)) / p.tau;
    return x;
}

__device__ __forceinline__ size_t score_slot(const unsigned* __restrict__ tables, const ScoreSpan& p,
                                             unsigned key, int block_size) {
    return (size_t)tables[p.table_start + key / (unsigned)block_size] * (size_t)block_size +
           key % (unsigned)block_size;
}

// logsumexp of query head h over a row's first n (max, sum of exp) partials, laid out
// [partial][n_heads].
__device__ __forceinline__ float score_merge_partials(const float2* __restrict__ in, unsigned n, int n_heads,
                                                      int h) {
    float m = -INFINITY, l = 0.f;
    for (unsigned t = 0; t < n; t++) {
        const float2 s = in[(size_t)t * n_heads + h];
        const float nm = fmaxf(m, s.x);
        l = l * __expf(m - nm) + s.y * __expf(s.x - nm);
        m = nm;
    }
    return m + logf(l);
}

// Loads query heads h0 .. h0 + nh of row `token` into qs[h][d] as f32. Block-wide.
__device__ __forceinline__ void score_load_q(float (*qs)[SCORE_MAX_HD], const __nv_bfloat16* __restrict__ q,
                                             size_t token, int n_heads, int h0, int nh, int head_dim) {
    for (int i = threadIdx.x; i < nh * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        qs[h][d] = __bfloat162float(q[(token * n_heads + h0 + h) * head_dim + d]);
    }
}

// Loads the tile of SCORE_TILE keys from `first` of KV head g into kt as bf16 pairs, transposed
// ([pair][key]) so that a warp reading one pair of its 32 keys hits 32 banks; keys past the span
// are zeros. Block-wide; the caller synchronises before use.
__device__ __forceinline__ void score_load_tile(uint32_t (*kt)[SCORE_TILE], const __nv_bfloat16* __restrict__ k_cache,
                                                const unsigned* __restrict__ tables, const ScoreSpan& p,
                                                unsigned first, int g, int n_kv_heads, int head_dim,
                                                int block_size) {
    const int pairs = head_dim / 2;
    for (int i = threadIdx.x; i < SCORE_TILE * pairs; i += blockDim.x) {
        const unsigned key = first + i / pairs;
        const int pr = i % pairs;
        uint32_t w = 0;
        if (key < p.kv_len) {
            const __nv_bfloat16* kp =
                k_cache + (score_slot(tables, p, key, block_size) * n_kv_heads + g) * head_dim;
            w = reinterpret_cast<const uint32_t*>(kp)[pr];
        }
        kt[pr][i / pairs] = w;
    }
}

// acc[h] = q_h . k for the calling thread's key of the tile, heads h < nh of qs.
__device__ __forceinline__ void score_dots(float (&acc)[SCORE_MAX_GROUP], const uint32_t (*kt)[SCORE_TILE],
                                           const float (*qs)[SCORE_MAX_HD], int nh, int head_dim) {
#pragma unroll
    for (int h = 0; h < SCORE_MAX_GROUP; h++) acc[h] = 0.f;
    for (int pr = 0; pr < head_dim / 2; pr++) {
        const uint32_t w = kt[pr][threadIdx.x];
        const float k0 = __uint_as_float(w << 16), k1 = __uint_as_float(w & 0xffff0000u);
#pragma unroll
        for (int h = 0; h < SCORE_MAX_GROUP; h++) {
            if (h < nh) acc[h] = fmaf(qs[h][2 * pr + 1], k1, fmaf(qs[h][2 * pr], k0, acc[h]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(SCORE_TILE)
    kv_score_partial_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
                          const unsigned* __restrict__ tables, const unsigned* __restrict__ spans,
                          const unsigned* __restrict__ tiles, const unsigned* __restrict__ positions,
                          float2* __restrict__ partials, int n_heads, int n_kv_heads, int head_dim,
                          int block_size, int layer, float scale) {
    __shared__ uint32_t kt[SCORE_MAX_HD / 2][SCORE_TILE];
    __shared__ float qs[SCORE_MAX_GROUP][SCORE_MAX_HD];
    __shared__ float red[SCORE_MAX_GROUP][SCORE_TILE / TURBO_WARP];
    const int g = blockIdx.y;
    const ScoreSpan p = score_span(spans, tiles[2 * blockIdx.x]);
    const unsigned first = tiles[2 * blockIdx.x + 1];
    const unsigned tile = first / SCORE_TILE;
    const unsigned j = first + threadIdx.x;
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    score_load_tile(kt, k_cache, tables, p, first, g, n_kv_heads, head_dim, block_size);
    const int group = n_heads / n_kv_heads;
    const unsigned cached = p.kv_len - p.n_q;
    const unsigned r0 = first > cached ? first - cached : 0;
    for (unsigned r = r0; r < p.n_q; r++) {
        const size_t token = (size_t)p.q_start + r;
        const unsigned pos = positions[token];
        const bool sees = j < p.kv_len && j <= cached + r;
        float2* out = partials + ((size_t)p.partial_base + (size_t)r * p.n_tiles + tile) * n_heads;
        for (int h0 = g * group; h0 < (g + 1) * group; h0 += SCORE_MAX_GROUP) {
            const int nh = min(SCORE_MAX_GROUP, (g + 1) * group - h0);
            __syncthreads();
            score_load_q(qs, q, token, n_heads, h0, nh, head_dim);
            __syncthreads();
            float y[SCORE_MAX_GROUP];
            score_dots(y, kt, qs, nh, head_dim);
#pragma unroll
            for (int h = 0; h < SCORE_MAX_GROUP; h++) {
                if (h < nh) {
                    y[h] = sees ? score_adjust(p, scale * y[h], pos, layer, h0 + h, j) : -INFINITY;
                    const float wm = warp_max(y[h]);
                    if (lane == 0) red[h][warp] = wm;
                }
            }
            __syncthreads();
            float m[SCORE_MAX_GROUP];
#pragma unroll
            for (int h = 0; h < SCORE_MAX_GROUP; h++) {
                if (h < nh) {
                    m[h] = red[h][0];
                    for (int w = 1; w < SCORE_TILE / TURBO_WARP; w++) m[h] = fmaxf(m[h], red[h][w]);
                }
            }
            __syncthreads();
#pragma unroll
            for (int h = 0; h < SCORE_MAX_GROUP; h++) {
                if (h < nh) {
                    // The row sees the tile's first key, so m[h] is finite.
                    const float ws = warp_sum(sees ? __expf(y[h] - m[h]) : 0.f);
                    if (lane == 0) red[h][warp] = ws;
                }
            }
            __syncthreads();
            if (threadIdx.x < nh) {
                const int h = threadIdx.x;
                float l = 0.f;
                for (int w = 0; w < SCORE_TILE / TURBO_WARP; w++) l += red[h][w];
                out[h0 + h] = make_float2(m[h], l);
            }
        }
    }
}

// lse[row_base + r][h] = the merge of row r's partials over the tiles it sees. One CTA per scored
// row, threads over query heads.
extern "C" __global__ void kv_score_merge(const unsigned* __restrict__ spans, const unsigned* __restrict__ rows,
                                          const float2* __restrict__ partials, float* __restrict__ lse,
                                          int n_heads) {
    const unsigned row = blockIdx.x;
    const ScoreSpan p = score_span(spans, rows[2 * row]);
    const unsigned r = rows[2 * row + 1];
    const unsigned seen_tiles = (p.kv_len - p.n_q + r) / SCORE_TILE + 1;
    const float2* in = partials + ((size_t)p.partial_base + (size_t)r * p.n_tiles) * n_heads;
    for (int h = threadIdx.x; h < n_heads; h += blockDim.x) {
        lse[((size_t)p.row_base + r) * n_heads + h] = score_merge_partials(in, seen_tiles, n_heads, h);
    }
}

extern "C" __global__ void __launch_bounds__(SCORE_TILE)
    kv_score_add_bf16(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
                      float* __restrict__ scores, const unsigned* __restrict__ tables,
                      const unsigned* __restrict__ spans, const unsigned* __restrict__ tiles,
                      const unsigned* __restrict__ positions, const float* __restrict__ lse, int n_heads,
                      int n_kv_heads, int head_dim, int block_size, int layer, float scale) {
    __shared__ uint32_t kt[SCORE_MAX_HD / 2][SCORE_TILE];
    __shared__ float qs[SCORE_MAX_GROUP][SCORE_MAX_HD];
    const int g = blockIdx.y;
    const ScoreSpan p = score_span(spans, tiles[2 * blockIdx.x]);
    const unsigned first = tiles[2 * blockIdx.x + 1];
    const unsigned j = first + threadIdx.x;
    const bool valid = j < p.kv_len;
    score_load_tile(kt, k_cache, tables, p, first, g, n_kv_heads, head_dim, block_size);
    const int group = n_heads / n_kv_heads;
    const unsigned cached = p.kv_len - p.n_q;  // keys before this step's chunk
    // Rows before r0 see no key of the tile.
    const unsigned r0 = first > cached ? first - cached : 0;
    float inc = 0.f;
    for (unsigned r = r0; r < p.n_q; r++) {
        const size_t token = (size_t)p.q_start + r;
        const unsigned pos = positions[token];
        const bool sees = valid && j <= cached + r;
        for (int h0 = g * group; h0 < (g + 1) * group; h0 += SCORE_MAX_GROUP) {
            const int nh = min(SCORE_MAX_GROUP, (g + 1) * group - h0);
            __syncthreads();
            score_load_q(qs, q, token, n_heads, h0, nh, head_dim);
            __syncthreads();
            if (!sees) continue;
            float acc[SCORE_MAX_GROUP];
            score_dots(acc, kt, qs, nh, head_dim);
            const float* row_lse = lse + (size_t)(p.row_base + r) * n_heads;
#pragma unroll
            for (int h = 0; h < SCORE_MAX_GROUP; h++) {
                if (h < nh) {
                    const float y = score_adjust(p, scale * acc[h], pos, layer, h0 + h, j);
                    inc += __expf(y - row_lse[h0 + h]);
                }
            }
        }
    }
    if (!valid) return;
    const size_t at = score_slot(tables, p, j, block_size) * n_kv_heads + g;
    // A key written in this step (the chunk's own) starts from 0: its slot may hold an evicted
    // key's score.
    scores[at] = (j >= cached ? 0.f : scores[at]) + inc;
}

// ------------------------------------------------------------------------------------------------
// The same two passes on tensor cores, for head_dim 64 and 128: kv_score_partial_mma_d* writes
// the partials kv_score_partial_bf16 does, kv_score_add_mma_d* adds what kv_score_add_bf16 adds,
// with the same tables, grid and arguments (SCORE_MMA_WARPS warps per CTA).
//
// One CTA per (key tile of SCORE_TILE keys, KV head g): the tile's keys go to shared memory once
// (16-byte cp.async copies through the block table, swizzled rows as in the prefill attention),
// then the CTA walks the flattened rows f = (r - r0) · group + h of the (query row r, query head
// g · group + h) pairs that see the tile, 16 per m-tile, the warps taking m-tiles in turn. Per
// m-tile, S = Q·Kᵀ (16 × SCORE_TILE) by mma.sync m16n8k16 (bf16 in, f32 accumulate; Q fragments
// read straight from global memory, K fragments by ldmatrix), then f and the causal mask in
// registers, and either
//   partial: each row's (max, sum of exp) over the tile, reduced over the quad of lanes that
//            holds the row, written to the row's partial of this tile, or
//   add:     exp(f(x) - lse) summed per key column in registers; at the end the columns are
//            reduced over each warp's lanes and then over the warps in a fixed order, and each
//            key's score is updated once (no atomics: deterministic).
#define SCORE_MMA_WARPS 4

template <int HD, bool ADD, int KIND>
__device__ __forceinline__ void score_mma(const __nv_bfloat16* __restrict__ q,
                                          const __nv_bfloat16* __restrict__ k_cache,
                                          const unsigned* __restrict__ tables, const unsigned* __restrict__ spans,
                                          const unsigned* __restrict__ tiles, const unsigned* __restrict__ positions,
                                          float2* __restrict__ partials, const float* __restrict__ lse,
                                          float* __restrict__ scores, int n_heads, int n_kv_heads, int block_size,
                                          int layer, float scale) {
    constexpr int KSTEPS = HD / 16;                       // k-steps of Q·Kᵀ
    constexpr int NTILES = SCORE_TILE / 8;                // 8-key n-tiles of S
    constexpr int THREADS = SCORE_MMA_WARPS * TURBO_WARP;
    constexpr int CPR = HD / 8;                           // 16-byte chunks per key row
    constexpr int RPP = THREADS / CPR;                    // key rows copied per pass
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    static_assert(SCORE_TILE % RPP == 0 && SCORE_TILE % 16 == 0, "copy shape");
    __shared__ __align__(16) __nv_bfloat16 sK[SCORE_TILE * HD];
    __shared__ float colsum[ADD ? SCORE_MMA_WARPS : 1][SCORE_TILE];
    __shared__ float sScale[KIND == KV_BF16 ? 1 : SCORE_TILE];  // quantized: each key's scale

    const int tid = threadIdx.x, lane = tid % TURBO_WARP, warp = tid / TURBO_WARP;
    const int gid = lane >> 2, t = lane & 3;  // mma fragment row group and column pair
    const int g = blockIdx.y;
    const ScoreSpan p = score_span(spans, tiles[2 * blockIdx.x]);
    const unsigned first = tiles[2 * blockIdx.x + 1];
    const unsigned tile = first / SCORE_TILE;
    const int group = n_heads / n_kv_heads;
    const unsigned cached = p.kv_len - p.n_q;  // keys before this step's chunk
    // Rows before r0 see no key of the tile; every row from r0 on sees its first key.
    const unsigned r0 = first > cached ? first - cached : 0;

    // The tile's keys of KV head g (zeros past the span).
    const int cc = tid % CPR;
#pragma unroll
    for (int pass = 0; pass < SCORE_TILE / RPP; pass++) {
        const int r = tid / CPR + RPP * pass;
        const unsigned key = first + (unsigned)r;
        const bool valid = key < p.kv_len;
        if constexpr (KIND == KV_BF16) {
            const __nv_bfloat16* src =
                valid ? k_cache + (score_slot(tables, p, key, block_size) * n_kv_heads + g) * HD + cc * 8 : k_cache;
            pf_cp_async16(&sK[pf_swz<HD>(r, cc)], src, valid);
        } else {
            // A quantized cache: the row's 8 codes of this chunk as their exact values (bf16 holds
            // them), the row's scale beside the tile, applied to the scores.
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; e++) f[e] = 0.f;
            if (valid) {
                const size_t slot = score_slot(tables, p, key, block_size);
                const uint32_t blk = (uint32_t)(slot / (size_t)block_size);
                const uint32_t off = (uint32_t)(slot - (size_t)blk * (size_t)block_size);
                const uint8_t* base = reinterpret_cast<const uint8_t*>(k_cache);
                const uint2 w = __ldg(reinterpret_cast<const uint2*>(
                    base + kvq_code_at(blk, off, g, block_size, n_kv_heads, HD) + cc * 8));
                if (cc == 0) {
                    sScale[r] = __ldg(reinterpret_cast<const float*>(
                                    base + kvq_scale_at(blk, off, g, block_size, n_kv_heads, HD))) *
                                kvq_unit<KIND>();
                }
                float lo[4], hi[4];
                kvq_decode4<KIND>(w.x, lo);
                kvq_decode4<KIND>(w.y, hi);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    f[e] = lo[e];
                    f[4 + e] = hi[e];
                }
            } else if (cc == 0) {
                sScale[r] = 0.f;
            }
            *reinterpret_cast<uint4*>(&sK[pf_swz<HD>(r, cc)]) = bf16x8_pack(f);
        }
    }
    pf_cp_async_commit();
    pf_cp_async_wait_all();
    __syncthreads();

    const unsigned n_flat = (p.n_q - r0) * (unsigned)group;
    const float inv_tau = 1.f / p.tau;
    // ldmatrix lanes: keys 0-7 at dims 16ks.. and 16ks+8.., then keys 8-15 (b0, b1 of n-tile
    // 2np, then of 2np + 1).
    const int kr = (lane & 7) + ((lane >> 4) << 3);
    const int kc = (lane >> 3) & 1;
    float cs[NTILES][2];  // add: this thread's column sums (columns n · 8 + 2t, + 1)
#pragma unroll
    for (int n = 0; n < NTILES; n++) cs[n][0] = cs[n][1] = 0.f;

    for (unsigned mt = (unsigned)warp; mt * 16 < n_flat; mt += SCORE_MMA_WARPS) {
        // This thread's rows gid and gid + 8 of the m-tile.
        bool live[2];
        unsigned r[2], h[2];
        const uint32_t* qrow[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const unsigned f = mt * 16 + (unsigned)(gid + 8 * i);
            live[i] = f < n_flat;
            r[i] = live[i] ? r0 + f / (unsigned)group : r0;
            h[i] = (unsigned)g * group + (live[i] ? f % (unsigned)group : 0);
            qrow[i] = reinterpret_cast<const uint32_t*>(
                q + (((size_t)p.q_start + r[i]) * (size_t)n_heads + h[i]) * HD);
        }
        float s[NTILES][4];
#pragma unroll
        for (int n = 0; n < NTILES; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            // a0..a3 of m16n8k16: (row gid, dims 2t..), (gid + 8, 2t..), (gid, 2t + 8..),
            // (gid + 8, 2t + 8..) of this k-step; rows past the flattened rows are zeros.
            uint32_t a[4];
            a[0] = live[0] ? __ldg(qrow[0] + ks * 8 + t) : 0u;
            a[1] = live[1] ? __ldg(qrow[1] + ks * 8 + t) : 0u;
            a[2] = live[0] ? __ldg(qrow[0] + ks * 8 + 4 + t) : 0u;
            a[3] = live[1] ? __ldg(qrow[1] + ks * 8 + 4 + t) : 0u;
#pragma unroll
            for (int np = 0; np < NTILES / 2; np++) {
                uint32_t b[4];
                pf_ldmatrix_x4(b, &sK[pf_swz<HD>(np * 16 + kr, 2 * ks + kc)]);
                pf_mma(s[2 * np], a, b[0], b[1]);
                pf_mma(s[2 * np + 1], a, b[2], b[3]);
            }
        }

        // f(x) of the keys each row sees, -inf elsewhere (1/tau by one product: within an ulp of
        // the CPU's quotient).
        unsigned long long base[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            base[i] = p.function == 2 && live[i]
                          ? score_gumbel_base(p.seed, positions[p.q_start + r[i]], (unsigned)layer)
                          : 0ull;
        }
#pragma unroll
        for (int n = 0; n < NTILES; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = e >> 1;
                const unsigned j = first + (unsigned)(n * 8 + 2 * t + (e & 1));
                const bool sees = live[i] && j < p.kv_len && j <= cached + r[i];
                float y = scale * (KIND == KV_BF16 ? s[n][e] : s[n][e] * sScale[n * 8 + 2 * t + (e & 1)]);
                if (p.function == 2) y = (y + (sees ? score_gumbel_at(base[i], h[i], j) : 0.f)) * inv_tau;
                s[n][e] = sees ? y : -INFINITY;
            }
        }

        if constexpr (ADD) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float l = live[i] ? lse[((size_t)p.row_base + r[i]) * n_heads + h[i]] : 0.f;
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const float y = s[n][2 * i + c];
                        cs[n][c] += y == -INFINITY ? 0.f : __expf(y - l);
                    }
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float m = -INFINITY;
#pragma unroll
                for (int n = 0; n < NTILES; n++) m = fmaxf(m, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                float l = 0.f;
#pragma unroll
                for (int n = 0; n < NTILES; n++) {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const float y = s[n][2 * i + c];
                        l += y == -INFINITY ? 0.f : __expf(y - m);
                    }
                }
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                // A live row sees the tile's first key, so m is finite.
                if (t == 0 && live[i]) {
                    partials[((size_t)p.partial_base + (size_t)r[i] * p.n_tiles + tile) * n_heads + h[i]] =
                        make_float2(m, l);
                }
            }
        }
    }

    if constexpr (ADD) {
#pragma unroll
        for (int n = 0; n < NTILES; n++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                float v = cs[n][c];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (gid == 0) colsum[warp][n * 8 + 2 * t + c] = v;
            }
        }
        __syncthreads();
        if (tid < SCORE_TILE) {
            const unsigned j = first + (unsigned)tid;
            if (j < p.kv_len) {
                float inc = 0.f;
#pragma unroll
                for (int w = 0; w < SCORE_MMA_WARPS; w++) inc += colsum[w][tid];
                const size_t at = score_slot(tables, p, j, block_size) * n_kv_heads + g;
                // A key written in this step (the chunk's own) starts from 0.
                scores[at] = (j >= cached ? 0.f : scores[at]) + inc;
            }
        }
    }
}

#define SCORE_MMA_KERNELS(HD)                                                                                  \
    SCORE_MMA_KERNELS_OF(HD, KV_BF16, d) SCORE_MMA_KERNELS_OF(HD, KV_INT8, q8_d) SCORE_MMA_KERNELS_OF(HD, KV_FP8, f8_d)
// The q8 and f8 kernels read INT8 and FP8 caches (same arguments).
#define SCORE_MMA_KERNELS_OF(HD, KIND, NAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(SCORE_MMA_WARPS * TURBO_WARP) kv_score_partial_mma_##NAME##HD( \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                         \
        const unsigned* __restrict__ tables, const unsigned* __restrict__ spans,                                \
        const unsigned* __restrict__ tiles, const unsigned* __restrict__ positions, float2* __restrict__ partials, \
        int n_heads, int n_kv_heads, int head_dim, int block_size, int layer, float scale) {                    \
        score_mma<HD, false, KIND>(q, k_cache, tables, spans, tiles, positions, partials, nullptr, nullptr, n_heads,  \
                             n_kv_heads, block_size, layer, scale);                                             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(SCORE_MMA_WARPS * TURBO_WARP) kv_score_add_mma_##NAME##HD(     \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,                         \
        float* __restrict__ scores, const unsigned* __restrict__ tables, const unsigned* __restrict__ spans,    \
        const unsigned* __restrict__ tiles, const unsigned* __restrict__ positions,                             \
        const float* __restrict__ lse, int n_heads, int n_kv_heads, int head_dim, int block_size, int layer,    \
        float scale) {                                                                                          \
        score_mma<HD, true, KIND>(q, k_cache, tables, spans, tiles, positions, nullptr, lse, scores, n_heads,         \
                            n_kv_heads, block_size, layer, scale);                                              \
    }

SCORE_MMA_KERNELS(64)
SCORE_MMA_KERNELS(128)

// out[layer][head][key] = scores of `layer` at the key's slot, for keys < keys of one sequence
// (the host reads them to choose the kept keys). layer_scores holds each layer's scores pointer.
extern "C" __global__ void kv_score_gather(float* __restrict__ out, const unsigned long long* __restrict__ layer_scores,
                                           const unsigned* __restrict__ table, int n_layers, int n_kv_heads,
                                           int keys, int block_size) {
    const long long total = (long long)n_layers * n_kv_heads * keys;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int key = (int)(i % keys);
        const long long lh = i / keys;
        const int head = (int)(lh % n_kv_heads), layer = (int)(lh / n_kv_heads);
        const float* s = reinterpret_cast<const float*>(layer_scores[layer]);
        const size_t slot = (size_t)table[key / block_size] * block_size + key % block_size;
        out[i] = s[slot * n_kv_heads + head];
    }
}

// ------------------------------------------------------------------------------------------------
// Scores from logits: the spans whose rows the decode attention kernel computed with
// attn_decode_logits_d*, which wrote f(x) of their scaled logits x = scale q.k to `logits` (span
// s's rows at `row_base`, [row][n_heads][stride], stride kv_len rounded up to even, each row
// filling the keys it sees) and each row's normaliser logsumexp_j f(x_j) to `lse`
// ([token][n_heads]). One kernel, reading no key,
// with a launch shape fixed by the step's row count alone (so that a recorded decode step replays
// it whatever its key counts):
//   kv_score_logit_add  grid (span x part of its keys, sub-range of the part): each span's keys
//                       are cut into `parts` equal ranges and each of those into gridDim.y
//                       sub-ranges. A thread owns one key for every KV head: it sums, per KV
//                       head, exp(f(x) - lse) over the rows and query heads that see the key and
//                       adds that into the key's score (a key written in this step starts from
//                       0). No atomics. Owning all KV heads of a key makes the thread's score
//                       updates one contiguous run of the [slot][n_kv_heads] layout (a thread per
//                       (key, KV head) touched a 32-byte sector for each 4-byte score), while the
//                       logit reads stay contiguous along keys across the warp.
// Tables: spans as above, with row_base the span's logits offset (padding spans are all zeros).
// CTAs of any size up to LOGIT_MAX_THREADS (the kernel strides by blockDim.x): ops::scores
// chooses it by what else the step runs beside the key sums (measured in docs/keyformer.md).
#define LOGIT_MAX_THREADS 1024

// The distance between a span's rows of logits: kv_len rounded up to even, so that the attention
// kernel writes pairs of keys as float2s (ops::attention::logit_row_stride).
__device__ __forceinline__ size_t score_logit_stride(unsigned kv_len) { return (size_t)kv_len + (kv_len & 1u); }

// One KV head's increment for key j: sum over rows r0.. and the group's query heads of
// exp(f(x) - lse).
__device__ __forceinline__ float score_logit_inc(const float* __restrict__ logits, const float* __restrict__ lse,
                                                 const ScoreSpan& p, unsigned j, unsigned r0, int g, int group,
                                                 int n_heads) {
    float inc = 0.f;
    const size_t stride = score_logit_stride(p.kv_len);
    for (unsigned r = r0; r < p.n_q; r++) {
        const float* y = logits + (size_t)p.row_base + ((size_t)r * n_heads + (size_t)g * group) * stride + j;
        const float* row_lse = lse + ((size_t)p.q_start + r) * n_heads + (size_t)g * group;
        for (int h = 0; h < group; h++) inc += __expf(y[(size_t)h * stride] - row_lse[h]);
    }
    return inc;
}

extern "C" __global__ void __launch_bounds__(LOGIT_MAX_THREADS)
    kv_score_logit_add(const float* __restrict__ logits, float* __restrict__ scores,
                       const unsigned* __restrict__ tables, const unsigned* __restrict__ spans,
                       const float* __restrict__ lse, int n_heads, int n_kv_heads, int block_size, int parts) {
    const ScoreSpan p = score_span(spans, blockIdx.x / (unsigned)parts);
    if (p.n_q == 0) return;
    const unsigned part = blockIdx.x % (unsigned)parts, subs = gridDim.y;
    const unsigned len = (p.kv_len + (unsigned)parts - 1) / (unsigned)parts;
    const unsigned part_first = part * len, part_end = min(p.kv_len, part_first + len);
    if (part_first >= part_end) return;
    const unsigned sub_len = (part_end - part_first + subs - 1) / subs;
    const unsigned first = part_first + blockIdx.y * sub_len, end = min(part_end, first + sub_len);
    const int group = n_heads / n_kv_heads;
    const unsigned cached = p.kv_len - p.n_q;
    const bool by4 = (n_kv_heads & 3) == 0;
    // The grid's third dimension deals the KV heads out (groups of four where they come in
    // fours), so that each thread's chain of loads is short.
    const int g_first = (by4 ? 4 : 1) * (int)blockIdx.z, g_step = (by4 ? 4 : 1) * (int)gridDim.z;
    for (unsigned j = first + threadIdx.x; j < end; j += blockDim.x) {
        // Rows before r0 do not see key j; a key written in this step starts from 0.
        const unsigned r0 = j > cached ? j - cached : 0;
        const bool fresh = j >= cached;
        float* s = scores + score_slot(tables, p, j, block_size) * n_kv_heads;
        if (p.n_q == 1 && by4) {
            // A decode row: four KV heads at a time, their query heads' logits loaded together
            // (independent loads in flight, where the loop below waits on each in turn).
            const float* y = logits + (size_t)p.row_base + j;
            const size_t stride = score_logit_stride(p.kv_len);
            const float* row_lse = lse + (size_t)p.q_start * n_heads;
            for (int g = g_first; g < n_kv_heads; g += g_step) {
                float inc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
                for (int h = 0; h < group; h++) {
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int head = (g + u) * group + h;
                        inc[u] += __expf(y[(size_t)head * stride] - row_lse[head]);
                    }
                }
                float4 v = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(s + g);
                v.x += inc[0];
                v.y += inc[1];
                v.z += inc[2];
                v.w += inc[3];
                *reinterpret_cast<float4*>(s + g) = v;
            }
        } else if (by4) {
            for (int g = g_first; g < n_kv_heads; g += g_step) {
                float4 v = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(s + g);
                v.x += score_logit_inc(logits, lse, p, j, r0, g, group, n_heads);
                v.y += score_logit_inc(logits, lse, p, j, r0, g + 1, group, n_heads);
                v.z += score_logit_inc(logits, lse, p, j, r0, g + 2, group, n_heads);
                v.w += score_logit_inc(logits, lse, p, j, r0, g + 3, group, n_heads);
                *reinterpret_cast<float4*>(s + g) = v;
            }
        } else {
            for (int g = g_first; g < n_kv_heads; g += g_step) {
                s[g] = (fresh ? 0.f : s[g]) + score_logit_inc(logits, lse, p, j, r0, g, group, n_heads);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Kept keys chosen on the device (turbo_keyformer::KeepRule::select_into, the same choice): one
// CTA per (layer, KV head) row of a sequence of n keys keeps k < n: the first `sinks`, the last
// `recent`, and the `top` highest scores in between, ties to the lower key, a NaN ranking lowest;
// kept[row][k] in increasing key order. The top-th largest score is found by a radix select on
// order-preserving u32 images of the scores (4 passes of 8 bits), then the kept keys are written
// in order by a block-wide scan.
#define SELECT_THREADS 512

// An order-preserving image of a score: larger score, larger image; NaN as -inf, -0 as +0.
__device__ __forceinline__ unsigned select_image(float s) {
    if (isnan(s)) s = -INFINITY;
    if (s == 0.f) s = 0.f;
    const unsigned u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block (blockDim.x == SELECT_THREADS), and the total.
__device__ __forceinline__ unsigned select_scan(unsigned v, unsigned* warp_totals, unsigned& total) {
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    unsigned x = v;
#pragma unroll
    for (int o = 1; o < TURBO_WARP; o *= 2) {
        const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == TURBO_WARP - 1) warp_totals[warp] = x;
    __syncthreads();
    unsigned before = 0, all = 0;
    for (int w = 0; w < SELECT_THREADS / TURBO_WARP; w++) {
        const unsigned t = warp_totals[w];
        if (w < warp) before += t;
        all += t;
    }
    __syncthreads();
    total = all;
    return before + x - v;
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    kv_select_kept(unsigned* __restrict__ kept, const unsigned long long* __restrict__ layer_scores,
                   const unsigned* __restrict__ table, int n_kv_heads, int block_size, int n, int k, int sinks,
                   int recent, int top) {
    __shared__ unsigned hist[256];
    __shared__ unsigned warp_totals[SELECT_THREADS / TURBO_WARP];
    __shared__ unsigned chosen[2];  // digit, count still to take
    const int row = blockIdx.x, layer = row / n_kv_heads, head = row % n_kv_heads;
    unsigned* out = kept + (size_t)row * k;
    const int recent_start = n - recent;
    for (int i = threadIdx.x; i < sinks; i += blockDim.x) out[i] = i;
    for (int i = threadIdx.x; i < recent; i += blockDim.x) out[sinks + top + i] = recent_start + i;
    if (top == 0) return;
    const float* scores = reinterpret_cast<const float*>(layer_scores[layer]);
    auto image = [&](int j) {
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        return select_image(scores[slot * n_kv_heads + head]);
    };
    // Radix select of the top-th largest image among keys [sinks, recent_start).
    unsigned prefix = 0, mask = 0, remaining = (unsigned)top;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int j = sinks + threadIdx.x; j < recent_start; j += blockDim.x) {
            const unsigned u = image(j);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned above = 0;
            for (int d = 255; d >= 0; d--) {
                if (above + hist[d] >= remaining) {
                    chosen[0] = d;
                    chosen[1] = remaining - above;
                    break;
                }
                above += hist[d];
            }
        }
        __syncthreads();
        prefix |= chosen[0] << shift;
        mask |= 255u << shift;
        remaining = chosen[1];
        __syncthreads();
    }
    // Keep every image above the threshold and the first `remaining` equal to it, in key order.
    unsigned written = 0, ties_seen = 0;
    for (int c0 = sinks; c0 < recent_start; c0 += blockDim.x) {
        const int j = c0 + threadIdx.x;
        const unsigned u = j < recent_start ? image(j) : 0u;
        const bool in = j < recent_start;
        const bool above = in && u > prefix, tie = in && u == prefix;
        unsigned ties_total;
        const unsigned tie_rank = select_scan(tie ? 1u : 0u, warp_totals, ties_total);
        const bool take = above || (tie && ties_seen + tie_rank < remaining);
        unsigned taken;
        const unsigned at = select_scan(take ? 1u : 0u, warp_totals, taken);
        if (take) out[sinks + written + at] = (unsigned)j;
        written += taken;
        ties_seen += ties_total;
    }
}
