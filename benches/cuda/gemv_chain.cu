// Decode products back to back, outside the engine: do per-kernel start and end costs go away
// when each kernel streams its weights through a shared-memory ring filled by bulk copies that
// start before the kernel ahead has finished (programmatic dependent launch)?
//
// 32 layers of Llama-3-8B's four one-token products (bf16, 6144/4096/28672/4096 rows), each
// reading the output of the one before, recorded into a CUDA graph and replayed; prints µs a
// layer and the weights' read rate for each form, and each form's final vector against the
// first's (the ring forms split a row over several warps, so they differ in rounding).
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o gemv_chain benches/cuda/gemv_chain.cu && ./gemv_chain
//
// Results: docs/perf/h100.md, "One-token products fed through a shared-memory ring".
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1);} } while (0)

__global__ void init_bf16(__nv_bfloat16* p, size_t n, float a, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = __float2bfloat16(a * ((h >> 8) * (2.0f / 16777216.0f) - 1.0f));
  }
}

__device__ __forceinline__ void fma8(float& acc, uint4 w, const float* x) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(p[i]); acc = fmaf(f.x, x[2*i], acc); acc = fmaf(f.y, x[2*i+1], acc); }
}
__device__ __forceinline__ void unpack8(uint4 v, float* x) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(p[i]); x[2*i] = f.x; x[2*i+1] = f.y; }
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A: a warp per row, 16-byte loads 4 deep, x from global (as the engine's gemv).
template <int K, bool PDL>
__global__ void __launch_bounds__(256) gemv_plain(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int n) {
  constexpr int V = K / 8 / 32;
  int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  if (row >= n) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * K);
  uint4 wv[4];
  float acc = 0.f;
  int j = 0;
  // first loads before the wait (weights do not depend on the kernel ahead)
#pragma unroll
  for (int u = 0; u < 4; ++u) wv[u] = __ldg(wr + lane + 32 * u);
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  for (j = 0; j < V; j += 4) {
    uint4 nw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (j + 4 + u < V) nw[u] = __ldg(wr + lane + 32 * (j + 4 + u));
#pragma unroll
    for (int u = 0; u < 4; ++u) { float xf[8]; unpack8(xr[lane + 32 * (j + u)], xf); fma8(acc, wv[u], xf); }
#pragma unroll
    for (int u = 0; u < 4; ++u) wv[u] = nw[u];
  }
  acc = warp_sum(acc);
  if (lane == 0) y[row] = __float2bfloat16(acc);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint32_t b, uint32_t c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(c) : "memory"); }
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t parity) {
  uint32_t ok = 0;
  do { asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(b), "r"(parity) : "memory"); } while (!ok);
}
__device__ __forceinline__ void bar_arrive(uint32_t b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void bar_expect(uint32_t b, uint32_t bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory"); }
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(b) : "memory");
}

// B: persistent CTAs, each owns a contiguous run of row groups (R rows, R*K*2 bytes), streamed
// by one producer lane through an S-stage ring of bulk copies; 8 consumer warps, K split over
// 8/R warps per row. The producer never reads what the kernel ahead wrote, so under PDL it fills
// the ring before the kernel ahead ends; the consumers wait before reading x.
template <int K, int R, int S, bool PDL>
__global__ void __launch_bounds__(288, 2) gemv_ring(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int n) {
  constexpr int WPR = 8 / R, KW = K / WPR, V = KW / 256;
  constexpr uint32_t STAGE = R * K * 2;
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t full[S], empty[S];
  __shared__ float part[2][8];
  const int groups = n / R;
  const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x), g1 = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) { bar_init(smem_u32(&full[s]), 1); bar_init(smem_u32(&empty[s]), 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  if (warp == 8) {
    if (lane == 0) {
      for (int g = g0, i = 0; g < g1; ++g, ++i) {
        int s = i % S;
        if (i >= S) bar_wait(smem_u32(&empty[s]), ((i / S) - 1) & 1);
        bar_expect(smem_u32(&full[s]), STAGE);
        bulk_copy(smem_u32(sm + s * STAGE), w + (size_t)g * R * K, STAGE, smem_u32(&full[s]));
      }
    }
    return;
  }
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int r = warp / WPR, h = warp % WPR;
  float xf[V * 8];
  const uint4* xr = reinterpret_cast<const uint4*>(x + h * KW);
#pragma unroll
  for (int v = 0; v < V; ++v) unpack8(xr[lane + 32 * v], xf + 8 * v);
  for (int g = g0, i = 0; g < g1; ++g, ++i) {
    int s = i % S;
    bar_wait(smem_u32(&full[s]), (i / S) & 1);
    const uint4* ws = reinterpret_cast<const uint4*>(sm + s * STAGE + (size_t)r * K * 2 + h * KW * 2);
    float acc = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v) fma8(acc, ws[lane + 32 * v], xf + 8 * v);
    __syncwarp();
    if (lane == 0) bar_arrive(smem_u32(&empty[s]));
    acc = warp_sum(acc);
    if (lane == 0) part[i & 1][warp] = acc;
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (threadIdx.x < R) {
      float t = 0.f;
#pragma unroll
      for (int q = 0; q < WPR; ++q) t += part[i & 1][threadIdx.x * WPR + q];
      y[(size_t)g * R + threadIdx.x] = __float2bfloat16(t);
    }
  }
}

struct Prod { int n, k; };
static const Prod layer[4] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};

