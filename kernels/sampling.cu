// sampling kernels.
#include "common.cuh"

#define ARGMAX_NONE 0xffffffffu
// What a row with no logit above -inf samples (turbo_core::sampling::NO_FINITE_LOGIT): no token.
#define SAMPLE_NO_TOKEN 0xfffffffeu

// Whether candidate (v, i) beats the current best (bv, bi): a larger value, or an equal value at
// a lower index; ARGMAX_NONE marks "no candidate". NaN is mapped to -inf before it gets here, so
// this is a strict total order and every reduction order gives the same winner.
__device__ __forceinline__ bool argmax_better(float v, unsigned i, float bv, unsigned bi) {
    return i != ARGMAX_NONE && (bi == ARGMAX_NONE || v > bv || (v == bv && i < bi));
}

__device__ __forceinline__ void argmax_take(float v, unsigned i, float& bv, unsigned& bi) {
    v = isnan(v) ? -INFINITY : v;
    if (argmax_better(v, i, bv, bi)) {
        bv = v;
        bi = i;
    }
}

// Warp-wide reduction of (bv, bi): every lane ends with the warp's best.
__device__ __forceinline__ void argmax_warp(float& bv, unsigned& bi) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// The block's best (bv, bi), given to every thread (blockDim.x a multiple of 32, at most 1024).
// The order is strict and total, so the winner does not depend on the reduction's order.
__device__ void block_argmax(float& bv, unsigned& bi) {
    __shared__ float sv[32];
    __shared__ unsigned si[32];
    argmax_warp(bv, bi);
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    const int warps = blockDim.x / TURBO_WARP;
    for (int w = 0; w < warps; w++) {
        if (argmax_better(sv[w], si[w], bv, bi)) {
            bv = sv[w];
            bi = si[w];
        }
    }
    __syncthreads();
}

// Block-wide reduction of (bv, bi); the result is written to out[row] by thread 0, or
// SAMPLE_NO_TOKEN when no value is above -inf.
__device__ __forceinline__ void argmax_finish(float bv, unsigned bi, unsigned* out, int row) {
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[row] = bi == ARGMAX_NONE || bv == -INFINITY ? SAMPLE_NO_TOKEN : bi;
}

// out[r] = the lowest index of the largest value of row r of logits ([rows, cols], cols >= 1);
// NaN counts as -inf; SAMPLE_NO_TOKEN for a row with nothing above -inf. One block per row (blockDim.x a multiple of 32, at most 1024); 16-byte loads
// when cols % 8 == 0 and the buffer is 16-byte aligned.
extern "C" __global__ void __launch_bounds__(1024)
argmax_bf16(const __nv_bfloat16* logits, int rows, int cols, unsigned* out) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const __nv_bfloat16* x = logits + (size_t)row * (size_t)cols;
    float bv = -INFINITY;
    unsigned bi = ARGMAX_NONE;
    if ((cols % 8) == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
            const uint4 v = xv[c];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 t = __bfloat1622float2(h[k]);
                argmax_take(t.x, (unsigned)(c * 8 + 2 * k), bv, bi);
                argmax_take(t.y, (unsigned)(c * 8 + 2 * k + 1), bv, bi);
            }
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) argmax_take(__bfloat162float(x[c]), (unsigned)c, bv, bi);
    }
    argmax_finish(bv, bi, out, row);
}

// As argmax_bf16, for f32 logits (16-byte loads when cols % 4 == 0).
extern "C" __global__ void __launch_bounds__(1024)
argmax_f32(const float* logits, int rows, int cols, unsigned* out) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* x = logits + (size_t)row * (size_t)cols;
    float bv = -INFINITY;
    unsigned bi = ARGMAX_NONE;
    if ((cols % 4) == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 v = xv[c];
            argmax_take(v.x, (unsigned)(c * 4), bv, bi);
            argmax_take(v.y, (unsigned)(c * 4 + 1), bv, bi);
            argmax_take(v.z, (unsigned)(c * 4 + 2), bv, bi);
            argmax_take(v.w, (unsigned)(c * 4 + 3), bv, bi);
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) argmax_take(x[c], (unsigned)c, bv, bi);
    }
    argmax_finish(bv, bi, out, row);
}

