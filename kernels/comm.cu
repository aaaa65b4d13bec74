// Collectives between the GPUs of one tensor-parallel group in one process, through memory the
// ranks map into each other's address space (peer access over NVLink or PCIe): a step's small
// all-reduces (decode's residual stream) cost one kernel and one barrier instead of a NCCL launch,
// and they can be recorded into CUDA graphs.
//
// Each rank owns, in its own device memory:
//   - a staging buffer of two halves of `half_elems` bf16. Call e uses half e % 2, so a rank never
//     overwrites what a peer may still be reading: to be in call e + 2 it must have finished call
//     e + 1, which needs every peer to have started it (joined its barriers, or pushed its lines)
//     after finishing call e;
//   - signals (u32): COMM_MAX_BLOCKS x COMM_MAX_RANKS arrival epochs that peers write, then the
//     rank's epoch (calls made so far) and a count of the blocks of the current call that are done.
// `table` (u64, on each rank): the staging base of every rank, then the signals base of every
// rank, then the base of every rank's inbox of flagged lines (all_reduce_flagged_bf16),
// COMM_MAX_RANKS entries each. Every rank launches the same grid for a call (it depends on the
// message's size and the group's block cap only), so block b of every rank handles the same
// elements and meets only block b of its peers.
#include "common.cuh"

__device__ __forceinline__ void comm_store_release(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned comm_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ __nv_bfloat16 comm_load_fresh_bf16(const __nv_bfloat16* p) {
    unsigned short v;
    asm volatile("ld.volatile.global.u16 %0, [%1];\n" : "=h"(v) : "l"(p) : "memory");
    return __ushort_as_bfloat16(v);
}

// Barrier with block blockIdx.x of every rank: publish that this block's part of the call is
// staged, wait until every rank's is.
__device__ __forceinline__ void comm_barrier(const CommCall& call, int rank, int world,
                                             const unsigned long long* table,
                                             const volatile int* abort_flag) {
    __syncthreads();
    if (threadIdx.x < world) {
        unsigned* peer_signals = reinterpret_cast<unsigned*>(table[COMM_MAX_RANKS + threadIdx.x]);
        comm_store_release(peer_signals + blockIdx.x * COMM_MAX_RANKS + rank, call.epoch);
        const unsigned* arrived = call.signals + blockIdx.x * COMM_MAX_RANKS + threadIdx.x;
        for (unsigned spins = 0; (int)(comm_load_acquire(arrived) - call.epoch) < 0; spins++) {
            if ((spins & 1023u) == 1023u && *abort_flag) break;
        }
    }
    __syncthreads();
}

// Sums the first n values of x over the group, in place, in rank order (0, 1, ..., world - 1,
// in f32, rounded once to bf16), so every rank ends with the same bits. `abort_flag` is host
// memory: when the host sets it (a rank failed and will never arrive), waiting blocks give up and
// x is left unspecified.
extern "C" __global__ void __launch_bounds__(512) all_reduce_pulled_bf16(
    __nv_bfloat16* x, long long n, int rank, int world, const unsigned long long* table,
    long long half_elems, const volatile int* abort_flag) {
    const CommCall call = comm_begin_call(table, rank);
    const long long half = (long long)(call.epoch & 1u) * half_elems;
    __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(table[rank]) + half;

    // 16-byte chunks are dealt to (block, thread) the same way on every rank; the tail of
    // n % 8 values goes to block 0.
    const long long chunks = n / 8;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tail = chunks * 8 + threadIdx.x;
    const bool has_tail = blockIdx.x == 0 && tail < n;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* sv = reinterpret_cast<uint4*>(staging);
    for (long long c = first; c < chunks; c += stride) sv[c] = xv[c];
    if (has_tail) staging[tail] = x[tail];

    comm_barrier(call, rank, world, table, abort_flag);

    for (long long c = first; c < chunks; c += stride) {
        float acc[8], part[8];
        bf16x8_unpack(rank == 0 ? xv[c]
                                : comm_load_fresh(reinterpret_cast<const uint4*>(
                                      reinterpret_cast<const __nv_bfloat16*>(table[0]) + half) + c),
                      acc);
        for (int r = 1; r < world; r++) {
            const uint4* peer = reinterpret_cast<const uint4*>(
                reinterpret_cast<const __nv_bfloat16*>(table[r]) + half);
            bf16x8_unpack(r == rank ? xv[c] : comm_load_fresh(peer + c), part);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] += part[k];
        }
        reinterpret_cast<uint4*>(x)[c] = bf16x8_pack(acc);
    }
    if (has_tail) {
        float acc = 0.f;
        for (int r = 0; r < world; r++) {
            const __nv_bfloat16* peer = reinterpret_cast<const __nv_bfloat16*>(table[r]) + half;
            acc += __bfloat162float(r == rank ? x[tail] : comm_load_fresh_bf16(peer + tail));
        }
        x[tail] = __float2bfloat16_rn(acc);
    }
    comm_end_call(call);
}

