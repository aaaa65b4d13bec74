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
//   (each read of x serves all of them, each decoded code all tokens), with the same
//   options as gemv.cu's bf16 kernels: the RMSNorm before (NORM), and the epilogues store bf16,
//   store f32, add to the residual stream, or SwiGLU over a [gate; up] pair of rows. The block
//   stages x (times the norm's weights) in shared memory as f32: read from global memory at the
//   lanes' chunk strides, x took most of the L1 traffic. 4- and 5-bit codes are decoded as
//   1 + c / 128 (one permute per value; see code_unit). qgemv_loop_<type>_m1 (and _norm_) are the
//   one-token products whose blocks loop over groups of rows, staging x once (see qgemv).
// - qmma1_[norm_][swiglu_]<type> (Q4_K, Q6_K): one-token products on tensor cores (mma.sync, the
//   sub-blocks of a super-block as the columns of a block-diagonal x; see below), the norm fused
//   where the caller asks for it; qmma_[swiglu_]<type>_m<2|4|6|8>: the same for steps of up to 2,
//   4, 6 or 8 tokens, x normalized by the caller.
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

// A code c < 128 as 1 + c / 128 by one byte permute: the byte (with its top bit set) becomes the
// top of the mantissa under 1.0's exponent. Sums of (1 + c / 128) x give Σ c x = 128 (Σ - Σ x).
__device__ __forceinline__ float code_unit(uint32_t word_with_top_bits, int byte) {
    return __int_as_float(__byte_perm(word_with_top_bits, 0x3F000000u, 0x7044u | ((unsigned)byte << 8)));
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
// already in place, or 0): with UNIT as 1 + c / 128, else as c - offset.
template <bool UNIT>
__device__ __forceinline__ void nibbles8(uint32_t w0, uint32_t w1, bool high, uint32_t e0, uint32_t e1, float offset,
                                         float* q) {
    const uint32_t top = UNIT ? 0x80808080u : 0u;
    const uint32_t v0 = ((high ? w0 >> 4 : w0) & 0x0F0F0F0Fu) | e0 | top;
    const uint32_t v1 = ((high ? w1 >> 4 : w1) & 0x0F0F0F0Fu) | e1 | top;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        q[b] = UNIT ? code_unit(v0, b) : code_float(v0, b, offset);
        q[4 + b] = UNIT ? code_unit(v1, b) : code_float(v1, b, offset);
    }
}

// -- the types: geometry, a chunk's loads, and its sub-blocks' decoding ---------------------------
//
// T::load(row, c, raw) issues every load of chunk c of a row; T::scales(raw, s, scale, bias)
// gives sub-block s's scale and bias, T::codes8<false>(raw, s, h, q) its codes 8h .. 8h + 7 (exact
// integers, the type's OFFSET taken off), so that only eight codes of a row are live at a time;
// T::codes8<true> gives them as 1 + c / 128 before the offset (types with UNIT_CODES: codes < 128).
// A value is scale * (c - OFFSET) + bias.

// Legacy blocks of 32 (chunk c is block c of the row), one sub-block each: 16 bytes of nibbles
// (value j the low nibble of byte j, value j + 16 its high nibble), with Q5's fifth bits in qh
// (bit v for value v).
template <int BYTES, bool MIN, bool FIVE, int OFFSET>
struct Legacy4 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = BYTES, CHUNK = 32, SUBS = 1, SUB = 32, SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = MIN, UNIT_CODES = true;
    static constexpr int OFFSET_CODE = OFFSET, X_PAD_SHIFT = 3;  // a chunk reads 8 words of x
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
    template <bool UNIT>
    __device__ static void codes8(const Raw& raw, int, int h, float* q) {
        const int i = 2 * (h % 2);
        uint32_t e0 = 0, e1 = 0;
        if (FIVE) {
            e0 = spread_bits4((raw.qh >> (8 * h)) & 0xFu);
            e1 = spread_bits4((raw.qh >> (8 * h + 4)) & 0xFu);
        }
        nibbles8<UNIT>(raw.w[i], raw.w[i + 1], h >= 2, e0, e1, (float)OFFSET, q);
    }
};
using Q4_0 = Legacy4<18, false, false, 8>;
using Q4_1 = Legacy4<20, true, false, 0>;
using Q5_0 = Legacy4<22, false, true, 16>;
using Q5_1 = Legacy4<24, true, true, 0>;

struct Q8_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34, CHUNK = 32, SUBS = 1, SUB = 32, SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = false, UNIT_CODES = false;  // 8-bit codes
    static constexpr int OFFSET_CODE = 0, X_PAD_SHIFT = 3;
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
    template <bool>
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
// Selects, not a branch: lanes of a warp hold different j.
__device__ __forceinline__ void scale_min_k4(int j, const uint32_t* s, int& sc, int& m) {
    const unsigned at = 8u * (unsigned)(j & 3);
    const uint32_t a = s[0] >> at, b = s[1] >> at, c = s[2] >> at;
    const bool low = j < 4;
    sc = (int)(low ? a & 63u : (c & 0xFu) | (((a >> 6) & 3u) << 4));
    m = (int)(low ? b & 63u : ((c >> 4) & 0xFu) | (((b >> 6) & 3u) << 4));
}

