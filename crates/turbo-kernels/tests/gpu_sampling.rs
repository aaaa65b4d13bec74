//! The GPU sampler (`ops::sampling::sample`) against turbo-core's `sample_row`, on a real GPU.
//!
//! Every test skips (passes, printing "skipping: no CUDA device") on a machine without CUDA. With
//! a GPU, each case draws fresh random logits (seeded) and parameters, runs many rows with
//! different parameters in one launch, and checks each row's token against the CPU.
//!
//! The two may differ only by rounding: the CPU sums f32 weights in f64, the GPU sums them in
//! 2^-40 fixed point, and its `expf` may be 2 ulp (~1.2e-7 relative) away from the CPU's `exp`.
//! So a draw whose `uniform · K` lands within that error of a boundary between two kept tokens,
//! a top-p goal that close to the end of a rank prefix, or a weight that close to `min_p`, may go
//! either way. [`acceptable`] lists, in f64, every token the definition allows under those errors
//! (with a margin); a case with a single acceptable token must match `sample_row` exactly, a
//! borderline one must give one of its acceptable tokens, and borderline cases must stay rare.

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_core::sampling::{
    argmax, sample_row, PenaltyLists, PenaltyRow, SampleParams, NO_FINITE_LOGIT,
};
use turbo_kernels::ops::sampling;
use turbo_kernels::CudaDevice;

fn device() -> Option<CudaDevice> {
    if !turbo_kernels::cuda_available() {
        println!("skipping: no CUDA device");
        return None;
    }
    Some(CudaDevice::new(0).expect("cannot open CUDA device 0"))
}

/// Relative error allowed between the CPU's and the GPU's sums of weights: 2 ulp of expf is
/// ~1.2e-7; 1e-6 leaves a margin.
const REL_TOL: f64 = 1e-6;
/// The GPU's fixed-point rounding, at most 2^-41 a token (doubled for a margin).
const FIXED_TOL: f64 = 1.0 / (1u64 << 40) as f64;

