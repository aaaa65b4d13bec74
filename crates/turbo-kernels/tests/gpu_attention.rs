//! The paged-attention kernels against the CPU reference, `turbo_attention::paged_attention`.
//!
//! Every case draws fresh random q, K and V (uniform in (-1, 1), rounded to bf16), lays each
//! sequence's KV out in blocks taken from a shuffled list of block ids (so tables are neither
//! contiguous nor monotonic, and the cache holds unused blocks of random data too), puts the
//! sequences' query rows in a shuffled order, poisons `out` and `lse` with NaN, and compares
//! with the CPU reference run on the same bf16 values converted to f32.
//!
//! Under `KvSplit::Auto`, spans of at least `PREFILL_MIN_ROWS` rows with head_dim 64 or 128 go to
//! the tensor-core prefill kernel, everything else to a row kernel; `Off` and `Chunk` send every
//! row to a row kernel. Every split runs with both row kernels: the grouped tensor-core decode
//! kernel (`RowKernel::Auto`, head_dim 64 and 128; the CUDA-core one for the others) and the
//! per-head CUDA-core kernel (`RowKernel::PerHead`).
//!
//! Tolerances:
//! - out: each output is a convex combination of values in [-1, 1], so |o| <= 1. The kernels
//!   compute in f32 from the same bf16 inputs as the reference, so the two differ by f32 rounding
//!   (summation order, exp2 vs exp: ~1e-6) plus the final rounding to bf16 (relative 2^-8,
//!   absolute <= 2^-9 for |o| <= 1). 1.5e-2 absolute leaves ample room for that, and is still far
//!   below what a wrong key, block, head, position or softmax weight would cause. The prefill
//!   and grouped decode kernels also round the softmax weights to bf16 for their P·V product
//!   (relative 2^-9 each, so at most 2^-9 · Σ p|v| / Σ p <= 2^-9 on the output), which the margin
//!   covers too.
//! - lse: f32 on both sides, no bf16 rounding. A score's rounding error is ~1e-6 of its size
//!   and the sum of up to a few thousand positive terms differs by at most ~n·eps relatively
//!   (a few 1e-4 at worst, which ln turns into the same absolute error), so
//!   1e-3 · (1 + |lse|) bounds it.

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::kv_quant::{dequantize_row, quantize_row};
use turbo_attention::{KvDtype, PagedKv, QuerySpan};
use turbo_kernels::ops::attention::{
    logit_row_stride, paged_attention, paged_attention_with, AttentionPlan, KvLayout, KvSplit,
    LogitScoring, PlanOptions, PrefillKernel, RowKernel, PREFILL_MIN_ROWS,
};
use turbo_kernels::CudaDevice;

const OUT_TOL: f32 = 1.5e-2;
const LSE_TOL: f32 = 1e-3;

macro_rules! require_gpu {
    () => {
        if !turbo_kernels::cuda_available() {
            eprintln!("skipping: no CUDA device");
            return;
        }
    };
}

/// One attention problem: head shapes, block size and the sequences as (n_q, kv_len).
#[derive(Clone, Debug)]
struct Case {
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    seqs: Vec<(usize, usize)>,
    seed: u64,
}

/// A case's random data: q `[tokens, n_heads, head_dim]`, the caches, and per sequence its first
/// query row and its block table.
struct Problem {
    case: Case,
    n_tokens: usize,
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    q_starts: Vec<usize>,
    tables: Vec<Vec<u32>>,
    /// With a quantized dtype: the caches as the device holds them (each block's codes, then its
    /// scales; bytes two to a bf16) and their values decoded, which the reference reads.
    quantized: Option<Quantized>,
}

struct Quantized {
    dtype: KvDtype,
    k: Vec<bf16>,
    v: Vec<bf16>,
    k_values: Vec<f32>,
    v_values: Vec<f32>,
}

/// `cache` (bf16 `[block][slot][kv head][head_dim]`) quantized row by row with the CPU's
/// quantizer into the device layout of `kernels/common.cuh`, and the decoded values.
fn quantize_cache(dtype: KvDtype, case: &Case, cache: &[bf16]) -> (Vec<bf16>, Vec<f32>) {
    let (bs, kvh, hd) = (case.block_size, case.n_kv_heads, case.head_dim);
    let rows_per_block = bs * kvh;
    let block_bytes = rows_per_block * (hd + 4);
    let n_blocks = cache.len() / (rows_per_block * hd);
    let mut bytes = vec![0u8; n_blocks * block_bytes];
    let mut values = vec![0f32; cache.len()];
    let mut codes = vec![0u8; hd];
    for (r, row) in cache.chunks(hd).enumerate() {
        let (b, i) = (r / rows_per_block, r % rows_per_block);
        let x = to_f32(row);
        let scale = quantize_row(dtype, &x, &mut codes);
        dequantize_row(dtype, &codes, scale, &mut values[r * hd..(r + 1) * hd]);
        let at = b * block_bytes + i * hd;
        bytes[at..at + hd].copy_from_slice(&codes);
        // Scales [kv head][slot].
        let (slot, head) = (i / kvh, i % kvh);
        let sat = b * block_bytes + rows_per_block * hd + 4 * (head * bs + slot);
        bytes[sat..sat + 4].copy_from_slice(&scale.to_le_bytes());
    }
    let pairs = bytes
        .chunks(2)
        .map(|p| bf16::from_bits(u16::from_le_bytes([p[0], p[1]])))
        .collect();
    (pairs, values)
}