// Q4_K / Q5_K: chunk c is the 64 values 64 (c % 4) .. of super-block c / 4; its two sub-blocks of 32
// are the low and the high nibbles of 32 bytes of ql, with (Q5_K) bits 2j and 2j + 1 of the 32
// bytes of qh as fifth bits.
template <bool FIVE>
struct QK45 {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = FIVE ? 176 : 144, CHUNK = 64, SUBS = 2, SUB = 32,
                         SUB_STRIDE = 32;
    static constexpr bool HAS_BIAS = true, UNIT_CODES = true;
    static constexpr int OFFSET_CODE = 0, X_PAD_SHIFT = 4;  // 16 words
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
    template <bool UNIT>
    __device__ static void codes8(const Raw& raw, int s, int h, float* q) {
        uint32_t e0 = 0, e1 = 0;
        if (FIVE) {
            const unsigned bit = (unsigned)(2 * raw.j + s);
            e0 = ((raw.qh[2 * h] >> bit) & 0x01010101u) << 4;
            e1 = ((raw.qh[2 * h + 1] >> bit) & 0x01010101u) << 4;
        }
        nibbles8<UNIT>(raw.ql[2 * h], raw.ql[2 * h + 1], s == 1, e0, e1, 0.f, q);
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
    // Unit codes measured slower here (six-bit codes need their top bits ORed in first).
    static constexpr bool HAS_BIAS = false, UNIT_CODES = false;
    // A chunk reads words 4i + 8t + 2h (+1) of its half super-block's 32 (the half's two chunks
    // alternate i), so runs of 32 words share padding.
    static constexpr int OFFSET_CODE = 32, X_PAD_SHIFT = 5;
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
    template <bool UNIT>
    __device__ static void codes8(const Raw& raw, int t, int h, float* q) {
        const uint32_t* w = t % 2 == 0 ? raw.qa : raw.qb;
        const uint32_t e0 = ((raw.qh[2 * h] >> (2 * t)) & 0x03030303u) << 4;
        const uint32_t e1 = ((raw.qh[2 * h + 1] >> (2 * t)) & 0x03030303u) << 4;
        nibbles8<UNIT>(w[2 * h], w[2 * h + 1], t >= 2, e0, e1, 32.f, q);
    }
};

// -- products --------------------------------------------------------------------------------------

// x (times g with a norm) in f32, staged in shared memory a tile of X_TILE_VALUES / M values per
// token at a time. Lanes read the 8-value runs of their own chunks, 64 to 256 bytes apart from
// their neighbours': from global memory every such load touches 32 lines for 16 bytes each. In the
// tile, 16-byte word v is kept at v + (v >> T::X_PAD_SHIFT): one word of padding per run of words
// that a chunk reads from, so the lanes of a read, and the contiguous writes of the staging, are
// free of bank conflicts, and a chunk's words keep their distances (its reads take immediate
// offsets from one address).
constexpr int X_TILE_VALUES = 16384;

// Words of the tile (with padding) for M tokens of `stride` values.
__host__ __device__ constexpr int x_tile_words(int m, int stride) { return m * stride / 4 + m * stride / 32 + 1; }

template <class T>
__device__ __forceinline__ int x_word(int v) {
    return v + (v >> T::X_PAD_SHIFT);
}

// Chunk c of the warp's ROWS rows (decoded from raw) times each of the M tokens, added into
// dot[m][r]; x comes from the tile that starts at value t0 (tokens past the step's are zeros there,
// so the loops have no branches). Per eight values x is read once for all rows, and each row's
// eight codes are decoded once for all tokens. With UNIT, codes
// come as 1 + c / 128 (one permute each, no subtraction) and the sub-block's sum of x turns the
// sums back into Σ (c - OFFSET) x.
template <class T, int M, int ROWS, bool UNIT>
__device__ __forceinline__ void chunk_dots(const typename T::Raw (&raw)[ROWS], int c, int t0, const float4* xs,
                                           int stride, float (&dot)[M][ROWS]) {
    constexpr bool SUM_X = T::HAS_BIAS || UNIT;
    // Each token's first word of the chunk; the chunk's words share its padding.
    const float4* xm[M];
#pragma unroll
    for (int m = 0; m < M; m++) xm[m] = xs + x_word<T>((m * stride + T::x_base(c) - t0) / 4);
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
            for (int r = 0; r < ROWS; r++) T::template codes8<UNIT>(raw[r], s, h, q[r]);
#pragma unroll
            for (int m = 0; m < M; m++) {
                const int at = (s * T::SUB_STRIDE + 8 * h) / 4;
                const float4 a = xm[m][at], b = xm[m][at + 1];
                const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    if (SUM_X) sx[m] += f[e];
#pragma unroll
                    for (int r = 0; r < ROWS; r++) sum[m][r] = fmaf(q[r][e], f[e], sum[m][r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float scale, bias;
            T::scales(raw[r], s, scale, bias);
            // UNIT: Σ (c - OFFSET) x = 128 Σ - (128 + OFFSET) Σ x.
            const float on_sum = UNIT ? 128.f * scale : scale;
            const float on_x = UNIT ? bias - scale * (float)(128 + T::OFFSET_CODE) : bias;
#pragma unroll
            for (int m = 0; m < M; m++) {
                dot[m][r] = fmaf(on_sum, sum[m][r], dot[m][r]);
                if (SUM_X) dot[m][r] = fmaf(on_x, sx[m], dot[m][r]);
            }
        }
    }
}

__device__ __forceinline__ float round_to_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Units per warp: more rows share each read of x when few tokens leave registers to spare.
template <int M, int R>
struct WarpUnits {
    static constexpr int value = (M <= 2 ? 4 : 2) / R;
};

// Values per token of the M-token kernels' tile of x (ops::quant mirrors this for the launch's
// shared memory: x_tile_words 16-byte words).
template <int M>
struct XTile {
    static constexpr int VALUES = X_TILE_VALUES / M;
};

// Group `group` of the product (see qgemv; without LOOP, blockIdx.x's): its units' dot products over
// every tile of x, stored. With `stage` the block stages each tile (and computes the norm's scale
// into `scale`); without, x's single tile is in place from the block's earlier group. Block-wide
// with `stage`.
template <class T, int M, int R, bool NORM, int G, bool UNIT, bool LOOP>
__device__ __forceinline__ void qgemv_group(const uint8_t* __restrict__ w, long long row_bytes,
                                            const __nv_bfloat16* __restrict__ x,
                                            const __nv_bfloat16* __restrict__ g, float eps, void* out, int tokens,
                                            int units, int k, int ld, int mode, int group, bool stage,
                                            float (&scale)[M]) {
    constexpr int ROWS = G * R, TILE = XTile<M>::VALUES;
    constexpr bool UNIT_OK = UNIT && T::UNIT_CODES;
    extern __shared__ float4 qgemv_x[];
    const int lane = threadIdx.x % TURBO_WARP;
    // (blockIdx.x read here, after the lane, keeps the one-token kernels' code as it was before the
    // looping form: ptxas scheduled the Q6_K products 3% slower with the reads swapped.)
    const int first = ((LOOP ? group : (int)blockIdx.x) * (int)(blockDim.x / TURBO_WARP) +
                       (int)(threadIdx.x / TURBO_WARP)) * G;
    const bool active = first < units;  // uniform per warp; an idle warp still stages x
    const uint8_t* row[ROWS];
#pragma unroll
    for (int u = 0; u < G; u++) {
        const int unit = first + u < units ? first + u : first;
#pragma unroll
        for (int r = 0; r < R; r++) row[u * R + r] = w + (size_t)(unit + r * units) * (size_t)row_bytes;
    }
    const int stride = k < TILE ? k : TILE;
    float dot[M][ROWS], ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        ss[m] = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) dot[m][r] = 0.f;
    }
    for (int t0 = 0; t0 < k; t0 += TILE) {
        const int tn = k - t0 < TILE ? k - t0 : TILE;
        if (stage) {
            __syncthreads();  // the previous tile is read
            for (int i = threadIdx.x; i < M * (tn / 8); i += blockDim.x) {
                const int m = i / (tn / 8), e8 = 8 * (i % (tn / 8));
                float f[8];
                if (m < tokens) {
                    bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * k + t0 + e8)), f);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++) f[e] = 0.f;
                }
                if (NORM) {
                    float gf[8];
                    bf16x8_unpack(__ldg(reinterpret_cast<const uint4*>(g + t0 + e8)), gf);
                    float part = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        part = fmaf(f[e], f[e], part);
                        f[e] *= gf[e];
                    }
#pragma unroll
                    for (int mm = 0; mm < M; mm++)
                        if (mm == m) ss[mm] += part;  // registers, not an indexed array
                }
                const int v = (m * stride + e8) / 4;
                qgemv_x[x_word<T>(v)] = make_float4(f[0], f[1], f[2], f[3]);
                qgemv_x[x_word<T>(v + 1)] = make_float4(f[4], f[5], f[6], f[7]);
            }
            __syncthreads();
        }
        if (active) {
            for (int c = t0 / T::CHUNK + lane; c < (t0 + tn) / T::CHUNK; c += TURBO_WARP) {
                typename T::Raw raw[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; r++) T::load(row[r], c, raw[r]);
                chunk_dots<T, M, ROWS, UNIT_OK>(raw, c, t0, qgemv_x, stride, dot);
            }
        }
    }
    if (stage) {
#pragma unroll
        for (int m = 0; m < M; m++) scale[m] = NORM ? rsqrtf(block_sum(ss[m]) / (float)k + eps) : 1.f;
    }
    if (!active) return;
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) dot[m][r] = warp_sum(dot[m][r]) * scale[m];
    }
    if (lane != 0) return;
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

// out[m * ld + unit] per token m < tokens, for each warp's G consecutive units; R == 2: unit j is
// rows j and units + j, stored as SwiGLU. The block stages x a tile at a time (times g and the
// squares summed with NORM); each warp's lanes then take the tile's chunks lane, lane + 32, ... of
// its rows. Dynamic shared memory: x_tile_words(M, min(XTile<M>::VALUES, k)) 16-byte words.
//
// With LOOP, a block takes groups of QGEMV_WARPS * G units blockIdx.x, blockIdx.x + gridDim.x,
// ...: where x fits one tile (k <= XTile<M>::VALUES) the launch makes only the blocks that are
// resident at once, and each stages x (and the norm's scale) once for all of its groups, instead
// of a block a group staging it again. With several tiles the launch makes a block per group.
// Measured on an H200 (benches/quant_kernels/qx.cu): Q4_K gate/up with SwiGLU 119 -> 71 us at 4
// tokens and 48 -> 44 at 2; the Q6_K LM head (128256 rows, one token) 178 -> 154 us. One-token
// products of a few waves of groups ran 2-5% slower looping, so they have both forms and ops::quant
// loops only over many waves.
template <class T, int M, int R, bool NORM, int G = WarpUnits<M, R>::value, bool UNIT = true, bool LOOP = (M > 1)>
__device__ __forceinline__ void qgemv(const uint8_t* __restrict__ w, long long row_bytes,
                                      const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                      float eps, void* out, int tokens, int units, int k, int ld, int mode) {
    float scale[M];
    if constexpr (LOOP) {
        const int warps = blockDim.x / TURBO_WARP, groups = (units + warps * G - 1) / (warps * G);
        // The block's first group stages x (every tile of it: with several tiles the block has
        // only this group); later groups find x's single tile in place.
        for (int group = blockIdx.x; group < groups; group += gridDim.x)
            qgemv_group<T, M, R, NORM, G, UNIT, true>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode,
                                                      group, group == (int)blockIdx.x, scale);
    } else {
        qgemv_group<T, M, R, NORM, G, UNIT, false>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode, 0,
                                                   true, scale);
    }
}

// -- one-token products on tensor cores (Q4_K) ------------------------------------------------------
//
// The CUDA-core products above spend a decode and a multiply-add per weight and token. Here a warp
// takes a tile of 16 rows and multiplies its codes on mma.sync (m16n8k16, bf16 in, f32 out), whose
// 8 columns hold the 8 sub-blocks of a super-block rather than tokens: B is block-diagonal, column
// n holding x over sub-block n and zeros elsewhere, so each accumulator is one (row, sub-block)
// sum, and each lane scales exactly the sums it holds. Lane (g, p) (g = lane / 4, p = lane % 4)
// holds rows g and g + 8 at k-rows 2p, 2p + 1 (sub-block 2p: the low nibbles of chunk p) and
// 2p + 8, 2p + 9 (sub-block 2p + 1: its high nibbles), so it loads and decodes only chunk p of its
// two rows, and its accumulators are its own sub-blocks' sums. Codes are exact in bf16 as 128 + c
// (one byte permute per pair), x is bf16 already, so every product is exact and sums are f32; an
// mma of ones over the same B gives each sub-block's Σx, which turns Σ (128 + c) x into Σ c x and
// carries the minimum. The warps of a block split the tile's super-blocks and add their sums in
// shared memory (qmma1_q4k below: weights staged in shared memory, the norm optionally fused).
//
// Measured on an H200 (benches/quant_kernels/qx.cu, 8B shapes, µs, qgemv -> the first form, which
// loaded each super-block into registers): QKV 6144x4096 10.8 -> 8.4, O 9.6 -> 7.1, gate/up +
// SwiGLU 31.4 -> 24.9 (4 warps), down 4096x14336 23.4 -> 15.8, a 49152-row LM head 48.1 -> 37.0 (4
// warps). Tried and slower: loading the next super-block into registers before using the current
// one (more registers, fewer blocks per SM), and two x arrays instead of masks (fewer blocks per
// SM).