// ---------------------------------------------------------------------------------------------
// Sampling: repetition penalty, temperature, top-k, top-p, min-p and the draw, exactly as
// turbo_core::sampling::sample_row defines them, on f32 logits.
//
// One block of SAMPLE_THREADS threads per row. Tokens are compared through an order-preserving
// u32 key of their logit (NaN keyed as -inf), so the ranking is (key desc, index asc). Weights
// are w = expf((l - max) / T) in f32, as the definition has them, then summed as u64 fixed point
// (w · 2^40, rounded): integer sums are exact in any order, so every total, threshold and draw is
// the same run to run, and the rounding (at most 2^-41 a token) is far below the f32 error the
// definition allows between backends.
//
// Paths, chosen per row (the choice is block-uniform); pass 1 (argmax, max, finite count, each
// thread's largest key) always runs:
// * greedy (T == 0): pass 1 is all.
// * top-k with 0 < k <= SAMPLE_THREADS: the k-th largest of the threads' maxima (to 24 bits, by
//   radix select over those keys) bounds the top-k threshold from below; one more pass
//   gathers the tokens at or above it (usually not many more than k) into shared memory, where
//   the rest happens: a bitonic sort by rank gives the top k, a scan in rank order top-p, a sort
//   by index and a scan the draw.
// * otherwise (no top-k, a larger k, or too many tokens gathered): top-k by radix select over
//   the row (12/12/8-bit digits, histograms of counts; ties at the threshold cut at the n-th equal
//   token in index order). Top-p: a histogram of weights over the distance to the max (below),
//   then one pass gathers the bin holding the goal, to cut it in shared memory, and sums the
//   kept tokens above it by segment (falling back to radix select when that bin is too full).
//   The draw: each warp sums a contiguous segment of the row, then the one segment holding the
//   target is split among all threads and scanned.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / TURBO_WARP)
// Candidates the top-k path can gather into shared memory, and each thread's share of them.
#define SAMPLE_CAP (2 * SAMPLE_THREADS)
#define SAMPLE_IPT (SAMPLE_CAP / SAMPLE_THREADS)
// Shared memory of the radix histograms (4096 bins of two u32 halves), or of the gathered
// candidates and their weights, in u64 words.
#define SAMPLE_SMEM_WORDS (2 * SAMPLE_CAP > 4096 ? 2 * SAMPLE_CAP : 4096)
// sample_key(-inf): every finite logit's key is larger.
#define SAMPLE_KEY_NEG_INF 0x007fffffu
// A weight of 1 (the largest there is) in fixed point.
#define SAMPLE_FIXED_ONE 1099511627776.0f

typedef unsigned long long sample_u64;

// Order-preserving key of a logit: a > b (as floats, -0 < +0 as total_cmp) iff key(a) > key(b).
__device__ __forceinline__ unsigned sample_key(float v) {
    const unsigned u = __float_as_uint(v);
    if (isnan(v)) return SAMPLE_KEY_NEG_INF;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float sample_logit(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Clamped to [0, 1] (NaN to 0), so that no sum can overflow whatever the parameters.
__device__ __forceinline__ sample_u64 sample_fixed(float w) {
    w = w >= 0.f ? fminf(w, 1.f) : 0.f;
    return __float2ull_rn(w * SAMPLE_FIXED_ONE);
}

struct SampleWeights {
    float max, temperature, inv_temperature;

    // The definition's weight (the accurate expf: __expf would differ from the CPU by far more).
    __device__ __forceinline__ float operator()(float l) const { return expf((l - max) / temperature); }

    // The weight in fixed point. Tokens more than 30 temperatures below the max round to 0
    // (e^-30 · 2^40 < 0.5), so their exp is skipped.
    __device__ __forceinline__ sample_u64 fixed(float l) const {
        if ((l - max) * inv_temperature < -30.f) return 0;
        return sample_fixed((*this)(l));
    }
};

// Runs f(logit, index) over the row in an unspecified order, with 16-byte loads when the row
// allows them and four loads in flight a thread: one block reading a row alone is latency-bound.
template <typename F>
__device__ __forceinline__ void sample_for_each(const float* x, int vocab, F f) {
    int i = threadIdx.x;
    if ((vocab & 3) == 0 && aligned16(x)) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        const int n4 = vocab / 4;
        for (; i + 3 * SAMPLE_THREADS < n4; i += 4 * SAMPLE_THREADS) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = xv[i + u * SAMPLE_THREADS];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned j = 4 * (unsigned)(i + u * SAMPLE_THREADS);
                f(v[u].x, j);
                f(v[u].y, j + 1);
                f(v[u].z, j + 2);
                f(v[u].w, j + 3);
            }
        }
        for (; i < n4; i += SAMPLE_THREADS) {
            const float4 v = xv[i];
            f(v.x, 4 * (unsigned)i);
            f(v.y, 4 * (unsigned)i + 1);
            f(v.z, 4 * (unsigned)i + 2);
            f(v.w, 4 * (unsigned)i + 3);
        }
        return;
    }
    for (; i + 3 * SAMPLE_THREADS < vocab; i += 4 * SAMPLE_THREADS) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = x[i + u * SAMPLE_THREADS];
#pragma unroll
        for (int u = 0; u < 4; u++) f(v[u], (unsigned)(i + u * SAMPLE_THREADS));
    }
    for (; i < vocab; i += SAMPLE_THREADS) f(x[i], (unsigned)i);
}

// Runs f(logit, index) over x[s0, s1) with the calling warp's lanes (s0, s1 multiples of 4 when
// vec: then 16-byte loads, two in flight a lane).
template <typename F>
__device__ __forceinline__ void sample_for_segment(const float* x, int s0, int s1, bool vec, F f) {
    const int lane = threadIdx.x % TURBO_WARP;
    if (vec) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        const int e = s1 / 4;
        int i = s0 / 4 + lane;
        for (; i + TURBO_WARP < e; i += 2 * TURBO_WARP) {
            const float4 a = xv[i], b = xv[i + TURBO_WARP];
            const unsigned j = 4 * (unsigned)i, k = j + 4 * TURBO_WARP;
            f(a.x, j);
            f(a.y, j + 1);
            f(a.z, j + 2);
            f(a.w, j + 3);
            f(b.x, k);
            f(b.y, k + 1);
            f(b.z, k + 2);
            f(b.w, k + 3);
        }
        if (i < e) {
            const float4 a = xv[i];
            const unsigned j = 4 * (unsigned)i;
            f(a.x, j);
            f(a.y, j + 1);
            f(a.z, j + 2);
            f(a.w, j + 3);
        }
        return;
    }