fn uniform_bf16(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

impl Problem {
    fn new(case: &Case) -> Problem {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
        let bs = case.block_size;
        let n_tokens: usize = case.seqs.iter().map(|s| s.0).sum();
        // Query rows: the sequences' row ranges in a shuffled order.
        let mut order: Vec<usize> = (0..case.seqs.len()).collect();
        order.shuffle(&mut rng);
        let mut q_starts = vec![0; case.seqs.len()];
        let mut row = 0;
        for &s in &order {
            q_starts[s] = row;
            row += case.seqs[s].0;
        }
        // Blocks: what each sequence needs, one more for every other sequence (tables may be
        // longer than needed), and a few spare; handed out from a shuffled list.
        let lens: Vec<usize> = case
            .seqs
            .iter()
            .enumerate()
            .map(|(i, &(_, kv))| kv.div_ceil(bs) + i % 2)
            .collect();
        let n_blocks = lens.iter().sum::<usize>() + 5;
        let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut tables = Vec::new();
        let mut next = 0;
        for &len in &lens {
            tables.push(ids[next..next + len].to_vec());
            next += len;
        }
        let cache_len = n_blocks * bs * case.n_kv_heads * case.head_dim;
        let q = uniform_bf16(&mut rng, n_tokens * case.n_heads * case.head_dim);
        let k = uniform_bf16(&mut rng, cache_len);
        let v = uniform_bf16(&mut rng, cache_len);
        Problem {
            case: case.clone(),
            n_tokens,
            q,
            k,
            v,
            q_starts,
            tables,
            quantized: None,
        }
    }

    /// The same problem over a cache quantized to `dtype` (the reference then reads the decoded
    /// values).
    fn quantize(mut self, dtype: KvDtype) -> Problem {
        if dtype.is_quantized() {
            let (k, k_values) = quantize_cache(dtype, &self.case, &self.k);
            let (v, v_values) = quantize_cache(dtype, &self.case, &self.v);
            self.quantized = Some(Quantized {
                dtype,
                k,
                v,
                k_values,
                v_values,
            });
        }
        self
    }

    fn dtype(&self) -> KvDtype {
        self.quantized.as_ref().map_or(KvDtype::Full, |q| q.dtype)
    }

    /// The caches as uploaded.
    fn caches(&self) -> (&[bf16], &[bf16]) {
        match &self.quantized {
            Some(q) => (&q.k, &q.v),
            None => (&self.k, &self.v),
        }
    }

    /// Makes the first `blocks` blocks of every member's table those of the first member, as the
    /// KV manager's prefix sharing does for a common prompt.
    fn share_prefix(&mut self, members: &[usize], blocks: usize) {
        let prefix = self.tables[members[0]][..blocks].to_vec();
        for &m in &members[1..] {
            self.tables[m][..blocks].copy_from_slice(&prefix);
        }
    }

    fn spans(&self) -> Vec<QuerySpan<'_>> {
        self.case
            .seqs
            .iter()
            .enumerate()
            .map(|(i, &(n_q, kv_len))| QuerySpan {
                q_start: self.q_starts[i],
                n_q,
                kv_len,
                block_table: &self.tables[i],
            })
            .collect()
    }

    fn layout(&self) -> KvLayout {
        KvLayout {
            block_size: self.case.block_size,
            n_kv_heads: self.case.n_kv_heads,
            head_dim: self.case.head_dim,
            dtype: self.dtype(),
        }
    }

    /// The CPU reference on the bf16 values (or the quantized cache's decoded values): (out, lse).
    fn reference(&self, scale: f32) -> (Vec<f32>, Vec<f32>) {
        let c = &self.case;
        let (keys, values) = match &self.quantized {
            Some(q) => (q.k_values.clone(), q.v_values.clone()),
            None => (to_f32(&self.k), to_f32(&self.v)),
        };
        let kv = PagedKv {
            keys: &keys,
            values: &values,
            block_size: c.block_size,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            quant: None,
        };
        let mut out = vec![0f32; self.q.len()];
        let mut lse = vec![0f32; self.n_tokens * c.n_heads];
        turbo_attention::paged_attention(
            &to_f32(&self.q),
            c.n_heads,
            &kv,
            &self.spans(),
            scale,
            &mut out,
            Some(&mut lse),
        );
        (out, lse)
    }
}

/// The problem's data on the device, with `out` and `lse` poisoned with NaN.
struct Device {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
}

impl Device {
    fn upload(dev: &CudaDevice, p: &Problem) -> Device {
        let s = &dev.stream;
        let (k, v) = p.caches();
        Device {
            q: s.clone_htod(&p.q).unwrap(),
            k: s.clone_htod(k).unwrap(),
            v: s.clone_htod(v).unwrap(),
            out: s.clone_htod(&vec![bf16::NAN; p.q.len()]).unwrap(),
            lse: s
                .clone_htod(&vec![f32::NAN; p.n_tokens * p.case.n_heads])
                .unwrap(),
        }
    }

    fn poison(&mut self, dev: &CudaDevice) {
        let s = &dev.stream;
        self.out = s.clone_htod(&vec![bf16::NAN; self.out.len()]).unwrap();
        self.lse = s.clone_htod(&vec![f32::NAN; self.lse.len()]).unwrap();
    }

