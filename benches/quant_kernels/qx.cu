// Kernel bench of kernels/quant.cu at Llama-3-8B shapes on random blocks: the decode-step products
// (qgemv) per type, token count, units per warp G and code form (exact integers or 1 + c/128), and
// the decode-to-bf16 kernel. Weights cycle through copies of at least 256 MB, so every launch reads
// them from memory. Each variant's output is compared with the first variant's (max |difference|).
// Build and run on the GPU machine (docs/perf/h100.md has figures):
//   nvcc -O3 -arch=sm_90 -std=c++17 -Ikernels benches/quant_kernels/qx.cu -o qx && ./qx [Q4_K|Q6_K|small|Q8_0|Q5_0]
// The tensor-core products: `./qx mma` (Q4_K, one token, with the read-only floor and the fused
// norm), `mma6` (Q6_K, one token), `mmat` (Q4_K, 2 and 4 tokens), `mma6t` (Q6_K, 2 and 4 tokens).
// Environment: QX_ITERS (launches timed, default 200), QX_SHAPE (a shape name's substring), QX_M.
#include "../../kernels/quant.cu"
#include "../../kernels/norm.cu"
#include <cstdio>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <cstdlib>
#include <vector>
#include <string>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

template <class T, int M, int R, bool NORM, int G, bool UNIT, bool LOOP>
__global__ void __launch_bounds__(128) kq(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x,
                                             const __nv_bfloat16* g, float eps, void* out, int tokens, int units,
                                             int k, int ld, int mode) {
    qgemv<T, M, R, NORM, G, UNIT, LOOP>(w, row_bytes, x, g, eps, out, tokens, units, k, ld, mode);
}
template <int R, int W, int S, bool NORM>
__global__ void __launch_bounds__(W * 32) kmma(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x,
                                                const __nv_bfloat16* g, float eps, void* out, int units, int k,
                                                int mode) {
    qmma1_q4k<R, W, S, NORM>(w, row_bytes, x, g, eps, out, units, k, mode);
}
// The floor for a product: reading the same bytes with 16-byte loads and nothing else.
__global__ void __launch_bounds__(256) kstream(const uint4* w, size_t words, uint32_t* out) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * 256 + threadIdx.x; i < words; i += (size_t)gridDim.x * 256) {
        const uint4 v = __ldg(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
template <int R, int M>
__global__ void __launch_bounds__(128) kmmat(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x,
                                             void* out, int tokens, int units, int k, int ld, int mode) {
    qmma1_q4k<R, 4, 2, false, M>(w, row_bytes, x, nullptr, 0.f, out, units, k, mode, tokens, ld);
}
template <int R, int W, int M>
__global__ void __launch_bounds__(W * 32) kmma6t(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x,
                                                  void* out, int tokens, int units, int k, int ld, int mode) {
    qmma_q6k_tokens<R, W, M>(w, row_bytes, x, out, tokens, units, k, ld, mode);
}
template <int R, int W, bool NORM>
__global__ void __launch_bounds__(W * 32) kmma6(const uint8_t* w, long long row_bytes, const __nv_bfloat16* x,
                                                 const __nv_bfloat16* g, float eps, void* out, int units, int k,
                                                 int mode) {
    qmma1_q6k<R, W, NORM>(w, row_bytes, x, g, eps, out, units, k, mode);
}
template <class T>
__global__ void __launch_bounds__(256) kds(const uint8_t* w, long long rb, int rows, int k, __nv_bfloat16* out) {
    dequant<T>(w, rb, rows, k, out);
}

struct Buf { uint8_t* p; size_t bytes; };
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)rng; }
static uint16_t f16(float f) { __half h = __float2half(f); return *reinterpret_cast<uint16_t*>(&h); }