// The same sums as all_reduce_pulled_bf16 (rank order, f32, rounded once: the same bits), for
// messages small enough that latency rules them: each rank stores its part straight into every
// peer's inbox as flagged lines and sums what its own inbox receives. `table[2 * COMM_MAX_RANKS +
// r]` is rank r's inbox: two halves (by the call's parity) of `world` senders' slots of
// `slot_lines` lines of 4 bf16. A rank writes a peer's half e % 2 in call e only after it
// received every peer's part of call e - 1, which the peer sent after reading its inbox in call
// e - 2.
extern "C" __global__ void __launch_bounds__(512) all_reduce_flagged_bf16(
    __nv_bfloat16* x, long long n, int rank, int world, const unsigned long long* table,
    long long slot_lines, const volatile int* abort_flag) {
    const CommCall call = comm_begin_call(table, rank);
    const unsigned epoch = call.epoch;
    const long long half = (long long)(epoch & 1u) * world * slot_lines;
    // Each thread takes 8 values (two lines) at a time; the tail of n % 8 values is padded with
    // zeros into the last pair of lines, which the thread of the last chunk handles.
    const long long chunks = (n + 7) / 8;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool whole = n % 8 == 0;
    auto own_chunk = [&](long long c) -> uint4 {
        if (whole || c * 8 + 8 <= n) return reinterpret_cast<const uint4*>(x)[c];
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = c * 8 + k < n ? __bfloat162float(x[c * 8 + k]) : 0.f;
        return bf16x8_pack(v);
    };
    for (long long c = first; c < chunks; c += stride) {
        const uint4 v = own_chunk(c);
        for (int r = 0; r < world; r++) {
            if (r == rank) continue;
            uint4* slot = reinterpret_cast<uint4*>(table[2 * COMM_MAX_RANKS + r]) + half +
                          (long long)rank * slot_lines;
            comm_push_line(slot + 2 * c, v.x, v.y, epoch);
            comm_push_line(slot + 2 * c + 1, v.z, v.w, epoch);
        }
    }
    const uint4* inbox = reinterpret_cast<const uint4*>(table[2 * COMM_MAX_RANKS + rank]) + half;
    for (long long c = first; c < chunks; c += stride) {
        const uint4 mine = own_chunk(c);
        auto part_of = [&](int r) -> uint4 {
            if (r == rank) return mine;
            const uint4* slot = inbox + (long long)r * slot_lines;
            const uint2 lo = comm_pull_line(slot + 2 * c, epoch, abort_flag);
            const uint2 hi = comm_pull_line(slot + 2 * c + 1, epoch, abort_flag);
            return make_uint4(lo.x, lo.y, hi.x, hi.y);
        };
        float acc[8], part[8];
        bf16x8_unpack(part_of(0), acc);
        for (int r = 1; r < world; r++) {
            bf16x8_unpack(part_of(r), part);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] += part[k];
        }
        if (whole || c * 8 + 8 <= n) {
            reinterpret_cast<uint4*>(x)[c] = bf16x8_pack(acc);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                if (c * 8 + k < n) x[c * 8 + k] = __float2bfloat16_rn(acc[k]);
            }
        }
    }
    comm_end_call(call);
}