    /// Runs the kernels with `options` (the defaults through the public entry point); returns out
    /// and, when asked for, lse.
    fn run(
        &mut self,
        dev: &CudaDevice,
        p: &Problem,
        scale: f32,
        options: PlanOptions,
        with_lse: bool,
    ) -> (Vec<f32>, Option<Vec<f32>>) {
        self.poison(dev);
        let spans = p.spans();
        let lse = with_lse.then_some(&mut self.lse);
        if options == PlanOptions::default() {
            paged_attention(
                dev,
                &self.q,
                &self.k,
                &self.v,
                p.layout(),
                p.case.n_heads,
                &spans,
                scale,
                &mut self.out,
                lse,
            )
            .unwrap();
        } else {
            paged_attention_with(
                dev,
                &self.q,
                &self.k,
                &self.v,
                p.layout(),
                p.case.n_heads,
                &spans,
                scale,
                options,
                &mut self.out,
                lse,
            )
            .unwrap();
        }
        let out = to_f32(&dev.stream.clone_dtoh(&self.out).unwrap());
        let lse = with_lse.then(|| dev.stream.clone_dtoh(&self.lse).unwrap());
        (out, lse)
    }
}

/// Compares a GPU result with the reference; panics naming the first element out of tolerance.
fn compare(
    what: &str,
    p: &Problem,
    (out, lse): (&[f32], Option<&[f32]>),
    (ref_out, ref_lse): (&[f32], &[f32]),
) {
    let c = &p.case;
    let d = c.head_dim;
    // Where each row comes from, for messages.
    let mut row_of = vec![(0usize, 0usize); p.n_tokens];
    for (s, &(n_q, kv_len)) in c.seqs.iter().enumerate() {
        for i in 0..n_q {
            row_of[p.q_starts[s] + i] = (s, kv_len - n_q + i);
        }
    }
    let mut worst = 0f32;
    for (i, (&g, &r)) in out.iter().zip(ref_out).enumerate() {
        let (token, head, dim) = (i / (c.n_heads * d), i / d % c.n_heads, i % d);
        let (s, pos) = row_of[token];
        assert!(
            g.is_finite(),
            "{what}: out[{token}, {head}, {dim}] = {g} (sequence {s}, position {pos})"
        );
        let err = (g - r).abs();
        assert!(
            err <= OUT_TOL,
            "{what}: out[{token}, {head}, {dim}] = {g}, reference {r} (sequence {s} {:?}, position {pos})",
            c.seqs[s]
        );
        worst = worst.max(err);
    }
    if let Some(lse) = lse {
        for (i, (&g, &r)) in lse.iter().zip(ref_lse).enumerate() {
            let (token, head) = (i / c.n_heads, i % c.n_heads);
            let (s, pos) = row_of[token];
            assert!(
                (g - r).abs() <= LSE_TOL * (1.0 + r.abs()),
                "{what}: lse[{token}, {head}] = {g}, reference {r} (sequence {s} {:?}, position {pos})",
                c.seqs[s]
            );
        }
    }
    eprintln!("{what}: ok, max |out - reference| = {worst:.2e}");
}

/// Runs `case` with each of `splits` and both row kernels (and, under Auto, both prefill kernels:
/// warpgroup MMA where the device has it, and mma.sync) at the usual scale 1/√d and at a sharper
/// one (peaked softmax, so the running maximum matters), comparing out and lse with the reference
/// each time.
fn check_case(dev: &CudaDevice, case: &Case, splits: &[KvSplit]) {
    check_case_with(dev, case, splits, KvDtype::Full);
}

/// [`check_case`] over a cache of `dtype`.
fn check_case_with(dev: &CudaDevice, case: &Case, splits: &[KvSplit], dtype: KvDtype) {
    let mut options = Vec::new();
    for &split in splits {
        for row_kernel in [RowKernel::Auto, RowKernel::PerHead] {
            let prefill_kernels: &[PrefillKernel] = if split == KvSplit::Auto {
                &[PrefillKernel::Auto, PrefillKernel::MmaSync]
            } else {
                &[PrefillKernel::Auto]
            };
            for &prefill_kernel in prefill_kernels {
                options.push(PlanOptions {
                    split,
                    row_kernel,
                    prefill_kernel,
                    ..PlanOptions::default()
                });
            }
        }
    }
    check_problem(dev, &Problem::new(case).quantize(dtype), &options);
}

/// Runs `p` with each of `options` at the usual scale and a sharper one, comparing out and lse
/// with the reference each time.
fn check_problem(dev: &CudaDevice, p: &Problem, options: &[PlanOptions]) {
    let case = &p.case;
    let mut gpu = Device::upload(dev, p);
    for scale in [1.0 / (case.head_dim as f32).sqrt(), 1.5] {
        let (ref_out, ref_lse) = p.reference(scale);
        for &o in options {
            let what = format!(
                "{}/{} heads, d {}, blocks of {}, {} cache, scale {scale}, {o:?}",
                case.n_heads,
                case.n_kv_heads,
                case.head_dim,
                case.block_size,
                p.dtype()
            );
            let (out, lse) = gpu.run(dev, p, scale, o, true);
            compare(&what, p, (&out, lse.as_deref()), (&ref_out, &ref_lse));
        }
    }
}

fn device() -> CudaDevice {
    CudaDevice::new(0).expect("CUDA device 0")
}

/// Decode rows of very different lengths next to two prefills, GQA 32/8, d 128, blocks of 16:
/// long rows split into many chunks, short ones into one.
#[test]
fn ragged_batch_gqa4_d128_bs16() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        // Decode over 1..5000 keys; a 7-row prefill over 9 keys of history; a 64-row prefill with
        // no history.
        seqs: vec![
            (1, 1),
            (1, 17),
            (1, 300),
            (1, 1000),
            (1, 5000),
            (7, 16),
            (64, 64),
        ],
        seed: 1,
    };
    check_case(
        &dev,
        &case,
        &[
            KvSplit::Auto,
            KvSplit::Off,
            KvSplit::Chunk(256),
            KvSplit::Chunk(37),
            KvSplit::Fixed(1),
            KvSplit::Fixed(4),
            KvSplit::Fixed(64),
        ],
    );
}