/// Every token the definition can give for `logits` (already penalized) when sums may be off by
/// `REL_TOL` relative plus `FIXED_TOL` a token and weights by `REL_TOL` relative; sorted.
fn acceptable(logits: &[f32], p: &SampleParams) -> Vec<u32> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        // Nothing above -inf (every logit NaN or -inf): no token.
        return vec![NO_FINITE_LOGIT];
    }
    if p.temperature == 0.0 {
        return vec![argmax(logits)];
    }
    if !max.is_finite() {
        return vec![argmax(logits)];
    }
    let mut ranked: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| **l > f32::NEG_INFINITY)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    ranked.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let k = p.top_k as usize;
    if k > 0 && k < ranked.len() {
        ranked.truncate(k);
    }
    let n = ranked.len();
    let w: Vec<f64> = ranked
        .iter()
        .map(|c| ((c.1 - max) / p.temperature).exp() as f64)
        .collect();
    let slack = |total: f64| REL_TOL * total + n as f64 * FIXED_TOL;

    // Top-p: every rank-prefix length the cut can take.
    let mut lens = Vec::new();
    if p.top_p < 1.0 {
        let total: f64 = w.iter().sum();
        let goal = p.top_p as f64 * total;
        let e = slack(total);
        let mut cum = 0.0;
        for (j, wj) in w.iter().enumerate() {
            let before = cum;
            cum += wj;
            if before >= goal + e {
                break;
            }
            if cum >= goal - e || j + 1 == n {
                lens.push(j + 1);
            }
        }
    } else {
        lens.push(n);
    }

    // Min-p: weights within REL_TOL of min_p may fall either side (but the max's is exactly 1
    // everywhere); equal logits move together.
    let mut borderline: Vec<f64> = Vec::new();
    if p.min_p > 0.0 {
        let m = p.min_p as f64;
        for (c, &wj) in ranked.iter().zip(&w) {
            if c.1 < max && (wj - m).abs() <= REL_TOL * m && !borderline.contains(&wj) {
                borderline.push(wj);
            }
        }
    }
    assert!(borderline.len() <= 4, "too many min-p borderline weights");

    let mut out = Vec::new();
    for &len in &lens {
        for choice in 0..1u32 << borderline.len() {
            let mut kept: Vec<(u32, f64)> = (0..len)
                .filter(|&j| {
                    if p.min_p <= 0.0 {
                        return true;
                    }
                    match borderline.iter().position(|&b| b == w[j]) {
                        Some(b) => choice >> b & 1 == 1,
                        None => w[j] >= p.min_p as f64,
                    }
                })
                .map(|j| (ranked[j].0, w[j]))
                .collect();
            if kept.is_empty() {
                out.push(argmax(logits));
                continue;
            }
            kept.sort_unstable_by_key(|c| c.0);
            let total: f64 = kept.iter().map(|c| c.1).sum();
            let r = p.uniform as f64 * total;
            let e = slack(total);
            let mut cum = 0.0;
            for &(t, wt) in &kept {
                let before = cum;
                cum += wt;
                if wt > 0.0 && cum > r - e && before <= r + e {
                    out.push(t);
                }
            }
            if r + e >= total {
                out.push(kept.last().unwrap().0);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// One row: its logits (before the penalty), parameters and penalized tokens with their counts
/// of generated occurrences (empty counts: all 0).
#[derive(Clone)]
struct Row {
    logits: Vec<f32>,
    params: SampleParams,
    penalized: Vec<u32>,
    counts: Vec<u32>,
}

impl Row {
    fn penalty_row(&self) -> PenaltyRow<'_> {
        PenaltyRow {
            tokens: &self.penalized,
            counts: &self.counts,
        }
    }
}

/// How many rows ran, and how many of them were borderline (more than one acceptable token).
#[derive(Default)]
struct Tally {
    rows: usize,
    borderline: usize,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.rows += other.rows;
        self.borderline += other.borderline;
    }

    /// Borderline cases must be rare (nearly flat rows over 10^5 tokens make some), or the
    /// comparison would say little.
    fn check(&self, what: &str) {
        println!("{what}: {} rows, {} borderline", self.rows, self.borderline);
        assert!(
            self.borderline * 10 <= self.rows + 10,
            "{what}: {} of {} rows borderline",
            self.borderline,
            self.rows
        );
    }
}

/// Runs `rows` (all of `vocab` logits) in one launch and checks every token, and the penalized
/// logits, against the CPU.
fn check_rows(dev: &CudaDevice, vocab: usize, rows: &[Row], what: &str) -> Tally {
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
    assert_eq!(flat.len(), rows.len() * vocab);
    let params: Vec<SampleParams> = rows.iter().map(|r| r.params).collect();
    let penalties = PenaltyLists::from_rows(rows.iter().map(Row::penalty_row));
    let mut logits = dev.stream.clone_htod(&flat).unwrap();
    let got = sampling::sample_host(dev, &mut logits, rows.len(), vocab, &params, &penalties)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let after = dev.stream.clone_dtoh(&logits).unwrap();
    let mut tally = Tally::default();
    for (r, row) in rows.iter().enumerate() {
        let mut cpu = row.logits.clone();
        let want = sample_row(&mut cpu, &row.params, row.penalty_row());
        let gpu_row = &after[r * vocab..(r + 1) * vocab];
        for (i, (g, c)) in gpu_row.iter().zip(&cpu).enumerate() {
            assert!(
                g.to_bits() == c.to_bits() || (g.is_nan() && c.is_nan()),
                "{what}: row {r}: penalized logit {i}: gpu {g} vs cpu {c}"
            );
        }
        let ok = acceptable(&cpu, &row.params);
        assert!(
            ok.contains(&want),
            "{what}: row {r}: the reference misses the CPU's token {want} ({ok:?}), {:?}",
            row.params
        );
        if ok.len() == 1 {
            assert_eq!(
                got[r], want,
                "{what}: row {r} (vocab {vocab}): gpu token {} vs cpu {want}, {:?}",
                got[r], row.params
            );
        } else {
            tally.borderline += 1;
            assert!(
                ok.contains(&got[r]),
                "{what}: row {r} (vocab {vocab}): gpu token {} not among {ok:?}, {:?}",
                got[r],
                row.params
            );
        }
        tally.rows += 1;
    }
    tally
}

/// Shapes of random logits, picked by `kind`.
fn random_logits(rng: &mut ChaCha8Rng, vocab: usize, kind: usize) -> Vec<f32> {
    let mut x: Vec<f32> = match kind % 6 {
        // Spread: weights over many orders of magnitude.
        0 => (0..vocab).map(|_| rng.random_range(-8.0..8.0)).collect(),
        // A few tokens far above the rest, as a confident model.
        1 => {
            let mut x: Vec<f32> = (0..vocab).map(|_| rng.random_range(-4.0..4.0)).collect();
            for _ in 0..rng.random_range(1..5) {
                x[rng.random_range(0..vocab)] = rng.random_range(6.0..12.0);
            }
            x
        }
        // Whole numbers: ties everywhere, at every cut.
        2 => (0..vocab)
            .map(|_| rng.random_range(-3i32..=3) as f32)
            .collect(),
        // Rounded to bf16, as logits from a bf16 model: ties in large vocabularies.
        3 => (0..vocab)
            .map(|_| {
                let v: f32 = (0..3).map(|_| rng.random_range(-3.0f32..3.0)).sum();
                bf16::from_f32(v).to_f32()
            })
            .collect(),
        // Nearly flat: every token weighs about the same.
        4 => (0..vocab).map(|_| rng.random_range(-0.01..0.01)).collect(),
        // Spread, with -inf (masked tokens) and a NaN.
        _ => {
            let mut x: Vec<f32> = (0..vocab).map(|_| rng.random_range(-6.0..6.0)).collect();
            for v in x.iter_mut() {
                if rng.random_range(0..10) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
            x[rng.random_range(0..vocab)] = f32::NAN;
            x
        }
    };
    // Keep at least one finite logit unless the row is meant to have none.
    if x.iter().all(|v| !v.is_finite()) {
        x[0] = 0.5;
    }
    x
}

fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f32) -> SampleParams {
    SampleParams {
        temperature,
        top_k,
        top_p,
        min_p,
        uniform,
        ..SampleParams::GREEDY
    }
}

/// A uniform number, now and then one of the ends of [0, 1).
fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    match rng.random_range(0..20) {
        0 => 0.0,
        1 => 1.0 - f32::EPSILON / 2.0,
        _ => rng.random(),
    }
}