__device__ __forceinline__ void qmma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16 pair (128 + c0, 128 + c1) of the codes (< 128) in the bytes of v that `sel` picks (0x4140:
// bytes 0 and 1; 0x4342: bytes 2 and 3): each byte becomes the mantissa under 128's exponent.
// `sel` comes in a register: given as constants, the selectors were materialized again for every
// permute (ptxas reused their registers).
__device__ __forceinline__ uint32_t code_pair(uint32_t v, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, 0x43, %2;" : "=r"(d) : "r"(v), "r"(sel));
    return d;
}

// Scales and minimums of sub-blocks 2p and 2p + 1 of a Q4_K super-block (header words 1-3) as
// floats: sc[h], m[h] for sub-block 2p + h. Four sub-blocks' six-bit values are unpacked at once
// and the lane's two bytes picked.
__device__ __forceinline__ void q4k_scales2(const uint4& head, int p, float (&sc)[2], float (&m)[2]) {
    const uint32_t s0 = head.y, s1 = head.z, s2 = head.w;
    uint32_t scw, mw;
    if (p < 2) {  // sub-blocks 0-3: the low six bits of bytes 0-3 and 4-7
        scw = s0 & 0x3F3F3F3Fu;
        mw = s1 & 0x3F3F3F3Fu;
    } else {  // sub-blocks 4-7: nibbles of bytes 8-11 and the top two bits of bytes 0-3 / 4-7
        scw = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
        mw = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
    }
    const unsigned at = 16u * (unsigned)(p & 1);
    scw >>= at;
    mw >>= at;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        sc[h] = __int_as_float(__byte_perm(scw, 0x4B000000u, 0x7440u | (unsigned)h)) - 8388608.f;
        m[h] = __int_as_float(__byte_perm(mw, 0x4B000000u, 0x7440u | (unsigned)h)) - 8388608.f;
    }
}

// What a lane of the one-token Q4_K mma kernels keeps for every super-block. B: lane (g, p) holds
// column g; its k-rows 2p.. belong to sub-block 2p, 2p + 8.. to 2p + 1. The lane whose column is
// one of those loads x over it (on_a, on_b); every other B value is zero (the masks).
struct Mma1Lane {
    int p, gq;
    bool on_a, on_b;
    uint32_t mask_a, mask_b, sel01, sel23;
    int x_at;  // the lane's first x value within a super-block (when on_a or on_b)
    __device__ Mma1Lane() {
        const int lane = threadIdx.x % TURBO_WARP;
        p = lane % 4;
        gq = lane / 4;
        on_a = gq == 2 * p;
        on_b = gq == 2 * p + 1;
        mask_a = on_a ? ~0u : 0u;
        mask_b = on_b ? ~0u : 0u;
        x_at = 64 * p + (on_b ? 32 : 0);
        // Selectors the compiler cannot fold (threadIdx.x < 2^16), so that they stay in registers.
        const uint32_t opaque = threadIdx.x >> 16;
        sel01 = 0x4140u | opaque;
        sel23 = 0x4342u | opaque;
    }
};

// The A fragments of k-steps t and t + 1 (a0, a1): bf16 codes of values 2t.. and 2t + 2.. of the
// lane's two sub-blocks in rows a and b, from word t / 2 of their chunks.
__device__ __forceinline__ void q4k_code_pairs(const Mma1Lane& l, uint32_t qa, uint32_t qb, uint32_t (&a0)[4],
                                               uint32_t (&a1)[4]) {
    const uint32_t la = qa & 0x0F0F0F0Fu, lb = qb & 0x0F0F0F0Fu;
    const uint32_t ua = (qa >> 4) & 0x0F0F0F0Fu, ub = (qb >> 4) & 0x0F0F0F0Fu;
    a0[0] = code_pair(la, l.sel01), a0[1] = code_pair(lb, l.sel01);
    a0[2] = code_pair(ua, l.sel01), a0[3] = code_pair(ub, l.sel01);
    a1[0] = code_pair(la, l.sel23), a1[1] = code_pair(lb, l.sel23);
    a1[2] = code_pair(ua, l.sel23), a1[3] = code_pair(ub, l.sel23);
}

// A super-block's scales and minimums of the lane's sub-blocks in rows a and b (from the headers
// ha and hb), decoded once for every token's sums.
struct Q4kRowScales {
    float sca[2], ma[2], scb[2], mb[2];
    float2 dma, dmb;
    __device__ __forceinline__ Q4kRowScales(const Mma1Lane& l, const uint4& ha, const uint4& hb) {
        q4k_scales2(ha, l.p, sca, ma);
        q4k_scales2(hb, l.p, scb, mb);
        dma = __half22float2(*reinterpret_cast<const __half2*>(&ha.x));
        dmb = __half22float2(*reinterpret_cast<const __half2*>(&hb.x));
    }
    // Adds a token's sums to rows a and b: c[0], c[1] are row a's sub-blocks 2p, 2p + 1 (c[2],
    // c[3]: row b), each Σ (128 + code) x; s holds each sub-block's Σx. Row sum: d Σ sc (c - 128 s)
    // - dmin Σ m s.
    __device__ __forceinline__ void add(const float (&c)[4], const float (&s)[4], float& acc_a,
                                        float& acc_b) const {
        const float ca = fmaf(sca[1], fmaf(-128.f, s[1], c[1]), sca[0] * fmaf(-128.f, s[0], c[0]));
        const float na = fmaf(ma[1], s[1], ma[0] * s[0]);
        const float cb = fmaf(scb[1], fmaf(-128.f, s[3], c[3]), scb[0] * fmaf(-128.f, s[2], c[2]));
        const float nb = fmaf(mb[1], s[3], mb[0] * s[2]);
        acc_a = fmaf(-dma.y, na, fmaf(dma.x, ca, acc_a));
        acc_b = fmaf(-dmb.y, nb, fmaf(dmb.x, cb, acc_b));
    }
};

// One super-block of the lane's rows a (g) and b (g + 8) added into acc_a and acc_b: headers ha and
// hb, the lane's chunk p of each row (qa, qb: 32 bytes), x over the lane's column (xw; only read
// where the lane is on_a or on_b).
__device__ __forceinline__ void q4k_mma_superblock(const Mma1Lane& l, const uint4& ha, const uint4& hb,
                                                   const uint32_t (&qa)[8], const uint32_t (&qb)[8],
                                                   const uint32_t (&xw)[16], float& acc_a, float& acc_b) {
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    float c[4] = {0.f, 0.f, 0.f, 0.f}, s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int t = 0; t < 16; t += 2) {
        // k-step t takes values 2t, 2t + 1 of each sub-block: bytes 0-1 of word t / 2, then 2-3.
        uint32_t a0[4], a1[4];
        q4k_code_pairs(l, qa[t / 2], qb[t / 2], a0, a1);
        const uint32_t b00 = xw[t] & l.mask_a, b01 = xw[t] & l.mask_b;
        qmma_16816(c, a0, b00, b01);
        qmma_16816(s, ones, b00, b01);
        const uint32_t b10 = xw[t + 1] & l.mask_a, b11 = xw[t + 1] & l.mask_b;
        qmma_16816(c, a1, b10, b11);
        qmma_16816(s, ones, b10, b11);
    }
    Q4kRowScales(l, ha, hb).add(c, s, acc_a, acc_b);
}

// An RMSNorm split between two one-token tensor-core products (ops::quant::NormLink). The residual
// step that writes x (mode QGEMV_ADD_RESIDUAL, `g` set) also writes x · g rounded to bf16 (`scaled`,
// laid out as its output) and each block's Σx² (`parts_out[block]`, over the stored bf16 values, in
// a fixed order); the next product takes x · g as its x, and with `parts_in` set it multiplies its
// sums by rsqrt(Σ parts / k + eps) before its epilogue. The norm then costs neither a launch of its
// own nor a pass over x in every block, and the residual step's blocks pay 16 multiplies and a
// shuffle reduction.
struct NormLink {
    const float* parts_in;    // the product over x · g: k / 16 partial sums, or null
    const __nv_bfloat16* g;   // the residual step: the next norm's weights, or null
    __nv_bfloat16* scaled;    // the residual step: x · g, as many values as its outputs
    float* parts_out;         // the residual step: gridDim.x partial sums
    float eps;
};

// Where a one-token QKV product puts its outputs instead of a qkv row (qkv_rope_kv_bf16 of
// kernels/elementwise.cu in its epilogue): rotated queries to q, the rotated keys and the values
// to the token's slot of the layer's bf16 caches (skipped for a slot past cache_slots). Each
// output is first rounded to bf16, as the qkv row stores it, then rotated in f32 with its pair's
// partner (the neighbouring unit, a lane away) and rounded again: the same values as the unfused
// path. unit0 is the band's first row within the [q | k | v] rows.
struct RopeKvOut {
    __nv_bfloat16* q;
    __nv_bfloat16* k_cache;
    __nv_bfloat16* v_cache;
    const unsigned* positions;
    const unsigned* slots;
    const float* inv_freq;
    long long cache_slots;
    int q_cols, kv_cols, head_dim, unit0;
};