template <class T>
std::vector<Buf> make_weights(int rows, int k, size_t min_total) {
    size_t rb = (size_t)k / T::BLOCK_VALUES * T::BLOCK_BYTES, bytes = rb * rows + 16;
    int copies = (int)((min_total + bytes - 1) / bytes);
    std::vector<uint8_t> h(bytes);
    for (auto& b : h) b = (uint8_t)rnd();
    size_t nb = rb * rows / T::BLOCK_BYTES;
    for (size_t b = 0; b < nb; b++) {
        uint8_t* p = h.data() + b * T::BLOCK_BYTES;
        auto put = [&](int at, float v) { uint16_t x = f16(v); memcpy(p + at, &x, 2); };
        if (T::BLOCK_BYTES == 210) put(208, 0.001f + (rnd() % 1000) * 1e-5f);
        else { put(0, 0.001f + (rnd() % 1000) * 1e-5f); if (T::BLOCK_VALUES == 256 || T::HAS_BIAS) put(2, 0.001f + (rnd() % 1000) * 1e-5f); }
    }
    std::vector<Buf> out;
    for (int c = 0; c < copies; c++) { Buf b{nullptr, bytes}; CK(cudaMalloc(&b.p, bytes)); CK(cudaMemcpy(b.p, h.data(), bytes, cudaMemcpyHostToDevice)); out.push_back(b); }
    return out;
}

__nv_bfloat16* rand_bf16(size_t n) {
    std::vector<__nv_bfloat16> h(n);
    for (auto& v : h) v = __float2bfloat16(((int)(rnd() % 2001) - 1000) / 1000.f);
    __nv_bfloat16* d; CK(cudaMalloc(&d, n * 2)); CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice)); return d;
}

template <class F>
float time_us(int iters, F f) {
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < (iters < 5 ? 0 : 5); i++) f(i);
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; i++) f(i);
    CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); CK(cudaGetLastError());
    return ms * 1000.f / iters;
}

static float to_f(const uint8_t* p, int mode) {
    if (mode == QGEMV_STORE_F32) return *reinterpret_cast<const float*>(p);
    uint32_t b = (uint32_t)*reinterpret_cast<const uint16_t*>(p) << 16; float f; memcpy(&f, &b, 4); return f;
}

// The largest |out - ref| over the first n outputs, and the largest |ref| (a NaN makes err 1e30).
static void compare(const void* out, const void* ref, size_t out_bytes, int mode, size_t n, double& err, double& mag) {
    std::vector<uint8_t> a(out_bytes), b(out_bytes);
    CK(cudaMemcpy(a.data(), out, out_bytes, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
    size_t es = mode == QGEMV_STORE_F32 ? 4 : 2;
    for (size_t i = 0; i < n; i++) {
        float fa = to_f(a.data() + i * es, mode), fb = to_f(b.data() + i * es, mode);
        err = fmax(err, fabs((double)fa - fb)); mag = fmax(mag, fabs((double)fb));
        if (!(fa == fa)) err = 1e30;
    }
}

template <class T, int M, int R, bool NORM, int G, bool UNIT, bool LOOP = (M > 1)>
void run_variant(const char* type, const char* shape, std::vector<Buf>& ws, int rows, int k, int mode,
                 const __nv_bfloat16* x, const __nv_bfloat16* g, void* out, void* ref, size_t out_bytes, bool first) {
    int units = rows / R;
    long long rb = (long long)k / T::BLOCK_VALUES * T::BLOCK_BYTES;
    int per_block = 4 * G;
    int tile = XTile<M>::VALUES < k ? XTile<M>::VALUES : k;
    size_t smem = (size_t)x_tile_words(M, tile) * 16;
    auto kern = kq<T, M, R, NORM, G, UNIT, LOOP>;
    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    // As ops::quant launches it: a looping kernel where x fits one tile gets only the blocks
    // resident at once.
    int groups = (units + per_block - 1) / per_block, resident = 0, sms = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kern, 128, smem));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (LOOP && k <= XTile<M>::VALUES && resident * sms < groups) groups = resident * sms;
    dim3 grid(groups), block(128);
    auto launch = [&](int i) { kern<<<grid, block, smem>>>(ws[i % ws.size()].p, rb, x, g, 1e-5f, out, M, units, k, units, mode); };
    CK(cudaMemset(out, 0, out_bytes)); launch(0); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    double err = 0, mag = 0;
    if (first) CK(cudaMemcpy(ref, out, out_bytes, cudaMemcpyDeviceToDevice));
    else compare(out, ref, out_bytes, mode, (size_t)M * units, err, mag);
    static const int iters = getenv("QX_ITERS") ? atoi(getenv("QX_ITERS")) : 200;
    float us = time_us(iters, launch);
    double gbs = (double)rb * rows / us / 1e3;
    printf("%s %-16s m%d G%d %s%s: %8.2f us  %7.1f GB/s  |diff| %.2e of %.2e\n", type, shape, M, G,
           UNIT && T::UNIT_CODES ? "unit" : "int ", LOOP ? " loop" : "", us, gbs, err, mag);
}

