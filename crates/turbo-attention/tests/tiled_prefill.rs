//! Paged attention of spans with many query rows (the tiled path) against a naive f64 softmax, on
//! fresh random batches: ragged spans (decode rows, short and long prefill chunks, with and
//! without history), scattered block tables of several block sizes, GQA ratios 1, 3 and 4, head
//! dims 16, 64, 128 and an odd one, and the lse output.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::{paged_attention, PagedKv, QuerySpan};

/// A random batch over paged KV storage.
struct Batch {
    block_size: usize,
    n_kv_heads: usize,
    n_heads: usize,
    d: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    q: Vec<f32>,
    /// Per span: (q_start, n_q, kv_len, block table).
    spans: Vec<(usize, usize, usize, Vec<u32>)>,
    /// Query rows no span covers.
    uncovered: Vec<usize>,
}

impl Batch {
    /// `shapes`: per span, (history tokens, new tokens). The spans' rows are laid out in a shuffled
    /// order, with one row that no span covers between them; block ids come from a shuffled pool.
    fn new(
        seed: u64,
        block_size: usize,
        n_kv_heads: usize,
        per_kv: usize,
        d: usize,
        magnitude: f32,
        shapes: &[(usize, usize)],
    ) -> Batch {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let blocks: usize = shapes
            .iter()
            .map(|&(h, n)| (h + n).div_ceil(block_size) + 1)
            .sum::<usize>()
            + 2;
        let mut pool: Vec<u32> = (0..blocks as u32).collect();
        pool.shuffle(&mut rng);
        let mut spans = Vec::new();
        for &(history, new) in shapes {
            let kv_len = history + new;
            let table: Vec<u32> = pool.drain(..kv_len.div_ceil(block_size) + 1).collect();
            spans.push((0, new, kv_len, table));
        }
        let mut order: Vec<usize> = (0..spans.len()).collect();
        order.shuffle(&mut rng);
        let (mut row, mut uncovered) = (0, Vec::new());
        for (i, &s) in order.iter().enumerate() {
            if i == 1 {
                uncovered.push(row);
                row += 1;
            }
            spans[s].0 = row;
            row += spans[s].1;
        }
        let n_heads = n_kv_heads * per_kv;
        let len = blocks * block_size * n_kv_heads * d;
        let mut r = |n: usize, m: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-1.0f32..1.0) * m).collect()
        };
        Batch {
            block_size,
            n_kv_heads,
            n_heads,
            d,
            keys: r(len, magnitude),
            values: r(len, 1.0),
            q: r(row * n_heads * d, magnitude),
            spans,
            uncovered,
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    fn run(&self) -> (Vec<f32>, Vec<f32>) {
        let kv = PagedKv {
            keys: &self.keys,
            values: &self.values,
            block_size: self.block_size,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.d,
            quant: None,
        };
        let spans: Vec<QuerySpan> = self
            .spans
            .iter()
            .map(|(q_start, n_q, kv_len, table)| QuerySpan {
                q_start: *q_start,
                n_q: *n_q,
                kv_len: *kv_len,
                block_table: table,
            })
            .collect();
        let rows = self.q.len() / self.d;
        let mut out = vec![f32::NAN; self.q.len()];
        let mut lse = vec![f32::NAN; rows];
        paged_attention(
            &self.q,
            self.n_heads,
            &kv,
            &spans,
            self.scale(),
            &mut out,
            Some(&mut lse),
        );
        (out, lse)
    }

    /// Naive f64 attention of query row `token`, head `head`, over keys `0..=pos` of `table`:
    /// (o, lse).
    fn reference(&self, token: usize, head: usize, table: &[u32], pos: usize) -> (Vec<f64>, f64) {
        let d = self.d;
        let kv_head = head / (self.n_heads / self.n_kv_heads);
        let q = &self.q[(token * self.n_heads + head) * d..][..d];
        let at = |p: usize| {
            ((table[p / self.block_size] as usize * self.block_size + p % self.block_size)
                * self.n_kv_heads
                + kv_head)
                * d
        };
        let scores: Vec<f64> = (0..=pos)
            .map(|p| {
                let k = &self.keys[at(p)..][..d];
                q.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * self.scale() as f64
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        let mut o = vec![0f64; d];
        for (p, wp) in w.iter().enumerate() {
            for (x, &v) in o.iter_mut().zip(&self.values[at(p)..][..d]) {
                *x += wp / sum * v as f64;
            }
        }
        (o, max + sum.ln())
    }

    /// Largest errors of the output (relative to 1 + the largest |o| of the row, as `o` is a
    /// weighted mean of values) and of the lse, over every row and head.
    fn max_errors(&self) -> (f64, f64) {
        let (out, lse) = self.run();
        let d = self.d;
        let mut rows: Vec<(usize, &[u32], usize)> = Vec::new();
        for (q_start, n_q, kv_len, table) in &self.spans {
            for i in 0..*n_q {
                rows.push((q_start + i, table, kv_len - n_q + i));
            }
        }
        // An uncovered row is position 0 of the first span's sequence.
        for &u in &self.uncovered {
            rows.push((u, &self.spans[0].3, 0));
        }
        let (mut err_o, mut err_lse) = (0f64, 0f64);
        for (token, table, pos) in rows {
            for head in 0..self.n_heads {
                let (o_ref, lse_ref) = self.reference(token, head, table, pos);
                let o = &out[(token * self.n_heads + head) * d..][..d];
                let scale = 1.0 + o_ref.iter().fold(0f64, |m, x| m.max(x.abs()));
                for (&x, y) in o.iter().zip(&o_ref) {
                    err_o = err_o.max((x as f64 - y).abs() / scale);
                }
                let l = lse[token * self.n_heads + head] as f64;
                err_lse = err_lse.max((l - lse_ref).abs() / (1.0 + lse_ref.abs()));
            }
        }
        (err_o, err_lse)
    }
}

/// Tolerance for both errors. The kernels accumulate in f32, in another order than the f64
/// reference (dot products in SIMD lanes, the softmax online over chunks of keys, rescaled as its
/// running max grows) and with a polynomial 2^x good to a few ulps; over up to a few hundred keys
/// and a head dim of 128 that stays within a few times 1e-6 of the exact result (measured: below
/// 6e-7 at magnitude 1, below 3e-6 at magnitude 4), so 2e-5 leaves a margin without hiding a
/// wrong key, row or rescale (an off-by-one causal mask is off by 3e-3 to 1 here).
const TOLERANCE: f64 = 2e-5;

/// History and new tokens per span: a decode step, short chunks, chunks longer than a tile
/// (48 rows, i.e. 16-48 tokens for these ratios) with and without history, one that starts in the
/// middle of a block.
const SHAPES: &[(usize, usize)] = &[
    (40, 1),
    (9, 2),
    (0, 37),
    (100, 70),
    (33, 17),
    (5, 3),
    (0, 1),
];

#[test]
fn tiled_prefill_matches_the_reference() {
    let mut seed = 0;
    for per_kv in [1usize, 3, 4] {
        for d in [16usize, 64, 128, 7] {
            for block_size in [1usize, 5, 16] {
                seed += 1;
                let batch = Batch::new(seed, block_size, 2, per_kv, d, 1.0, SHAPES);
                let (err_o, err_lse) = batch.max_errors();
                assert!(
                    err_o < TOLERANCE && err_lse < TOLERANCE,
                    "per_kv {per_kv}, d {d}, block {block_size}: o error {err_o:e}, lse error {err_lse:e}"
                );
            }
        }
    }
}

/// Larger scores (|q|, |k| up to 4: scores up to 16 sqrt(d)) exercise the running max and the
/// rescaling of the accumulated output far from the first chunk.
#[test]
fn tiled_prefill_matches_the_reference_with_large_scores() {
    for (seed, per_kv, d) in [(101u64, 3usize, 64usize), (102, 4, 128), (103, 1, 16)] {
        let batch = Batch::new(seed, 16, 3, per_kv, d, 4.0, SHAPES);
        let (err_o, err_lse) = batch.max_errors();
        assert!(
            err_o < TOLERANCE && err_lse < TOLERANCE,
            "per_kv {per_kv}, d {d}: o error {err_o:e}, lse error {err_lse:e}"
        );
    }
}

/// One long chunk over a long history, the shape of a chat round (SmolLM2's heads, smaller).
#[test]
fn a_chat_round_over_a_long_history_matches_the_reference() {
    let batch = Batch::new(7, 16, 3, 3, 64, 1.0, &[(700, 130), (300, 1)]);
    let (err_o, err_lse) = batch.max_errors();
    assert!(
        err_o < TOLERANCE && err_lse < TOLERANCE,
        "o error {err_o:e}, lse error {err_lse:e}"
    );
}