// Stores unit u's value r (bf16-exact) of the QKV rows as RopeKvOut says, `partner` the value of
// unit u ^ 1.
__device__ __forceinline__ void rope_kv_store(const RopeKvOut& rope, int u, float r, float partner) {
    const int g = rope.unit0 + u;
    const bool even = (g & 1) == 0;
    const unsigned slot = rope.slots[0];
    const bool store = (long long)slot < rope.cache_slots;
    const int half = rope.head_dim / 2;
    if (g < rope.q_cols + rope.kv_cols) {
        const bool key = g >= rope.q_cols;
        const int at = key ? g - rope.q_cols : g;
        const float2 ab = even ? make_float2(r, partner) : make_float2(partner, r);
        const float2 rot = rope_rotate(ab, (float)rope.positions[0], rope.inv_freq[(at / 2) % half]);
        const __nv_bfloat16 v = __float2bfloat16_rn(even ? rot.x : rot.y);
        if (!key)
            rope.q[at] = v;
        else if (store)
            rope.k_cache[(size_t)slot * (size_t)rope.kv_cols + at] = v;
    } else if (store) {
        rope.v_cache[(size_t)slot * (size_t)rope.kv_cols + (g - rope.q_cols - rope.kv_cols)] = __float2bfloat16_rn(r);
    }
}

// 1 / rms from the residual step's parts (warp 0), into *inv; read after the block's next
// __syncthreads.
__device__ __forceinline__ void norm_link_inv(const NormLink& link, int k, float* inv) {
    const int lane = threadIdx.x % TURBO_WARP;
    if (link.parts_in == nullptr || threadIdx.x >= TURBO_WARP) return;  // uniform per warp
    float s = 0.f;
    for (int i = lane; i < k / 16; i += TURBO_WARP) s += __ldg(link.parts_in + i);
    s = warp_sum(s);
    if (lane == 0) *inv = rsqrtf(s / (float)k + link.eps);
}

// The warps' sums of rows a and b for each of M tokens, reduced over the lanes of a row and put in
// `part` for the block's epilogue (qmma1_store), which may read them once this returns.
template <int W, int M>
__device__ __forceinline__ void qmma1_gather(float (&part)[W][M][16], float (&acc_a)[M], float (&acc_b)[M]) {
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
#pragma unroll
    for (int m = 0; m < M; m++) {
        acc_a[m] += __shfl_xor_sync(0xFFFFFFFFu, acc_a[m], 1);
        acc_a[m] += __shfl_xor_sync(0xFFFFFFFFu, acc_a[m], 2);
        acc_b[m] += __shfl_xor_sync(0xFFFFFFFFu, acc_b[m], 1);
        acc_b[m] += __shfl_xor_sync(0xFFFFFFFFu, acc_b[m], 2);
        if (lane % 4 == 0) {
            part[warp][m][lane / 4] = acc_a[m];
            part[warp][m][lane / 4 + 8] = acc_b[m];
        }
    }
    __syncthreads();
}

template <int R, int W, int M>
__device__ __forceinline__ void qmma1_store(float (&part)[W][M][16], float (&acc_a)[M], float (&acc_b)[M],
                                            int unit0, int units, void* out, int tokens, int ld, int mode) {
    constexpr int UNITS = R == 2 ? 8 : 16;
    qmma1_gather(part, acc_a, acc_b);
    const int i = threadIdx.x % UNITS, m = threadIdx.x / UNITS;
    if (m >= M || m >= tokens || unit0 + i >= units) return;
    const int unit = unit0 + i;
    const size_t at = (size_t)m * (size_t)ld + (size_t)unit;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < W; wi++) v += part[wi][m][i];
    if (R == 2) {
        float up = 0.f;
#pragma unroll
        for (int wi = 0; wi < W; wi++) up += part[wi][m][i + 8];
        const float gate = round_to_bf16(v);
        up = round_to_bf16(up);
        static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    } else if (mode == QGEMV_STORE_F32) {
        static_cast<float*>(out)[at] = v;
    } else {
        __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
        o[at] = __float2bfloat16_rn(mode == QGEMV_ADD_RESIDUAL ? __bfloat162float(o[at]) + v : v);
    }
}

template <int R, int W, int M, bool ROPE>
__device__ __forceinline__ void qmma1_store_linked(float (&part)[W][M][16], float (&acc_a)[M], float (&acc_b)[M],
                                                   int unit0, int units, void* out, int mode, const NormLink& link,
                                                   float inv, const RopeKvOut& rope) {
    static_assert(M == 1, "a split norm joins one-token products");
    constexpr int UNITS = R == 2 ? 8 : 16;
    qmma1_gather(part, acc_a, acc_b);
    // Thread i < UNITS stores unit i; no thread of warp 0 returns before the residual step's or
    // the rotation's shuffles, which every thread of the warp takes part in.
    if (threadIdx.x >= TURBO_WARP) return;
    const int i = threadIdx.x % UNITS, unit = unit0 + i;
    const bool on = threadIdx.x < UNITS && unit < units;
    const float scale = link.parts_in != nullptr ? inv : 1.f;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < W; wi++) v += part[wi][0][i];
    if (R == 2) {
        if (!on) return;
        float up = 0.f;
#pragma unroll
        for (int wi = 0; wi < W; wi++) up += part[wi][0][i + 8];
        const float gate = round_to_bf16(v * scale);
        up = round_to_bf16(up * scale);
        static_cast<__nv_bfloat16*>(out)[unit] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
    } else if (ROPE) {
        // A pair's units are neighbouring lanes.
        const float r = on ? round_to_bf16(v * scale) : 0.f;
        const float partner = __shfl_xor_sync(0xFFFFFFFFu, r, 1);
        if (on) rope_kv_store(rope, unit, r, partner);
    } else if (mode == QGEMV_STORE_F32) {
        if (on) static_cast<float*>(out)[unit] = v * scale;
    } else {
        __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
        float h = 0.f;
        if (on) {
            const float p = v * scale;
            const __nv_bfloat16 r = __float2bfloat16_rn(mode == QGEMV_ADD_RESIDUAL ? __bfloat162float(o[unit]) + p : p);
            o[unit] = r;
            h = __bfloat162float(r);
            if (link.g != nullptr) link.scaled[unit] = __float2bfloat16_rn(h * __bfloat162float(link.g[unit]));
        }
        if (mode == QGEMV_ADD_RESIDUAL && link.g != nullptr) {  // uniform per block
            // Σ h² over the block's 16 units, lanes 0-15 (lanes 16-31 add zeros among themselves).
            float sq = h * h;
#pragma unroll
            for (int o2 = 8; o2 > 0; o2 >>= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o2);
            if (threadIdx.x == 0) link.parts_out[blockIdx.x] = sq;
        }
    }
}

// qmma1_store, or with LINK its part in a split norm (qmma1_store_linked; with ROPE, a QKV product
// whose epilogue rotates and writes the KV cache): separate functions, so that the products without
// a link compile as they did before it existed.
template <int R, int W, int M, bool LINK, bool ROPE>
__device__ __forceinline__ void qmma1_epilogue(float (&part)[W][M][16], float (&acc_a)[M], float (&acc_b)[M],
                                               int unit0, int units, void* out, int tokens, int ld, int mode,
                                               const NormLink& link, const float* inv, const RopeKvOut& rope) {
    if constexpr (LINK)
        qmma1_store_linked<R, W, M, ROPE>(part, acc_a, acc_b, unit0, units, out, mode, link, *inv, rope);
    else
        qmma1_store<R, W, M>(part, acc_a, acc_b, unit0, units, out, tokens, ld, mode);
}

// As q4k_mma_superblock for M tokens: the codes are decoded once for all of them, and each
// token's mmas take its x from the warp's slot (token m's 32 words at xs + 32 m, the lane's own
// words from x_at on), masked as one token's.
template <int M>
__device__ __forceinline__ void q4k_mma_superblock_tokens(const Mma1Lane& l, const uint4& ha, const uint4& hb,
                                                          const uint32_t (&qa)[8], const uint32_t (&qb)[8],
                                                          const uint4* xs, float (&acc_a)[M], float (&acc_b)[M]) {
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    float c[M][4], s[M][4];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[m][i] = s[m][i] = 0.f;
    uint4 xq[M];
#pragma unroll
    for (int t = 0; t < 16; t += 2) {
        if (t % 4 == 0) {
#pragma unroll
            for (int m = 0; m < M; m++) xq[m] = xs[32 * m + l.x_at / 8 + t / 4];
        }
        uint32_t a0[4], a1[4];
        q4k_code_pairs(l, qa[t / 2], qb[t / 2], a0, a1);
#pragma unroll
        for (int m = 0; m < M; m++) {
            const uint32_t x0 = t % 4 == 0 ? xq[m].x : xq[m].z, x1 = t % 4 == 0 ? xq[m].y : xq[m].w;
            qmma_16816(c[m], a0, x0 & l.mask_a, x0 & l.mask_b);
            qmma_16816(s[m], ones, x0 & l.mask_a, x0 & l.mask_b);
            qmma_16816(c[m], a1, x1 & l.mask_a, x1 & l.mask_b);
            qmma_16816(s[m], ones, x1 & l.mask_a, x1 & l.mask_b);
        }
    }
    const Q4kRowScales scales(l, ha, hb);
#pragma unroll
    for (int m = 0; m < M; m++) scales.add(c[m], s[m], acc_a[m], acc_b[m]);
}