template <class T, int M, int R, bool NORM>
void shape_runs(const char* type, const char* shape, int rows, int k, int mode) {
    if (getenv("QX_SHAPE") && !strstr(shape, getenv("QX_SHAPE"))) return;
    if (getenv("QX_M") && atoi(getenv("QX_M")) != M) return;
    auto ws = make_weights<T>(rows, k, 256u << 20);
    const __nv_bfloat16* x = rand_bf16((size_t)M * k);
    const __nv_bfloat16* g = rand_bf16(k);
    size_t out_bytes = (size_t)M * rows * 4;
    void *out, *ref; CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    constexpr int G2 = R == 1 ? 2 : 1, GD = WarpUnits<M, R>::value;
#define V(G, UN, F) run_variant<T, M, R, NORM, G, UN>(type, shape, ws, rows, k, mode, x, g, out, ref, out_bytes, F)
    V(GD, true, true);
    if (T::UNIT_CODES) V(GD, false, false);
    if (M <= 2) V(G2, true, false);
#undef V
    // One token: the looping form too (ops::quant takes it for many waves of groups).
    if (M == 1) run_variant<T, M, R, NORM, GD, true, true>(type, shape, ws, rows, k, mode, x, g, out, ref, out_bytes, false);
    for (auto& b : ws) CK(cudaFree(b.p));
    CK(cudaFree(out)); CK(cudaFree(ref));
}

// The tensor-core one-token products (qmma1) against qgemv on the same weights and x (`./qx mma`,
// `./qx mma6`).
// qmma1_q4k with W warps and S slots; with NORM, the norm fused, against the unfused norm kernel
// launched before the product without it (UNFUSED).
template <int R, int W, int S, bool NORM = false, bool UNFUSED = false>
void mma_variant(const char* shape, std::vector<Buf>& ws, int rows, int k, int mode, const __nv_bfloat16* x,
                 const __nv_bfloat16* g, __nv_bfloat16* xn, void* out, void* ref, size_t out_bytes) {
    int units = rows / R, per = R == 2 ? 8 : 16;
    long long rb = (long long)k / 256 * 144;
    const int grid = (units + per - 1) / per;
    auto launch = [&](int i) {
        const __nv_bfloat16* xin = x;
        if (UNFUSED) { rms_norm_bf16<<<1, 1024>>>(xn, x, g, 1, k, 1e-5f); xin = xn; }
        kmma<R, W, S, NORM><<<grid, W * 32>>>(ws[i % ws.size()].p, rb, xin, g, 1e-5f, out, units, k, mode);
    };
    CK(cudaMemset(out, 0, out_bytes)); launch(0); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    double err = 0, mag = 0;
    compare(out, ref, out_bytes, mode, (size_t)units, err, mag);
    static const int iters = getenv("QX_ITERS") ? atoi(getenv("QX_ITERS")) : 200;
    float us = time_us(iters, launch);
    printf("Q4_K %-16s mma1 w%d s%d%s: %8.2f us  %7.1f GB/s  |diff| %.2e of %.2e\n", shape, W, S,
           NORM ? " norm fused" : UNFUSED ? " norm kernel first" : "", us, (double)rb * rows / us / 1e3, err, mag);
}