// Rank 0's first n words of x replace every other rank's (the tokens rank 0 sampled, which the
// peers embed when the next step names them). One block; it takes a call's epoch and staging
// half like an all-reduce, so the two kinds of call interleave freely.
extern "C" __global__ void __launch_bounds__(512) broadcast_from_first_u32(
    unsigned* x, long long n, int rank, int world, const unsigned long long* table,
    long long half_elems, const volatile int* abort_flag) {
    const CommCall call = comm_begin_call(table, rank);
    // A staging half of bf16 holds half_elems / 2 words.
    const long long half = (long long)(call.epoch & 1u) * half_elems;
    if (rank == 0) {
        unsigned* staging = reinterpret_cast<unsigned*>(
            reinterpret_cast<__nv_bfloat16*>(table[0]) + half);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) staging[i] = x[i];
    }
    comm_barrier(call, rank, world, table, abort_flag);
    if (rank != 0) {
        const unsigned* root = reinterpret_cast<const unsigned*>(
            reinterpret_cast<const __nv_bfloat16*>(table[0]) + half);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned v;
            asm volatile("ld.volatile.global.u32 %0, [%1];\n" : "=r"(v) : "l"(root + i) : "memory");
            x[i] = v;
        }
    }
    comm_end_call(call);
}

// Rank 0 gathers the logits of a head split over the vocabulary. Rank r's `part` holds its rows x
// cols_r values, row-major, for its columns r * vocab / world.. (turbo_core::comm::vocab_part);
// rank 0 writes every part into out ([rows, vocab]), the peers only send. The peers stage their
// part in their staging half (f32, half_elems / 2 of them: the host splits larger messages into
// calls of fewer rows), the ranks meet at the barrier, and rank 0 reads the staged parts. Every
// rank launches the same grid, and a block reads on rank 0 exactly what the same block of each
// peer staged, so the per-block barrier covers it.
extern "C" __global__ void __launch_bounds__(512) gather_parts_to_first_f32(
    float* out, const float* part, long long rows, long long vocab, int rank, int world,
    const unsigned long long* table, long long half_elems, const volatile int* abort_flag) {
    const CommCall call = comm_begin_call(table, rank);
    const long long half = (long long)(call.epoch & 1u) * half_elems;
    auto staged = [&](int r) {
        return reinterpret_cast<float*>(reinterpret_cast<__nv_bfloat16*>(table[r]) + half);
    };
    auto start_of = [&](long long r) { return r * vocab / world; };
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    // Whole 16-byte units where every part starts and ends on a multiple of 4 columns.
    const bool vec = vocab % (4 * world) == 0;
    if (rank != 0) {
        const long long n = rows * (start_of(rank + 1) - start_of(rank));
        float* dst = staged(rank);
        if (vec) {
            for (long long u = first; u < n / 4; u += stride)
                reinterpret_cast<float4*>(dst)[u] = reinterpret_cast<const float4*>(part)[u];
        } else {
            for (long long i = first; i < n; i += stride) dst[i] = part[i];
        }
    }
    comm_barrier(call, rank, world, table, abort_flag);
    if (rank == 0) {
        for (int r = 0; r < world; r++) {
            const long long start = start_of(r), cols = start_of(r + 1) - start;
            const float* src = r == 0 ? part : staged(r);
            if (vec) {
                const long long units = cols / 4;
                for (long long u = first; u < rows * units; u += stride) {
                    const long long row = u / units;
                    const uint4 v = r == 0 ? reinterpret_cast<const uint4*>(src)[u]
                                           : comm_load_fresh(reinterpret_cast<const uint4*>(src) + u);
                    *reinterpret_cast<uint4*>(out + row * vocab + start + 4 * (u - row * units)) = v;
                }
            } else {
                for (long long i = first; i < rows * cols; i += stride) {
                    const long long row = i / cols;
                    float v;
                    if (r == 0) {
                        v = src[i];
                    } else {
                        asm volatile("ld.volatile.global.f32 %0, [%1];\n" : "=f"(v) : "l"(src + i) : "memory");
                    }
                    out[row * vocab + start + (i - row * cols)] = v;
                }
            }
        }
    }
    comm_end_call(call);
}