// The widest x that the one-token products normalize themselves (in shared memory, bf16).
constexpr int MMA1_NORM_MAX_K = 8192;

// x's RMSNorm times g into `normed` (k / 8 words of shared memory), as rms_norm_bf16 computes it
// (f32, rounded once to bf16), by the whole block; returns once every thread can read it.
__device__ __forceinline__ void normalize_to_shared(const __nv_bfloat16* __restrict__ x,
                                                    const __nv_bfloat16* __restrict__ g, float eps, int k,
                                                    uint4* normed) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* gv = reinterpret_cast<const uint4*>(g);
    float ss = 0.f;
    for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
        float f[8];
        bf16x8_unpack(__ldg(xv + i), f);
#pragma unroll
        for (int e = 0; e < 8; e++) ss = fmaf(f[e], f[e], ss);
    }
    const float inv = rsqrtf(block_sum(ss) / (float)k + eps);
    for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
        float f[8], gf[8];
        bf16x8_unpack(__ldg(xv + i), f);
        bf16x8_unpack(__ldg(gv + i), gf);
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = f[e] * inv * gf[e];
        normed[i] = bf16x8_pack(f);
    }
    __syncthreads();
}

// Grid: ceil(units / UNITS) blocks of W warps, UNITS = 16 rows (R == 1) or 8 SwiGLU units (R == 2:
// rows g are gates, rows g + 8 the matching ups, stored as silu(gate) · up). Up to M tokens
// (`tokens`, token t's outputs at out + t · ld; one, with NORM); mode as qgemv's; k % 256 == 0;
// with NORM, k <= MMA1_NORM_MAX_K.
//
// Warp w takes super-blocks w, w + W, ... and copies each (its 16 rows' blocks, and x over it)
// into its own S slots of shared memory with cp.async, S super-blocks ahead of the one it
// multiplies: loads in flight take no registers, so a warp keeps S super-blocks coming while it
// computes (measured on an H200, 8B shapes, µs against loading into registers as each super-block
// comes, 8 warps / 4 warps: QKV 9.1 / 9.6 -> 9.1, gate/up 27.7 / 26.8 -> 25.3, down 16.3 / 22.1 ->
// 14.5, the 49152-row LM head 42.2 / 39.6 -> 38.0; reading the same bytes with nothing else takes
// 6.1, 18.4, 10.5 and 29.2).
//
// With NORM the block first computes x's RMSNorm times g, as rms_norm_bf16 does (f32, rounded once
// to bf16), into shared memory while its first weights are in flight, instead of a separate launch
// writing it to global memory; x is then not copied per super-block. With M > 1, each code is
// decoded once for every token (q4k_mma_superblock_tokens; measured in docs/perf/h100.md).
template <int R, int W, int S, bool NORM, int M = 1, bool LINK = false, bool ROPE = false>
__device__ __forceinline__ void qmma1_q4k(const uint8_t* __restrict__ w, long long row_bytes,
                                          const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                          float eps, void* out, int units, int k, int mode, int tokens = 1,
                                          int ld = 0, NormLink link = {}, RopeKvOut rope = {}) {
    static_assert(M == 1 || !NORM, "steps of several tokens take normalized x");
    constexpr int UNITS = R == 2 ? 8 : 16, SB_BYTES = 144, SB_WORDS = 9;
    // A slot: x over the super-block (32 words a token, without NORM), then the 16 rows' blocks.
    constexpr int X_WORDS = NORM ? 0 : 32 * M, SLOT_WORDS = X_WORDS + 16 * SB_WORDS;
    __shared__ float part[W][M][16];
    // Eight tokens' slots take more than static shared memory may hold (48 KiB a block): from
    // M = 8 they are the launch's dynamic shared memory, W · S · SLOT_WORDS words (ops::quant's
    // MmaTokens::smem gives it).
    constexpr bool DYNAMIC = M >= 8;
    __shared__ uint4 stage_static[DYNAMIC ? 1 : W][DYNAMIC ? 1 : S][SLOT_WORDS];
    extern __shared__ uint4 stage_dynamic[];
    auto stage = [&](int wi, int si) -> uint4* {
        if constexpr (DYNAMIC)
            return stage_dynamic + ((size_t)wi * S + (size_t)si) * SLOT_WORDS;
        else
            return stage_static[wi][si];
    };
    __shared__ uint4 normed[NORM ? MMA1_NORM_MAX_K / 8 : 1];
    __shared__ float norm_inv[1];
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const Mma1Lane l;
    const int unit0 = blockIdx.x * UNITS;
    // The lane copies word c = lane + 32 j (j < 5, c < 144) of the rows' blocks: word c % 9 of row
    // c / 9, at wbase + off[j] for super-block 0 (offsets from the block's first row fit 32 bits).
    // (A form whose blocks loop over several tiles, computing the norm once, kept more registers
    // and was 1-8% slower on every shape.)
    const uint8_t* wbase = w + (size_t)unit0 * (size_t)row_bytes;
    uint32_t off[5];
#pragma unroll
    for (int j = 0; j < 5; j++) {
        const int c = min(lane + 32 * j, 16 * SB_WORDS - 1);
        const int r = c / SB_WORDS;
        const int unit = min(unit0 + (R == 2 ? r % 8 : r), units - 1);
        const long long row = R == 2 && r >= 8 ? (long long)unit + units : unit;
        off[j] = (uint32_t)((row - unit0) * row_bytes) + 16u * (uint32_t)(c % SB_WORDS);
    }
    const int nsb = k / 256, mine = (nsb - warp + W - 1) / W;
    auto issue = [&](int i) {
        const int sb = warp + i * W;
        uint4* slot = stage(warp, i % S);
        // Tokens past the step's are staged as zeros.
        if (!NORM)
#pragma unroll
            for (int m = 0; m < M; m++)
                pf_cp_async16(slot + 32 * m + lane, x + (size_t)min(m, tokens - 1) * k + (size_t)sb * 256 + 8 * lane,
                              m < tokens);
        const uint8_t* wsb = wbase + (size_t)sb * SB_BYTES;
#pragma unroll
        for (int j = 0; j < 5; j++)
            if (j < 4 || lane < 16) pf_cp_async16(slot + X_WORDS + lane + 32 * j, wsb + off[j], true);
    };
#pragma unroll
    for (int i = 0; i < S; i++) {
        if (i < mine) issue(i);
        pf_cp_async_commit();
    }
    if constexpr (NORM) normalize_to_shared(x, g, eps, k, normed);
    if constexpr (LINK) norm_link_inv(link, k, norm_inv);  // while the first weights are in flight
    float acc_a[M], acc_b[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc_a[m] = acc_b[m] = 0.f;
    uint32_t xw[16];
#pragma unroll
    for (int i = 0; i < 16; i++) xw[i] = 0u;
    for (int i = 0; i < mine; i++) {
        pf_cp_async_wait<S - 1>();
        __syncwarp();
        const uint4* slot = stage(warp, i % S);
        const uint4* row_a = slot + X_WORDS + l.gq * SB_WORDS;
        const uint4* row_b = slot + X_WORDS + (l.gq + 8) * SB_WORDS;
        const uint4 ha = row_a[0], hb = row_b[0];
        const uint4 qa0 = row_a[1 + 2 * l.p], qa1 = row_a[2 + 2 * l.p];
        const uint4 qb0 = row_b[1 + 2 * l.p], qb1 = row_b[2 + 2 * l.p];
        const uint32_t qa[8] = {qa0.x, qa0.y, qa0.z, qa0.w, qa1.x, qa1.y, qa1.z, qa1.w};
        const uint32_t qb[8] = {qb0.x, qb0.y, qb0.z, qb0.w, qb1.x, qb1.y, qb1.z, qb1.w};
        if constexpr (M == 1) {
            if (l.on_a || l.on_b) {
                const uint4* xs = (NORM ? normed + (size_t)(warp + i * W) * 32 : slot) + l.x_at / 8;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint4 v = xs[q];
                    xw[4 * q] = v.x, xw[4 * q + 1] = v.y, xw[4 * q + 2] = v.z, xw[4 * q + 3] = v.w;
                }
            }
            __syncwarp();
            // The slot is read: refill it with the super-block S ahead.
            if (i + S < mine) issue(i + S);
            pf_cp_async_commit();
            q4k_mma_superblock(l, ha, hb, qa, qb, xw, acc_a[0], acc_b[0]);
        } else {
            // Several tokens' x is read from the slot as it is used: refill it afterwards.
            q4k_mma_superblock_tokens<M>(l, ha, hb, qa, qb, slot, acc_a, acc_b);
            __syncwarp();
            if (i + S < mine) issue(i + S);
            pf_cp_async_commit();
        }
    }
    qmma1_epilogue<R, W, M, LINK, ROPE>(part, acc_a, acc_b, unit0, units, out, tokens, ld, mode, link, norm_inv,
                                        rope);
}