#pragma unroll 4
    for (int i = s0 + lane; i < s1; i += TURBO_WARP) f(x[i], (unsigned)i);
}

// Radix histograms in shared memory. Counts are u32; fixed-point weights are u64 kept as two u32
// halves, since a 64-bit shared atomicAdd is a compare-and-swap loop: the low half's carry goes
// to the high half, so the sum is exact (and the same) in any order.
struct SampleCountHist {
    unsigned* h;
    __device__ __forceinline__ void clear(int nb) const {
        for (int b = threadIdx.x; b < nb; b += SAMPLE_THREADS) h[b] = 0;
    }
    __device__ __forceinline__ void add(unsigned b, unsigned v) const { atomicAdd(&h[b], v); }
    __device__ __forceinline__ sample_u64 get(int b) const { return h[b]; }
};

struct SampleWeightHist {
    unsigned* lo;  // 4096 words, then the 4096 high words
    __device__ __forceinline__ void clear(int nb) const {
        for (int b = threadIdx.x; b < nb; b += SAMPLE_THREADS) lo[b] = lo[4096 + b] = 0;
    }
    __device__ __forceinline__ void add(unsigned b, sample_u64 v) const {
        const unsigned v_lo = (unsigned)v, old = atomicAdd(&lo[b], v_lo);
        const unsigned v_hi = (unsigned)(v >> 32) + (old + v_lo < old);
        if (v_hi) atomicAdd(&lo[4096 + b], v_hi);
    }
    __device__ __forceinline__ sample_u64 get(int b) const {
        return (sample_u64)lo[4096 + b] << 32 | lo[b];
    }
};

__device__ __forceinline__ sample_u64 warp_sum_u64(sample_u64 v) {
#pragma unroll
    for (int o = TURBO_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix sum of v in thread order; *total gets the block's sum. Integer, so exact.
__device__ sample_u64 block_excl_scan(sample_u64 v, sample_u64* total) {
    __shared__ sample_u64 warp_total[SAMPLE_WARPS];
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    sample_u64 incl = v;
#pragma unroll
    for (int o = 1; o < TURBO_WARP; o <<= 1) {
        const sample_u64 n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == TURBO_WARP - 1) warp_total[warp] = incl;
    __syncthreads();
    sample_u64 before = 0, all = 0;
#pragma unroll 8
    for (int w = 0; w < SAMPLE_WARPS; w++) {
        const sample_u64 s = warp_total[w];
        before += w < warp ? s : 0;
        all += s;
    }
    __syncthreads();
    *total = all;
    return before + incl - v;
}

__device__ __forceinline__ sample_u64 block_sum_u64(sample_u64 v) {
    sample_u64 total;
    block_excl_scan(v, &total);
    return total;
}

// Sorts s[0, n) ascending (n a power of two, at most 2 · SAMPLE_THREADS); the caller has synced
// after writing s, and the sort ends synced. Up to 256 elements one warp sorts them alone, with
// no block-wide barrier between the stages.
__device__ void block_sort(sample_u64* s, int n) {
    const auto stage = [&](int k, int j, int step) {
        for (int i = threadIdx.x; i < n / 2; i += step) {
            const int lo = 2 * i - (i & (j - 1)), hi = lo + j;
            const sample_u64 a = s[lo], b = s[hi];
            if ((a > b) == ((lo & k) == 0)) {
                s[lo] = b;
                s[hi] = a;
            }
        }
    };
    if (n <= 256) {
        if (threadIdx.x < TURBO_WARP) {
            for (int k = 2; k <= n; k <<= 1) {
                for (int j = k >> 1; j > 0; j >>= 1) {
                    stage(k, j, TURBO_WARP);
                    __syncwarp();
                }
            }
        }
        __syncthreads();
        return;
    }
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            stage(k, j, SAMPLE_THREADS);
            __syncthreads();
        }
    }
}

// r = uniform · total as the draw's target: the drawn token is the first whose running weight
// exceeds r, i.e. exceeds floor(r) (weights are integers). Kept below total, so a token is found.
__device__ __forceinline__ sample_u64 sample_draw_target(float uniform, sample_u64 total) {
    const double r = (double)uniform * (double)total;
    if (!(r > 0.0)) return 0;
    if (r >= (double)total) return total - 1;
    const sample_u64 t = (sample_u64)r;
    return t < total ? t : total - 1;
}

// Top-p keeps the shortest rank prefix whose weight reaches ceil(top_p · total) (at least 1, so
// the top token always stays).
__device__ __forceinline__ sample_u64 sample_top_p_goal(float top_p, sample_u64 total) {
    const double g = ceil((double)top_p * (double)total);
    if (!(g >= 1.0)) return 1;
    if (g >= (double)total) return total;
    return (sample_u64)g;
}