// NORM: the shape's product takes the RMSNorm first (QKV, gate/up).
template <int R, bool NORM>
void mma_runs(const char* shape, int rows, int k, int mode) {
    if (getenv("QX_SHAPE") && !strstr(shape, getenv("QX_SHAPE"))) return;
    auto ws = make_weights<Q4_K>(rows, k, 256u << 20);
    const __nv_bfloat16* x = rand_bf16(k);
    const __nv_bfloat16* g = rand_bf16(k);
    __nv_bfloat16* xn; CK(cudaMalloc(&xn, (size_t)k * 2));
    size_t out_bytes = (size_t)rows * 4;
    void *out, *ref; CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    run_variant<Q4_K, 1, R, false, WarpUnits<1, R>::value, true>("Q4_K", shape, ws, rows, k, mode, x, g, out, ref, out_bytes, true);
    {
        const size_t words = (size_t)rows * (k / 256 * 144) / 16;
        for (int blocks : {132 * 8, 132 * 16}) {
            float us = time_us(200, [&](int i) { kstream<<<blocks, 256>>>(reinterpret_cast<const uint4*>(ws[i % ws.size()].p), words, (uint32_t*)out); });
            printf("Q4_K %-16s read only, %d blocks: %8.2f us  %7.1f GB/s\n", shape, blocks, us, words * 16.0 / us / 1e3);
        }
    }
    mma_variant<R, 4, 2>(shape, ws, rows, k, mode, x, g, xn, out, ref, out_bytes);
    mma_variant<R, 8, 1>(shape, ws, rows, k, mode, x, g, xn, out, ref, out_bytes);
    if (NORM) {
        run_variant<Q4_K, 1, R, true, WarpUnits<1, R>::value, true>("Q4_K", shape, ws, rows, k, mode, x, g, out, ref, out_bytes, true);
        mma_variant<R, 4, 2, false, true>(shape, ws, rows, k, mode, x, g, xn, out, ref, out_bytes);
        mma_variant<R, 4, 2, true>(shape, ws, rows, k, mode, x, g, xn, out, ref, out_bytes);
    }
    for (auto& w : ws) CK(cudaFree(w.p));
    CK(cudaFree(out)); CK(cudaFree(ref)); CK(cudaFree(xn));
}

// qmma1_q6k with W warps (NORM: the norm fused) against qgemv with or without the norm.
template <int R, int W, bool NORM>
void mma6_variant(const char* shape, std::vector<Buf>& ws, int rows, int k, int mode, const __nv_bfloat16* x,
                  const __nv_bfloat16* g, void* out, void* ref, size_t out_bytes) {
    int units = rows / R, per = R == 2 ? 8 : 16;
    long long rb = (long long)k / 256 * 210;
    auto launch = [&](int i) {
        kmma6<R, W, NORM><<<(units + per - 1) / per, W * 32>>>(ws[i % ws.size()].p, rb, x, g, 1e-5f, out, units, k, mode);
    };
    CK(cudaMemset(out, 0, out_bytes)); launch(0); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    double err = 0, mag = 0;
    compare(out, ref, out_bytes, mode, (size_t)units, err, mag);
    static const int iters = getenv("QX_ITERS") ? atoi(getenv("QX_ITERS")) : 200;
    float us = time_us(iters, launch);
    printf("Q6_K %-16s mma1 w%d%s: %8.2f us  %7.1f GB/s  |diff| %.2e of %.2e\n", shape, W, NORM ? " norm fused" : "", us,
           (double)rb * rows / us / 1e3, err, mag);
}

template <int R, bool NORM>
void mma6_runs(const char* shape, int rows, int k, int mode) {
    if (getenv("QX_SHAPE") && !strstr(shape, getenv("QX_SHAPE"))) return;
    auto ws = make_weights<Q6_K>(rows, k, 256u << 20);
    const __nv_bfloat16* x = rand_bf16(k);
    const __nv_bfloat16* g = rand_bf16(k);
    size_t out_bytes = (size_t)rows * 4;
    void *out, *ref; CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    run_variant<Q6_K, 1, R, NORM, WarpUnits<1, R>::value, true>("Q6_K", shape, ws, rows, k, mode, x, g, out, ref, out_bytes, true);
    run_variant<Q6_K, 1, R, NORM, WarpUnits<1, R>::value, true, true>("Q6_K", shape, ws, rows, k, mode, x, g, out, ref, out_bytes, false);
    const size_t words = (size_t)rows * (k / 256 * 210) / 16;
    float us = time_us(200, [&](int i) { kstream<<<132 * 16, 256>>>(reinterpret_cast<const uint4*>(ws[i % ws.size()].p), words, (uint32_t*)out); });
    printf("Q6_K %-16s read only: %8.2f us  %7.1f GB/s\n", shape, us, words * 16.0 / us / 1e3);
    mma6_variant<R, 4, NORM>(shape, ws, rows, k, mode, x, g, out, ref, out_bytes);
    mma6_variant<R, 8, NORM>(shape, ws, rows, k, mode, x, g, out, ref, out_bytes);
    for (auto& w : ws) CK(cudaFree(w.p));
    CK(cudaFree(out)); CK(cudaFree(ref));
}