/// Lengths at block boundaries (k·4 - 1, k·4, k·4 + 1), GQA 9/3, d 64, blocks of 4, with chunks
/// of 1 key (three of the four warps of every CTA see nothing), and chunks not aligned to blocks.
#[test]
fn block_boundaries_gqa3_d64_bs4() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 4,
        seqs: vec![
            (1, 3),
            (1, 4),
            (1, 5),
            (1, 7),
            (1, 8),
            (1, 9),
            (1, 63),
            (1, 64),
            (1, 65),
            (3, 12),
            (5, 13),
            (4, 4),
            (1, 1),
        ],
        seed: 2,
    };
    check_case(
        &dev,
        &case,
        &[
            KvSplit::Auto,
            KvSplit::Off,
            KvSplit::Chunk(1),
            KvSplit::Chunk(4),
            KvSplit::Chunk(5),
            KvSplit::Chunk(16),
            KvSplit::Fixed(2),
            KvSplit::Fixed(8),
        ],
    );
}

/// Query-head groups of 8, 16 (a full tile) and 32 (two tiles per KV head: MQA), d 128 and 64.
#[test]
fn large_query_head_groups() {
    require_gpu!();
    let dev = device();
    for (n_heads, n_kv_heads, head_dim) in [(16, 2, 128), (32, 2, 64), (32, 1, 128)] {
        let case = Case {
            n_heads,
            n_kv_heads,
            head_dim,
            block_size: 16,
            seqs: vec![(1, 1), (1, 33), (1, 700), (1, 3000), (2, 50)],
            seed: 11,
        };
        check_case(
            &dev,
            &case,
            &[KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(200)],
        );
    }
}

/// Multi-head attention (GQA ratio 1), d 64, blocks of 16, including a long decode.
#[test]
fn mha_d64_bs16() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 8,
        n_kv_heads: 8,
        head_dim: 64,
        block_size: 16,
        seqs: vec![(1, 15), (1, 16), (1, 17), (1, 2049), (9, 40), (16, 16)],
        seed: 3,
    };
    check_case(
        &dev,
        &case,
        &[KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(64)],
    );
}

/// Multi-head attention, d 128, blocks of 4.
#[test]
fn mha_d128_bs4() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 4,
        n_kv_heads: 4,
        head_dim: 128,
        block_size: 4,
        seqs: vec![(1, 1000), (12, 40), (1, 33), (2, 2)],
        seed: 4,
    };
    check_case(
        &dev,
        &case,
        &[
            KvSplit::Auto,
            KvSplit::Off,
            KvSplit::Chunk(128),
            KvSplit::Chunk(3),
        ],
    );
}

/// A long prefill next to a decode, GQA 4, d 128: with chunks of 64 keys the prefill's rows split
/// into up to 11 chunks each.
#[test]
fn long_prefill_split() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
        seqs: vec![(300, 700), (1, 2000)],
        seed: 5,
    };
    check_case(
        &dev,
        &case,
        &[KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(64)],
    );
}

/// A batch large enough that the automatic choice does not split (4096 row-heads), GQA 4, d 128.
#[test]
fn large_decode_batch() {
    require_gpu!();
    let dev = device();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let seqs = (0..128).map(|_| (1, rng.random_range(1..600))).collect();
    let case = Case {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        seqs,
        seed: 6,
    };
    check_case(
        &dev,
        &case,
        &[KvSplit::Auto, KvSplit::Chunk(100), KvSplit::Fixed(2)],
    );
}

/// One plan run several times, as every layer of a step runs it. Both row kernels merge a split
/// row in the last of its ranges to finish, found by a count the kernel resets: a count left over
/// from one run would merge too early or never in the next. The cases also cover ranges of
/// hundreds of blocks (blocks of 1), one query head per KV head (the grouped merge's columns then
/// use a quarter of the CTA), 20 heads per KV head (two head tiles; the merge takes several passes
/// over its columns) and head_dim 96 (the per-head kernel only), with and without lse.
#[test]
fn plans_run_repeatedly() {
    require_gpu!();
    let dev = device();
    let cases = [
        (32, 8, 128, 16, vec![(1, 9000), (1, 300), (1, 4000)]),
        (8, 8, 64, 1, vec![(1, 1500), (1, 700)]),
        (40, 2, 128, 4, vec![(1, 3000), (1, 64)]),
        (6, 2, 96, 8, vec![(1, 2500), (1, 100)]),
    ];
    for (seed, (n_heads, n_kv_heads, head_dim, block_size, seqs)) in cases.into_iter().enumerate() {
        let case = Case {
            n_heads,
            n_kv_heads,
            head_dim,
            block_size,
            seqs,
            seed: 70 + seed as u64,
        };
        let p = Problem::new(&case);
        let mut gpu = Device::upload(&dev, &p);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (ref_out, ref_lse) = p.reference(scale);
        let spans = p.spans();
        let n_blocks = p.k.len() / (block_size * n_kv_heads * head_dim);
        let splits = [
            KvSplit::Auto,
            KvSplit::Off,
            KvSplit::Chunk(64),
            KvSplit::Chunk(1000),
            KvSplit::Fixed(8),
        ];
        let kernels = [RowKernel::Auto, RowKernel::PerHead];
        for (split, row_kernel) in splits.into_iter().flat_map(|s| kernels.map(|k| (s, k))) {
            let options = PlanOptions {
                split,
                row_kernel,
                ..PlanOptions::default()
            };
            let mut plan = AttentionPlan::new(
                &dev,
                p.layout(),
                n_heads,
                p.n_tokens,
                &spans,
                n_blocks,
                options,
            )
            .unwrap();
            for run in 0..3 {
                gpu.poison(&dev);
                let with_lse = run != 1;
                let lse = with_lse.then_some(&mut gpu.lse);
                plan.run(&dev, &gpu.q, &gpu.k, &gpu.v, scale, &mut gpu.out, lse, 0)
                    .unwrap();
                let out = to_f32(&dev.stream.clone_dtoh(&gpu.out).unwrap());
                let lse = with_lse.then(|| dev.stream.clone_dtoh(&gpu.lse).unwrap());
                let what = format!("{case:?}, {split:?}, {row_kernel:?}, run {run}");
                compare(&what, &p, (&out, lse.as_deref()), (&ref_out, &ref_lse));
            }
        }
    }
}

