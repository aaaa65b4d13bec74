// Prefill and cascade attention for Hopper (sm_90a): warpgroup MMA (wgmma) over paged KV.
//
// Built as compute_90a PTX (`cargo xtask kernels` builds files named *_sm90a.cu for that target),
// which only an sm_90 device loads; elsewhere the mma.sync kernels of attention.cu do this work.
// The arguments, work items and semantics are those of attn_prefill_d128 / attn_shared_d128
// (kernels/attention.cu), with 128 query rows per CTA, so the host plans both the same way.
//
// One CTA (384 threads) computes 128 query rows of one span for one head (or, for cascade, 128
// flattened (row, query head) pairs of one KV head over a prefix chunk), FlashAttention-3's way:
// a producer warpgroup gathers Q and the K and V tiles, and two consumer warpgroups of 64 rows
// each walk the keys in tiles of 128:
//   S = Q·Kᵀ   wgmma m64n128k16, Q and K both read from shared memory through descriptors
//   mask, online softmax in the log2 domain (registers; a quad of lanes holds a row's scores)
//   O += P·V   wgmma m64n128k16, P from registers (bf16), V from shared memory, transposed
// Step j issues S(j) and P(j - 1)·V(j - 1) together and computes the softmax of S(j) while the
// tensor cores run the second product (intra-warpgroup overlap), and the two consumers take turns
// issuing (see the roles below). The producer gathers each key's K and V rows from the paged
// cache (through the block table, looked up a tile ahead) with 16-byte cp.async copies into
// two-stage rings, handing stages over through mbarriers, so no CTA-wide barrier stops the
// consumers. Shared tiles use the 128-byte swizzle wgmma reads: a tile of rows of 128 dimensions
// is two panels of 64 dimensions (rows of 128 bytes), and the 16-byte chunk c of row r of a panel
// sits at chunk c ^ (r mod 8).
//
// Measured on an H200 (causal, 32 heads, d 128; docs/perf/h100.md), S 8192 / S 2048: 1.237 ms /
// 96.7 µs, against 1.555 ms / 122.7-129.3 µs for the kernel this replaced (two warpgroups that
// both copied and computed, with CTA-wide barriers between tiles); three stages a ring 1.308 ms /
// 103.5 µs; without the turns 1.245 ms / 98.7 µs.
#include "common.cuh"

#define WG_THREADS 384  // a producer warpgroup and two consumer warpgroups
// How far (log2 units) a row's maximum may grow past the one its exponentials use before O is
// rescaled: P then stays below 2^8, far inside bf16's range (the row sums are f32).
#define WG_RESCALE_LOG2 8.f
#define WG_ROWS 128     // query rows per CTA
#define WG_KEYS 128  // keys per tile
#define WG_HD 128
#define WG_PANEL (128 * 128)             // bytes of one 64-dimension panel of a 128-row tile
#define WG_TILE (2 * WG_PANEL)           // bytes of one 128 x 128 bf16 tile
#define WG_STAGES 2  // stages of the K ring and of the V ring (3 measured slower: above)
#define WG_SMEM (WG_TILE * (1 + 2 * WG_STAGES) + 8 * WG_BARS)  // Q, the rings, the barriers (below)
// A quantized cache (KV_INT8, KV_FP8) adds, before the barriers: each K stage's key and value
// scales (WG_KEYS of each, f32), and the producer's staging area for one tile's 8-bit codes of K
// and of V and their scales.
#define WG_SCALES (2 * WG_KEYS * 4)                       // bytes of one K stage's scales
#define WG_STAGING (2 * WG_KEYS * WG_HD + 2 * WG_KEYS * 4)  // codes of K and V, then their scales
#define WG_SMEM_QUANT (WG_TILE * (1 + 2 * WG_STAGES) + WG_STAGES * WG_SCALES + WG_STAGING + 8 * WG_BARS)

extern __shared__ __align__(1024) unsigned char wg_smem[];