// -- one-token Q6_K products on tensor cores -----------------------------------------------------
//
// As qmma1_q4k's layout, for Q6_K's 16 sub-blocks of 16 values (a 210-byte super-block: low nibbles
// ql[128], top bits qh[64], int8 scales[16], f16 d). Value n·128 + 32m + l (half n, quarter m,
// l < 32) has its low four bits in ql[64n + l] (m = 0, low nibble; m = 2, high) or ql[64n + 32 +
// l] (m = 1, 3) and its top two in bits 2m of qh[32n + l]; it belongs to sub-block 8n + 2m + l / 16.
// Lane (g, p) takes half n = p / 2, l in L .. L + 15 (L = 16 (p % 2)): 16 bytes of ql at 64n + L and
// at 64n + 32 + L, 16 of qh at 128 + 16p, so its four sub-blocks 8n + 2m + p % 2 are whole. The
// mmas come in two accumulator tiles: tile T holds quarters 2T (k-rows 2p.., column 2p) and 2T + 1
// (k-rows 2p + 8.., column 2p + 1), so as in Q4_K each lane's accumulators are its own sub-blocks'
// sums, and B is x masked by the same two lane conditions. Codes are exact in bf16 as 128 + q
// (q < 64); Σ (q - 32) x = Σ (128 + q) x - 160 Σx. Super-blocks are only 2-byte aligned: the
// lane's words are read as aligned words and shifted into place (words_at2).
//
// Measured on an H200 (benches/quant_kernels/qx.cu `mma6`, 8B shapes, µs, qgemv (its looping form
// where faster) -> 8 warps here): down 4096x14336 + residual 31.6 -> 23.4, O 11.5 -> 9.6, a
// 1024-row V band with the norm 8.5 -> 8.2. With 128 registers a thread it is no faster for many
// blocks: the 49152-row LM head 66.1 -> 66.2 (4 warps), gate/up 44.3 -> 49.8, so ops::quant takes
// it only for products of few blocks.
template <int R, int W, bool NORM, bool LINK = false, bool ROPE = false>
__device__ __forceinline__ void qmma1_q6k(const uint8_t* __restrict__ w, long long row_bytes,
                                          const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                          float eps, void* out, int units, int k, int mode, int /* tokens: 1 */ = 1,
                                          int /* ld */ = 0, NormLink link = {}, RopeKvOut rope = {}) {
    constexpr int UNITS = R == 2 ? 8 : 16, SB_BYTES = 210;
    __shared__ float part[W][1][16];
    __shared__ uint4 normed[NORM ? MMA1_NORM_MAX_K / 8 : 1];
    __shared__ float norm_inv[1];
    const int warp = threadIdx.x / TURBO_WARP;
    const Mma1Lane l;
    const int half = l.p / 2, quarter_l = 16 * (l.p % 2);
    const int unit0 = blockIdx.x * UNITS;
    const int ra = min(unit0 + l.gq, units - 1);
    const int rb = R == 2 ? ra + units : min(unit0 + l.gq + 8, units - 1);
    const uint8_t* wa = w + (size_t)ra * (size_t)row_bytes;
    const uint8_t* wb = w + (size_t)rb * (size_t)row_bytes;
    if constexpr (NORM) normalize_to_shared(x, g, eps, k, normed);
    if constexpr (LINK) norm_link_inv(link, k, norm_inv);
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    // x over the lane's column in tile T: quarter 2T (on_a) or 2T + 1 (on_b) of its half.
    const int x_at = 128 * half + (l.on_b ? 32 : 0) + quarter_l;
    float acc_a = 0.f, acc_b = 0.f;
    uint32_t xw[2][8];
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int i = 0; i < 8; i++) xw[t][i] = 0u;
    for (int sb = warp; sb < k / 256; sb += W) {
        const uint8_t* pa = wa + (size_t)sb * SB_BYTES;
        const uint8_t* pb = wb + (size_t)sb * SB_BYTES;
        uint32_t la[4], ua[4], ha[4], lb[4], ub[4], hb[4], sa[2], sbw[2];
        words_at2<4>(pa + 64 * half + quarter_l, la);
        words_at2<4>(pa + 64 * half + 32 + quarter_l, ua);
        words_at2<4>(pa + 128 + 16 * l.p, ha);
        words_at2<4>(pb + 64 * half + quarter_l, lb);
        words_at2<4>(pb + 64 * half + 32 + quarter_l, ub);
        words_at2<4>(pb + 128 + 16 * l.p, hb);
        words_at2<2>(pa + 192 + 8 * half, sa);
        words_at2<2>(pb + 192 + 8 * half, sbw);
        const float da = half_at(pa + 208), db = half_at(pb + 208);
        if (l.on_a || l.on_b) {
#pragma unroll
            for (int t = 0; t < 2; t++) {
                const uint4* xs = NORM ? normed + (sb * 256 + x_at + 64 * t) / 8
                                       : reinterpret_cast<const uint4*>(x + (size_t)sb * 256 + x_at + 64 * t);
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const uint4 v = NORM ? xs[q] : __ldg(xs + q);
                    xw[t][4 * q] = v.x, xw[t][4 * q + 1] = v.y, xw[t][4 * q + 2] = v.z, xw[t][4 * q + 3] = v.w;
                }
            }
        }
        float c[2][4], s[2][4];
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[t][i] = s[t][i] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // Codes of quarters 0-3 at l = L + 4i .. L + 4i + 3, one per byte.
            const uint32_t qa[4] = {(la[i] & 0x0F0F0F0Fu) | ((ha[i] << 4) & 0x30303030u),
                                    (ua[i] & 0x0F0F0F0Fu) | ((ha[i] << 2) & 0x30303030u),
                                    ((la[i] >> 4) & 0x0F0F0F0Fu) | (ha[i] & 0x30303030u),
                                    ((ua[i] >> 4) & 0x0F0F0F0Fu) | ((ha[i] >> 2) & 0x30303030u)};
            const uint32_t qb[4] = {(lb[i] & 0x0F0F0F0Fu) | ((hb[i] << 4) & 0x30303030u),
                                    (ub[i] & 0x0F0F0F0Fu) | ((hb[i] << 2) & 0x30303030u),
                                    ((lb[i] >> 4) & 0x0F0F0F0Fu) | (hb[i] & 0x30303030u),
                                    ((ub[i] >> 4) & 0x0F0F0F0Fu) | ((hb[i] >> 2) & 0x30303030u)};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t sel = h == 0 ? l.sel01 : l.sel23;
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    const uint32_t a[4] = {code_pair(qa[2 * t], sel), code_pair(qb[2 * t], sel),
                                           code_pair(qa[2 * t + 1], sel), code_pair(qb[2 * t + 1], sel)};
                    const uint32_t b0 = xw[t][2 * i + h] & l.mask_a, b1 = xw[t][2 * i + h] & l.mask_b;
                    qmma_16816(c[t], a, b0, b1);
                    qmma_16816(s[t], ones, b0, b1);
                }
            }
        }
        // c[t][0], c[t][1]: row a, quarters 2t and 2t + 1 (c[t][2], c[t][3]: row b). Their scales
        // are bytes 2m + p % 2 of the half's eight.
        const unsigned pick = 8u * (unsigned)(l.p % 2);
        float suma = 0.f, sumb = 0.f;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int t = m / 2, h = m % 2;
            const uint32_t wa_ = sa[m / 2], wb_ = sbw[m / 2];
            const unsigned at = 16u * (unsigned)(m % 2) + pick;
            const float sca = (float)(int8_t)((wa_ >> at) & 0xFFu), scb = (float)(int8_t)((wb_ >> at) & 0xFFu);
            suma = fmaf(sca, fmaf(-160.f, s[t][h], c[t][h]), suma);
            sumb = fmaf(scb, fmaf(-160.f, s[t][2 + h], c[t][2 + h]), sumb);
        }
        acc_a = fmaf(da, suma, acc_a);
        acc_b = fmaf(db, sumb, acc_b);
    }
    float sums_a[1] = {acc_a}, sums_b[1] = {acc_b};
    qmma1_epilogue<R, W, 1, LINK, ROPE>(part, sums_a, sums_b, unit0, units, out, 1, 0, mode, link, norm_inv, rope);
}

