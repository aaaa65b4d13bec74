// Shared helpers for Turbo's kernels. Included by every kernels/*.cu (and spliced in for NVRTC).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define TURBO_WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / TURBO_WARP;
    v = lane < warps ? partial[lane] : 0.f;
    return warp_sum(v);
}

// 8 bf16 values in one 16-byte vector, unpacked to / packed from f32.
__device__ __forceinline__ void bf16x8_unpack(uint4 v, float f[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 bf16x8_pack(const float f[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// RoPE's rotation of one interleaved pair (a, b) by the angle pos * f:
//   (a, b) -> (a cos - b sin, a sin + b cos).
// The angle p * f is carried exactly as hi + lo (hi = fl(p * f), lo = fma(p, f, -hi)), so large
// positions lose no accuracy to the f32 product: sincosf(hi) (full range reduction, not the fast
// intrinsic) is corrected to first order in lo (|lo| <= ulp(hi) / 2, so the error is ~lo^2 / 2).
__device__ __forceinline__ float2 rope_rotate(float2 ab, float pos, float f) {
    const float hi = pos * f;
    const float lo = fmaf(pos, f, -hi);
    float s, c;
    sincosf(hi, &s, &c);
    const float sn = fmaf(lo, c, s);
    const float cs = fmaf(-lo, s, c);
    return make_float2(ab.x * cs - ab.y * sn, ab.x * sn + ab.y * cs);
}

// -- PTX primitives of the mma.sync kernels (sm_80+): prefill attention, prompt KV scores --
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

// Element offset of 16-byte chunk c of row r in a swizzled shared tile with rows of HD bf16.
template <int HD>
__device__ __forceinline__ int pf_swz(int r, int c) {
    return r * HD + ((c ^ (r & 7)) << 3);
}

// ---- KV eviction noise, shared by the scoring kernels (scores.cu) and the decode attention
// kernel that scores its rows as it goes (attention.cu).

__device__ __forceinline__ unsigned long long score_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// turbo_keyformer::gumbel(seed, step, layer, head, key): -ln(-ln(u)), u in (0, 1) from a hash
// of the counter (bit for bit), then the two logs. score_gumbel_base hashes (seed) and
// (step, layer) once per query row with splitmix64; score_gumbel_at the row's hash with key and
// head per logit, in two 32-bit rounds (lowbias32: two multiplies each).
//
// The logs are the hardware's fast ones (__logf: one MUFU.LG2 each, against ~20 instructions
// for logf), as the noise is drawn for every (row, head, key) and dominated the scoring time.
// -ln(u) for u near 1 would lose most of its digits to __logf's absolute error (2^-21.4), so
// there it is the series of -ln(1 - t) in t = 1 - u (exact): t + t^2/2 + t^3/3 + t^4/4, whose
// relative error is below t^4/5 < 1.2e-8 for t < 2^-6. Elsewhere |ln u| >= 2^-6 and __logf's
// error is below 2.3e-5 of it, so the draw differs from the CPU's (libm logs in f32) by at most
// ~2.5e-5 absolute: far below the noise's spread (pi / sqrt 6), and rounding-sized in the
// scores the CPU and GPU tests compare.
#define SCORE_GAMMA 0x9E3779B97F4A7C15ull
__device__ __forceinline__ unsigned score_mix32(unsigned x) {
    x = (x ^ (x >> 16)) * 0x7FEB352Du;
    x = (x ^ (x >> 15)) * 0x846CA68Bu;
    return x ^ (x >> 16);
}

__device__ __forceinline__ unsigned long long score_gumbel_base(unsigned long long seed, unsigned step,
                                                                unsigned layer) {
    const unsigned long long h = score_mix(seed ^ SCORE_GAMMA);
    return score_mix(h ^ (((unsigned long long)step << 32) | (unsigned long long)layer) ^ SCORE_GAMMA);
}

__device__ __forceinline__ float score_gumbel_at(unsigned long long base, unsigned head, unsigned key) {
    const unsigned x = score_mix32(score_mix32((unsigned)base ^ key) ^ (unsigned)(base >> 32) ^ head);
    const unsigned m = x >> 9;  // u = (2m + 1) 2^-24
    const float t = __uint2float_rn(0xFFFFFFu - 2u * m) * 0x1p-24f;  // 1 - u, exact
    float e;  // -ln(u)
    if (t < 0x1p-6f) {
        e = t * fmaf(t, fmaf(t, fmaf(t, 0.25f, 1.f / 3.f), 0.5f), 1.f);
    } else {
        e = -__logf(__uint2float_rn(2u * m + 1u) * 0x1p-24f);
    }
    return -__logf(e);
}

// ------------------------------------------------------------------------------------------------
// Quantized KV cache (turbo_attention::kv_quant): 8-bit codes with one f32 scale per (token, KV
// head) row. INT8: scale = max|x| / 127, code = round-to-nearest-even(x / scale) in -127..127.
// FP8: E4M3 with scale = max|x| / 448, code nearest to x / scale (ties to even, saturating).
// A row of zeros has scale 0 and codes 0. Every step is one IEEE f32 operation, as on the CPU,
// so both write the same codes for the same row.
//
// A quantized layer range (keys or values) is a sequence of blocks of kvq_block_bytes each: the
// block's codes [slot][kv head][head_dim] u8, then its scales [kv head][slot] f32 (a KV head's
// scales of consecutive keys side by side, as the attention kernels read them). One range per
// layer and kind, as for bf16, so block tables, mapping on demand and CUDA graphs are unchanged;
// a quantized cache needs block_size · n_kv_heads to be a multiple of 4 (16-byte aligned rows).
#define KV_BF16 0
#define KV_INT8 1
#define KV_FP8 2

__device__ __forceinline__ size_t kvq_block_bytes(int block_size, int n_kv_heads, int head_dim) {
    return (size_t)block_size * (size_t)n_kv_heads * (size_t)(head_dim + 4);
}
// Byte offset of the codes of (block, slot, KV head) in a layer range.
__device__ __forceinline__ size_t kvq_code_at(uint32_t block, uint32_t slot, int kvh, int block_size, int n_kv_heads,
                                              int head_dim) {
    return (size_t)block * kvq_block_bytes(block_size, n_kv_heads, head_dim) +
           ((size_t)slot * (size_t)n_kv_heads + (size_t)kvh) * (size_t)head_dim;
}
// Byte offset of the scale of (block, slot, KV head) in a layer range.
__device__ __forceinline__ size_t kvq_scale_at(uint32_t block, uint32_t slot, int kvh, int block_size, int n_kv_heads,
                                               int head_dim) {
    return (size_t)block * kvq_block_bytes(block_size, n_kv_heads, head_dim) +
           (size_t)block_size * (size_t)n_kv_heads * (size_t)head_dim +
           4 * ((size_t)kvh * (size_t)block_size + (size_t)slot);
}

// The code magnitude max|x| maps to.
template <int KIND>
__device__ __forceinline__ constexpr float kvq_code_max() {
    return KIND == KV_INT8 ? 127.f : 448.f;
}
// What kvq_decode4's values are multiplied by, with the scale, to give the stored value: the FP8
// decoder yields E4M3 values times 2^-8 (exactly), the INT8 one the codes themselves.
template <int KIND>
__device__ __forceinline__ constexpr float kvq_unit() {
    return KIND == KV_INT8 ? 1.f : 256.f;
}

// INT8 code of y = x / scale: round to nearest, ties to even, clamped to -127..127.
__device__ __forceinline__ uint32_t kvq_int8_code(float y) {
    return (uint32_t)(uint8_t)(signed char)max(-127, min(127, __float2int_rn(y)));
}

// E4M3 code nearest to y (ties to the even code), finite values past 448 saturating to ±448 and
// NaN to NaN: kv_quant::e4m3_code, step for step.
__device__ __forceinline__ uint32_t kvq_e4m3_code(float y) {
    if (isnan(y)) return 0x7Fu;
    const uint32_t sign = (__float_as_uint(y) >> 24) & 0x80u;
    const float a = fabsf(y);
    if (a >= 448.f) return sign | 0x7Eu;
    const uint32_t bits = __float_as_uint(a);
    const int e = (int)(bits >> 23) - 127;
    uint32_t code;
    if (e < -6) {
        code = (uint32_t)__float2int_rn(a * 512.f);  // subnormal: multiples of 2^-9
    } else {
        const uint32_t mant = bits & 0x7FFFFFu, keep = mant >> 20, rest = mant & 0xFFFFFu;
        const uint32_t up = (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) ? 1u : 0u;
        code = ((uint32_t)(e + 7) << 3) + keep + up;
    }
    return sign | min(code, 0x7Eu);
}

// The value of y's E4M3 code for finite y: kv_quant::e4m3_value(e4m3_code(y)) computed on the f32
// bits (the mantissa rounded to 3 bits, ties to even, a carry moving into the exponent; below
// 2^-6 the multiples of 2^-9; saturating at 448), without forming the code.
__device__ __forceinline__ float kvq_e4m3_round(float y) {
    const float a = fabsf(y);
    const uint32_t bits = __float_as_uint(a);
    const float normal = __uint_as_float((bits + 0x7FFFFu + ((bits >> 20) & 1u)) & ~0xFFFFFu);
    const float mag = fminf(a < 0x1p-6f ? rintf(a * 512.f) * 0x1p-9f : normal, 448.f);
    return copysignf(mag, y);
}

template <int KIND>
__device__ __forceinline__ uint32_t kvq_code(float y) {
    if constexpr (KIND == KV_INT8) {
        return kvq_int8_code(y);
    } else {
        return kvq_e4m3_code(y);
    }
}

// Four codes (bytes of w, lowest first) to exact f32 values: INT8 codes as integers, FP8 codes as
// their E4M3 values times 2^-8 (through f16 bit patterns, exact for subnormals too).
template <int KIND>
__device__ __forceinline__ void kvq_decode4(uint32_t w, float (&f)[4]) {
    if constexpr (KIND == KV_INT8) {
        // 2^23 + (code + 128) as an f32, minus 2^23 + 128.
        const uint32_t x = w ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; i++) f[i] = __uint_as_float(__byte_perm(x, 0x4B00u, 0x5440u + i)) - 8388736.f;
    } else {
        // Byte b at bits 15..8 of a half: sign in place, exponent and mantissa shifted down one
        // give the f16 of E4M3 value · 2^-8 (f16 has 5 exponent bits, bias 15; E4M3 4, bias 7).
        const uint32_t lo = __byte_perm(w, 0u, 0x1404u), hi = __byte_perm(w, 0u, 0x3424u);
        const uint32_t hlo = (lo & 0x80008000u) | ((lo >> 1) & 0x3F803F80u);
        const uint32_t hhi = (hi & 0x80008000u) | ((hi >> 1) & 0x3F803F80u);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&hlo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hhi));
        f[0] = a.x;
        f[1] = a.y;
        f[2] = b.x;
        f[3] = b.y;
    }
}

// The factor u such that kvq_decode4_bf16x2's pairs are the codes' values times u^-2 (INT8: 1;
// FP8: 2^60, the pairs being E4M3 values times 2^-120). A reader multiplies by u twice (e.g. once
// into a scale, once into a result) so that no product of a scale with u^2 overflows f32.
template <int KIND>
__device__ __forceinline__ constexpr float kvq_bf16_half_unit() {
    return KIND == KV_INT8 ? 1.f : 0x1p60f;
}

// Four codes (bytes of w) to two bf16 pairs (bytes 0, 1 in lo; 2, 3 in hi), exactly, without f32:
// - INT8: the code itself: bf16 128 + (b & 0x7f) minus 128 or 256 by the sign bit, one bf16x2
//   subtraction a pair;
// - FP8: the E4M3 value times 2^-120: E4M3's exponent and mantissa bits placed under bf16's
//   (bias 7 read as bias 127), sign on top; E4M3 subnormals land on bf16 subnormals of the same
//   scaled value. (The NaN codes 0x7F/0xFF, which the writers never produce for a finite row,
//   read as ±480.)
// See kvq_bf16_half_unit for the factor.
template <int KIND>
__device__ __forceinline__ void kvq_decode4_bf16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    if constexpr (KIND == KV_INT8) {
        const uint32_t mag = w & 0x7f7f7f7fu, sgn = w & 0x80808080u;
        const uint32_t a_lo = __byte_perm(mag, 0x43u, 0x4140u), a_hi = __byte_perm(mag, 0x43u, 0x4342u);
        const uint32_t b_lo = __byte_perm(sgn, 0x43u, 0x4140u), b_hi = __byte_perm(sgn, 0x43u, 0x4342u);
        const __nv_bfloat162 l = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a_lo),
                                         *reinterpret_cast<const __nv_bfloat162*>(&b_lo));
        const __nv_bfloat162 h = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a_hi),
                                         *reinterpret_cast<const __nv_bfloat162*>(&b_hi));
        lo = *reinterpret_cast<const uint32_t*>(&l);
        hi = *reinterpret_cast<const uint32_t*>(&h);
    } else {
        // Each byte as the low byte of a 16-bit half, then moved into place.
        const uint32_t a = __byte_perm(w, 0u, 0x4140u), b = __byte_perm(w, 0u, 0x4342u);
        lo = ((a & 0x007f007fu) << 4) | ((a & 0x00800080u) << 8);
        hi = ((b & 0x007f007fu) << 4) | ((b & 0x00800080u) << 8);
    }
}

