// Products with GGUF-quantized weights kept as the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), decoded in registers.
//
// A row of W is `k / block_len` blocks laid out exactly as in the file. Each lane of a warp takes
// one *chunk* of a row at a time (a block of 32 for the legacy types; 64 values of a 256-value
// super-block for the K-quants: the values that share a run of its packed bytes), and decodes its
// codes to small exact integers in f32 (a byte placed under the exponent of 2^23, then 2^23 plus the
// code's offset subtracted: exact, and cheaper than an int-to-float conversion). A chunk is
// `SUBS` sub-blocks of `SUB` values, each with one scale and (for types with a minimum) one bias:
// value = scale * q + bias. The products then sum scale * Σ q·x + bias * Σ x per sub-block, so the
// arithmetic per weight is the decode and one FMA per token.
//
// Kernels (one template per type, the type in the name):
// - qgemv_<type>_m<M>: decode steps of up to M = 1, 2, 4, 8 tokens, a warp per 2-4 output units
//   (each load of x serves all of them, each decoded code all tokens), with the same
//   options as gemv.cu's bf16 kernels: the RMSNorm before (NORM), and the epilogues store bf16,
//   store f32, add to the residual stream, or SwiGLU over a [gate; up] pair of rows.
// - dequant_<type>: rows decoded to bf16 (the feed of the cuBLASLt products for larger steps),
//   each value computed as GGML's reference dequantiser computes it (quant.rs on the host), then
//   rounded once to bf16.
// - embed_<type>: token embedding from a quantized table, values as dequant_ gives them.
//
// Each type is its own module (kernels/ptx/quant_<type>.ptx), compiled with -DQUANT_TYPE=<type>, so
// that a process compiles (JIT) only the types its weights hold.
// kernel-variants QUANT_TYPE: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
//
// Buffers are the file's bytes followed by at least 16 bytes of padding (loads of 2-byte aligned
// blocks read whole aligned words, up to 4 bytes past a block).
#include "common.cuh"

#define QGEMV_WARPS 4

enum : int { QGEMV_STORE_BF16 = 0, QGEMV_STORE_F32 = 1, QGEMV_ADD_RESIDUAL = 2 };

// Exact small integers: a byte under 2^23's exponent, minus 2^23 and the code's offset.
__device__ __forceinline__ float code_float(uint32_t word, int byte, float offset) {
    return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (unsigned)byte)) - (8388608.f + offset);
}

__device__ __forceinline__ float half_at(const uint8_t* p) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
}

// N little-endian words of the bytes at p, which is 2-byte aligned: whole aligned words are read and
// shifted into place (the last read may pass the block's end by up to 4 bytes: the padding).
template <int N>
__device__ __forceinline__ void words_at2(const uint8_t* p, uint32_t (&w)[N]) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t* base = reinterpret_cast<const uint32_t*>(a & ~(uintptr_t)3);
    const unsigned shift = (unsigned)(a & 3) * 8;
    uint32_t raw[N + 1];
#pragma unroll
    for (int i = 0; i <= N; i++) raw[i] = __ldg(base + i);
#pragma unroll
    for (int i = 0; i < N; i++) w[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
}

// N words at a 4-byte aligned p.
template <int N>
__device__ __forceinline__ void words_at4(const uint8_t* p, uint32_t (&w)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) w[i] = __ldg(reinterpret_cast<const uint32_t*>(p) + i);
}

// Four 1-bits (bits 0-3 of b) spread to bit 4 of each byte.
__device__ __forceinline__ uint32_t spread_bits4(uint32_t b) { return ((b * 0x00204081u) & 0x01010101u) << 4; }

// Eight codes from two words of nibbles (low or high), each ORed with `extra` (fifth or sixth bits
// already in place, or 0), minus `offset`.
__device__ __forceinline__ void nibbles8(uint32_t w0, uint32_t w1, bool high, uint32_t e0, uint32_t e1, float offset,
                                         float* q) {
    const uint32_t v0 = ((high ? w0 >> 4 : w0) & 0x0F0F0F0Fu) | e0;
    const uint32_t v1 = ((high ? w1 >> 4 : w1) & 0x0F0F0F0Fu) | e1;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        q[b] = code_float(v0, b, offset);
        q[4 + b] = code_float(v1, b, offset);
    }
}

// -- the types: geometry, a chunk's loads, and its sub-blocks' decoding ---------------------------
//
// T::load(row, c, raw) issues every load of chunk c of a row; T::scales(raw, s, scale, bias) gives
// sub-block s's scale and bias, T::codes8(raw, s, h, q) its codes 8h .. 8h + 7 (exact integers, the
// type's offset applied), so that only eight codes of a row are live at a time.

