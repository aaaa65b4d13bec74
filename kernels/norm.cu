// norm kernels.
#include "common.cuh"

// RMSNorm of each row of x ([rows, cols] row-major) times w ([cols]):
//   out[r, c] = x[r, c] * rsqrt(mean_c(x[r, :]^2) + eps) * w[c]
// in f32, rounded to bf16 once. One block per row (blockDim.x a multiple of 32, at most 1024);
// 16-byte loads when cols % 8 == 0 and every pointer is 16-byte aligned, scalar otherwise.
// out may alias x: after the reduction, each thread reads and writes only its own elements.
extern "C" __global__ void __launch_bounds__(1024)
rms_norm_bf16(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* w, int rows, int cols,
              float eps) {
    const int row = blockIdx.x;
    if (row >= rows) return;  // uniform per block
    const size_t base = (size_t)row * (size_t)cols;
    const __nv_bfloat16* xr = x + base;
    __nv_bfloat16* orow = out + base;
    const bool vec = (cols % 8) == 0 && aligned16(x) && aligned16(w) && aligned16(out);

    float ss = 0.f;
    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        const int nv = cols / 8;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float f[8];
            bf16x8_unpack(xv[i], f);
#pragma unroll
            for (int k = 0; k < 8; k++) ss = fmaf(f[k], f[k], ss);
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = __bfloat162float(xr[i]);
            ss = fmaf(v, v, ss);
        }
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)cols + eps);

    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        const uint4* wv = reinterpret_cast<const uint4*>(w);
        uint4* ov = reinterpret_cast<uint4*>(orow);
        const int nv = cols / 8;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            float f[8], g[8];
            bf16x8_unpack(xv[i], f);
            bf16x8_unpack(wv[i], g);
#pragma unroll
            for (int k = 0; k < 8; k++) f[k] = f[k] * inv * g[k];
            ov[i] = bf16x8_pack(f);
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = __bfloat162float(xr[i]) * inv * __bfloat162float(w[i]);
            orow[i] = __float2bfloat16_rn(v);
        }
    }
}