// Finds the bin b of hist[0, nb), walking down from the top bin, with
// above(b) <= target < above(b) + hist[b], above(b) being the sum over the bins above b. In the
// first pass the target is made from the histogram's total: target_of(total) (< total).
template <typename H, typename G>
__device__ void sample_find_bin(const H& hist, int nb, bool first, G target_of, sample_u64& target,
                                unsigned& bin, sample_u64& above, sample_u64& in_bin) {
    __shared__ unsigned s_bin;
    __shared__ sample_u64 s_above, s_in_bin;
    constexpr int PER = 4096 / SAMPLE_THREADS;  // bins a thread walks (the most a digit has)
    const int p0 = threadIdx.x * PER;
    sample_u64 local = 0;
#pragma unroll
    for (int q = 0; q < PER; q++)
        if (p0 + q < nb) local += hist.get(nb - 1 - (p0 + q));
    sample_u64 total;
    sample_u64 run = block_excl_scan(local, &total);
    if (first) target = target_of(total);
    if (threadIdx.x == 0 && target >= total) {  // unreachable for valid targets: keep a defined result
        s_bin = 0;
        s_above = total;
        s_in_bin = 0;
    }
#pragma unroll
    for (int q = 0; q < PER; q++) {
        if (p0 + q < nb) {
            const int b = nb - 1 - (p0 + q);
            const sample_u64 h = hist.get(b);
            if (run <= target && target < run + h) {
                s_bin = (unsigned)b;
                s_above = run;
                s_in_bin = h;
            }
            run += h;
        }
    }
    __syncthreads();
    bin = s_bin;
    above = s_above;
    in_bin = s_in_bin;
    __syncthreads();
}

struct SampleSelected {
    unsigned key;     // the threshold key K
    sample_u64 above; // the sum over tokens with key > K
    sample_u64 at;    // the sum over tokens with key == K
    sample_u64 rest;  // target - above: what the tokens equal to K must cover (rest < at)
};

// Radix select over the row: the key K at which the running sum of value(logit, key, index)
// (0 for tokens not taking part), taken from the largest key down, first exceeds the target
// (target_of(total)): above(K) <= target < above(K) + at(K). hist: a SampleCountHist or
// SampleWeightHist over 4096 bins, value's result type fitting it.
template <typename H, typename F, typename G>
__device__ SampleSelected sample_radix_select(const float* x, int vocab, const H& hist, F value, G target_of) {
    constexpr int SHIFT[3] = {20, 8, 0}, BITS[3] = {12, 12, 8};
    unsigned prefix = 0, high = 0;
    sample_u64 target = 0, above_all = 0, at = 0;
#pragma unroll
    for (int p = 0; p < 3; p++) {
        const int nb = 1 << BITS[p];
        hist.clear(nb);
        __syncthreads();
        sample_for_each(x, vocab, [&](float l, unsigned i) {
            const unsigned key = sample_key(l);
            if ((key & high) != prefix) return;
            const auto v = value(l, key, i);
            if (v) hist.add((key >> SHIFT[p]) & (nb - 1), v);
        });
        __syncthreads();
        unsigned b;
        sample_u64 above;
        sample_find_bin(hist, nb, p == 0, target_of, target, b, above, at);
        target -= above;
        above_all += above;
        prefix |= b << SHIFT[p];
        high |= (unsigned)(nb - 1) << SHIFT[p];
    }
    return {prefix, above_all, at, target};
}

// The draw and the tie cuts walk the row in index order in two levels: each warp sums a
// contiguous segment (a multiple of 4 tokens, for 16-byte loads where the row allows them), then
// the one segment holding the target is split among all threads.
__device__ __forceinline__ int sample_segment(int vocab) {
    return (vocab + 4 * SAMPLE_WARPS - 1) / (4 * SAMPLE_WARPS) * 4;
}

// seg_total[w] = the sum of value(logit, index) over warp w's segment; ends synced.
template <typename F>
__device__ void sample_segment_sums(const float* x, int vocab, sample_u64* seg_total, F value) {
    const int lane = threadIdx.x % TURBO_WARP, warp = threadIdx.x / TURBO_WARP;
    const int seg = sample_segment(vocab);
    const int s0 = min(vocab, warp * seg), s1 = min(vocab, s0 + seg);
    sample_u64 sum = 0;
    sample_for_segment(x, s0, s1, (vocab & 3) == 0 && aligned16(x),
                       [&](float l, unsigned i) { sum += value(l, i); });
    sum = warp_sum_u64(sum);
    if (lane == 0) seg_total[warp] = sum;
    __syncthreads();
}