// Legacy blocks of 32 (chunk c is block c of the row), one sub-block each: 16 bytes of nibbles
// (value j the low nibble of byte j, value j + 16 its high nibble), with Q5's fifth bits in qh
// (bit v for value v).
template <int BYTES, bool MIN, bool FIVE, int OFFSET>
struct Legacy4 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = BYTES, CHUNK = 32, SUBS = 1, SUB = 32, SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = MIN;
    struct Raw {
        uint32_t w[4];
        uint32_t qh;
        float d, m;
    };
    __device__ static int x_base(int c) { return 32 * c; }
    __device__ static void load(const uint8_t* row, int c, Raw& raw) {
        const uint8_t* p = row + (size_t)c * BLOCK_BYTES;
        constexpr int at = MIN ? 4 : 2;  // after d (and m)
        constexpr int words = FIVE ? 5 : 4;
        uint32_t w[words];
        if (MIN) {
            words_at4<words>(p + at, w);
        } else {
            words_at2<words>(p + at, w);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) raw.w[i] = w[i + words - 4];
        raw.qh = FIVE ? w[0] : 0u;
        raw.d = half_at(p);
        raw.m = MIN ? half_at(p + 2) : 0.f;
    }
    __device__ static void scales(const Raw& raw, int, float& scale, float& bias) {
        scale = raw.d;
        bias = raw.m;
    }
    __device__ static void codes8(const Raw& raw, int, int h, float* q) {
        const int i = 2 * (h % 2);
        uint32_t e0 = 0, e1 = 0;
        if (FIVE) {
            e0 = spread_bits4((raw.qh >> (8 * h)) & 0xFu);
            e1 = spread_bits4((raw.qh >> (8 * h + 4)) & 0xFu);
        }
        nibbles8(raw.w[i], raw.w[i + 1], h >= 2, e0, e1, (float)OFFSET, q);
    }
};
using Q4_0 = Legacy4<18, false, false, 8>;
using Q4_1 = Legacy4<20, true, false, 0>;
using Q5_0 = Legacy4<22, false, true, 16>;
using Q5_1 = Legacy4<24, true, true, 0>;

struct Q8_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34, CHUNK = 32, SUBS = 1, SUB = 32, SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = false;
    struct Raw {
        uint32_t w[8];
        float d;
    };
    __device__ static int x_base(int c) { return 32 * c; }
    __device__ static void load(const uint8_t* row, int c, Raw& raw) {
        const uint8_t* p = row + (size_t)c * BLOCK_BYTES;
        words_at2<8>(p + 2, raw.w);
        raw.d = half_at(p);
    }
    __device__ static void scales(const Raw& raw, int, float& scale, float& bias) {
        scale = raw.d;
        bias = 0.f;
    }
    __device__ static void codes8(const Raw& raw, int, int h, float* q) {
        const uint32_t v0 = raw.w[2 * h] ^ 0x80808080u, v1 = raw.w[2 * h + 1] ^ 0x80808080u;  // codes + 128
#pragma unroll
        for (int b = 0; b < 4; b++) {
            q[b] = code_float(v0, b, 128.f);
            q[4 + b] = code_float(v1, b, 128.f);
        }
    }
};

// Scale and minimum j (of 8) of a Q4_K / Q5_K super-block's 12 packed bytes (3 words), by shifts
// only (an index into the words would put them in local memory).
__device__ __forceinline__ void scale_min_k4(int j, const uint32_t* s, int& sc, int& m) {
    const unsigned at = 8u * (unsigned)(j & 3);
    const uint32_t a = s[0] >> at, b = s[1] >> at, c = s[2] >> at;
    if (j < 4) {
        sc = (int)(a & 63u);
        m = (int)(b & 63u);
    } else {
        sc = (int)((c & 0xFu) | (((a >> 6) & 3u) << 4));
        m = (int)(((c >> 4) & 0xFu) | (((b >> 6) & 3u) << 4));
    }
}