// ---- Collectives through peer-mapped memory (comm.cu; gemv.cu's fused all-reduce) ----
// Each rank's signals hold COMM_MAX_BLOCKS x COMM_MAX_RANKS arrival epochs, then the rank's epoch
// (calls made so far) and a count of the blocks of the current call that are done; `table` names
// every rank's buffers (see comm.cu).
#define COMM_MAX_RANKS 8
#define COMM_MAX_BLOCKS 256

// A peer's 16 bytes, fetched again rather than from a cache line an earlier call left behind.
__device__ __forceinline__ uint4 comm_load_fresh(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// One collective call of a kernel: this rank's signals (peers' arrival epochs), where its epoch
// lives (followed by the count of the call's blocks done), and the call's epoch, one past the
// last call's, which the previous kernel on this stream wrote in comm_end_call.
struct CommCall {
    unsigned* signals;
    unsigned* own_epoch;
    unsigned epoch;
};

__device__ __forceinline__ CommCall comm_begin_call(const unsigned long long* table, int rank) {
    CommCall call;
    call.signals = reinterpret_cast<unsigned*>(table[COMM_MAX_RANKS + rank]);
    call.own_epoch = call.signals + COMM_MAX_BLOCKS * COMM_MAX_RANKS;
    call.epoch = *reinterpret_cast<volatile unsigned*>(call.own_epoch) + 1;
    return call;
}

// The last block done ends the call: the next call (a later kernel) reads the new epoch.
__device__ __forceinline__ void comm_end_call(const CommCall& call) {
    unsigned* blocks_done = call.own_epoch + 1;
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
        *blocks_done = 0;
        *call.own_epoch = call.epoch;
    }
}