/// Sizes not a multiple of anything (1, 7, 50257: scalar loads, unaligned rows) and of real
/// vocabularies (16-byte loads).
const VOCABS: [usize; 6] = [1, 7, 1000, 49_152, 50_257, 128_256];

/// Runs `make(rng, vocab, i)` rows for each vocabulary size (fewer for the large ones), one launch
/// per size, and checks the tally.
fn run(
    seed: u64,
    what: &str,
    rows_small: usize,
    rows_large: usize,
    mut make: impl FnMut(&mut ChaCha8Rng, usize, usize) -> Row,
) {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tally = Tally::default();
    for vocab in VOCABS {
        let n = if vocab > 10_000 {
            rows_large
        } else {
            rows_small
        };
        let rows: Vec<Row> = (0..n).map(|i| make(&mut rng, vocab, i)).collect();
        tally.add(check_rows(
            &dev,
            vocab,
            &rows,
            &format!("{what} vocab {vocab}"),
        ));
    }
    tally.check(what);
}

#[test]
fn greedy_takes_the_first_maximum() {
    run(1, "greedy", 24, 12, |rng, vocab, i| {
        let mut logits = random_logits(rng, vocab, i);
        match i % 4 {
            // A tie for the maximum: the lower index wins.
            0 if vocab > 1 => {
                let (a, b) = (rng.random_range(0..vocab), rng.random_range(0..vocab));
                logits[a] = 50.0;
                logits[b] = 50.0;
            }
            // NaN counts as -inf, never as a maximum.
            1 => logits[rng.random_range(0..vocab)] = f32::NAN,
            2 => logits.fill(f32::NAN),
            _ => {}
        }
        let t = if i % 2 == 0 { 0.0 } else { -0.0 };
        Row {
            logits,
            params: params(t, 0, 1.0, 0.0, uniform(rng)),
            penalized: Vec::new(),
            counts: Vec::new(),
        }
    });
}

