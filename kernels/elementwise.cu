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

// Four consecutive bf16 (8-byte aligned) as f32.
__device__ __forceinline__ void ew_load4(const __nv_bfloat16* p, float (&x)[4]) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    x[0] = a.x;
    x[1] = a.y;
    x[2] = b.x;
    x[3] = b.y;
}

// Quantizes one (token, KV head) row of head_dim <= 256 values held by a warp and stores its codes
// (codes: the row's first byte, 4-byte aligned) and scale: lane l holds elements 4q..4q+3 in x[i]
// for q = l + 32i < head_dim / 4. The operations are kv_quant::quantize_row's, each one IEEE f32
// operation (the max is exact in any order), so the codes and scale equal the CPU's bit for bit.
// Warp-wide: every lane calls it.
template <int KIND>
__device__ __forceinline__ void ew_kvq_store_row(const float (&x)[2][4], int head_dim, unsigned char* codes,
                                                 float* scale) {
    const int lane = threadIdx.x % TURBO_WARP, quads = head_dim / 4;
    float m = 0.f;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (lane + TURBO_WARP * i < quads) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                m = fmaxf(m, fabsf(x[i][j]));
                nan |= isnan(x[i][j]);
            }
        }
    }
    // A NaN anywhere in the row: scale NaN and codes 0, as on the CPU (fmaxf skips NaNs).
    const bool row_nan = __any_sync(0xffffffffu, nan);
    const float amax = row_nan ? 0.f : warp_max(m);
    float s = row_nan ? __int_as_float(0x7fc00000) : amax / kvq_code_max<KIND>();  // +0 for a row of zeros
    if constexpr (KIND == KV_FP8) {
        // The scale max|x| / t, t in E4M3's top binade (448, 416, ..., 256), whose row has the
        // least squared error, the first of equals: kv_quant::quantize_row with fp8_row_error's
        // order of sums (each lane its elements in order, then the warp's butterfly), every
        // operation rounded on its own (no contraction), so the CPU and GPU choose alike; the
        // errors are measured on x · (t / max|x|), a product where the codes take a quotient. The
        // seven candidates are independent chains, unrolled so that their latencies overlap (a
        // decode step's writer is one warp per row).
        if (amax != 0.f) {
            float err[7], sc[7], inv[7];
#pragma unroll
            for (int c = 0; c < 7; c++) {
                sc[c] = amax / (448.f - 32.f * (float)c);
                inv[c] = (448.f - 32.f * (float)c) / amax;
                err[c] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < 2; i++) {
                if (lane + TURBO_WARP * i < quads) {
#pragma unroll
                    for (int j = 0; j < 4; j++) {
#pragma unroll
                        for (int c = 0; c < 7; c++) {
                            const float y = __fmul_rn(x[i][j], inv[c]);
                            const float d = __fsub_rn(__fmul_rn(kvq_e4m3_round(y), sc[c]), x[i][j]);
                            err[c] = __fadd_rn(err[c], __fmul_rn(d, d));
                        }
                    }
                }
            }
#pragma unroll
            for (int o = TURBO_WARP / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int c = 0; c < 7; c++) err[c] = __fadd_rn(err[c], __shfl_xor_sync(0xffffffffu, err[c], o));
            }
            float least = __int_as_float(0x7f800000);
#pragma unroll
            for (int c = 0; c < 7; c++) {
                if (err[c] < least) {
                    least = err[c];
                    s = sc[c];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int q = lane + TURBO_WARP * i;
        if (q >= quads) continue;
        uint32_t w = 0;
        if (amax != 0.f) {
#pragma unroll
            for (int j = 0; j < 4; j++) w |= kvq_code<KIND>(x[i][j] / s) << (8 * j);
        }
        reinterpret_cast<uint32_t*>(codes)[q] = w;
    }
    if (lane == 0) *scale = s;
}

// kv_quant::hadamard_rotate of one row of head_dim values (a power of two, at most 256) held by a
// warp as ew_kvq_store_row takes it (lane l holds elements 4q..4q+3 in x[i] for q = l + 32i):
// stages at strides 1, 2 (inside a lane's quad), 4..64 (between lanes l and l ^ (stride / 4)),
// 128 (between x[0] and x[1]), each pair (lo, hi) becoming (lo + hi, lo - hi), one f32 rounding
// each, in the CPU's order, so the bits are the CPU's. Warp-wide: every lane calls it.
__device__ __forceinline__ void ew_hadamard_row(float (&x)[2][4], int head_dim) {
    const int lane = threadIdx.x % TURBO_WARP, quads = head_dim / 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (head_dim >= 2) {
            for (int j = 0; j < 4; j += 2) {
                const float lo = x[i][j], hi = x[i][j + 1];
                x[i][j] = __fadd_rn(lo, hi);
                x[i][j + 1] = __fsub_rn(lo, hi);
            }
        }
        if (head_dim >= 4) {
            for (int j = 0; j < 2; j++) {
                const float lo = x[i][j], hi = x[i][j + 2];
                x[i][j] = __fadd_rn(lo, hi);
                x[i][j + 2] = __fsub_rn(lo, hi);
            }
        }
    }
    for (int m = 1; m < quads && m < TURBO_WARP; m <<= 1) {
        const bool high = (lane & m) != 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float other = __shfl_xor_sync(0xffffffffu, x[i][j], m);
                x[i][j] = high ? __fsub_rn(other, x[i][j]) : __fadd_rn(x[i][j], other);
            }
        }
    }
    if (quads > TURBO_WARP) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float lo = x[0][j], hi = x[1][j];
            x[0][j] = __fadd_rn(lo, hi);
            x[1][j] = __fsub_rn(lo, hi);
        }
    }
}