__device__ __forceinline__ float wg_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t wg_smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared; with valid == false nothing is read and 16 zero bytes written.
__device__ __forceinline__ void wg_cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// The same for 4 bytes.
__device__ __forceinline__ void wg_cp_async4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ float2 wg_lds_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint4 wg_lds_u4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ void wg_sts_u4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void wg_sts_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ float wg_lds_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}

// Byte offset of 16-byte chunk c (0..15, 8 dimensions each) of row r in a swizzled tile.
__device__ __forceinline__ uint32_t wg_chunk(int r, int c) {
    return (uint32_t)((c >> 3) * WG_PANEL + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A wgmma shared-memory descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets (each stored >> 4).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across a wgmma issue or wait.
__device__ __forceinline__ void wg_fence_regs(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// 2^x (MUFU, flushing subnormal results to 0: they are far below bf16's resolution of P).
__device__ __forceinline__ float wg_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t wg_pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// d (+)= A·B for one m64n128k16 step, A and B in shared memory (descriptors, both K-major);
// scale_d == 0 overwrites d instead of adding to it.
__device__ __forceinline__ void wg_mma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// d += A·B for one m64n128k16 step: A from registers (this warp's 16 rows as an m16n8k16 A
// fragment), B in shared memory stored N-major (transposed).
__device__ __forceinline__ void wg_mma_rs_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// The CTA's roles and barriers. Warpgroup 0 is the producer: it gathers Q once, then each K and
// V tile, into rings of WG_STAGES stages, and each copy's landing arrives on the stage's "full"
// barrier (cp.async.mbarrier.arrive). Warpgroups 1 and 2 are the consumers, 64 query rows each:
// they wait on a stage's full barrier, and once their wgmma groups that read it are done they
// arrive on its "empty" barrier (one arrival per warp), which the producer waits on before it
// refills the stage. Stage s of tile j is in its (j / WG_STAGES)-th use: the barriers' phase
// parity is that use's.
//
// The producer gives most of its registers to the consumers (setmaxnreg): 128 x 40 + 256 x 232
// is the 384 x 168 the CTA is launched with.
//
// The two consumers take turns issuing their wgmma groups (named barriers 1 and 2, FlashAttention-3's
// ping-pong): while one warpgroup's products run on the tensor cores, the other computes its
// softmax, so the tensor cores see one product after another instead of both warpgroups' products
// together and then nothing during both softmaxes.
#define WG_PRODUCER_REGS 40
#define WG_CONSUMER_REGS 232
enum : int { WG_BAR_Q = 0, WG_BAR_FULL_K = 1, WG_BAR_FULL_V = 1 + WG_STAGES, WG_BAR_EMPTY_K = 1 + 2 * WG_STAGES,
             WG_BAR_EMPTY_V = 1 + 3 * WG_STAGES, WG_BARS = 1 + 4 * WG_STAGES };

__device__ __forceinline__ void wg_bar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void wg_bar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWG_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WG_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void wg_bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier once every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void wg_bar_arrive_copies(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Makes shared memory written through the generic proxy (cp.async) visible to wgmma's reads.
__device__ __forceinline__ void wg_fence_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// KIND (common.cuh): KV_BF16 caches are gathered straight into the rings by cp.async. With an
// 8-bit cache (KV_INT8, KV_FP8) the producer gathers each tile's codes and scales into a staging
// area, then writes the codes into the ring's stage as bf16 (kvq_decode4_bf16x2: INT8 codes
// exactly, FP8 values times u^-2, u = kvq_bf16_half_unit) and the tile's key and value scales
// (times u) beside its K stage. The consumers multiply each key's column of S by its scale (so
// scores are in units of 1 / u, which the log2 factor and the lse take back), and each key's
// softmax weight, once summed into l, by its value scale before P is packed (so O is in units of
// 1 / u, taken back when it is normalized): no dequantised copy and no extra pass. A K stage
// holds its tile's value scales, so the consumers release it after the softmax instead of
// before.
template <bool SHARED, int KIND>
__device__ __forceinline__ void attn_prefill_wg(const __nv_bfloat16* __restrict__ q,
                                                const __nv_bfloat16* __restrict__ k_cache,
                                                const __nv_bfloat16* __restrict__ v_cache,
                                                const uint32_t* __restrict__ tables,
                                                const uint32_t* __restrict__ seq_table_start,
                                                const uint32_t* __restrict__ items, int n_heads, int group,
                                                int n_kv_heads, int block_size, int block_shift, float scale,
                                                __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out,
                                                const uint32_t* __restrict__ shared_tokens,
                                                const uint32_t* __restrict__ token_state,
                                                float* __restrict__ part_o, float* __restrict__ part_lse) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const uint32_t sQ = wg_smem_addr(wg_smem);
    constexpr bool QUANT = KIND != KV_BF16;
    const uint32_t sK = sQ + WG_TILE, sV = sK + WG_STAGES * WG_TILE;  // stage s at + s · WG_TILE
    // Quantized caches: K stage s's key scales at sScales + s · WG_SCALES, its value scales
    // WG_KEYS · 4 bytes later; the staging area's K codes [row][WG_HD], V codes, K scales, V scales.
    const uint32_t sScales = sV + WG_STAGES * WG_TILE, sStaging = sScales + WG_STAGES * WG_SCALES;
    const uint32_t bars = QUANT ? sStaging + WG_STAGING : sV + WG_STAGES * WG_TILE;
    auto bar = [&](int i) { return bars + 8u * (uint32_t)i; };

    // Prefill: one head, rows token0 + r at positions pos0 + r, keys [0, pos0 + n_rows).
    // SHARED: one KV head, flattened rows f0 + r, keys [k0, k1).
    int head;
    uint32_t token0, n_rows, pos0, seq, k0, k1, f0 = 0, chunk = 0;
    if constexpr (SHARED) {
        const uint32_t* it = items + 8 * (size_t)blockIdx.x;
        f0 = it[0];
        n_rows = it[1];
        k0 = it[2];
        k1 = it[3];
        seq = it[4];
        chunk = it[5];
        head = (int)it[6] * group;
        token0 = pos0 = 0;
    } else {
        head = (int)(blockIdx.x % (unsigned)n_heads);
        const size_t item = blockIdx.x / (unsigned)n_heads;
        token0 = items[4 * item];
        n_rows = items[4 * item + 1];
        pos0 = items[4 * item + 2];
        seq = items[4 * item + 3];
        k0 = 0;
        k1 = pos0 + n_rows;
    }
    auto row_of = [&](uint32_t r, uint32_t& token, int& h) {
        if constexpr (SHARED) {
            token = shared_tokens[(f0 + r) / (uint32_t)group];
            h = head + (int)((f0 + r) % (uint32_t)group);
        } else {
            token = token0 + r;
            h = head;
        }
    };
    const int n_tiles = (int)((k1 - k0 + WG_KEYS - 1) / WG_KEYS);

    if (tid == 0) {
        wg_bar_init(bar(WG_BAR_Q), 128);
#pragma unroll
        for (int s = 0; s < WG_STAGES; s++) {
            wg_bar_init(bar(WG_BAR_FULL_K + s), 128);
            wg_bar_init(bar(WG_BAR_FULL_V + s), 128);
            wg_bar_init(bar(WG_BAR_EMPTY_K + s), 8);
            wg_bar_init(bar(WG_BAR_EMPTY_V + s), 8);
        }
    }
    __syncthreads();

    if (wg == 0) {
        // -- the producer ----------------------------------------------------------------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WG_PRODUCER_REGS));
        constexpr int PASSES = WG_KEYS / 16;  // rows a thread copies per tile, two chunks each
        const int c0 = tid & 7;                // chunks c0 and c0 + 8 (one in each panel)
        const uint32_t* table = tables + seq_table_start[seq];
        const size_t slot_stride = (size_t)n_kv_heads * WG_HD;
        const size_t head_off = (size_t)(head / group) * WG_HD + (size_t)c0 * 8;
        // Q rows (zeros past the item's rows).
#pragma unroll
        for (int p = 0; p < PASSES; p++) {
            const int r = (tid >> 3) + 16 * p;
            const bool valid = (uint32_t)r < n_rows;
            const __nv_bfloat16* src = q;
            if (valid) {
                uint32_t token;
                int h;
                row_of((uint32_t)r, token, h);
                src = q + ((size_t)token * (size_t)n_heads + (size_t)h) * WG_HD + c0 * 8;
            }
            wg_cp_async16(sQ + wg_chunk(r, c0), src, valid);
            wg_cp_async16(sQ + wg_chunk(r, c0 + 8), src + 64, valid);
        }
        wg_bar_arrive_copies(bar(WG_BAR_Q));
        // Cache rows (block · block_size + slot) of the keys this thread copies for tile j; ~0u
        // past k1. Looked up a tile ahead, so that the table reads are in flight meanwhile.
        uint32_t rows[PASSES];
        auto find_rows = [&](int j) {
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const uint32_t key = k0 + (uint32_t)(j * WG_KEYS + (tid >> 3) + 16 * p);
                uint32_t row = ~0u;
                if (key < k1) {
                    const uint32_t b = block_shift >= 0 ? key >> block_shift : key / (uint32_t)block_size;
                    row = table[b] * (uint32_t)block_size + (key - b * (uint32_t)block_size);
                }
                rows[p] = row;
            }
        };
        // Copies the current tile's K (or V) rows into a stage (zeros past k1).
        auto copy_tile = [&](const __nv_bfloat16* __restrict__ cache, uint32_t stage) {
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int r = (tid >> 3) + 16 * p;
                const bool valid = rows[p] != ~0u;
                const __nv_bfloat16* src = valid ? cache + (size_t)rows[p] * slot_stride + head_off : cache;
                wg_cp_async16(stage + wg_chunk(r, c0), src, valid);
                wg_cp_async16(stage + wg_chunk(r, c0 + 8), src + 64, valid);
            }
        };
        find_rows(0);
        if constexpr (QUANT) {
            // This thread stages codes [16 cq, 16 cq + 16) of its rows (and, cq == 0, their
            // scales), then converts exactly those: no other producer thread reads them.
            const int cq = tid & 7;
            const int kvh = head / group;
            const unsigned char* kq = reinterpret_cast<const unsigned char*>(k_cache);
            const unsigned char* vq = reinterpret_cast<const unsigned char*>(v_cache);
            // Stages the K and V codes and scales of the tile whose rows are in rows[] (each
            // row's addresses computed once for both: the producer's instructions are what a
            // quantized tile waits on).
            auto stage_codes = [&] {
#pragma unroll
                for (int p = 0; p < PASSES; p++) {
                    const int r = (tid >> 3) + 16 * p;
                    const bool valid = rows[p] != ~0u;
                    size_t code = 0, sc = 0;
                    if (valid) {
                        const uint32_t b = block_shift >= 0 ? rows[p] >> block_shift : rows[p] / (uint32_t)block_size;
                        const uint32_t slot = rows[p] - b * (uint32_t)block_size;
                        code = kvq_code_at(b, slot, kvh, block_size, n_kv_heads, WG_HD) + (size_t)cq * 16;
                        sc = kvq_scale_at(b, slot, kvh, block_size, n_kv_heads, WG_HD);
                    }
                    const uint32_t at = sStaging + (uint32_t)(r * WG_HD + cq * 16);
                    wg_cp_async16(at, kq + code, valid);
                    wg_cp_async16(at + WG_KEYS * WG_HD, vq + code, valid);
                    if (cq == 0) {
                        const uint32_t sat = sStaging + 2 * WG_KEYS * WG_HD + 4u * (uint32_t)r;
                        wg_cp_async4(sat, kq + sc, valid);
                        wg_cp_async4(sat + 4 * WG_KEYS, vq + sc, valid);
                    }
                }
            };
            // The staged codes of K (values: V) as bf16 into a ring stage.
            auto convert = [&](bool values, uint32_t stage) {
                // Two rows at a time: the producer has 40 registers.
#pragma unroll 2
                for (int p = 0; p < PASSES; p++) {
                    const int r = (tid >> 3) + 16 * p;
                    const uint4 w = wg_lds_u4(sStaging + (uint32_t)((values ? WG_KEYS * WG_HD : 0) + r * WG_HD + cq * 16));
                    uint32_t b[8];
                    kvq_decode4_bf16x2<KIND>(w.x, b[0], b[1]);
                    kvq_decode4_bf16x2<KIND>(w.y, b[2], b[3]);
                    kvq_decode4_bf16x2<KIND>(w.z, b[4], b[5]);
                    kvq_decode4_bf16x2<KIND>(w.w, b[6], b[7]);
                    wg_sts_u4(stage + wg_chunk(r, 2 * cq), b[0], b[1], b[2], b[3]);
                    wg_sts_u4(stage + wg_chunk(r, 2 * cq + 1), b[4], b[5], b[6], b[7]);
                }
            };
            constexpr float u = kvq_bf16_half_unit<KIND>();
            // Tile j + 1's codes and scales are staged once tile j is converted; each tile waits
            // for all of its own. (Orders that staged K and V apart, in two passes, measured
            // slower.)
            stage_codes();
            for (int j = 0; j < n_tiles; j++) {
                const int s = j % WG_STAGES;
                const uint32_t refill_parity = (uint32_t)(j / WG_STAGES - 1) & 1u;
                asm volatile("cp.async.wait_all;\n" ::: "memory");
                if (j >= WG_STAGES) wg_bar_wait(bar(WG_BAR_EMPTY_K + s), refill_parity);
                convert(false, sK + (uint32_t)s * WG_TILE);
                // The tile's key and value scales go beside its K stage (the consumers read both
                // during its softmax).
                if (cq == 0) {
#pragma unroll
                    for (int p = 0; p < PASSES; p++) {
                        const uint32_t r4 = 4u * (uint32_t)((tid >> 3) + 16 * p);
                        const uint32_t from = sStaging + 2 * WG_KEYS * WG_HD + r4;
                        const uint32_t to = sScales + (uint32_t)s * WG_SCALES + r4;
                        wg_sts_f32(to, wg_lds_f32(from) * u);
                        wg_sts_f32(to + 4 * WG_KEYS, wg_lds_f32(from + 4 * WG_KEYS) * u);
                    }
                }
                wg_bar_arrive(bar(WG_BAR_FULL_K + s));
                if (j >= WG_STAGES) wg_bar_wait(bar(WG_BAR_EMPTY_V + s), refill_parity);
                convert(true, sV + (uint32_t)s * WG_TILE);
                wg_bar_arrive(bar(WG_BAR_FULL_V + s));
                if (j + 1 < n_tiles) {
                    find_rows(j + 1);
                    stage_codes();
                }
            }
        } else {
            for (int j = 0; j < n_tiles; j++) {
                const int s = j % WG_STAGES;
                const uint32_t refill_parity = (uint32_t)(j / WG_STAGES - 1) & 1u;
                if (j >= WG_STAGES) wg_bar_wait(bar(WG_BAR_EMPTY_K + s), refill_parity);
                copy_tile(k_cache, sK + (uint32_t)s * WG_TILE);
                wg_bar_arrive_copies(bar(WG_BAR_FULL_K + s));
                if (j >= WG_STAGES) wg_bar_wait(bar(WG_BAR_EMPTY_V + s), refill_parity);
                copy_tile(v_cache, sV + (uint32_t)s * WG_TILE);
                wg_bar_arrive_copies(bar(WG_BAR_FULL_V + s));
                if (j + 1 < n_tiles) find_rows(j + 1);
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // -- the consumers ---------------------------------------------------------------------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WG_CONSUMER_REGS));
    const int cw = wg - 1, wq = warp & 3;  // consumer warpgroup, and warp within it
    const int g = lane >> 2, t = lane & 3;  // accumulator row group and column pair
    // Turns at issuing wgmma groups: a warpgroup waits on its barrier (1 + cw) and, once it has
    // issued, lets the other go; the first consumer goes first.
    auto my_turn = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + cw) : "memory"); };
    auto your_turn = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - cw) : "memory"); };
    if (cw == 0) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    auto wait_full = [&](int first_bar, int j) {
        wg_bar_wait(bar(first_bar + j % WG_STAGES), (uint32_t)(j / WG_STAGES) & 1u);
        wg_fence_async_proxy();
    };
    // This warp is done with a stage (its wgmma groups that read it have completed).
    auto release = [&](int first_bar, int j) {
        __syncwarp();
        if (lane == 0) wg_bar_arrive(bar(first_bar + j % WG_STAGES));
    };

    // Scores to the log2 domain (a quantized cache's scores are in units of 1 / u).
    constexpr float u = QUANT ? kvq_bf16_half_unit<KIND>() : 1.f;
    const float sl2 = scale * u * 1.4426950408889634f;
    // This thread's rows: g (h = 0) and g + 8 (h = 1) of its warp's 16 rows.
    const int row_base = 64 * cw + 16 * wq + g;
    auto row_pos = [&](int h) { return pos0 + (uint32_t)(row_base + 8 * h); };
    float m[2] = {wg_neg_inf(), wg_neg_inf()}, l[2] = {0.f, 0.f};  // m: raw scores; l: this thread's columns
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    float s[64];                   // S(j), then P(j) in f32
    uint32_t pa[WG_KEYS / 16][4];  // P(j) as A fragments

    // Issues S(j) = Q·K(j)ᵀ as one wgmma group.
    auto issue_s = [&](int j) {
        const uint32_t stage = (uint32_t)(j % WG_STAGES) * WG_TILE;
#pragma unroll
        for (int ks = 0; ks < WG_HD / 16; ks++) {
            const uint32_t kofs = (uint32_t)((ks >> 2) * WG_PANEL + (ks & 3) * 32);
            wg_mma_ss(s, wg_desc(sQ + kofs + 64 * 128 * cw, 16, 1024), wg_desc(sK + stage + kofs, 16, 1024), ks);
        }
        wg_commit();
    };
    // Issues O += P(j)·V(j) as one wgmma group. V is B, N-major: keys 16kk.. are rows 16kk.. of
    // both panels; the panels (64 dimensions each) are WG_PANEL apart, groups of 8 keys 1024
    // bytes apart.
    auto issue_pv = [&](int j) {
        const uint32_t stage = (uint32_t)(j % WG_STAGES) * WG_TILE;
#pragma unroll
        for (int kk = 0; kk < WG_KEYS / 16; kk++) {
            wg_mma_rs_tb(o, pa[kk], wg_desc(sV + stage + (uint32_t)(kk * 16 * 128), WG_PANEL, 1024));
        }
        wg_commit();
    };
    // Masks S(j) and turns it into P(j) with the rows' new maxima; returns in corr the factors
    // that take O (and l) from the old maxima to the new.
    // A quantized cache: tile j's key and value scales (times u) for this thread's keys 8i + 2t
    // and 8i + 2t + 1, in its K stage.
    auto tile_scales = [&](int j) { return sScales + (uint32_t)(j % WG_STAGES) * WG_SCALES + 8u * (uint32_t)t; };
    auto softmax = [&](int j, float (&corr)[2]) -> bool {
        const uint32_t key0 = k0 + (uint32_t)j * WG_KEYS;
        if constexpr (QUANT) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const float2 ks = wg_lds_f2(tile_scales(j) + 32u * (uint32_t)i);
                s[4 * i] *= ks.x;
                s[4 * i + 1] *= ks.y;
                s[4 * i + 2] *= ks.x;
                s[4 * i + 3] *= ks.y;
            }
        }
        // Keys past each row's position (tiles reaching past the warp's first row) or, SHARED,
        // at or past k1 (the last tile). s[4i + e]: n-tile i, row g + 8 (e >> 1), key
        // key0 + 8i + 2t + (e & 1).
        const bool masked = SHARED ? key0 + WG_KEYS > k1 : key0 + WG_KEYS - 1 > pos0 + (uint32_t)(64 * cw + 16 * wq);
        if (masked) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const uint32_t key = key0 + (uint32_t)(8 * i + 2 * t + (e & 1));
                    if (SHARED ? key >= k1 : key > row_pos(e >> 1)) s[4 * i + e] = wg_neg_inf();
                }
            }
        }
        // The rows' maxima move only when one of the warp's rows has grown by more than
        // WG_RESCALE_LOG2 (log2 units) past the maximum its exponentials use: otherwise the
        // old maxima stay, P stays below 2^WG_RESCALE_LOG2, and O and l need no rescaling (a
        // warp-uniform skip of 64 multiplies a thread). Any maximum gives the same softmax and
        // lse (exponentials and sums both use it).
        float mx[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float v = m[h];
#pragma unroll
            for (int i = 0; i < 16; i++) v = fmaxf(v, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
            mx[h] = v;
            // True while m is -inf (the first tile); false while the row has seen no key.
            grow |= (v - m[h]) * sl2 > WG_RESCALE_LOG2;
        }
        const bool rescale = __any_sync(0xffffffffu, grow);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            corr[h] = 1.f;
            if (rescale) {
                // -inf only while a row has seen no key (not reachable: every row sees the
                // first key of the first tile); then everything below is 0 instead of NaN.
                const float mu = mx[h] == wg_neg_inf() ? 0.f : mx[h];
                corr[h] = wg_exp2((m[h] - mu) * sl2);  // 0 while m is -inf
                m[h] = mx[h];
            }
            const float mus = (m[h] == wg_neg_inf() ? 0.f : m[h]) * sl2;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                s[4 * i + 2 * h] = wg_exp2(fmaf(s[4 * i + 2 * h], sl2, -mus));
                s[4 * i + 2 * h + 1] = wg_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -mus));
                sum += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
                if constexpr (QUANT) {
                    const float2 vs = wg_lds_f2(tile_scales(j) + 4u * WG_KEYS + 32u * (uint32_t)i);
                    s[4 * i + 2 * h] *= vs.x;
                    s[4 * i + 2 * h + 1] *= vs.y;
                }
            }
            l[h] = l[h] * corr[h] + sum;
        }
        return rescale;
    };
    // O to the new maxima, and P(j) as A fragments: k-step kk covers keys 16kk.. = n-tiles 2kk
    // (a0, a1) and 2kk + 1 (a2, a3).
    auto rescale_and_pack = [&](bool rescale, const float (&corr)[2]) {
        if (rescale) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                o[4 * i] *= corr[0];
                o[4 * i + 1] *= corr[0];
                o[4 * i + 2] *= corr[1];
                o[4 * i + 3] *= corr[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < WG_KEYS / 16; kk++) {
            pa[kk][0] = wg_pack(s[8 * kk], s[8 * kk + 1]);
            pa[kk][1] = wg_pack(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = wg_pack(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = wg_pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    // Step 0: S(0) and its softmax. Step j: S(j) and its softmax while O += P(j - 1)·V(j - 1)
    // runs on the tensor cores. Then the last P·V. (No wgmma sits in a branch: ptxas would
    // serialize them all.)
    float corr[2];
    wait_full(WG_BAR_Q, 0);
    wait_full(WG_BAR_FULL_K, 0);
    my_turn();
    wg_fence();
    issue_s(0);
    your_turn();
    wg_wait<0>();
    wg_fence_regs(s);
    if constexpr (!QUANT) release(WG_BAR_EMPTY_K, 0);
    bool rescale = softmax(0, corr);
    if constexpr (QUANT) release(WG_BAR_EMPTY_K, 0);
    rescale_and_pack(rescale, corr);
    for (int j = 1; j < n_tiles; j++) {
        wait_full(WG_BAR_FULL_K, j);
        wait_full(WG_BAR_FULL_V, j - 1);
        my_turn();
        wg_fence();
        issue_s(j);
        issue_pv(j - 1);
        your_turn();
        wg_wait<1>();  // S(j); P(j - 1)·V(j - 1) may still run
        wg_fence_regs(s);
        if constexpr (!QUANT) release(WG_BAR_EMPTY_K, j);
        rescale = softmax(j, corr);
        if constexpr (QUANT) release(WG_BAR_EMPTY_K, j);
        wg_wait<0>();
        wg_fence_regs(o);
        release(WG_BAR_EMPTY_V, j - 1);
        rescale_and_pack(rescale, corr);
    }
    wait_full(WG_BAR_FULL_V, n_tiles - 1);
    my_turn();
    wg_fence();
    issue_pv(n_tiles - 1);
    // The second consumer's last turn is the CTA's last: it leaves no arrival behind.
    if (cw == 0) your_turn();
    wg_wait<0>();
    wg_fence_regs(o);

    // Normalize and write this thread's rows: columns 8i + 2t, 8i + 2t + 1 of each n-tile i.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const uint32_t r = (uint32_t)(row_base + 8 * h);
        if (r < n_rows) {
            const float inv = u / sum;  // O is in units of 1 / u
            const float lse = m[h] * (scale * u) + logf(sum);
            uint32_t token;
            int hr;
            row_of(r, token, hr);
            if constexpr (SHARED) {
                const size_t st = (size_t)(token_state[token] + chunk) * (size_t)n_heads + (size_t)hr;
                float* dst = part_o + st * WG_HD + 2 * t;
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
                }
                if (t == 0) part_lse[st] = lse;
            } else {
                const size_t row = (size_t)token * (size_t)n_heads + (size_t)hr;
                __nv_bfloat16* dst = out + row * WG_HD + 2 * t;
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    *reinterpret_cast<uint32_t*>(dst + 8 * i) = wg_pack(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
                }
                if (lse_out != nullptr && t == 0) lse_out[row] = lse;
            }
        }
    }
}

// The host launches these with WG_THREADS threads and WG_SMEM (bf16) or WG_SMEM_QUANT (the q8 and
// f8 kernels, which read INT8 and FP8 caches with the same arguments) bytes of dynamic shared
// memory (crates/turbo-kernels/src/ops/attention.rs must agree).
#define ATTN_WG_KERNELS(KIND, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_prefill_wg_##NAME##128(                    \
        ATTN_PREFILL_ARGS, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {                    \
        attn_prefill_wg<false, KIND>(q, k_cache, v_cache, tables, seq_table_start, items, n_heads, group,      \
                                     n_kv_heads, block_size, block_shift, scale, out, lse_out, nullptr,         \
                                     nullptr, nullptr, nullptr);                                                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_shared_wg_##NAME##128(                     \
        ATTN_PREFILL_ARGS, ATTN_SHARED_ARGS) {                                                                  \
        attn_prefill_wg<true, KIND>(q, k_cache, v_cache, tables, seq_table_start, items, n_heads, group,       \
                                    n_kv_heads, block_size, block_shift, scale, nullptr, nullptr,               \
                                    shared_tokens, token_state, part_o, part_lse);                             \
    }
ATTN_WG_KERNELS(KV_BF16, d)
ATTN_WG_KERNELS(KV_INT8, q8_d)
ATTN_WG_KERNELS(KV_FP8, f8_d)