#[test]
fn temperature_alone_matches_cpu() {
    run(2, "temperature", 48, 12, |rng, vocab, i| Row {
        logits: random_logits(rng, vocab, i),
        params: params(
            [0.05, 0.3, 0.7, 1.0, 1.5, 4.0][i % 6],
            0,
            1.0,
            0.0,
            uniform(rng),
        ),
        penalized: Vec::new(),
        counts: Vec::new(),
    });
}

#[test]
fn top_k_matches_cpu() {
    // Small k (gathered into shared memory), k past the block size, k at and beyond the vocab.
    let ks = [1u32, 2, 3, 7, 50, 1000, 1024, 1025, 3000, 20_000];
    run(3, "top_k", 40, 20, |rng, vocab, i| {
        let top_k = match i % 12 {
            10 => vocab as u32 - 1,
            11 => vocab as u32 + rng.random_range(0..2),
            j => ks[j % ks.len()],
        };
        Row {
            logits: random_logits(rng, vocab, i / 2),
            params: params([0.5, 1.0, 2.0][i % 3], top_k.max(1), 1.0, 0.0, uniform(rng)),
            penalized: Vec::new(),
            counts: Vec::new(),
        }
    });
}

#[test]
fn top_k_ties_at_the_cut_keep_lower_indices() {
    // Every logit in {0, 1}, k inside the run of ones: the first k ones (by index) are kept, so
    // the draw over them never returns a later one.
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut tally = Tally::default();
    for vocab in [7usize, 1000, 49_152, 50_257] {
        let rows: Vec<Row> = (0..24)
            .map(|i| {
                let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(0..2) as f32).collect();
                let ones = logits.iter().filter(|&&l| l == 1.0).count().max(2) as u32;
                let top_k = [1, 2, ones / 2, ones - 1, 600, 1500][i % 6].clamp(1, vocab as u32);
                Row {
                    logits,
                    params: params(1.0, top_k, 1.0, 0.0, uniform(&mut rng)),
                    penalized: Vec::new(),
                    counts: Vec::new(),
                }
            })
            .collect();
        tally.add(check_rows(
            &dev,
            vocab,
            &rows,
            &format!("top_k ties vocab {vocab}"),
        ));
    }
    tally.check("top_k ties");
}

#[test]
fn top_p_matches_cpu() {
    let ps = [0.0f32, 0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.999];
    run(5, "top_p", 64, 24, |rng, vocab, i| Row {
        logits: random_logits(rng, vocab, i / 2),
        params: params(
            [0.6, 1.0, 1.3][i % 3],
            // Alone (the whole row), and after a top-k small and large.
            [0, 0, 40, 2000][i % 4],
            ps[i % ps.len()],
            0.0,
            uniform(rng),
        ),
        penalized: Vec::new(),
        counts: Vec::new(),
    });
}

#[test]
fn min_p_matches_cpu() {
    let ms = [0.001f32, 0.05, 0.2, 0.5, 1.0, 1.5];
    run(6, "min_p", 48, 18, |rng, vocab, i| Row {
        logits: random_logits(rng, vocab, i / 2),
        params: params(
            [0.7, 1.0, 1.2][i % 3],
            [0, 100][i % 2],
            1.0,
            ms[i % ms.len()],
            uniform(rng),
        ),
        penalized: Vec::new(),
        counts: Vec::new(),
    });
}