// One 16-byte line of a rank's inbox: two words of a peer's part, each beside the call's epoch
// as its flag (NCCL's "LL" protocol). Each 8-byte half {word, flag} of the store lands whole, so
// a line whose two flags equal the call's epoch holds that call's data: no barrier and no fence
// stand between a peer's stores and this rank's sums, only the link's one-way latency. Flags are
// compared for equality: a line is mistaken for the current call's only if it was last written
// exactly 2^32 calls before (or never, at epoch 0) and not since; lines a call uses are rewritten
// by every call of its size.
__device__ __forceinline__ void comm_push_line(uint4* dst, unsigned a, unsigned b, unsigned epoch) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(a),
                 "r"(epoch), "r"(b), "r"(epoch)
                 : "memory");
}

// Waits for the line `src` of the call `epoch` and returns its two words in .x and .y.
__device__ __forceinline__ uint2 comm_pull_line(const uint4* src, unsigned epoch,
                                                const volatile int* abort_flag) {
    uint4 v = comm_load_fresh(src);
    for (unsigned spins = 0; v.y != epoch || v.w != epoch; spins++) {
        if ((spins & 1023u) == 1023u && *abort_flag) break;
        v = comm_load_fresh(src);
    }
    return make_uint2(v.x, v.z);
}

// One line (four consecutive outputs, `element` = 4 · `line` of the stream) of a decode product's
// fused all-reduce: this rank's part `mine` (already bf16 values) goes to every peer's inbox
// (table[2 · COMM_MAX_RANKS + r], half `epoch & 1` of it, this rank's slot), every rank's part of
// the line is taken (this rank's from `mine`) and summed in rank order in f32, and the sum,
// rounded once to bf16, is stored at `out` (gemv.cu's and gemv_sm90a.cu's all-reduce products).
__device__ __forceinline__ void comm_all_reduce_line(const unsigned long long* table, int rank, int world,
                                                     long long slot_lines, unsigned epoch,
                                                     const volatile int* abort_flag, long long line,
                                                     const float* mine, __nv_bfloat16* out) {
    const long long half = (long long)(epoch & 1u) * world * slot_lines;
    const __nv_bfloat162 lo = __floats2bfloat162_rn(mine[0], mine[1]);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(mine[2], mine[3]);
    const unsigned a = *reinterpret_cast<const unsigned*>(&lo), b = *reinterpret_cast<const unsigned*>(&hi);
    for (int r = 0; r < world; r++) {
        if (r == rank) continue;
        uint4* slot = reinterpret_cast<uint4*>(table[2 * COMM_MAX_RANKS + r]) + half + (long long)rank * slot_lines;
        comm_push_line(slot + line, a, b, epoch);
    }
    const uint4* inbox = reinterpret_cast<const uint4*>(table[2 * COMM_MAX_RANKS + rank]) + half;
    float acc[4];
    for (int r = 0; r < world; r++) {
        float v[4];
        if (r == rank) {
#pragma unroll
            for (int e = 0; e < 4; e++) v[e] = mine[e];
        } else {
            const uint2 got = comm_pull_line(inbox + (long long)r * slot_lines + line, epoch, abort_flag);
            const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&got.x));
            const float2 q = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&got.y));
            v[0] = p.x, v[1] = p.y, v[2] = q.x, v[3] = q.y;
        }
