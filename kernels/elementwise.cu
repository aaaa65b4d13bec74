// elementwise kernels.
#include "common.cuh"

__device__ __forceinline__ long long ew_thread() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long ew_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// Interleaved-pair rotary embedding, in place. x is [tokens, heads, head_dim] (head_dim even);
// pair i of each head of token t rotates by positions[t] * inv_freq[i] (rope_rotate).
// Grid-stride, one thread per pair.
extern "C" __global__ void rope_bf16(__nv_bfloat16* x, int tokens, int heads, int head_dim,
                                     const unsigned* positions, const float* inv_freq) {
    const int half = head_dim / 2;
    const long long pairs = (long long)tokens * heads * half;
    __nv_bfloat162* xp = reinterpret_cast<__nv_bfloat162*>(x);
    for (long long p = ew_thread(); p < pairs; p += ew_stride()) {
        const int i = (int)(p % half);
        const long long t = p / half / heads;
        const float2 r = rope_rotate(__bfloat1622float2(xp[p]), (float)positions[t], inv_freq[i]);
        xp[p] = __floats2bfloat162_rn(r.x, r.y);
    }
}

// The attention block's step after the fused QKV product, in one pass: each row of qkv is
// [q | k | v] (q_cols + 2 kv_cols, head_dim consecutive per head); q ([tokens, q_cols]) receives
// the rotated queries, and the rotated keys and the values of token t go straight to slot
// slots[t] of the paged caches (kv_cols per slot; a slot >= cache_slots is skipped). The rotation
// is rope_bf16's, rounded to bf16 the same way. Grid (tokens, blocks per token): a token's pairs
// are spread over gridDim.y blocks, so a decode step of one token still fills several SMs.
extern "C" __global__ void qkv_rope_kv_bf16(const __nv_bfloat16* qkv, __nv_bfloat16* q, __nv_bfloat16* k_cache,
                                            __nv_bfloat16* v_cache, const unsigned* positions,
                                            const unsigned* slots, const float* inv_freq, int q_cols,
                                            int kv_cols, int head_dim, long long cache_slots) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const float pos = (float)positions[t];
    const unsigned slot = slots[t];
    const bool store = (long long)slot < cache_slots;
    const __nv_bfloat162* src =
        reinterpret_cast<const __nv_bfloat162*>(qkv + (size_t)t * (size_t)(q_cols + 2 * kv_cols));
    __nv_bfloat162* qd = reinterpret_cast<__nv_bfloat162*>(q + (size_t)t * (size_t)q_cols);
    __nv_bfloat162* kd = reinterpret_cast<__nv_bfloat162*>(k_cache + (size_t)slot * (size_t)kv_cols);
    __nv_bfloat162* vd = reinterpret_cast<__nv_bfloat162*>(v_cache + (size_t)slot * (size_t)kv_cols);
    const int qp = q_cols / 2, kp = kv_cols / 2;
    for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < qp + 2 * kp; p += gridDim.y * blockDim.x) {
        if (p < qp) {
            const float2 r = rope_rotate(__bfloat1622float2(src[p]), pos, inv_freq[p % half]);
            qd[p] = __floats2bfloat162_rn(r.x, r.y);
        } else if (!store) {
            continue;
        } else if (p < qp + kp) {
            const float2 r = rope_rotate(__bfloat1622float2(src[p]), pos, inv_freq[(p - qp) % half]);
            kd[p - qp] = __floats2bfloat162_rn(r.x, r.y);
        } else {
            vd[p - qp - kp] = src[p];
        }
    }
}

// gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, over n elements, f32 math.
__device__ __forceinline__ float ew_silu_mul(float g, float u) {
    return g / (1.f + expf(-g)) * u;
}