/// The other head dimensions, a block size of 8, and block sizes that are no power of two
/// (3) or a single slot (1).
#[test]
fn other_head_dims_and_block_sizes() {
    require_gpu!();
    let dev = device();
    let shapes = [
        (32, 8),
        (96, 8),
        (192, 8),
        (256, 8),
        (64, 3),
        (128, 1),
        (256, 16),
    ];
    for (seed, (head_dim, block_size)) in (100..).zip(shapes) {
        let case = Case {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim,
            block_size,
            seqs: vec![(1, 100), (5, 20), (1, 700)],
            seed,
        };
        check_case(
            &dev,
            &case,
            &[KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(16)],
        );
    }
}

/// Without an lse buffer the output is the same, bit for bit.
#[test]
fn lse_is_optional() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        seqs: vec![(1, 900), (4, 30), (80, 100)],
        seed: 7,
    };
    let p = Problem::new(&case);
    let mut gpu = Device::upload(&dev, &p);
    let scale = 0.125;
    for split in [KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(50)] {
        let options = PlanOptions {
            split,
            ..PlanOptions::default()
        };
        let (with, _) = gpu.run(&dev, &p, scale, options, true);
        let (without, lse) = gpu.run(&dev, &p, scale, options, false);
        assert!(lse.is_none());
        let same = with
            .iter()
            .zip(&without)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{split:?}: output differs without lse");
    }
}

/// Prefill spans through the tensor-core kernel (Auto) and the row kernel (Off): 16 rows (the
/// smallest prefill span), one full 64-row tile, 100 and 300 rows (partial last tiles), each with
/// no history and with history (so that the causal diagonal is not aligned to the 64-key tiles),
/// and, if `long`, 2048 rows with and without history.
fn check_prefill(
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    long: bool,
    seed: u64,
) {
    let mut seqs = vec![
        (PREFILL_MIN_ROWS, PREFILL_MIN_ROWS),
        (PREFILL_MIN_ROWS, PREFILL_MIN_ROWS + 21),
        (64, 64),
        (64, 64 + 64),
        (100, 100),
        (100, 100 + 37),
        (300, 300),
        (300, 300 + 250),
    ];
    if long {
        seqs.push((2048, 2048));
        seqs.push((2048, 2048 + 101));
    }
    let case = Case {
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
        seqs,
        seed,
    };
    check_case(&device(), &case, &[KvSplit::Auto, KvSplit::Off]);
}

/// GQA 32/8, d 128, blocks of 16 (Llama-3-8B's shape), with 2048-row spans.
#[test]
fn prefill_gqa4_d128_bs16() {
    require_gpu!();
    check_prefill(32, 8, 128, 16, true, 20);
}

/// On an sm_90 device the default plan runs d128 prefill spans and cascade prefixes with the
/// warpgroup-MMA kernels, and the mma.sync ones when asked (or on any other device).
#[test]
fn prefill_kernel_choice() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
        seqs: vec![(1, 600), (1, 700), (40, 40)],
        seed: 24,
    };
    let mut p = Problem::new(&case);
    p.share_prefix(&[0, 1], 30);
    let spans = p.spans();
    let n_blocks = p.k.len() / (case.block_size * case.n_kv_heads * case.head_dim);
    let hopper = dev.compute_capability() == (9, 0);
    for (prefill_kernel, wgmma) in [
        (PrefillKernel::Auto, hopper),
        (PrefillKernel::MmaSync, false),
    ] {
        let options = PlanOptions {
            prefill_kernel,
            ..PlanOptions::default()
        };
        let plan = AttentionPlan::new(
            &dev,
            p.layout(),
            case.n_heads,
            p.n_tokens,
            &spans,
            n_blocks,
            options,
        )
        .unwrap();
        let expected = if wgmma {
            (Some("attn_prefill_wg_d128"), Some("attn_shared_wg_d128"))
        } else {
            (Some("attn_prefill_d128"), Some("attn_shared_d128"))
        };
        assert_eq!(
            plan.prefill_kernels(),
            expected,
            "{prefill_kernel:?} on {:?}",
            dev.compute_capability()
        );
    }
}

/// MHA 4/4, d 128, blocks of 4, with 2048-row spans.
#[test]
fn prefill_mha_d128_bs4() {
    require_gpu!();
    check_prefill(4, 4, 128, 4, true, 21);
}

/// GQA 32/8, d 64, blocks of 4.
#[test]
fn prefill_gqa4_d64_bs4() {
    require_gpu!();
    check_prefill(32, 8, 64, 4, false, 22);
}

/// MHA 4/4, d 64, blocks of 16, with 2048-row spans.
#[test]
fn prefill_mha_d64_bs16() {
    require_gpu!();
    check_prefill(4, 4, 64, 16, true, 23);
}