// The codes (returned) and the scale (*scale) of (slot, KV head) in a quantized layer range.
__device__ __forceinline__ unsigned char* ew_kvq_row(unsigned char* range, unsigned slot, int head, int block_size,
                                                     int n_kv_heads, int head_dim, float** scale) {
    const unsigned block = slot / (unsigned)block_size, off = slot % (unsigned)block_size;
    *scale = reinterpret_cast<float*>(range + kvq_scale_at(block, off, head, block_size, n_kv_heads, head_dim));
    return range + kvq_code_at(block, off, head, block_size, n_kv_heads, head_dim);
}

// qkv_rope_kv_bf16 into a quantized cache (common.cuh's layout; k_cache and v_cache are one
// layer's ranges): q receives the same rotated queries; each rotated key pair is rounded to bf16
// as qkv_rope_kv_bf16 stores it, then every (token, KV head) row of keys and of values is
// quantized (ew_kvq_store_row) into slot slots[t] (a slot >= cache_slots is skipped). With
// `hadamard` (KvDtype::rotates_keys: head_dim a power of two), each key row is multiplied by the
// Hadamard matrix before it is quantized (ew_hadamard_row), and each query head, rounded to bf16
// after RoPE as the keys are, is rotated the same way, multiplied by 1 / head_dim and rounded
// again, so that q·k is kept. A warp per task: 32 query pairs (one query head when rotating), or
// one KV row (its quantization needs the whole row's max). Grid (tokens, blocks per token), as
// the bf16 kernel's, so a one-token step still fills several SMs. head_dim a multiple of 4, at
// most 256.
template <int KIND>
__device__ __forceinline__ void ew_qkv_rope_kv_quant(const __nv_bfloat16* qkv, __nv_bfloat16* q,
                                                     unsigned char* k_cache, unsigned char* v_cache,
                                                     const unsigned* positions, const unsigned* slots,
                                                     const float* inv_freq, int q_cols, int n_kv_heads, int head_dim,
                                                     int block_size, long long cache_slots, int hadamard) {
    const int t = blockIdx.x, lane = threadIdx.x % TURBO_WARP, warps = blockDim.x / TURBO_WARP;
    const int half = head_dim / 2, kv_cols = n_kv_heads * head_dim, qp = q_cols / 2;
    const float pos = (float)positions[t];
    const unsigned slot = slots[t];
    const bool store = (long long)slot < cache_slots;
    const __nv_bfloat16* src = qkv + (size_t)t * (size_t)(q_cols + 2 * kv_cols);
    const __nv_bfloat162* qs = reinterpret_cast<const __nv_bfloat162*>(src);
    __nv_bfloat16* q_row = q + (size_t)t * (size_t)q_cols;
    __nv_bfloat162* qd = reinterpret_cast<__nv_bfloat162*>(q_row);
    const int q_tasks = hadamard ? q_cols / head_dim : (qp + TURBO_WARP - 1) / TURBO_WARP;
    const int tasks = q_tasks + (store ? 2 * n_kv_heads : 0);
    // task is the same for the whole warp, so every branch below is warp-uniform.
    for (int task = blockIdx.y * warps + (int)threadIdx.x / TURBO_WARP; task < tasks; task += gridDim.y * warps) {
        if (task < q_tasks && !hadamard) {
            const int p = task * TURBO_WARP + lane;
            if (p < qp) {
                const float2 r = rope_rotate(__bfloat1622float2(qs[p]), pos, inv_freq[p % half]);
                qd[p] = __floats2bfloat162_rn(r.x, r.y);
            }
            continue;
        }
        const bool query = task < q_tasks;
        const int r = task - q_tasks;
        const bool values = !query && r >= n_kv_heads;
        const int head = query ? task : values ? r - n_kv_heads : r;
        const __nv_bfloat16* row =
            src + (query ? head * head_dim : q_cols + (values ? kv_cols : 0) + head * head_dim);
        float x[2][4] = {};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int quad = lane + TURBO_WARP * i;
            if (quad >= head_dim / 4) continue;
            ew_load4(row + 4 * quad, x[i]);
            if (!values) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const float2 k = rope_rotate(make_float2(x[i][2 * j], x[i][2 * j + 1]), pos,
                                                 inv_freq[2 * quad + j]);
                    const float2 b = __bfloat1622float2(__floats2bfloat162_rn(k.x, k.y));
                    x[i][2 * j] = b.x;
                    x[i][2 * j + 1] = b.y;
                }
            }
        }
        if (hadamard && !values) ew_hadamard_row(x, head_dim);
        if (query) {
            const float scale = 1.f / (float)head_dim;  // a power of two: exact
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int quad = lane + TURBO_WARP * i;
                if (quad >= head_dim / 4) continue;
                __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(q_row + head * head_dim + 4 * quad);
                out[0] = __floats2bfloat162_rn(__fmul_rn(x[i][0], scale), __fmul_rn(x[i][1], scale));
                out[1] = __floats2bfloat162_rn(__fmul_rn(x[i][2], scale), __fmul_rn(x[i][3], scale));
            }
            continue;
        }
        float* scale;
        unsigned char* codes =
            ew_kvq_row(values ? v_cache : k_cache, slot, head, block_size, n_kv_heads, head_dim, &scale);
        ew_kvq_store_row<KIND>(x, head_dim, codes, scale);
    }
}