// Given the segments' sums of value, the first token in index order at which the running sum
// exceeds target_of(total) (which must be < total); ARGMAX_NONE when the total is 0. Not inlined:
// it runs once a row, and inlining it at its call sites made sample_f32 spill registers.
template <typename F, typename G>
__device__ __noinline__ unsigned sample_find_in_segments(const float* x, int vocab, const sample_u64* seg_total, F value,
                                            G target_of) {
    __shared__ unsigned s_found;
    if (threadIdx.x == 0) s_found = ARGMAX_NONE;
    sample_u64 total = 0;
    for (int w = 0; w < SAMPLE_WARPS; w++) total += seg_total[w];
    if (total == 0) {
        __syncthreads();
        return ARGMAX_NONE;
    }
    const sample_u64 target = target_of(total);
    int w = 0;
    sample_u64 before = 0;
    for (; w < SAMPLE_WARPS - 1 && before + seg_total[w] <= target; w++) before += seg_total[w];
    const int seg = sample_segment(vocab);
    const int a0 = min(vocab, w * seg), a1 = min(vocab, a0 + seg);
    const int per = (a1 - a0 + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int t0 = min(a1, a0 + (int)threadIdx.x * per), t1 = min(a1, t0 + per);
    sample_u64 local = 0;
    for (int i = t0; i < t1; i++) local += value(x[i], (unsigned)i);
    sample_u64 seg_sum;
    sample_u64 run = before + block_excl_scan(local, &seg_sum);
    if (run <= target && target < run + local) {
        for (int i = t0; i < t1; i++) {
            const sample_u64 v = value(x[i], (unsigned)i);
            if (target < run + v) {
                s_found = (unsigned)i;
                break;
            }
            run += v;
        }
    }
    __syncthreads();
    const unsigned found = s_found;
    __syncthreads();
    return found;
}

// The first token, in index order, at which the running sum of value(logit, index) exceeds
// target_of(total) (which must be < total); ARGMAX_NONE when the total is 0.
template <typename F, typename G>
__device__ unsigned sample_find_prefix(const float* x, int vocab, F value, G target_of) {
    __shared__ sample_u64 seg_total[SAMPLE_WARPS];
    sample_segment_sums(x, vocab, seg_total, value);
    return sample_find_in_segments(x, vocab, seg_total, value, target_of);
}

// Gathers (~key << 32 | index) of the tokens for which take(logit, key, index) holds into
// s[0, SAMPLE_CAP) in an unspecified order (slots are taken a warp at a time), and returns how
// many there are, which may exceed SAMPLE_CAP (then only SAMPLE_CAP were written).
// Appends (~key << 32 | index) to s[0, SAMPLE_CAP) at slot *count (counting past the end; the
// order is unspecified). Slots are taken a warp at a time: callable from divergent code.
__device__ __forceinline__ void sample_append(sample_u64* s, unsigned* count, unsigned key, unsigned i) {
    const unsigned active = __activemask();
    const int lane = threadIdx.x % TURBO_WARP, leader = __ffs(active) - 1;
    unsigned slot = 0;
    if (lane == leader) slot = atomicAdd(count, (unsigned)__popc(active));
    slot = __shfl_sync(active, slot, leader) + __popc(active & ((1u << lane) - 1));
    if (slot < SAMPLE_CAP) s[slot] = (sample_u64)(~key) << 32 | i;
}

// Gathers the tokens for which take(logit, key, index) holds into s (sample_append) and returns
// how many there are, which may exceed SAMPLE_CAP (then only SAMPLE_CAP were written).
template <typename F>
__device__ unsigned sample_gather(const float* x, int vocab, sample_u64* s, F take) {
    __shared__ unsigned s_count;
    if (threadIdx.x == 0) s_count = 0;
    __syncthreads();
    sample_for_each(x, vocab, [&](float l, unsigned i) {
        const unsigned key = sample_key(l);
        if (take(l, key, i)) sample_append(s, &s_count, key, i);
    });
    __syncthreads();
    const unsigned n = s_count;
    __syncthreads();
    return n;
}

// Sorts the n gathered tokens of s by rank and returns the one at which their running
// fixed-point weight first exceeds target (which must be below their total); s stays sorted.
__device__ sample_u64 sample_cut(sample_u64* s, int n, const SampleWeights& weights, sample_u64 target) {
    __shared__ sample_u64 s_cut;
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + threadIdx.x; i < size; i += SAMPLE_THREADS) s[i] = ~0ull;
    if (threadIdx.x == 0) s_cut = s[0];
    __syncthreads();
    block_sort(s, size);
    sample_u64 fw[SAMPLE_IPT], local = 0;
#pragma unroll
    for (int q = 0; q < SAMPLE_IPT; q++) {
        const int i = SAMPLE_IPT * threadIdx.x + q;
        fw[q] = i < n ? weights.fixed(sample_logit(~(unsigned)(s[i] >> 32))) : 0;
        local += fw[q];
    }
    sample_u64 total;
    sample_u64 run = block_excl_scan(local, &total);
#pragma unroll
    for (int q = 0; q < SAMPLE_IPT; q++) {
        if (run <= target && target < run + fw[q]) s_cut = s[SAMPLE_IPT * threadIdx.x + q];
        run += fw[q];
    }
    __syncthreads();
    const sample_u64 cut = s_cut;
    __syncthreads();
    return cut;
}