// Q4_K / Q5_K: chunk c is the 64 values 64 (c % 4) .. of super-block c / 4; its two sub-blocks of 32
// are the low and the high nibbles of 32 bytes of ql, with (Q5_K) bits 2j and 2j + 1 of the 32
// bytes of qh as fifth bits.
template <bool FIVE>
struct QK45 {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = FIVE ? 176 : 144, CHUNK = 64, SUBS = 2, SUB = 32,
                         SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = true;
    struct Raw {
        uint32_t head[4];
        uint32_t ql[8];
        uint32_t qh[FIVE ? 8 : 1];
        int j;
    };
    __device__ static int x_base(int c) { return 64 * c; }
    __device__ static void load(const uint8_t* row, int c, Raw& raw) {
        raw.j = c % 4;
        const uint8_t* p = row + (size_t)(c / 4) * BLOCK_BYTES;
        const uint4 h = __ldg(reinterpret_cast<const uint4*>(p));
        raw.head[0] = h.x, raw.head[1] = h.y, raw.head[2] = h.z, raw.head[3] = h.w;
        const uint8_t* ql = p + (FIVE ? 48 : 16) + 32 * raw.j;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(ql) + i);
            raw.ql[4 * i] = v.x, raw.ql[4 * i + 1] = v.y, raw.ql[4 * i + 2] = v.z, raw.ql[4 * i + 3] = v.w;
        }
        if (FIVE) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + 16) + i);
                raw.qh[4 * i] = v.x, raw.qh[4 * i + 1] = v.y, raw.qh[4 * i + 2] = v.z, raw.qh[4 * i + 3] = v.w;
            }
        }
    }
    __device__ static void scales(const Raw& raw, int s, float& scale, float& bias) {
        const float d = __half2float(__ushort_as_half((unsigned short)(raw.head[0] & 0xFFFFu)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(raw.head[0] >> 16)));
        int sc, m;
        scale_min_k4(2 * raw.j + s, raw.head + 1, sc, m);
        scale = d * (float)sc;
        bias = -(dmin * (float)m);
    }
    __device__ static void codes8(const Raw& raw, int s, int h, float* q) {
        uint32_t e0 = 0, e1 = 0;
        if (FIVE) {
            const unsigned bit = (unsigned)(2 * raw.j + s);
            e0 = ((raw.qh[2 * h] >> bit) & 0x01010101u) << 4;
            e1 = ((raw.qh[2 * h + 1] >> bit) & 0x01010101u) << 4;
        }
        nibbles8(raw.ql[2 * h], raw.ql[2 * h + 1], s == 1, e0, e1, 0.f, q);
    }
};
using Q4_K = QK45<false>;
using Q5_K = QK45<true>;

// Q6_K: chunk c of super-block c / 4 is half n = (c % 4) / 2, quarter i = c % 2: values
// 128 n + 32 t + 16 i + l for t < 4, l < 16 (sub-block t, scale sc[8 n + i + 2 t]); value t takes the
// low (t < 2) or high nibble of ql[64 n + 32 (t % 2) + 16 i + l] and bits 2t, 2t + 1 of
// qh[32 n + 16 i + l], minus 32.
struct Q6_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210, CHUNK = 64, SUBS = 4, SUB = 16, SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = false;
    struct Raw {
        uint32_t qa[4], qb[4], qh[4], sc[2];
        float d;
        int i;
    };
    __device__ static int x_base(int c) { return 256 * (c / 4) + 128 * ((c % 4) / 2) + 16 * (c % 2); }
    __device__ static void load(const uint8_t* row, int c, Raw& raw) {
        const int n = (c % 4) / 2;
        raw.i = c % 2;
        const uint8_t* p = row + (size_t)(c / 4) * BLOCK_BYTES;
        words_at2<4>(p + 64 * n + 16 * raw.i, raw.qa);
        words_at2<4>(p + 64 * n + 32 + 16 * raw.i, raw.qb);
        words_at2<4>(p + 128 + 32 * n + 16 * raw.i, raw.qh);
        words_at2<2>(p + 192 + 8 * n, raw.sc);
        raw.d = half_at(p + 208);
    }
    __device__ static void scales(const Raw& raw, int t, float& scale, float& bias) {
        const int at = raw.i + 2 * t;
        const uint32_t word = at < 4 ? raw.sc[0] : raw.sc[1];
        scale = raw.d * (float)(int)(int8_t)((word >> (8 * (at % 4))) & 0xFFu);
        bias = 0.f;
    }
    __device__ static void codes8(const Raw& raw, int t, int h, float* q) {
        const uint32_t* w = t % 2 == 0 ? raw.qa : raw.qb;
        const uint32_t e0 = ((raw.qh[2 * h] >> (2 * t)) & 0x03030303u) << 4;
        const uint32_t e1 = ((raw.qh[2 * h + 1] >> (2 * t)) & 0x03030303u) << 4;
        nibbles8(w[2 * h], w[2 * h + 1], t >= 2, e0, e1, 32.f, q);
    }
};

// -- products --------------------------------------------------------------------------------------

// Eight bf16 values of x at `at` (16-byte aligned), times g with NORM (adding their squares to
// ss), into f.
template <bool NORM>
__device__ __forceinline__ void load_x8(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                        int at, float (&f)[8], float& ss) {
    bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(x + at)), f);
    if (NORM) {
        float gf[8];
        bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(g + at)), gf);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            ss = fmaf(f[e], f[e], ss);
            f[e] *= gf[e];
        }
    }
}