// As qmma1_q6k for steps of up to M tokens (x normalized by the caller): each warp copies the M
// tokens' x over its super-block into shared memory with cp.async (zeros past the step's tokens)
// while it loads the weights, and decodes each code once for every token; the two accumulator
// tiles are taken one after the other, so that M tokens' sums fit the registers.
//
// Measured on an H200 (`./qx mma6t`, 8B shapes, µs, qgemv's looping form -> 4 warps here), 2 / 4
// tokens: down + residual 43.3 -> 31.1 / 82.6 -> 36.5, O 13.6 -> 12.0 / 22.1 -> 13.8, gate/up +
// SwiGLU 55.6 -> 49.0 / 75.1 -> 62.3, the 49152-row LM head 77.0 -> 76.6 / 115.8 -> 100.2, a
// 1024-row V band 9.7 -> 9.4 / 10.5 -> 10.5.
template <int R, int W, int M>
__device__ __forceinline__ void qmma_q6k_tokens(const uint8_t* __restrict__ w, long long row_bytes,
                                                const __nv_bfloat16* __restrict__ x, void* out, int tokens,
                                                int units, int k, int ld, int mode) {
    constexpr int UNITS = R == 2 ? 8 : 16, SB_BYTES = 210;
    __shared__ float part[W][M][16];
    __shared__ uint4 xslot[W][32 * M];
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const Mma1Lane l;
    const int half = l.p / 2, quarter_l = 16 * (l.p % 2);
    const int unit0 = blockIdx.x * UNITS;
    const int ra = min(unit0 + l.gq, units - 1);
    const int rb = R == 2 ? ra + units : min(unit0 + l.gq + 8, units - 1);
    const uint8_t* wa = w + (size_t)ra * (size_t)row_bytes;
    const uint8_t* wb = w + (size_t)rb * (size_t)row_bytes;
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    // The lane's x pairs (bf16x2 words) in tile T: quarter 2T (on_a) or 2T + 1 (on_b) of its half.
    const int x_word = (128 * half + (l.on_b ? 32 : 0) + quarter_l) / 2;
    float acc_a[M], acc_b[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc_a[m] = acc_b[m] = 0.f;
    for (int sb = warp; sb < k / 256; sb += W) {
#pragma unroll
        for (int m = 0; m < M; m++)
            pf_cp_async16(&xslot[warp][32 * m + lane],
                          x + (size_t)min(m, tokens - 1) * k + (size_t)sb * 256 + 8 * lane, m < tokens);
        pf_cp_async_commit();
        const uint8_t* pa = wa + (size_t)sb * SB_BYTES;
        const uint8_t* pb = wb + (size_t)sb * SB_BYTES;
        uint32_t la[4], ua[4], ha[4], lb[4], ub[4], hb[4], sa[2], sbw[2];
        words_at2<4>(pa + 64 * half + quarter_l, la);
        words_at2<4>(pa + 64 * half + 32 + quarter_l, ua);
        words_at2<4>(pa + 128 + 16 * l.p, ha);
        words_at2<4>(pb + 64 * half + quarter_l, lb);
        words_at2<4>(pb + 64 * half + 32 + quarter_l, ub);
        words_at2<4>(pb + 128 + 16 * l.p, hb);
        words_at2<2>(pa + 192 + 8 * half, sa);
        words_at2<2>(pb + 192 + 8 * half, sbw);
        const float da = half_at(pa + 208), db = half_at(pb + 208);
        pf_cp_async_wait_all();
        __syncwarp();
        const uint32_t* xs = reinterpret_cast<const uint32_t*>(xslot[warp]);
        const unsigned pick = 8u * (unsigned)(l.p % 2);
#pragma unroll
        for (int t = 0; t < 2; t++) {
            float c[M][4], s[M][4];
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int e = 0; e < 4; e++) c[m][e] = s[m][e] = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // Codes of quarters 2t and 2t + 1 at l = L + 4i .. L + 4i + 3, one per byte.
                const uint32_t qa0 = t == 0 ? (la[i] & 0x0F0F0F0Fu) | ((ha[i] << 4) & 0x30303030u)
                                            : ((la[i] >> 4) & 0x0F0F0F0Fu) | (ha[i] & 0x30303030u);
                const uint32_t qa1 = t == 0 ? (ua[i] & 0x0F0F0F0Fu) | ((ha[i] << 2) & 0x30303030u)
                                            : ((ua[i] >> 4) & 0x0F0F0F0Fu) | ((ha[i] >> 2) & 0x30303030u);
                const uint32_t qb0 = t == 0 ? (lb[i] & 0x0F0F0F0Fu) | ((hb[i] << 4) & 0x30303030u)
                                            : ((lb[i] >> 4) & 0x0F0F0F0Fu) | (hb[i] & 0x30303030u);
                const uint32_t qb1 = t == 0 ? (ub[i] & 0x0F0F0F0Fu) | ((hb[i] << 2) & 0x30303030u)
                                            : ((ub[i] >> 4) & 0x0F0F0F0Fu) | ((hb[i] >> 2) & 0x30303030u);
                uint2 xv[M];
#pragma unroll
                for (int m = 0; m < M; m++)
                    xv[m] = *reinterpret_cast<const uint2*>(xs + 128 * m + x_word + 32 * t + 2 * i);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t sel = h == 0 ? l.sel01 : l.sel23;
                    const uint32_t a[4] = {code_pair(qa0, sel), code_pair(qb0, sel), code_pair(qa1, sel),
                                           code_pair(qb1, sel)};
#pragma unroll
                    for (int m = 0; m < M; m++) {
                        const uint32_t xw = h == 0 ? xv[m].x : xv[m].y;
                        qmma_16816(c[m], a, xw & l.mask_a, xw & l.mask_b);
                        qmma_16816(s[m], ones, xw & l.mask_a, xw & l.mask_b);
                    }
                }
            }
            // Quarters 2t + h: scale byte 2(2t + h) + p % 2 of the half's eight (word t).
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const unsigned at = 16u * (unsigned)h + pick;
                const float sca = da * (float)(int8_t)((sa[t] >> at) & 0xFFu);
                const float scb = db * (float)(int8_t)((sbw[t] >> at) & 0xFFu);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    acc_a[m] = fmaf(sca, fmaf(-160.f, s[m][h], c[m][h]), acc_a[m]);
                    acc_b[m] = fmaf(scb, fmaf(-160.f, s[m][2 + h], c[m][2 + h]), acc_b[m]);
                }
            }
        }
        __syncwarp();  // x is read before the next super-block's copy
    }
    qmma1_store<R, W, M>(part, acc_a, acc_b, unit0, units, out, tokens, ld, mode);
}

// Chunk c of a row decoded to bf16, eight values at a time: put(at, word) gets values at .. at + 7
// of the row. Each value is computed as GGML's reference computes it: fl(fl(scale * q) + bias), no
// fused multiply-add, the bias only for types with a minimum.
template <class T, class Put>
__device__ __forceinline__ void decode_chunk(const uint8_t* row, int c, Put put) {
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
            T::template codes8<false>(raw, s, h, q);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float p = __fmul_rn(scale, q[e]);
                v[e] = T::HAS_BIAS ? __fadd_rn(p, bias) : p;
            }
            put(base + s * T::SUB_STRIDE + 8 * h, bf16x8_pack(v));
        }
    }
}

// The 16-byte word a block's tile keeps its logical word v in: the words of eight consecutive
// chunks' same sub-block land in different banks (a chunk is 4 or 8 words), and eight consecutive
// words stay within one 128-byte row.
__device__ __forceinline__ int staged_word(int v) { return v ^ ((v >> 3) & 7); }

constexpr int DEQUANT_THREADS = 256;

// Grid: ceil(rows * chunks / DEQUANT_THREADS) blocks of DEQUANT_THREADS threads; out is [rows, k].
// Each thread decodes one chunk into the block's tile in shared memory; the block then stores the
// tile, which is a contiguous run of out (a block's chunks are consecutive, rows are contiguous in
// out, and a K-quant super-block's four chunks cover its 256 values), in whole 16-byte words by
// consecutive threads: every warp store writes 512 contiguous bytes. (A thread storing its own
// chunk writes 16 bytes per 64-128-byte stride: 4x slower for Q4_K, measured.)
template <class T>
__device__ __forceinline__ void dequant(const uint8_t* __restrict__ w, long long row_bytes, int rows, int k,
                                        __nv_bfloat16* __restrict__ out) {
    __shared__ uint4 tile[DEQUANT_THREADS * T::CHUNK / 8];
    const int chunks = k / T::CHUNK;
    const long long total = (long long)rows * chunks;
    const long long first = (long long)blockIdx.x * DEQUANT_THREADS;
    const long long i = first + threadIdx.x;
    if (i < total) {
        const int r = (int)(i / chunks), c = (int)(i % chunks);
        // Values of row r start at r * k - first * CHUNK in the tile.
        const int row_at = (int)((long long)r * k - first * T::CHUNK);
        decode_chunk<T>(w + (size_t)r * (size_t)row_bytes, c,
                        [&](int at, uint4 word) { tile[staged_word((row_at + at) / 8)] = word; });
    }
    __syncthreads();
    const long long held = total - first < DEQUANT_THREADS ? total - first : DEQUANT_THREADS;
    const int words = (int)(held * T::CHUNK / 8);
    uint4* dst = reinterpret_cast<uint4*>(out + first * T::CHUNK);
    for (int v = threadIdx.x; v < words; v += DEQUANT_THREADS) dst[v] = tile[staged_word(v)];
}