#define EW_QKV_ROPE_KV_QUANT(NAME, KIND)                                                                        \
    extern "C" __global__ void NAME(const __nv_bfloat16* qkv, __nv_bfloat16* q, unsigned char* k_cache,         \
                                    unsigned char* v_cache, const unsigned* positions, const unsigned* slots,   \
                                    const float* inv_freq, int q_cols, int n_kv_heads, int head_dim,           \
                                    int block_size, long long cache_slots, int hadamard) {                     \
        ew_qkv_rope_kv_quant<KIND>(qkv, q, k_cache, v_cache, positions, slots, inv_freq, q_cols, n_kv_heads,   \
                                   head_dim, block_size, cache_slots, hadamard);                                \
    }
EW_QKV_ROPE_KV_QUANT(qkv_rope_kv_q8, KV_INT8)
EW_QKV_ROPE_KV_QUANT(qkv_rope_kv_f8, KV_FP8)

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

// Token ids a step takes from the tokens the previous step sampled (overlapped stepping): an id
// with the top bit set (CARRIED_TOKEN in turbo-core) is replaced, in place, by sampled[id & 0x7fffffff];
// naming a row past the `sampled_len` sampled ones makes it an id past every vocabulary, which the
// embedding turns into a row of NaN rather than reading out of bounds. One thread per row.
extern "C" __global__ void resolve_carried_tokens(unsigned* ids, const unsigned* sampled, int n, int sampled_len) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned id = ids[i];
    if (id & 0x80000000u) {
        const unsigned row = id & 0x7fffffffu;
        ids[i] = row < (unsigned)sampled_len ? sampled[row] : 0xffffffffu;
    }
}

// out[i, :] = src[idx[i] - first, :] for i < n; src is [src_rows, cols], out is [n, cols]. One
// block per output row. src may be the rows first.. of a table split over the vocabulary (a rank
// of a tensor-parallel group): an index of another rank's rows gives zeros, so that a sum over
// the ranks is the embedding. An index at or past `limit` (the whole table's rows) fills its
// output row with NaN instead of reading out of bounds. Serves both token embedding (src = the
// table) and row gathering (first 0, limit src_rows).
extern "C" __global__ void gather_rows_bf16(__nv_bfloat16* out, const __nv_bfloat16* src, const unsigned* idx,
                                            int n, int cols, long long src_rows, long long first,
                                            long long limit) {
    const int i = blockIdx.x;
    if (i >= n) return;
    __nv_bfloat16* dst = out + (size_t)i * (size_t)cols;
    const long long r = (long long)idx[i];
    if (r >= limit) {
        const __nv_bfloat16 nan = __ushort_as_bfloat16((unsigned short)0x7FC0);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = nan;
        return;
    }
    if (r < first || r - first >= src_rows) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = __float2bfloat16_rn(0.f);
        return;
    }
    ew_copy_row(dst, src + (size_t)(r - first) * (size_t)cols, cols);
}