// A lower bound of the k-th largest of the threads' keys (mine): its top 24 bits, found by two
// 12-bit radix digits, so at least k keys reach it. hist: 4096 words of shared memory.
__device__ unsigned sample_kth_bound(unsigned mine, unsigned k, unsigned* hist) {
    const SampleCountHist h{hist};
    const int lane = threadIdx.x % TURBO_WARP;
    unsigned prefix = 0, high = 0;
    sample_u64 target = k - 1;
#pragma unroll
    for (int shift = 20; shift >= 8; shift -= 12) {
        h.clear(4096);
        __syncthreads();
        // The maxima crowd into few bins: one atomic per bin and warp.
        const bool in = (mine & high) == prefix;
        const unsigned bin = in ? (mine >> shift) & 4095 : 4096;
        const unsigned same = __match_any_sync(0xffffffffu, bin);
        if (in && lane == __ffs(same) - 1) h.add(bin, (unsigned)__popc(same));
        __syncthreads();
        unsigned b;
        sample_u64 above, at;
        sample_find_bin(h, 4096, false, [](sample_u64 t) { return t; }, target, b, above, at);
        target -= above;
        prefix |= b << shift;
        high |= 4095u << shift;
    }
    return prefix;
}

// The top-k path (see the top of this section): s[0, n) holds the gathered candidates as
// (~key << 32 | index), n >= k. Returns the token, or ARGMAX_NONE when none is kept.
__device__ unsigned sample_gathered(sample_u64* s, int n, unsigned k, float top_p, float min_p,
                                    float uniform, const SampleWeights& weights) {
    sample_u64* fixed = s + SAMPLE_CAP;  // each survivor's fixed-point weight, by rank
    __shared__ unsigned s_token;
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + threadIdx.x; i < size; i += SAMPLE_THREADS) s[i] = ~0ull;
    if (threadIdx.x == 0) s_token = ARGMAX_NONE;
    __syncthreads();
    block_sort(s, size);  // by rank: the top k come first

    // Weights of the top k; top-p over them in rank order (thread t holds ranks IPT·t ..), min-p.
    bool keep[SAMPLE_IPT];
    unsigned index[SAMPLE_IPT];
    float w[SAMPLE_IPT];
    sample_u64 fw[SAMPLE_IPT];
    sample_u64 local = 0;
#pragma unroll
    for (int q = 0; q < SAMPLE_IPT; q++) {
        const int i = SAMPLE_IPT * threadIdx.x + q;
        keep[q] = i < (int)k;
        index[q] = (unsigned)s[i];
        w[q] = keep[q] ? weights(sample_logit(~(unsigned)(s[i] >> 32))) : 0.f;
        fw[q] = keep[q] ? sample_fixed(w[q]) : 0;
        if (keep[q]) fixed[i] = fw[q];
        local += fw[q];
    }
    if (top_p < 1.f) {
        sample_u64 total;
        sample_u64 run = block_excl_scan(local, &total);
        const sample_u64 goal = sample_top_p_goal(top_p, total);
#pragma unroll
        for (int q = 0; q < SAMPLE_IPT; q++) {
            keep[q] = keep[q] && run < goal;
            run += fw[q];
        }
    }
    if (min_p > 0.f) {
#pragma unroll
        for (int q = 0; q < SAMPLE_IPT; q++) keep[q] = keep[q] && w[q] >= min_p;
    }

    // The draw over the kept ones in index order, as (index << 32 | rank).
    int kept_size = 1;
    while (kept_size < (int)k) kept_size <<= 1;
    sample_u64 kept = 0;
#pragma unroll
    for (int q = 0; q < SAMPLE_IPT; q++) {
        const int i = SAMPLE_IPT * threadIdx.x + q;
        if (i < kept_size) s[i] = keep[q] ? ((sample_u64)index[q] << 32 | (unsigned)i) : ~0ull;
        kept += keep[q];
    }
    __syncthreads();
    block_sort(s, kept_size);
    const int n_kept = (int)block_sum_u64(kept);
    if (n_kept > 0) {
        local = 0;
#pragma unroll
        for (int q = 0; q < SAMPLE_IPT; q++) {
            const int j = SAMPLE_IPT * threadIdx.x + q;
            fw[q] = j < n_kept ? fixed[(unsigned)s[j]] : 0;
            local += fw[q];
        }
        sample_u64 total;
        sample_u64 run = block_excl_scan(local, &total);
        if (total == 0) {
            // Only for parameters outside their ranges: the last kept token, as the CPU.
            if (threadIdx.x == 0) s_token = (unsigned)(s[n_kept - 1] >> 32);
        } else {
            const sample_u64 target = sample_draw_target(uniform, total);
#pragma unroll
            for (int q = 0; q < SAMPLE_IPT; q++) {
                const int j = SAMPLE_IPT * threadIdx.x + q;
                if (j < n_kept && run <= target && target < run + fw[q]) s_token = (unsigned)(s[j] >> 32);
                run += fw[q];
            }
        }
    }
    __syncthreads();
    return s_token;
}