extern "C" __global__ void silu_mul_bf16(__nv_bfloat16* gate, const __nv_bfloat16* up, long long n) {
    const long long nv = (aligned16(gate) && aligned16(up)) ? n / 8 : 0;
    uint4* gv = reinterpret_cast<uint4*>(gate);
    const uint4* uv = reinterpret_cast<const uint4*>(up);
    for (long long i = ew_thread(); i < nv; i += ew_stride()) {
        float g[8], u[8];
        bf16x8_unpack(gv[i], g);
        bf16x8_unpack(uv[i], u);
#pragma unroll
        for (int k = 0; k < 8; k++) g[k] = ew_silu_mul(g[k], u[k]);
        gv[i] = bf16x8_pack(g);
    }
    for (long long i = nv * 8 + ew_thread(); i < n; i += ew_stride()) {
        gate[i] = __float2bfloat16_rn(ew_silu_mul(__bfloat162float(gate[i]), __bfloat162float(up[i])));
    }
}

// x += y over n elements, f32 math.
extern "C" __global__ void add_bf16(__nv_bfloat16* x, const __nv_bfloat16* y, long long n) {
    const long long nv = (aligned16(x) && aligned16(y)) ? n / 8 : 0;
    uint4* xv = reinterpret_cast<uint4*>(x);
    const uint4* yv = reinterpret_cast<const uint4*>(y);
    for (long long i = ew_thread(); i < nv; i += ew_stride()) {
        float a[8], b[8];
        bf16x8_unpack(xv[i], a);
        bf16x8_unpack(yv[i], b);
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] += b[k];
        xv[i] = bf16x8_pack(a);
    }
    for (long long i = nv * 8 + ew_thread(); i < n; i += ew_stride()) {
        x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) + __bfloat162float(y[i]));
    }
}

// Copies one row of cols bf16, 16 bytes at a time when both ends allow it. Block-wide.
__device__ __forceinline__ void ew_copy_row(__nv_bfloat16* dst, const __nv_bfloat16* src, int cols) {
    if ((cols % 8) == 0 && aligned16(dst) && aligned16(src)) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) d[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
    }
}

// out[i, :] = src[idx[i], :] for i < n; src is [src_rows, cols], out is [n, cols]. One block per
// output row. An index out of range fills its output row with NaN instead of reading out of bounds.
// Serves both token embedding (src = the table) and row gathering.
extern "C" __global__ void gather_rows_bf16(__nv_bfloat16* out, const __nv_bfloat16* src, const unsigned* idx,
                                            int n, int cols, long long src_rows) {
    const int i = blockIdx.x;
    if (i >= n) return;
    __nv_bfloat16* dst = out + (size_t)i * (size_t)cols;
    const unsigned r = idx[i];
    if ((long long)r >= src_rows) {
        const __nv_bfloat16 nan = __ushort_as_bfloat16((unsigned short)0x7FC0);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = nan;
        return;
    }
    ew_copy_row(dst, src + (size_t)r * (size_t)cols, cols);
}

// Paged KV write: cache[slots[t] * slot_len + j] = src[t * slot_len + j] for t < tokens,
// j < slot_len; blockIdx.y = 0 writes keys, 1 values. One block per (token, k|v). A slot out of
// range (>= cache_slots) is skipped rather than written out of bounds.
extern "C" __global__ void write_kv_bf16(__nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const __nv_bfloat16* k,
                                         const __nv_bfloat16* v, const unsigned* slots, int tokens, int slot_len,
                                         long long cache_slots) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const unsigned slot = slots[t];
    if ((long long)slot >= cache_slots) return;
    const bool values = blockIdx.y == 1;
    const __nv_bfloat16* src = (values ? v : k) + (size_t)t * (size_t)slot_len;
    __nv_bfloat16* dst = (values ? v_cache : k_cache) + (size_t)slot * (size_t)slot_len;
    ew_copy_row(dst, src, slot_len);
}