// The logits of a head split over the vocabulary, gathered by NCCL: `parts` holds every rank's
// part (rank r's rows x its columns, row-major) at r * part_stride; out is [rows, vocab], rank r's
// columns starting at r * vocab / world (turbo_core::comm::vocab_part). Grid: (x blocks, world).
extern "C" __global__ void place_vocab_parts_f32(float* out, const float* parts, long long rows, long long vocab,
                                                 int world, long long part_stride) {
    const int r = blockIdx.y;
    const long long start = r * vocab / world;
    const long long cols = (r + 1) * vocab / world - start;
    const float* part = parts + r * part_stride;
    const long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / cols;
        out[row * vocab + start + (i - row * cols)] = part[i];
    }
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

// write_kv_bf16 into a quantized cache: k and v are [tokens][n_kv_heads * head_dim]; every
// (token, KV head) row of keys and of values is quantized (ew_kvq_store_row) into slot slots[t]
// of one layer's ranges (a slot >= cache_slots is skipped). A warp per row, grid-stride.
template <int KIND>
__device__ __forceinline__ void ew_write_kv_quant(unsigned char* k_cache, unsigned char* v_cache,
                                                  const __nv_bfloat16* k, const __nv_bfloat16* v,
                                                  const unsigned* slots, int tokens, int n_kv_heads, int head_dim,
                                                  int block_size, long long cache_slots) {
    const int lane = threadIdx.x % TURBO_WARP, warps = blockDim.x / TURBO_WARP;
    const long long rows = (long long)tokens * 2 * n_kv_heads;
    // r is the same for the whole warp, so every branch below is warp-uniform.
    for (long long r = (long long)blockIdx.x * warps + threadIdx.x / TURBO_WARP; r < rows;
         r += (long long)gridDim.x * warps) {
        const long long t = r / (2 * n_kv_heads);
        const int rem = (int)(r - t * 2 * n_kv_heads);
        const bool values = rem >= n_kv_heads;
        const int head = values ? rem - n_kv_heads : rem;
        const unsigned slot = slots[t];
        if ((long long)slot >= cache_slots) continue;
        const __nv_bfloat16* row =
            (values ? v : k) + ((size_t)t * (size_t)n_kv_heads + (size_t)head) * (size_t)head_dim;
        float x[2][4] = {};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int quad = lane + TURBO_WARP * i;
            if (quad < head_dim / 4) ew_load4(row + 4 * quad, x[i]);
        }
        float* scale;
        unsigned char* codes =
            ew_kvq_row(values ? v_cache : k_cache, slot, head, block_size, n_kv_heads, head_dim, &scale);
        ew_kvq_store_row<KIND>(x, head_dim, codes, scale);
    }
}

#define EW_WRITE_KV_QUANT(NAME, KIND)                                                                           \
    extern "C" __global__ void NAME(unsigned char* k_cache, unsigned char* v_cache, const __nv_bfloat16* k,     \
                                    const __nv_bfloat16* v, const unsigned* slots, int tokens, int n_kv_heads, \
                                    int head_dim, int block_size, long long cache_slots) {                     \
        ew_write_kv_quant<KIND>(k_cache, v_cache, k, v, slots, tokens, n_kv_heads, head_dim, block_size,       \
                                cache_slots);                                                                  \
    }
EW_WRITE_KV_QUANT(write_kv_q8, KV_INT8)
EW_WRITE_KV_QUANT(write_kv_f8, KV_FP8)

// Moves, in place, chunks of `k` rows of one (layer, KV head): row kept[j] to row j, each row
// `units` elements of type T starting at at(block, offset) for the key's cache block and offset
// in it. A chunk is blockDim.x / units rows, all read before any is written; since kept[j] >= j
// and rows are strictly increasing, earlier chunks wrote only below this chunk's sources and
// later chunks read only above its destinations.
template <typename T, typename At>
__device__ __forceinline__ void ew_compact_rows(const unsigned* row, const unsigned* block_table, int k,
                                                int block_size, int units, At at) {
    const int per_chunk = blockDim.x / units;
    const int t = threadIdx.x % units;
    for (int j0 = 0; j0 < k; j0 += per_chunk) {
        const int j = j0 + (int)threadIdx.x / units;
        bool moves = false;
        T* dst = nullptr;
        T x{};
        if ((int)threadIdx.x < per_chunk * units && j < k) {
            const unsigned from = row[j], to = (unsigned)j;
            if (from != to) {
                x = at(block_table[from / block_size], from % block_size)[t];
                dst = at(block_table[to / block_size], to % block_size) + t;
                moves = true;
            }
        }
        __syncthreads();
        if (moves) *dst = x;
        __syncthreads();
    }
}