#pragma unroll
        for (int e = 0; e < 4; e++) acc[e] = r == 0 ? v[e] : acc[e] + v[e];
    }
    const __nv_bfloat162 s0 = __floats2bfloat162_rn(acc[0], acc[1]);
    const __nv_bfloat162 s1 = __floats2bfloat162_rn(acc[2], acc[3]);
    uint2 sum;
    sum.x = *reinterpret_cast<const unsigned*>(&s0);
    sum.y = *reinterpret_cast<const unsigned*>(&s1);
    *reinterpret_cast<uint2*>(out) = sum;
}

// Waits until at most N of this thread's newest cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void pf_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------------------------
// Decode products (gemv.cu, and gemv_sm90a.cu's ring-fed form): the epilogues, shared so that
// both kernels give the same bits.
enum : int { GEMV_STORE_BF16 = 0, GEMV_STORE_F32 = 1, GEMV_ADD_RESIDUAL = 2 };

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Stores unit `unit`'s products of M tokens (`out` is [M, units]): with R == 2 silu(gate) · up,
// each rounded to bf16 first as the unfused path stores them; else as `mode` says.
template <int M, int R>
__device__ __forceinline__ void gemv_store(const float (&dot)[M][R], void* out, int units, int unit, int mode) {
#pragma unroll
    for (int m = 0; m < M; m++) {
        const size_t at = (size_t)m * units + unit;
        if (R == 2) {
            const float gate = round_bf16(dot[m][0]);
            const float up = round_bf16(dot[m][R - 1]);
            static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(gate / (1.f + __expf(-gate)) * up);
        } else {
            const float v = dot[m][0];
            if (mode == GEMV_STORE_F32) {
                static_cast<float*>(out)[at] = v;
            } else {
                __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
                o[at] = __float2bfloat16_rn(mode == GEMV_ADD_RESIDUAL ? __bfloat162float(o[at]) + v : v);
            }
        }
    }
}