// Steps of M tokens: qmma_Q4_K_m<M> against qgemv (no norm; ops::quant's form: looping for M > 1).
template <int R, int M>
void mmat_runs(const char* shape, int rows, int k, int mode) {
    if (getenv("QX_SHAPE") && !strstr(shape, getenv("QX_SHAPE"))) return;
    auto ws = make_weights<Q4_K>(rows, k, 256u << 20);
    const __nv_bfloat16* x = rand_bf16((size_t)M * k);
    int units = rows / R;
    size_t out_bytes = (size_t)M * rows * 4;
    void *out, *ref; CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    run_variant<Q4_K, M, R, false, WarpUnits<M, R>::value, true>("Q4_K", shape, ws, rows, k, mode, x, x, out, ref, out_bytes, true);
    long long rb = (long long)k / 256 * 144;
    auto launch = [&](int i) {
        kmmat<R, M><<<(units + (R == 2 ? 7 : 15)) / (R == 2 ? 8 : 16), 128>>>(ws[i % ws.size()].p, rb, x, out, M, units, k, units, mode);
    };
    CK(cudaMemset(out, 0, out_bytes)); launch(0); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    double err = 0, mag = 0;
    compare(out, ref, out_bytes, mode, (size_t)M * units, err, mag);
    float us = time_us(200, launch);
    printf("Q4_K %-16s m%d mma: %8.2f us  %7.1f GB/s  |diff| %.2e of %.2e\n", shape, M, us, (double)rb * rows / us / 1e3, err, mag);
    for (auto& w : ws) CK(cudaFree(w.p));
    CK(cudaFree(out)); CK(cudaFree(ref));
}