/// GQA 4/4 with d 128 and block sizes that are no power of two (3) or a single slot (1); GQA
/// 6/2 with d 64 and blocks of 8.
#[test]
fn prefill_odd_block_sizes() {
    require_gpu!();
    let dev = device();
    for (seed, (n_heads, n_kv_heads, head_dim, block_size)) in
        (30..).zip([(4, 4, 128, 3), (4, 4, 128, 1), (6, 2, 64, 8)])
    {
        let case = Case {
            n_heads,
            n_kv_heads,
            head_dim,
            block_size,
            seqs: vec![(17, 17), (70, 200), (129, 129)],
            seed,
        };
        check_case(&dev, &case, &[KvSplit::Auto]);
    }
}

/// A batch mixing prefill spans with decode rows and spans just below the prefill threshold, GQA
/// 32/8, d 128 and d 64, blocks of 16: under Auto the prefill kernel takes the long spans and
/// the row kernel the rest, split into chunks (few rows), then merged for just those rows.
#[test]
fn mixed_prefill_and_decode() {
    require_gpu!();
    let dev = device();
    for (seed, head_dim) in (40..).zip([128, 64]) {
        let case = Case {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim,
            block_size: 16,
            seqs: vec![
                (1, 1),
                (1, 500),
                (200, 450),
                (1, 3000),
                (PREFILL_MIN_ROWS - 1, PREFILL_MIN_ROWS - 1),
                (64, 1000),
                (7, 20),
                (PREFILL_MIN_ROWS, PREFILL_MIN_ROWS),
                (1, 64),
            ],
            seed,
        };
        check_case(
            &dev,
            &case,
            &[KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(100)],
        );
    }
}

/// Prefill spans next to enough decode rows that Auto does not split them: the row kernel then
/// runs one CTA per (decode row, head) over a list of just those rows.
#[test]
fn mixed_prefill_and_large_decode_batch() {
    require_gpu!();
    let dev = device();
    let mut rng = ChaCha8Rng::seed_from_u64(50);
    let mut seqs: Vec<(usize, usize)> = (0..48).map(|_| (1, rng.random_range(1..400))).collect();
    seqs.insert(10, (130, 130));
    seqs.push((40, 300));
    let case = Case {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        seqs,
        seed: 50,
    };
    check_case(&dev, &case, &[KvSplit::Auto]);
}

/// Bad shapes are errors, not launches: an unsupported head_dim, a block id past the cache, a
/// table too short for kv_len, query heads not a multiple of KV heads, an undersized `out`.
#[test]
fn rejects_bad_shapes() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        block_size: 4,
        seqs: vec![(1, 10)],
        seed: 8,
    };
    let p = Problem::new(&case);
    let mut gpu = Device::upload(&dev, &p);
    let n_blocks = (p.k.len() / (4 * 2 * 64)) as u32;
    let run = |gpu: &mut Device, layout: KvLayout, n_heads: usize, spans: &[QuerySpan]| {
        paged_attention(
            &dev,
            &gpu.q,
            &gpu.k,
            &gpu.v,
            layout,
            n_heads,
            spans,
            0.125,
            &mut gpu.out,
            None,
        )
    };
    // The valid call succeeds.
    assert!(run(&mut gpu, p.layout(), 4, &p.spans()).is_ok());
    let bad_dim = KvLayout {
        head_dim: 80,
        ..p.layout()
    };
    assert!(run(&mut gpu, bad_dim, 4, &p.spans()).is_err());
    assert!(run(&mut gpu, p.layout(), 3, &p.spans()).is_err());
    let past_end = [p.tables[0][0], n_blocks, p.tables[0][2]];
    let spans = [QuerySpan {
        block_table: &past_end,
        ..p.spans()[0]
    }];
    assert!(run(&mut gpu, p.layout(), 4, &spans).is_err());
    let short = [p.tables[0][0], p.tables[0][1]];
    let spans = [QuerySpan {
        block_table: &short,
        ..p.spans()[0]
    }];
    assert!(run(&mut gpu, p.layout(), 4, &spans).is_err());
    let mut small_out = dev.stream.alloc_zeros::<bf16>(10).unwrap();
    let spans = p.spans();
    let r = paged_attention(
        &dev,
        &gpu.q,
        &gpu.k,
        &gpu.v,
        p.layout(),
        4,
        &spans,
        0.125,
        &mut small_out,
        None,
    );
    assert!(r.is_err());
}