// The fused QKV product's outputs for RoPE pair `unit` (rows 2 unit and 2 unit + 1 of [W_q; W_k;
// W_v]): each product rounded to bf16 as a stored QKV row would be, q and k pairs rotated at the
// token's position as qkv_rope_kv rotates them; q to q ([M, q_cols]), k and v to slot slots[m] of
// the paged caches (kv_cols per slot; a slot >= cache_slots is skipped).
struct GemvQkvRope {
    __nv_bfloat16* q;
    __nv_bfloat16* k_cache;
    __nv_bfloat16* v_cache;
    const unsigned* positions;
    const unsigned* slots;
    const float* inv_freq;
    int q_cols, kv_cols, head_dim;
    long long cache_slots;
};

template <int M>
__device__ __forceinline__ void gemv_qkv_rope_store(const float (&dot)[M][2], const GemvQkvRope& o, int unit) {
    const int qp = o.q_cols / 2, kp = o.kv_cols / 2;
    const int half = o.head_dim / 2;
#pragma unroll
    for (int m = 0; m < M; m++) {
        float2 pair = make_float2(round_bf16(dot[m][0]), round_bf16(dot[m][1]));
        if (unit < qp) {
            pair = rope_rotate(pair, (float)o.positions[m], o.inv_freq[unit % half]);
            reinterpret_cast<__nv_bfloat162*>(o.q + (size_t)m * o.q_cols)[unit] = __floats2bfloat162_rn(pair.x, pair.y);
            continue;
        }
        const unsigned slot = o.slots[m];
        if ((long long)slot >= o.cache_slots) continue;
        if (unit < qp + kp) {
            pair = rope_rotate(pair, (float)o.positions[m], o.inv_freq[(unit - qp) % half]);
            reinterpret_cast<__nv_bfloat162*>(o.k_cache + (size_t)slot * o.kv_cols)[unit - qp] =
                __floats2bfloat162_rn(pair.x, pair.y);
        } else {
            reinterpret_cast<__nv_bfloat162*>(o.v_cache + (size_t)slot * o.kv_cols)[unit - qp - kp] =
                __floats2bfloat162_rn(pair.x, pair.y);
        }
    }
}

// The leading arguments of every prefill and cascade-prefix kernel (attention.cu's mma.sync
// kernels, attention_sm90a.cu's warpgroup ones): the host launches them all alike.
#define ATTN_PREFILL_ARGS                                                                              \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ k_cache,                  \
        const __nv_bfloat16 *__restrict__ v_cache, const uint32_t *__restrict__ tables,              \
        const uint32_t *__restrict__ seq_table_start, const uint32_t *__restrict__ items, int n_heads, \
        int group, int n_kv_heads, int block_size, int block_shift, float scale
// The cascade-prefix kernels' remaining arguments.
#define ATTN_SHARED_ARGS                                                                                  \
    const uint32_t *__restrict__ shared_tokens, const uint32_t *__restrict__ token_state,               \
        float *__restrict__ part_o, float *__restrict__ part_lse