// Grid: n blocks (one per token); out is [n, k]. The table holds rows first.. of the vocabulary
// (all of it, or a tensor-parallel rank's part): an id of another rank's rows gives zeros, an id
// at or past `limit` (the whole vocabulary) NaN.
template <class T>
__device__ __forceinline__ void embed(const uint8_t* __restrict__ w, long long row_bytes, long long rows,
                                      long long first, long long limit, const unsigned* __restrict__ ids, int n,
                                      int k, __nv_bfloat16* __restrict__ out) {
    const int t = blockIdx.x;
    if (t >= n) return;
    __nv_bfloat16* dst = out + (size_t)t * (size_t)k;
    const long long id = (long long)ids[t];
    if (id >= limit || id < first || id - first >= rows) {
        const __nv_bfloat16 fill =
            __ushort_as_bfloat16(id >= limit ? (unsigned short)0x7FC0 : (unsigned short)0);
        for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = fill;
        return;
    }
    for (int c = threadIdx.x; c < k / T::CHUNK; c += blockDim.x)
        decode_chunk<T>(w + (size_t)(id - first) * (size_t)row_bytes, c,
                        [&](int at, uint4 word) { *reinterpret_cast<uint4*>(dst + at) = word; });
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

// One-token products that loop over groups of rows (the LOOP form), for many waves of groups.
#define QGEMV_ROW_LOOP_KERNELS(T)                                                                             \
    extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * TURBO_WARP) qgemv_loop_##T##_m1(               \
        const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,      \
        void* out, int tokens, int units, int k, int ld, int mode) {                                          \
        qgemv<T, 1, 1, false, WarpUnits<1, 1>::value, true, true>(w, row_bytes, x, g, eps, out, tokens, units, k, \
                                                                  ld, mode);                                  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(QGEMV_WARPS * TURBO_WARP) qgemv_norm_loop_##T##_m1(          \
        const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps,      \
        void* out, int tokens, int units, int k, int ld, int mode) {                                          \
        qgemv<T, 1, 1, true, WarpUnits<1, 1>::value, true, true>(w, row_bytes, x, g, eps, out, tokens, units, k, \
                                                                 ld, mode);                                   \
    }

// Every kernel of one type.
#define QUANT_TYPE_KERNELS(T)                                                                                 \
    QGEMV_KERNELS(T, 1)                                                                                       \
    QGEMV_ROW_LOOP_KERNELS(T)                                                                                 \
    QGEMV_KERNELS(T, 2)                                                                                       \
    QGEMV_KERNELS(T, 4)                                                                                       \
    QGEMV_KERNELS(T, 8)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        dequant_##T(const uint8_t* w, long long row_bytes, int rows, int k, __nv_bfloat16* out) {             \
        dequant<T>(w, row_bytes, rows, k, out);                                                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        embed_##T(const uint8_t* w, long long row_bytes, long long rows, long long first, long long limit,    \
                  const unsigned* ids, int n, int k, __nv_bfloat16* out) {                                    \
        embed<T>(w, row_bytes, rows, first, limit, ids, n, k, out);                                           \
    }

// The tensor-core one-token products (Q4_K's and Q6_K's modules), W warps a block. Q4_K: 4 warps, 2
// slots a warp (on an H200 within 1.5% of the best of 4 / 8 warps and 1-4 slots on every 8B shape);
// Q6_K: 8 warps (faster than 4 for the few-block products it is used for).
#define QMMA1_Q4K_WARPS 4
#define QMMA1_Q4K_SLOTS 2
#define QMMA1_Q6K_WARPS 8
// Q6_K steps of 2-6 tokens: 4 warps (with 124-144 registers a thread, 8 warps were slower for 4
// tokens on every shape, and for 2 tokens over many blocks). Steps of 5-8 tokens take one launch
// of M = 6 or 8 (Q4_K 158 / 196 registers, Q6_K 198-222 / 255, no spills on sm_90; Q4_K's slots
// at M = 8 are dynamic shared memory) rather than two that each read the weights.
#define QMMA_Q6K_TOKENS_WARPS 4
#define QMMA1_KERNEL(NAME, W, CALL)                                                                           \
    extern "C" __global__ void __launch_bounds__(W * TURBO_WARP)                                              \
        NAME(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, const __nv_bfloat16* g, float eps, \
             void* out, int units, int k, int mode, NormLink link, RopeKvOut rope) {                          \
        CALL(w, row_bytes, x, g, eps, out, units, k, mode, 1, 0, link, rope);                                 \
    }
// The seven kernels of type T from template F<R, W, [the arguments after W,] NORM, ...>: without
// and with the norm, and the link_ forms that take part in a split norm (NormLink; the others ignore
// it), F's template arguments after NORM being LINKED for them; link_rope_ also puts a QKV
// product's outputs where RopeKvOut says (the others ignore it).
#define QMMA1_KERNELS(T, F, W, LINKED, ...)                                                                           \
    QMMA1_KERNEL(qmma1_##T, W, (F<1, W, __VA_ARGS__ false>))                                                  \
    QMMA1_KERNEL(qmma1_swiglu_##T, W, (F<2, W, __VA_ARGS__ false>))                                           \
    QMMA1_KERNEL(qmma1_norm_##T, W, (F<1, W, __VA_ARGS__ true>))                                              \
    QMMA1_KERNEL(qmma1_norm_swiglu_##T, W, (F<2, W, __VA_ARGS__ true>))                                       \
    QMMA1_KERNEL(qmma1_link_##T, W, (F<1, W, __VA_ARGS__ false, LINKED>))                                    \
    QMMA1_KERNEL(qmma1_link_swiglu_##T, W, (F<2, W, __VA_ARGS__ false, LINKED>))                             \
    QMMA1_KERNEL(qmma1_link_rope_##T, W, (F<1, W, __VA_ARGS__ false, LINKED, true>))

// Tensor-core products for steps of up to M tokens (x normalized by the caller), W warps a block:
// the one-token kernels' layouts, each code decoded once for every token. F(R, M) names the
// template instance.
#define QMMA_TOKENS_KERNEL(NAME, W, CALL)                                                                     \
    extern "C" __global__ void __launch_bounds__(W * TURBO_WARP)                                              \
        NAME(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x, void* out, int tokens, int units,  \
             int k, int ld, int mode) {                                                                       \
        CALL;                                                                                                 \
    }
#define QMMA_Q4K_TOKENS(R, M)                                                                                 \
    qmma1_q4k<R, QMMA1_Q4K_WARPS, QMMA1_Q4K_SLOTS, false, M>(w, row_bytes, x, nullptr, 0.f, out, units, k, mode, \
                                                             tokens, ld)
#define QMMA_Q6K_TOKENS(R, M) qmma_q6k_tokens<R, QMMA_Q6K_TOKENS_WARPS, M>(w, row_bytes, x, out, tokens, units, k, ld, mode)
#define QMMA_TOKENS_KERNELS(T, W, F, M)                                                                       \
    QMMA_TOKENS_KERNEL(qmma_##T##_m##M, W, F(1, M))                                                           \
    QMMA_TOKENS_KERNEL(qmma_swiglu_##T##_m##M, W, F(2, M))

// The indirection expands QUANT_TYPE before it is pasted into the kernels' names.
#define QUANT_KERNELS_OF(T) QUANT_TYPE_KERNELS(T)
#define QUANT_PASTE(a, b) a##b
#define QUANT_IS_Q4_K(T) QUANT_PASTE(QUANT_IS_Q4_K_, T)
#define QUANT_IS_Q4_K_Q4_K 1
#define QUANT_IS_Q6_K(T) QUANT_PASTE(QUANT_IS_Q6_K_, T)
#define QUANT_IS_Q6_K_Q6_K 1
#ifdef QUANT_TYPE
QUANT_KERNELS_OF(QUANT_TYPE)
#if QUANT_IS_Q4_K(QUANT_TYPE)
#define QMMA1_Q4K_LINKED 1, true
QMMA1_KERNELS(Q4_K, qmma1_q4k, QMMA1_Q4K_WARPS, QMMA1_Q4K_LINKED, QMMA1_Q4K_SLOTS, )
QMMA_TOKENS_KERNELS(Q4_K, QMMA1_Q4K_WARPS, QMMA_Q4K_TOKENS, 2)
QMMA_TOKENS_KERNELS(Q4_K, QMMA1_Q4K_WARPS, QMMA_Q4K_TOKENS, 4)
QMMA_TOKENS_KERNELS(Q4_K, QMMA1_Q4K_WARPS, QMMA_Q4K_TOKENS, 6)
QMMA_TOKENS_KERNELS(Q4_K, QMMA1_Q4K_WARPS, QMMA_Q4K_TOKENS, 8)
#endif
#if QUANT_IS_Q6_K(QUANT_TYPE)
QMMA1_KERNELS(Q6_K, qmma1_q6k, QMMA1_Q6K_WARPS, true, )
QMMA_TOKENS_KERNELS(Q6_K, QMMA_Q6K_TOKENS_WARPS, QMMA_Q6K_TOKENS, 2)
QMMA_TOKENS_KERNELS(Q6_K, QMMA_Q6K_TOKENS_WARPS, QMMA_Q6K_TOKENS, 4)
QMMA_TOKENS_KERNELS(Q6_K, QMMA_Q6K_TOKENS_WARPS, QMMA_Q6K_TOKENS, 6)
QMMA_TOKENS_KERNELS(Q6_K, QMMA_Q6K_TOKENS_WARPS, QMMA_Q6K_TOKENS, 8)
#endif
#endif