/// Cascade attention: decode rows (and two-row spans) of sequences that share leading blocks, the
/// shared part computed once per group by the multi-query pass and merged with each row's own
/// keys. Groups of 4 (a 640-key prefix) and 2 (320 keys), a 40-member group (160 query rows and
/// heads: two tiles of the pass, the second partial), a prefill span and a lone decode that share
/// blocks with a group but are not in it, and GQA 32/8 d 128 as well as 9/3 d 64 with blocks of 4.
/// Every plan must actually take the cascade path (checked on the plan), and match the reference
/// with and without cascade, with every split and row kernel.
#[test]
fn cascade_shared_prefixes() {
    require_gpu!();
    let dev = device();
    let mut cases = Vec::new();
    let mut seqs = vec![
        (1, 700),
        (1, 641),
        (2, 1000),
        (1, 2000),
        (1, 400),
        (1, 330),
        (1, 900),
        (20, 700),
    ];
    seqs.extend(std::iter::repeat_n((1, 310), 40));
    let big: Vec<usize> = (8..48).collect();
    cases.push((
        Case {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            seqs,
            seed: 21,
        },
        vec![(vec![0, 1, 2, 3, 7], 40), (vec![4, 5], 20), (big, 18)],
    ));
    cases.push((
        Case {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            block_size: 4,
            seqs: vec![(1, 300), (1, 257), (3, 600), (1, 90), (1, 95)],
            seed: 22,
        },
        vec![(vec![0, 1, 2], 64), (vec![3, 4], 20)],
    ));
    for (case, groups) in cases {
        let mut p = Problem::new(&case);
        for (members, blocks) in &groups {
            p.share_prefix(members, *blocks);
        }
        let spans = p.spans();
        let forced = PlanOptions {
            cascade_min_shared: Some(1),
            ..PlanOptions::default()
        };
        let plan = AttentionPlan::new(
            &dev,
            p.layout(),
            case.n_heads,
            p.n_tokens,
            &spans,
            p.k.len() / (case.block_size * case.n_kv_heads * case.head_dim),
            forced,
        )
        .unwrap();
        let cascade_rows: usize = groups
            .iter()
            .map(|(m, _)| {
                m.iter()
                    .filter(|&&s| case.seqs[s].0 < 16)
                    .map(|&s| case.seqs[s].0)
                    .sum::<usize>()
            })
            .sum();
        assert_eq!(
            plan.cascade_rows(),
            cascade_rows,
            "every decode row of a group goes through the cascade pass"
        );
        drop(spans);
        let mut options = Vec::new();
        for split in [KvSplit::Auto, KvSplit::Off, KvSplit::Chunk(100)] {
            for row_kernel in [RowKernel::Auto, RowKernel::PerHead] {
                for cascade_min_shared in [Some(1), None] {
                    for prefill_kernel in [PrefillKernel::Auto, PrefillKernel::MmaSync] {
                        options.push(PlanOptions {
                            split,
                            row_kernel,
                            cascade_min_shared,
                            prefill_kernel,
                        });
                    }
                }
            }
        }
        check_problem(&dev, &p, &options);
    }
}

/// Decode rows asked for their logits (KV eviction scoring) get f(x) of x = `scale q.k` for every
/// key they see (x for H2O's softmax, (x + g) / tau for Keyformer's, g the CPU's Gumbel draw of
/// the row's position, the layer, head and key) and per head the normaliser logsumexp_j f(x_j),
/// against an f64 reference, for whole spans of the grouped kernel only, with the attention
/// output unchanged under every split (a fixed split too: recorded decode steps score from
/// logits); spans not asked for and prefill spans write none.
/// Tolerance: the kernel's dot products are f32 sums of exact bf16 products (the same as f64 up
/// to summation rounding, ~1e-6 relative to Σ|q_i k_i| <= head_dim), so 1e-4 absolute; the
/// kernel's noise uses fast logs (within 2.5e-5 of the CPU's, see kernels/common.cuh), divided
/// by tau >= 1: 2e-4 absolute for f(x); the normaliser is an f32 sum of fast exps over up to
/// 3000 keys: 1e-4 relative to its sum, 2e-4 absolute in the log.
#[test]
fn decode_rows_write_their_logits() {
    require_gpu!();
    let dev = device();
    for (seed, head_dim) in [(300u64, 64usize), (301, 128)] {
        let case = Case {
            n_heads: 8,
            n_kv_heads: 2,
            head_dim,
            block_size: 16,
            // Odd and even key counts: rows of logits are padded to even lengths, and a row's
            // last key may be the first of a pair.
            seqs: vec![
                (1, 701),
                (3, 51),
                (PREFILL_MIN_ROWS, 100),
                (1, 3000),
                (2, 1500),
            ],
            seed,
        };
        let gumbel = LogitScoring::GumbelSoftmax {
            tau: 1.5,
            seed: 0x5eed + seed,
            position: 4000,
        };
        let soft = Some(LogitScoring::Softmax);
        let want = [soft, Some(gumbel), soft, None, Some(gumbel)];
        let layer = 3u32;
        let p = Problem::new(&case);
        let mut gpu = Device::upload(&dev, &p);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (ref_out, ref_lse) = p.reference(scale);
        let spans = p.spans();
        let n_blocks = p.k.len() / (case.block_size * case.n_kv_heads * head_dim);
        for split in [
            KvSplit::Auto,
            KvSplit::Chunk(64),
            KvSplit::Off,
            KvSplit::Fixed(4),
        ] {
            let options = PlanOptions {
                split,
                ..PlanOptions::default()
            };
            let (mut plan, _) = AttentionPlan::new_reusing(
                &dev,
                p.layout(),
                case.n_heads,
                p.n_tokens,
                &spans,
                n_blocks,
                options,
                &want,
                None,
            )
            .unwrap();
            gpu.poison(&dev);
            plan.run(
                &dev,
                &gpu.q,
                &gpu.k,
                &gpu.v,
                scale,
                &mut gpu.out,
                Some(&mut gpu.lse),
                layer as usize,
            )
            .unwrap();
            let out = to_f32(&dev.stream.clone_dtoh(&gpu.out).unwrap());
            let lse = dev.stream.clone_dtoh(&gpu.lse).unwrap();
            let what = format!("{case:?}, {split:?}, logits");
            compare(&what, &p, (&out, Some(&lse)), (&ref_out, &ref_lse));
            let (logits, normalisers) = plan.scored_logits(&dev).unwrap();
            let logits = dev.stream.clone_dtoh(logits).unwrap();
            let normalisers = dev.stream.clone_dtoh(normalisers).unwrap();
            let group = case.n_heads / case.n_kv_heads;
            for (s, span) in spans.iter().enumerate() {
                let expect = want[s].is_some() && span.n_q < PREFILL_MIN_ROWS;
                let base = plan.logit_base(s);
                assert_eq!(base.is_some(), expect, "{what}: span {s} logits {base:?}");
                let Some(base) = base else { continue };
                for r in 0..span.n_q {
                    let token = span.q_start + r;
                    for h in 0..case.n_heads {
                        let qr = &p.q[(token * case.n_heads + h) * head_dim..][..head_dim];
                        let mut fs = Vec::new();
                        for j in 0..span.kv_len - span.n_q + r + 1 {
                            let bs = case.block_size;
                            let slot = span.block_table[j / bs] as usize * bs + j % bs;
                            let kr =
                                &p.k[(slot * case.n_kv_heads + h / group) * head_dim..][..head_dim];
                            let dot: f64 = qr
                                .iter()
                                .zip(kr)
                                .map(|(a, b)| a.to_f64() * b.to_f64())
                                .sum();
                            let x = dot * scale as f64;
                            let want = match want[s] {
                                Some(LogitScoring::GumbelSoftmax {
                                    tau,
                                    seed,
                                    position,
                                }) => {
                                    let g = turbo_keyformer::gumbel(
                                        seed,
                                        position + r as u32,
                                        layer,
                                        h as u32,
                                        j as u32,
                                    );
                                    (x + g as f64) / tau as f64
                                }
                                _ => x,
                            };
                            fs.push(want);
                            let at = base as usize
                                + (r * case.n_heads + h) * logit_row_stride(span.kv_len)
                                + j;
                            let got = logits[at] as f64;
                            assert!(
                                (got - want).abs() <= 2e-4,
                                "{what}: span {s} row {r} head {h} key {j}: {got} vs {want}"
                            );
                        }
                        let m = fs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let lse = m + fs.iter().map(|f| (f - m).exp()).sum::<f64>().ln();
                        let got = normalisers[token * case.n_heads + h] as f64;
                        assert!(
                            (got - lse).abs() <= 2e-4,
                            "{what}: span {s} row {r} head {h} normaliser: {got} vs {lse}"
                        );
                    }
                }
            }
        }
    }
}