// Moves, in place, chunks of `k` rows of one (layer, KV head): row kept[j] to row j, each row
// `units` elements of type T at (slot * n_kv_heads + head) * units. A chunk is blockDim.x / units
// rows, all read before any is written; since kept[j] >= j and rows are strictly increasing,
// earlier chunks wrote only below this chunk's sources and later chunks read only above its
// destinations.
template <typename T>
__device__ __forceinline__ void ew_compact_rows(T* cache, const unsigned* row, const unsigned* block_table, int k,
                                                int block_size, int n_kv_heads, int head, int units) {
    const int per_chunk = blockDim.x / units;
    const int t = threadIdx.x % units;
    for (int j0 = 0; j0 < k; j0 += per_chunk) {
        const int j = j0 + (int)threadIdx.x / units;
        bool moves = false;
        size_t dst = 0;
        T x{};
        if ((int)threadIdx.x < per_chunk * units && j < k) {
            const unsigned from = row[j], to = (unsigned)j;
            if (from != to) {
                const size_t src_slot = (size_t)block_table[from / block_size] * block_size + from % block_size;
                const size_t dst_slot = (size_t)block_table[to / block_size] * block_size + to % block_size;
                x = cache[(src_slot * n_kv_heads + head) * units + t];
                dst = (dst_slot * n_kv_heads + head) * units + t;
                moves = true;
            }
        }
        __syncthreads();
        if (moves) cache[dst] = x;
        __syncthreads();
    }
}

// Compacts a sequence's KV in every layer at once (KV eviction): in every (layer, KV head), the
// key, value and score at key index kept[(layer * n_kv_heads + head) * k + j] move to key index j,
// for j < k; key index i lives at slot block_table[i / block_size] * block_size + i % block_size.
// layers holds per layer the addresses of its keys, values and scores ([3][n_layers]; a scores
// address of 0: none). Each row of kept is strictly increasing (see ew_compact_rows). Keys and
// values move 16 bytes per thread when head_dim is a multiple of 8 (one bf16 per thread
// otherwise), scores one f32. Grid (kv_heads, 3: keys, values, scores, layers); block 1-D, at
// least head_dim threads.
extern "C" __global__ void compact_kv_bf16(const unsigned long long* layers, const unsigned* block_table,
                                           const unsigned* kept, int k, int block_size, int n_layers,
                                           int n_kv_heads, int head_dim) {
    const int head = blockIdx.x, what = blockIdx.y, layer = blockIdx.z;
    const unsigned long long base = layers[what * n_layers + layer];
    if (base == 0) return;
    const unsigned* row = kept + ((size_t)layer * n_kv_heads + head) * (size_t)k;
    if (what == 2) {
        ew_compact_rows(reinterpret_cast<float*>(base), row, block_table, k, block_size, n_kv_heads, head, 1);
    } else if (head_dim % 8 == 0) {
        ew_compact_rows(reinterpret_cast<uint4*>(base), row, block_table, k, block_size, n_kv_heads, head,
                        head_dim / 8);
    } else {
        ew_compact_rows(reinterpret_cast<__nv_bfloat16*>(base), row, block_table, k, block_size, n_kv_heads,
                        head, head_dim);
    }
}

// SwiGLU of a fused gate/up product: gu is [rows, 2 * cols] with each row [gate | up];
// out[r, c] = silu(gate[r, c]) * up[r, c]. Grid-stride over rows * cols.
extern "C" __global__ void swiglu_bf16(__nv_bfloat16* out, const __nv_bfloat16* gu, long long rows,
                                       long long cols) {
    const long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols, c = i - r * cols;
        const float g = __bfloat162float(gu[r * 2 * cols + c]);
        const float u = __bfloat162float(gu[r * 2 * cols + cols + c]);
        out[i] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
    }
}

// Splits the columns of x ([rows, ca + cb + cc]) into a ([rows, ca]), b and c.
// Grid-stride over every element of x.
extern "C" __global__ void split3_bf16(__nv_bfloat16* a, __nv_bfloat16* b, __nv_bfloat16* c,
                                       const __nv_bfloat16* x, long long rows, long long ca, long long cb,
                                       long long cc) {
    const long long width = ca + cb + cc, n = rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width, col = i - r * width;
        const __nv_bfloat16 v = x[i];
        if (col < ca) a[r * ca + col] = v;
        else if (col < ca + cb) b[r * cb + col - ca] = v;
        else c[r * cc + col - ca - cb] = v;
    }
}