// The warp's ROWS rows times each of the first `tokens` (<= M) tokens: every lane gets dot[m][r]
// (times token m's 1/rms with NORM). A row that is absent (`present[r]` false) reads row 0 and is
// not stored. Each lane takes chunks lane, lane + 32, ...; per eight values it loads x once for
// all rows, and decodes each row's eight codes once for all tokens.
template <class T, int M, int ROWS, bool NORM>
__device__ __forceinline__ void qwarp_dots(const uint8_t* const (&row)[ROWS], const __nv_bfloat16* __restrict__ x,
                                           const __nv_bfloat16* __restrict__ g, float eps, int tokens, int k,
                                           float (&dot)[M][ROWS]) {
    const int lane = threadIdx.x % TURBO_WARP;
    const int chunks = k / T::CHUNK;
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        ss[m] = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) dot[m][r] = 0.f;
    }
    for (int c = lane; c < chunks; c += TURBO_WARP) {
        typename T::Raw raw[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) T::load(row[r], c, raw[r]);
        const int base = T::x_base(c);
#pragma unroll
        for (int s = 0; s < T::SUBS; s++) {
            float sum[M][ROWS], sx[M];
#pragma unroll
            for (int m = 0; m < M; m++) {
                sx[m] = 0.f;
#pragma unroll
                for (int r = 0; r < ROWS; r++) sum[m][r] = 0.f;
            }
#pragma unroll
            for (int h = 0; h < T::SUB / 8; h++) {
                float q[ROWS][8];
#pragma unroll
                for (int r = 0; r < ROWS; r++) T::codes8(raw[r], s, h, q[r]);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    if (m >= tokens) break;  // uniform
                    float f[8];
                    load_x8<NORM>(x + (size_t)m * k, g, base + s * T::SUB_STRIDE + 8 * h, f, ss[m]);
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        if (T::HAS_BIAS) sx[m] += f[e];
#pragma unroll
                        for (int r = 0; r < ROWS; r++) sum[m][r] = fmaf(q[r][e], f[e], sum[m][r]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float scale, bias;
                T::scales(raw[r], s, scale, bias);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    dot[m][r] = fmaf(scale, sum[m][r], dot[m][r]);
                    if (T::HAS_BIAS) dot[m][r] = fmaf(bias, sx[m], dot[m][r]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float scale = NORM ? rsqrtf(warp_sum(ss[m]) / (float)k + eps) : 1.f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) dot[m][r] = warp_sum(dot[m][r]) * scale;
    }
}

__device__ __forceinline__ float round_to_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Units per warp: more rows share each load of x when few tokens leave registers to spare.
template <int M, int R>
struct WarpUnits {
    static constexpr int value = (M <= 2 ? 4 : 2) / R;
};

// out[m * ld + unit] per token m < tokens, for the warp's G consecutive units; R == 2: unit j is
// rows j and units + j, stored as SwiGLU.
template <class T, int M, int R, bool NORM>
__device__ __forceinline__ void qgemv(const uint8_t* __restrict__ w, long long row_bytes,
                                      const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                      float eps, void* out, int tokens, int units, int k, int ld, int mode) {
    constexpr int G = WarpUnits<M, R>::value, ROWS = G * R;
    const int first = (blockIdx.x * QGEMV_WARPS + threadIdx.x / TURBO_WARP) * G;
    if (first >= units) return;  // uniform per warp; no barriers follow
    const uint8_t* row[ROWS];
#pragma unroll
    for (int u = 0; u < G; u++) {
        const int unit = first + u < units ? first + u : first;
#pragma unroll
        for (int r = 0; r < R; r++) row[u * R + r] = w + (size_t)(unit + r * units) * (size_t)row_bytes;
    }
    float dot[M][ROWS];
    qwarp_dots<T, M, ROWS, NORM>(row, x, g, eps, tokens, k, dot);
    if (threadIdx.x % TURBO_WARP != 0) return;
#pragma unroll
    for (int m = 0; m < M; m++) {
        if (m >= tokens) break;
#pragma unroll
        for (int u = 0; u < G; u++) {
            const int unit = first + u;
            if (unit >= units) break;
            const size_t at = (size_t)m * (size_t)ld + unit;
            if (R == 2) {
                const float gate = round_to_bf16(dot[m][u * R]);
                const float up = round_to_bf16(dot[m][u * R + R - 1]);
                static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
            } else if (mode == QGEMV_STORE_F32) {
                static_cast<float*>(out)[at] = dot[m][u];
            } else {
                __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
                o[at] = __float2bfloat16_rn(mode == QGEMV_ADD_RESIDUAL ? __bfloat162float(o[at]) + dot[m][u]
                                                                       : dot[m][u]);
            }
        }
    }
}

// One chunk of a row decoded to bf16 at out (the row's first value), each value as GGML's reference
// computes it: fl(fl(scale * q) + bias), no fused multiply-add, the bias only for types with a
// minimum.
template <class T>
__device__ __forceinline__ void dequant_chunk(const uint8_t* row, int c, __nv_bfloat16* out) {
    typename T::Raw raw;
    T::load(row, c, raw);
    const int base = T::x_base(c);
#pragma unroll
    for (int s = 0; s < T::SUBS; s++) {
        float scale, bias;
        T::scales(raw, s, scale, bias);
#pragma unroll
        for (int h = 0; h < T::SUB / 8; h++) {
            float q[8], v[8];
            T::codes8(raw, s, h, q);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float p = __fmul_rn(scale, q[e]);
                v[e] = T::HAS_BIAS ? __fadd_rn(p, bias) : p;
            }
            *reinterpret_cast<uint4*>(out + base + s * T::SUB_STRIDE + 8 * h) = bf16x8_pack(v);
        }
    }
}

// Grid: ceil(rows * chunks / 256) blocks of 256 threads, one chunk each; out is [rows, k].
template <class T>
__device__ __forceinline__ void dequant(const uint8_t* __restrict__ w, long long row_bytes, int rows, int k,
                                        __nv_bfloat16* __restrict__ out) {
    const int chunks = k / T::CHUNK;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * chunks) return;
    const int r = (int)(i / chunks), c = (int)(i % chunks);
    dequant_chunk<T>(w + (size_t)r * (size_t)row_bytes, c, out + (size_t)r * (size_t)k);
}