// out[r] = the token that params row r (SampleParams: temperature, top_k, top_p, min_p,
// repetition_penalty, uniform, frequency_penalty, presence_penalty, as 8 words) chooses from row r
// of logits ([rows, vocab], f32), by turbo_core::sampling::sample_row. The penalties are applied
// to logits in place, to the tokens penalty_tokens[penalty_offsets[r] .. penalty_offsets[r + 1]]
// (clamped to n_penalty_tokens; ids >= vocab are ignored; a token listed twice in a row is a race,
// where the CPU penalizes it twice), each generated penalty_counts[j] times. The row's argmax is
// written first and stays when nothing can be drawn; a row with no logit above -inf gets
// SAMPLE_NO_TOKEN.
// One block of SAMPLE_THREADS threads per row; vocab * 2^40 must fit in 64 bits.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32(float* logits, int rows, int vocab, const unsigned* params, const unsigned* penalty_offsets,
           const unsigned* penalty_tokens, const unsigned* penalty_counts, unsigned n_penalty_tokens,
           unsigned* out) {
    __shared__ __align__(16) sample_u64 smem[SAMPLE_SMEM_WORDS];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float* x = logits + (size_t)row * (size_t)vocab;
    const unsigned* p = params + (size_t)row * 8;
    const float temperature = __uint_as_float(p[0]);
    const unsigned top_k = p[1];
    const float top_p = __uint_as_float(p[2]), min_p = __uint_as_float(p[3]);
    const float penalty = __uint_as_float(p[4]), uniform = __uint_as_float(p[5]);
    const float frequency = __uint_as_float(p[6]), presence = __uint_as_float(p[7]);

    if (penalty != 1.f || frequency != 0.f || presence != 0.f) {
        const unsigned end = min(penalty_offsets[row + 1], n_penalty_tokens);
        for (unsigned j = penalty_offsets[row] + threadIdx.x; j < end; j += SAMPLE_THREADS) {
            const unsigned t = penalty_tokens[j];
            if (t < (unsigned)vocab) {
                float l = x[t];
                if (penalty != 1.f) l = l > 0.f ? l / penalty : l * penalty;
                const unsigned c = penalty_counts[j];
                // Rounded as the CPU rounds: a product, a sum, a difference (no fused multiply-add).
                if (c > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(frequency, (float)c), presence));
                x[t] = l;
            }
        }
        __syncthreads();  // makes the writes visible to the whole block
    }

    // Pass 1: the argmax (the max, and the answer when greedy or nothing can be weighed), how
    // many tokens are finite, and each thread's largest key.
    const bool greedy = temperature == 0.f;
    float bv = -INFINITY;
    unsigned bi = ARGMAX_NONE, n_finite = 0, top_key = 0;
    sample_for_each(x, vocab, [&](float l, unsigned i) {
        argmax_take(l, i, bv, bi);
        if (!greedy) {
            const unsigned key = sample_key(l);
            n_finite += key > SAMPLE_KEY_NEG_INF;
            top_key = max(top_key, key);
        }
    });
    if (greedy) {
        argmax_finish(bv, bi, out, row);
        return;
    }
    block_argmax(bv, bi);
    // The answer when nothing can be weighed or nothing is kept; overwritten by a drawn token.
    // No logit above -inf: no token.
    if (threadIdx.x == 0) out[row] = bv == -INFINITY ? SAMPLE_NO_TOKEN : bi;
    if (!isfinite(bv)) return;
    const unsigned n_kept = (unsigned)block_sum_u64(n_finite);
    const SampleWeights weights = {bv, temperature, 1.f / temperature};
    const bool k_active = top_k > 0 && top_k < n_kept;

    if (k_active && top_k <= SAMPLE_THREADS) {
        // A bound of the k-th largest thread maximum: at least k tokens reach it, so every top-k
        // token does.
        const unsigned bound = sample_kth_bound(top_key, top_k, reinterpret_cast<unsigned*>(smem));
        const unsigned n = sample_gather(x, vocab, smem, [=](float, unsigned key, unsigned) {
            return key > SAMPLE_KEY_NEG_INF && key >= bound;
        });
        if (n <= SAMPLE_CAP) {
            const unsigned token = sample_gathered(smem, (int)n, top_k, top_p, min_p, uniform, weights);
            if (threadIdx.x == 0 && token != ARGMAX_NONE) out[row] = token;
            return;
        }
    }

    // The general path. Top-k keeps key > k_key, and key == k_key up to index k_last.
    unsigned k_key = 0, k_last = ARGMAX_NONE;
    if (k_active) {
        const SampleSelected s = sample_radix_select(
            x, vocab, SampleCountHist{reinterpret_cast<unsigned*>(smem)},
            [](float, unsigned key, unsigned) -> unsigned { return key > SAMPLE_KEY_NEG_INF; },
            [=](sample_u64) -> sample_u64 { return top_k - 1; });
        k_key = s.key;
        const sample_u64 m = s.rest + 1;  // the first m tokens equal to k_key stay
        if (m < s.at)
            k_last = sample_find_prefix(
                x, vocab, [=](float l, unsigned) -> sample_u64 { return sample_key(l) == k_key; },
                [=](sample_u64) { return m - 1; });
    }
    const auto in_top_k = [=](unsigned key, unsigned i) {
        return !k_active || key > k_key || (key == k_key && i <= k_last);
    };
    const bool m_active = min_p > 0.f;
    // The draw's weight of a token that top-k, top-p and min-p keep (0 otherwise).
    const auto kept_weight = [=](float l, unsigned key, unsigned i, unsigned p_key, unsigned p_last) -> sample_u64 {
        if (key <= SAMPLE_KEY_NEG_INF || !in_top_k(key, i)) return 0;
        if (!(key > p_key || (key == p_key && i <= p_last))) return 0;
        if ((l - weights.max) * weights.inv_temperature < -30.f) return 0;
        const float w = weights(l);
        return m_active && !(w >= min_p) ? 0 : sample_fixed(w);
    };
    const auto draw_target = [=](sample_u64 total) { return sample_draw_target(uniform, total); };
    __shared__ sample_u64 seg_total[SAMPLE_WARPS];
    unsigned token;
    if (top_p < 1.f) {
        // Top-p over the top-k survivors. Weighted tokens lie within 30 temperatures of the max,
        // so a histogram of weights over 4096 even steps of that distance (the top bin last, as
        // radix bins) spreads them out, where a radix digit of the logit would pile them into a
        // few bins. One more pass gathers the tokens of the bin holding the goal (the cut is
        // found among them) and sums, per segment, the kept tokens of the bins above it.
        const auto bin_of = [=](float l) {
            const float d = (weights.max - l) * weights.inv_temperature;
            return 4095u - min(4095u, __float2uint_rz(d * (4096.f / 30.f)));
        };
        const SampleWeightHist hist{reinterpret_cast<unsigned*>(smem)};
        hist.clear(4096);
        __syncthreads();
        sample_for_each(x, vocab, [&](float l, unsigned i) {
            const unsigned key = sample_key(l);
            if (key <= SAMPLE_KEY_NEG_INF || !in_top_k(key, i)) return;
            const sample_u64 fw = weights.fixed(l);
            if (fw) hist.add(bin_of(l), fw);
        });
        __syncthreads();
        sample_u64 target, above, at;
        unsigned bin;
        sample_find_bin(
            hist, 4096, true, [=](sample_u64 total) { return sample_top_p_goal(top_p, total) - 1; },
            target, bin, above, at);
        __shared__ unsigned s_count;
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        sample_segment_sums(x, vocab, seg_total, [&](float l, unsigned i) -> sample_u64 {
            const unsigned key = sample_key(l);
            if (key <= SAMPLE_KEY_NEG_INF || !in_top_k(key, i)) return 0;
            const unsigned b = bin_of(l);
            const bool weighed = (l - weights.max) * weights.inv_temperature >= -30.f;
            if (b == bin && weighed) sample_append(smem, &s_count, key, i);
            return b > bin ? kept_weight(l, key, i, 0, 0) : 0;
        });
        const unsigned n = s_count;
        unsigned p_key, p_last;
        if (n <= SAMPLE_CAP) {
            const sample_u64 cut = sample_cut(smem, (int)n, weights, target - above);
            p_key = ~(unsigned)(cut >> 32);
            p_last = (unsigned)cut;
            // The gathered tokens up to the cut join their segments' sums.
            const int seg = sample_segment(vocab);
            for (int j = threadIdx.x; j < (int)n; j += SAMPLE_THREADS) {
                const sample_u64 c = smem[j];
                if (c > cut) continue;
                const unsigned key = ~(unsigned)(c >> 32), i = (unsigned)c;
                const sample_u64 fw = kept_weight(sample_logit(key), key, i, p_key, p_last);
                if (fw) atomicAdd(&seg_total[i / seg], fw);
            }
            __syncthreads();
        } else {
            // Too many tokens in that bin (ties, an infinite temperature): radix select over the
            // logits' keys instead, then the draw from scratch.
            const SampleSelected s = sample_radix_select(
                x, vocab, SampleWeightHist{reinterpret_cast<unsigned*>(smem)},
                [=](float l, unsigned key, unsigned i) -> sample_u64 {
                    return key > SAMPLE_KEY_NEG_INF && in_top_k(key, i) ? weights.fixed(l) : 0;
                },
                [=](sample_u64 total) { return sample_top_p_goal(top_p, total) - 1; });
            p_key = s.key;
            p_last = ARGMAX_NONE;
            // Tokens equal to p_key weigh the same: the first m of them reach the goal.
            const sample_u64 one = weights.fixed(sample_logit(p_key));
            if (one > 0) {
                const sample_u64 m = s.rest / one + 1;
                if (m < s.at / one)
                    p_last = sample_find_prefix(
                        x, vocab,
                        [=](float l, unsigned i) -> sample_u64 {
                            const unsigned key = sample_key(l);
                            return key == p_key && in_top_k(key, i);
                        },
                        [=](sample_u64) { return m - 1; });
            }
            sample_segment_sums(x, vocab, seg_total,
                                [=](float l, unsigned i) { return kept_weight(l, sample_key(l), i, p_key, p_last); });
        }
        token = sample_find_in_segments(
            x, vocab, seg_total,
            [=](float l, unsigned i) { return kept_weight(l, sample_key(l), i, p_key, p_last); }, draw_target);
    } else {
        token = sample_find_prefix(
            x, vocab, [=](float l, unsigned i) { return kept_weight(l, sample_key(l), i, 0, 0); }, draw_target);
    }
    if (threadIdx.x == 0 && token != ARGMAX_NONE) out[row] = token;
}