/// Random parameters of every kind in one launch: many rows, each its own.
fn random_row(rng: &mut ChaCha8Rng, vocab: usize, i: usize) -> Row {
    let temperature = match rng.random_range(0..8) {
        0 => 0.0,
        _ => rng.random_range(0.1..2.0),
    };
    let top_k = [0u32, 0, 1, 5, 50, 500, 2000][rng.random_range(0..7)];
    let top_p = match rng.random_range(0..3) {
        0 => 1.0,
        _ => rng.random_range(0.05..1.0),
    };
    let min_p = match rng.random_range(0..3) {
        0 => rng.random_range(0.0..0.3),
        _ => 0.0,
    };
    let repetition_penalty = match rng.random_range(0..3) {
        0 => 1.0,
        1 => rng.random_range(1.05..2.0),
        _ => rng.random_range(0.5..0.95),
    };
    let n_penalized = rng.random_range(0..40);
    let mut penalized: Vec<u32> = (0..n_penalized)
        .map(|_| rng.random_range(0..vocab as u32 + 3))
        .collect();
    penalized.sort_unstable();
    penalized.dedup();
    let counts = penalized.iter().map(|_| rng.random_range(0..4)).collect();
    let (frequency_penalty, presence_penalty) = match rng.random_range(0..3) {
        0 => (0.0, 0.0),
        _ => (rng.random_range(-2.0..2.0), rng.random_range(-2.0..2.0)),
    };
    Row {
        logits: random_logits(rng, vocab, i),
        params: SampleParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            uniform: uniform(rng),
            frequency_penalty,
            presence_penalty,
        },
        penalized,
        counts,
    }
}

#[test]
fn combined_parameters_many_rows_one_launch() {
    run(7, "combined", 128, 64, random_row);
}

#[test]
fn penalties_apply_in_place_like_the_cpu() {
    run(8, "penalty", 32, 12, |rng, vocab, i| {
        // Positive and negative logits, with the leaders penalized (so the choice moves), and
        // ids past the vocabulary (ignored).
        let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-5.0..5.0)).collect();
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let mut penalized: Vec<u32> = order.iter().take(20).copied().collect();
        penalized.extend((0..10).map(|_| rng.random_range(0..vocab as u32)));
        penalized.extend([vocab as u32, vocab as u32 + 7, u32::MAX]);
        penalized.sort_unstable();
        penalized.dedup();
        // Generated counts up to 100 (a long answer repeating a token), 0 for prompt tokens.
        let counts = penalized
            .iter()
            .map(|_| [0, 1, 2, 100][rng.random_range(0..4)])
            .collect();
        Row {
            logits,
            params: SampleParams {
                temperature: [0.0, 0.8, 1.0][i % 3],
                top_k: [0, 10][i % 2],
                top_p: [1.0, 0.9][i / 2 % 2],
                min_p: 0.0,
                repetition_penalty: [1.3, 0.7, 2.5, 1.0][i % 4],
                uniform: uniform(rng),
                frequency_penalty: [0.0, 0.5, -0.3, 1.7, 0.1][i % 5],
                presence_penalty: [0.0, 1.1, 0.2, -2.0][i / 2 % 4],
            },
            penalized,
            counts,
        }
    });
}

/// Rows with infinities and NaN: a +inf logit wins as the argmax, a row with nothing above -inf
/// gives no token (`NO_FINITE_LOGIT`), greedy or not.
#[test]
fn non_finite_rows_follow_the_definition() {
    run(9, "non-finite", 24, 8, |rng, vocab, i| {
        let mut logits = vec![f32::NEG_INFINITY; vocab];
        match i % 6 {
            0 => {}
            1 => logits.fill(f32::NAN),
            2 => {
                for v in logits.iter_mut() {
                    if rng.random::<bool>() {
                        *v = f32::NAN;
                    }
                }
            }
            // +inf: no finite ranking, the first +inf wins.
            3 => {
                logits = random_logits(rng, vocab, 0);
                logits[rng.random_range(0..vocab)] = f32::INFINITY;
            }
            // One finite token among -inf: always that one.
            4 => logits[rng.random_range(0..vocab)] = 1.5,
            // A few finite ones among -inf and NaN.
            _ => {
                for _ in 0..3 {
                    logits[rng.random_range(0..vocab)] = rng.random_range(-2.0..2.0);
                }
                logits[rng.random_range(0..vocab)] = f32::NAN;
            }
        }
        Row {
            logits,
            params: params(
                [1.0, 0.5, 0.0][i / 6 % 3],
                [0, 2][i / 2 % 2],
                [1.0, 0.5][i / 3 % 2],
                0.0,
                uniform(rng),
            ),
            penalized: Vec::new(),
            counts: Vec::new(),
        }
    });
}