/// INT8 and FP8 caches through every kernel (grouped decode, per-head decode, split and merged
/// rows, mma.sync prefill, the cascade pass), against the reference on the decoded values: the
/// kernels decode the codes as they read them. Same tolerances as bf16: the decode kernels use
/// the codes exactly and apply the scales in f32 (keys' to the scores, values' to the softmax
/// weights before their bf16 rounding, which bf16 caches round too); the prefill kernels round
/// each decoded value to bf16 (relative 2^-9, like the bf16 inputs they otherwise read).
#[test]
fn quantized_caches_on_every_path() {
    require_gpu!();
    let dev = device();
    for (seed, dtype) in (300..).zip([KvDtype::Int8, KvDtype::Fp8]) {
        let ragged = Case {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            seqs: vec![
                (1, 1),
                (1, 17),
                (1, 1000),
                (1, 5000),
                (7, 16),
                (64, 64),
                (200, 450),
            ],
            seed,
        };
        check_case_with(
            &dev,
            &ragged,
            &[
                KvSplit::Auto,
                KvSplit::Off,
                KvSplit::Chunk(37),
                KvSplit::Fixed(4),
            ],
            dtype,
        );
        let boundaries = Case {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            block_size: 4,
            seqs: vec![
                (1, 3),
                (1, 4),
                (1, 5),
                (1, 63),
                (1, 65),
                (3, 12),
                (40, 90),
                (1, 1),
            ],
            seed: seed + 10,
        };
        check_case_with(
            &dev,
            &boundaries,
            &[KvSplit::Auto, KvSplit::Chunk(5), KvSplit::Fixed(8)],
            dtype,
        );
        for (i, (head_dim, block_size)) in [(32, 8), (96, 8), (192, 8), (256, 16)]
            .into_iter()
            .enumerate()
        {
            let case = Case {
                n_heads: 4,
                n_kv_heads: 2,
                head_dim,
                block_size,
                seqs: vec![(1, 100), (5, 20), (1, 700)],
                seed: seed + 20 + i as u64,
            };
            check_case_with(&dev, &case, &[KvSplit::Auto, KvSplit::Chunk(16)], dtype);
        }
        // Cascade over shared quantized blocks.
        let mut seqs = vec![(1, 700), (1, 641), (2, 1000), (1, 2000), (20, 700)];
        seqs.extend(std::iter::repeat_n((1, 310), 12));
        let mut p = Problem::new(&Case {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            seqs,
            seed: seed + 30,
        });
        p.share_prefix(&[0, 1, 2, 3, 4], 40);
        p.share_prefix(&(5..17).collect::<Vec<_>>(), 18);
        let p = p.quantize(dtype);
        let mut options = Vec::new();
        for split in [KvSplit::Auto, KvSplit::Chunk(100)] {
            for row_kernel in [RowKernel::Auto, RowKernel::PerHead] {
                options.push(PlanOptions {
                    split,
                    row_kernel,
                    cascade_min_shared: Some(1),
                    prefill_kernel: PrefillKernel::Auto,
                });
            }
        }
        check_problem(&dev, &p, &options);
    }
}

/// A quantized cache whose rows would not start 16-byte aligned (block_size x KV heads not a
/// multiple of 4) is refused with an error, not read misaligned.
#[test]
fn quantized_cache_needs_aligned_rows() {
    require_gpu!();
    let dev = device();
    let case = Case {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        block_size: 3,
        seqs: vec![(1, 10)],
        seed: 5,
    };
    let p = Problem::new(&case).quantize(KvDtype::Int8);
    let spans = p.spans();
    let err = AttentionPlan::new(
        &dev,
        p.layout(),
        case.n_heads,
        p.n_tokens,
        &spans,
        4,
        PlanOptions::default(),
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("multiple of 4"), "{err}");
}