template <int M>
void mmat_shapes() {
    mmat_runs<1, M>("qkv", 6144, 4096, QGEMV_STORE_BF16);
    mmat_runs<1, M>("o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL);
    mmat_runs<2, M>("gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    mmat_runs<1, M>("down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
}

// Steps of M tokens on Q6_K: qmma_Q6_K_m<M> with 4 and 8 warps against qgemv (looping form).
template <int R, int M>
void mma6t_runs(const char* shape, int rows, int k, int mode) {
    if (getenv("QX_SHAPE") && !strstr(shape, getenv("QX_SHAPE"))) return;
    auto ws = make_weights<Q6_K>(rows, k, 256u << 20);
    const __nv_bfloat16* x = rand_bf16((size_t)M * k);
    int units = rows / R;
    size_t out_bytes = (size_t)M * rows * 4;
    void *out, *ref; CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    run_variant<Q6_K, M, R, false, WarpUnits<M, R>::value, true>("Q6_K", shape, ws, rows, k, mode, x, x, out, ref, out_bytes, true);
    long long rb = (long long)k / 256 * 210;
    auto one = [&](auto kern, int wps) {
        auto launch = [&](int i) {
            kern<<<(units + (R == 2 ? 7 : 15)) / (R == 2 ? 8 : 16), wps * 32>>>(ws[i % ws.size()].p, rb, x, out, M, units, k, units, mode);
        };
        CK(cudaMemset(out, 0, out_bytes)); launch(0); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
        double err = 0, mag = 0;
        compare(out, ref, out_bytes, mode, (size_t)M * units, err, mag);
        float us = time_us(200, launch);
        printf("Q6_K %-16s m%d mma w%d: %8.2f us  %7.1f GB/s  |diff| %.2e of %.2e\n", shape, M, wps, us, (double)rb * rows / us / 1e3, err, mag);
    };
    one(kmma6t<R, 4, M>, 4);
    one(kmma6t<R, 8, M>, 8);
    for (auto& w : ws) CK(cudaFree(w.p));
    CK(cudaFree(out)); CK(cudaFree(ref));
}

template <int M>
void mma6t_shapes() {
    mma6t_runs<1, M>("v", 1024, 4096, QGEMV_STORE_BF16);
    mma6t_runs<1, M>("o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL);
    mma6t_runs<2, M>("gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    mma6t_runs<1, M>("down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
    mma6t_runs<1, M>("lm_head_f32", 49152, 4096, QGEMV_STORE_F32);
}

template <class T>
void dequant_runs(const char* type, int rows, int k) {
    if (getenv("QX_SHAPE")) return;
    auto ws = make_weights<T>(rows, k, 256u << 20);
    long long rb = (long long)k / T::BLOCK_VALUES * T::BLOCK_BYTES;
    size_t n = (size_t)rows * k;
    __nv_bfloat16* out; CK(cudaMalloc(&out, n * 2));
    long long threads = (long long)rows * (k / T::CHUNK);
    dim3 grid((unsigned)((threads + DEQUANT_THREADS - 1) / DEQUANT_THREADS));
    float us = time_us(50, [&](int i) { kds<T><<<grid, DEQUANT_THREADS>>>(ws[i % ws.size()].p, rb, rows, k, out); });
    double bytes = (double)rb * rows + n * 2.0;
    printf("%s dequant %dx%d: %8.2f us (%6.1f GB/s read + written)\n", type, rows, k, us, bytes / us / 1e3);
    for (auto& w : ws) CK(cudaFree(w.p));
    CK(cudaFree(out));
}

template <class T>
void all_shapes(const char* type) {
    shape_runs<T, 1, 1, true>(type, "qkv_norm", 6144, 4096, QGEMV_STORE_BF16);
    shape_runs<T, 1, 1, false>(type, "o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL);
    shape_runs<T, 1, 2, true>(type, "gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    shape_runs<T, 1, 1, false>(type, "down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
    shape_runs<T, 2, 2, true>(type, "gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    shape_runs<T, 4, 2, true>(type, "gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    shape_runs<T, 8, 2, true>(type, "gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
    shape_runs<T, 8, 1, false>(type, "down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
    dequant_runs<T>(type, 8192, 4096);
    dequant_runs<T>(type, 2048, 14336);
}

int main(int argc, char** argv) {
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0)); printf("%s\n", p.name);
    std::string only = argc > 1 ? argv[1] : "";
    if (only == "mma") {
        mma_runs<1, true>("qkv", 6144, 4096, QGEMV_STORE_BF16);
        mma_runs<1, false>("o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL);
        mma_runs<2, true>("gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
        mma_runs<1, false>("down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
        mma_runs<1, true>("lm_head_f32", 49152, 4096, QGEMV_STORE_F32);
        return 0;
    }
    if (only == "mmat") {
        mmat_shapes<2>();
        mmat_shapes<4>();
        return 0;
    }
    if (only == "mma6t") {
        mma6t_shapes<2>();
        mma6t_shapes<4>();
        return 0;
    }
    if (only == "mma6") {
        mma6_runs<1, true>("v_norm", 1024, 4096, QGEMV_STORE_BF16);
        mma6_runs<1, true>("qkv_norm", 6144, 4096, QGEMV_STORE_BF16);
        mma6_runs<1, false>("o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL);
        mma6_runs<2, true>("gate_up_swiglu", 28672, 4096, QGEMV_STORE_BF16);
        mma6_runs<1, false>("down_residual", 4096, 14336, QGEMV_ADD_RESIDUAL);
        mma6_runs<1, false>("lm_head_f32", 49152, 4096, QGEMV_STORE_F32);
        return 0;
    }
    if (only.empty() || only == "Q4_K") all_shapes<Q4_K>("Q4_K");
    if (only.empty() || only == "Q6_K") {
        all_shapes<Q6_K>("Q6_K");
        shape_runs<Q6_K, 1, 1, false>("Q6_K", "lm_head_f32", 128256, 4096, QGEMV_STORE_F32);
    }
    if (only.empty() || only == "Q8_0") { shape_runs<Q8_0, 1, 1, false>("Q8_0", "o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL); dequant_runs<Q8_0>("Q8_0", 8192, 4096); }
    if (only.empty() || only == "small") {
        shape_runs<Q5_0, 1, 1, false>("Q5_0", "smol_576", 1536, 576, QGEMV_ADD_RESIDUAL);
        shape_runs<Q8_0, 1, 1, false>("Q8_0", "smol_576", 1536, 576, QGEMV_ADD_RESIDUAL);
        shape_runs<Q4_0, 4, 2, true>("Q4_0", "smol_576_swiglu", 3072, 576, QGEMV_STORE_BF16);
    }
    if (only.empty() || only == "Q5_0") { shape_runs<Q5_0, 1, 1, false>("Q5_0", "o_residual", 4096, 4096, QGEMV_ADD_RESIDUAL); dequant_runs<Q5_0>("Q5_0", 8192, 4096); }
    return 0;
}