// ew_compact_rows over a [block][slot][kv head][units] layout (bf16 keys and values, scores).
template <typename T>
__device__ __forceinline__ void ew_compact_plain(T* cache, const unsigned* row, const unsigned* block_table, int k,
                                                 int block_size, int n_kv_heads, int head, int units) {
    ew_compact_rows<T>(row, block_table, k, block_size, units, [=](unsigned block, unsigned off) {
        return cache + (((size_t)block * block_size + off) * n_kv_heads + head) * units;
    });
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
        ew_compact_plain(reinterpret_cast<float*>(base), row, block_table, k, block_size, n_kv_heads, head, 1);
    } else if (head_dim % 8 == 0) {
        ew_compact_plain(reinterpret_cast<uint4*>(base), row, block_table, k, block_size, n_kv_heads, head,
                         head_dim / 8);
    } else {
        ew_compact_plain(reinterpret_cast<__nv_bfloat16*>(base), row, block_table, k, block_size, n_kv_heads,
                         head, head_dim);
    }
}

// compact_kv_bf16 for a quantized cache (INT8 and FP8 alike: bytes move as they are): a kept key's
// codes row (16 bytes per thread; head_dim a multiple of 16, block_size · n_kv_heads of 4) and
// then its scale move, per (layer, KV head); the scores as for bf16. Codes and scales are disjoint,
// so each pass is ew_compact_rows' in-place move on its own.
extern "C" __global__ void compact_kv_quant(const unsigned long long* layers, const unsigned* block_table,
                                            const unsigned* kept, int k, int block_size, int n_layers,
                                            int n_kv_heads, int head_dim) {
    const int head = blockIdx.x, what = blockIdx.y, layer = blockIdx.z;
    const unsigned long long base = layers[what * n_layers + layer];
    if (base == 0) return;
    const unsigned* row = kept + ((size_t)layer * n_kv_heads + head) * (size_t)k;
    if (what == 2) {
        ew_compact_plain(reinterpret_cast<float*>(base), row, block_table, k, block_size, n_kv_heads, head, 1);
        return;
    }
    unsigned char* range = reinterpret_cast<unsigned char*>(base);
    ew_compact_rows<uint4>(row, block_table, k, block_size, head_dim / 16, [=](unsigned block, unsigned off) {
        return reinterpret_cast<uint4*>(range + kvq_code_at(block, off, head, block_size, n_kv_heads, head_dim));
    });
    ew_compact_rows<float>(row, block_table, k, block_size, 1, [=](unsigned block, unsigned off) {
        return reinterpret_cast<float*>(range + kvq_scale_at(block, off, head, block_size, n_kv_heads, head_dim));
    });
}

// SwiGLU of a fused gate/up product: gu is [rows, 2 * cols] with each row [gate | up];
// out[r, c] = silu(gate[r, c]) * up[r, c]. Grid-stride over rows * cols.
extern "C" __global__ void swiglu_bf16(__nv_bfloat16* out, const __nv_bfloat16* gu, long long rows,
                                       long long cols) {
    // Rows of a multiple of 8 values on 16-byte boundaries: 8 values per thread in one vector load
    // of the gate, one of the up part and one store (the same arithmetic per value).
    if ((cols & 7) == 0 && (((unsigned long long)out | (unsigned long long)gu) & 15) == 0) {
        const long long vcols = cols >> 3, vn = rows * vcols;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vn;
             i += (long long)gridDim.x * blockDim.x) {
            const long long r = i / vcols, c = i - r * vcols;
            const uint4* row = reinterpret_cast<const uint4*>(gu + r * 2 * cols);
            float g[8], u[8], o[8];
            bf16x8_unpack(row[c], g);
            bf16x8_unpack(row[vcols + c], u);
#pragma unroll
            for (int k = 0; k < 8; k++) o[k] = g[k] / (1.f + __expf(-g[k])) * u[k];
            reinterpret_cast<uint4*>(out + r * cols)[c] = bf16x8_pack(o);
        }
        return;
    }
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