// Grid: n blocks (one per token); out is [n, k]. An id past the table fills its row with NaN.
template <class T>
__device__ __forceinline__ void embed(const uint8_t* __restrict__ w, long long row_bytes, long long rows,
                                      const unsigned* __restrict__ ids, int n, int k, __nv_bfloat16* __restrict__ out) {
    const int t = blockIdx.x;
    if (t >= n) return;
    __nv_bfloat16* dst = out + (size_t)t * (size_t)k;
    const unsigned id = ids[t];
    if ((long long)id >= rows) {
        const __nv_bfloat16 nan = __ushort_as_bfloat16((unsigned short)0x7FC0);
        for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = nan;
        return;
    }
    for (int c = threadIdx.x; c < k / T::CHUNK; c += blockDim.x) dequant_chunk<T>(w + (size_t)id * (size_t)row_bytes, c, dst);
}

#define QGEMV_KERNELS(T, M)                                                                                   \
    extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * TURBO_WARP)                                    \
        qgemv_##T##_m##M(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, \
                         float eps, void* out, int tokens, int units, int k, int ld, int mode) {              \
        qgemv<T, M, 1, false>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode);                      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * TURBO_WARP) qgemv_norm_##T##_m##M(              \
        const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,      \
        void* out, int tokens, int units, int k, int ld, int mode) {                                          \
        qgemv<T, M, 1, true>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode);                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * TURBO_WARP) qgemv_norm_swiglu_##T##_m##M(       \
        const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,      \
        void* out, int tokens, int units, int k, int ld, int mode) {                                          \
        qgemv<T, M, 2, true>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode);                       \
    }

// Every kernel of one type.
#define QUANT_TYPE_KERNELS(T)                                                                                 \
    QGEMV_KERNELS(T, 1)                                                                                       \
    QGEMV_KERNELS(T, 2)                                                                                       \
    QGEMV_KERNELS(T, 4)                                                                                       \
    QGEMV_KERNELS(T, 8)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        dequant_##T(const uint8_t* w, long long row_bytes, int rows, int k, __nv_bfloat16* out) {             \
        dequant<T>(w, row_bytes, rows, k, out);                                                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) embed_##T(const uint8_t* w, long long row_bytes,         \
                                                                long long rows, const unsigned* ids, int n,   \
                                                                int k, __nv_bfloat16* out) {                  \
        embed<T>(w, row_bytes, rows, ids, n, k, out);                                                         \
    }

// The indirection expands QUANT_TYPE before it is pasted into the kernels' names.
#define QUANT_KERNELS_OF(T) QUANT_TYPE_KERNELS(T)
#ifdef QUANT_TYPE
QUANT_KERNELS_OF(QUANT_TYPE)
#endif