#[test]
fn sampling_is_deterministic() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    for vocab in [1000usize, 50_257, 128_256] {
        let rows: Vec<Row> = (0..48).map(|i| random_row(&mut rng, vocab, i)).collect();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
        let params: Vec<SampleParams> = rows.iter().map(|r| r.params).collect();
        let penalties = PenaltyLists::from_rows(rows.iter().map(Row::penalty_row));
        let mut first: Option<(Vec<u32>, Vec<f32>)> = None;
        for _ in 0..3 {
            let mut logits: CudaSlice<f32> = dev.stream.clone_htod(&flat).unwrap();
            let got =
                sampling::sample_host(&dev, &mut logits, rows.len(), vocab, &params, &penalties)
                    .unwrap();
            let after = dev.stream.clone_dtoh(&logits).unwrap();
            match &first {
                None => first = Some((got, after)),
                Some((tokens, logits)) => {
                    assert_eq!(&got, tokens, "vocab {vocab}: tokens differ between runs");
                    assert!(
                        after
                            .iter()
                            .zip(logits)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "vocab {vocab}: penalized logits differ between runs"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let Some(dev) = device() else { return };
    let s = &dev.stream;
    let (rows, vocab) = (2usize, 10usize);
    let mut logits = s.clone_htod(&vec![0.0f32; rows * vocab]).unwrap();
    let words = sampling::SAMPLE_PARAM_WORDS;
    let params = s.clone_htod(&vec![0u32; rows * words]).unwrap();
    let offsets = s.clone_htod(&vec![0u32; rows + 1]).unwrap();
    let tokens = s.clone_htod(&[0u32]).unwrap();
    let counts = s.clone_htod(&[0u32]).unwrap();
    let mut out = s.alloc_zeros::<u32>(rows).unwrap();
    let mut call = |logits: &mut CudaSlice<f32>, rows, vocab, p: usize, o: usize, n: usize| {
        sampling::sample(
            &dev,
            logits,
            rows,
            vocab,
            &params.slice(..p),
            &offsets.slice(..o),
            &tokens.as_view(),
            &counts.as_view(),
            &mut out.slice_mut(..n),
        )
    };
    let all = rows * words;
    assert!(call(&mut logits, rows, vocab, all, 3, 2).is_ok());
    assert!(
        call(&mut logits, rows, vocab + 1, all, 3, 2).is_err(),
        "logits"
    );
    assert!(
        call(&mut logits, rows, 0, all, 3, 2).is_err(),
        "empty vocab"
    );
    assert!(
        call(&mut logits, rows, vocab, all - 1, 3, 2).is_err(),
        "params"
    );
    assert!(
        call(&mut logits, rows, vocab, all, 2, 2).is_err(),
        "offsets"
    );
    assert!(call(&mut logits, rows, vocab, all, 3, 1).is_err(), "out");
    assert!(call(&mut logits, 0, vocab, 0, 1, 0).is_ok(), "no rows");
    let greedy = [SampleParams::GREEDY; 2];
    assert!(
        sampling::sample_host(
            &dev,
            &mut logits,
            rows,
            vocab,
            &greedy[..1],
            &PenaltyLists::empty(2)
        )
        .is_err(),
        "params for fewer rows"
    );
    let bad = PenaltyLists {
        offsets: vec![0, 2, 1],
        tokens: vec![1, 2],
        counts: vec![0, 0],
    };
    assert!(
        sampling::sample_host(&dev, &mut logits, rows, vocab, &greedy, &bad).is_err(),
        "decreasing offsets"
    );
    assert_eq!(
        sampling::sample_host(
            &dev,
            &mut logits,
            rows,
            vocab,
            &greedy,
            &PenaltyLists::empty(2)
        )
        .unwrap(),
        vec![0, 0]
    );
}