int main(int argc, char** argv) {
  int layers = 32, sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t wbytes = 0;
  for (auto p : layer) wbytes += (size_t)p.n * p.k * 2;
  std::vector<__nv_bfloat16*> W(layers * 4);
  for (int l = 0; l < layers; ++l) for (int q = 0; q < 4; ++q) {
    size_t e = (size_t)layer[q].n * layer[q].k;
    CK(cudaMalloc(&W[l * 4 + q], e * 2));
    init_bf16<<<1024, 256>>>(W[l * 4 + q], e, sqrtf(3.0f / layer[q].k), l * 4 + q + 1);
  }
  __nv_bfloat16 *buf[2];
  for (int b = 0; b < 2; ++b) { CK(cudaMalloc(&buf[b], 28672 * 2)); init_bf16<<<32, 256>>>(buf[b], 28672, 1.0f, 99); }
  __nv_bfloat16* x0; CK(cudaMalloc(&x0, 28672 * 2)); init_bf16<<<32, 256>>>(x0, 28672, 1.0f, 99);
  CK(cudaDeviceSynchronize());
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));


  struct Var { const char* name; int variant; int S; int cps; bool pdl; const void* k4; const void* k14; };
  std::vector<Var> vars = {
    {"plain warp/row", 0, 0, 0, false, (const void*)gemv_plain<4096, false>, (const void*)gemv_plain<14336, false>},
    {"plain warp/row, PDL", 0, 0, 0, true, (const void*)gemv_plain<4096, true>, (const void*)gemv_plain<14336, true>},
    {"ring S3 1/SM", 1, 3, 1, false, (const void*)gemv_ring<4096, 4, 3, false>, (const void*)gemv_ring<14336, 1, 3, false>},
    {"ring S3 1/SM PDL", 1, 3, 1, true, (const void*)gemv_ring<4096, 4, 3, true>, (const void*)gemv_ring<14336, 1, 3, true>},
    {"ring S6 1/SM", 1, 6, 1, false, (const void*)gemv_ring<4096, 4, 6, false>, (const void*)gemv_ring<14336, 1, 6, false>},
    {"ring S6 1/SM PDL", 1, 6, 1, true, (const void*)gemv_ring<4096, 4, 6, true>, (const void*)gemv_ring<14336, 1, 6, true>},
    {"ring S3 2/SM", 1, 3, 2, false, (const void*)gemv_ring<4096, 4, 3, false>, (const void*)gemv_ring<14336, 1, 3, false>},
    {"ring S3 2/SM PDL", 1, 3, 2, true, (const void*)gemv_ring<4096, 4, 3, true>, (const void*)gemv_ring<14336, 1, 3, true>},
  };
  for (auto& v : vars) if (v.variant == 1) {
    CK(cudaFuncSetAttribute(v.k4, cudaFuncAttributeMaxDynamicSharedMemorySize, v.S * 4 * 4096 * 2));
    CK(cudaFuncSetAttribute(v.k14, cudaFuncAttributeMaxDynamicSharedMemorySize, v.S * 14336 * 2));
  }
  std::vector<float> ref;
  for (int round = 0; round < 2; ++round)
  for (auto& v : vars) {
    auto run_layers = [&](int nl) {
      const __nv_bfloat16* in = x0; int b = 0;
      for (int l = 0; l < nl; ++l) for (int q = 0; q < 4; ++q) {
        int n = layer[q].n; const void* kern = layer[q].k == 4096 ? v.k4 : v.k14;
        __nv_bfloat16* out = buf[b]; b ^= 1;
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.stream = st; cfg.attrs = at; cfg.numAttrs = v.pdl ? 1 : 0;
        int k = layer[q].k;
        if (v.variant == 0) { cfg.gridDim = dim3((n + 7) / 8); cfg.blockDim = dim3(256); }
        else { int R = k == 4096 ? 4 : 1; cfg.gridDim = dim3(sms * v.cps); cfg.blockDim = dim3(288); cfg.dynamicSmemBytes = (size_t)v.S * R * k * 2; }
        const __nv_bfloat16* wp = W[l * 4 + q];
        void* args[] = {(void*)&wp, (void*)&in, (void*)&out, (void*)&n};
        CK(cudaLaunchKernelExC(&cfg, kern, args));
        in = out;
      }
      return in;
    };
    // correctness: final vector against the first variant's
    const __nv_bfloat16* fin = run_layers(layers);
    CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
    std::vector<__nv_bfloat16> h(4096); CK(cudaMemcpy(h.data(), fin, 4096 * 2, cudaMemcpyDeviceToHost));
    std::vector<float> hf(4096); for (int i = 0; i < 4096; ++i) hf[i] = __bfloat162float(h[i]);
    double err = 0, mag = 0;
    if (ref.empty()) ref = hf;
    for (int i = 0; i < 4096; ++i) { err = fmax(err, fabs(hf[i] - ref[i])); mag = fmax(mag, fabs(ref[i])); }
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    run_layers(layers);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::vector<float> ts;
    for (int rep = 0; rep < 15; ++rep) {
      CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    float med = ts[ts.size() / 2];
    printf("%-24s %8.1f us/layer  %5.2f TB/s  (max|diff| %.3g of %.3g)\n", v.name, med * 1000 / layers, wbytes * layers / (med * 1e-3) / 1e12, err, mag);
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  }
  return 0;
}
