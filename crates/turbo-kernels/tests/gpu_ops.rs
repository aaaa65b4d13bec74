//! The norm, matrix-vector, matrix product, elementwise and sampling kernels against CPU references,
//! on a real GPU.
//!
//! Every test skips (passes, printing "skipping: no CUDA device") on a machine without CUDA. With a
//! GPU, each case draws fresh random inputs (seeded, nonzero), rounds them to bf16, fills outputs
//! with NaN first so an element the kernel never wrote shows up, and compares with a reference
//! computed in f64 from the same bf16 values (and, for rms_norm / rope / silu_mul, also with
//! turbo-core's CPU ops).

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_kernels::{ops, CudaDevice};

/// A quiet NaN in bf16: what every output buffer starts as.
const NAN_BITS: u16 = 0x7FC0;

fn device() -> Option<CudaDevice> {
    if !turbo_kernels::cuda_available() {
        println!("skipping: no CUDA device");
        return None;
    }
    Some(CudaDevice::new(0).expect("cannot open CUDA device 0"))
}

/// `n` values uniform in ±[0.05, max): never zero, either sign, rounded to bf16.
fn random_bf16(rng: &mut ChaCha8Rng, n: usize, max: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(0.05..max);
            bf16::from_f32(if rng.random::<bool>() { m } else { -m })
        })
        .collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn upload<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &[T]) -> CudaSlice<T> {
    dev.stream.clone_htod(v).expect("upload")
}

fn download<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, s: &CudaSlice<T>) -> Vec<T> {
    dev.stream.clone_dtoh(s).expect("download")
}

/// `n` bf16 NaNs on the device.
fn poisoned(dev: &CudaDevice, n: usize) -> CudaSlice<bf16> {
    upload(dev, &vec![bf16::from_bits(NAN_BITS); n])
}

/// The kernels compute in f32 and round each output to bf16 once. bf16 keeps 8 significant bits,
/// so that rounding alone is off by up to 2^-9 relative (2^-8 between neighbouring values), and
/// the f32 arithmetic adds ~1e-6. `|gpu - ref| <= 1e-2 · max(1, |ref|)` is ~2.5 bf16 steps: it
/// never fails on correct rounding, yet catches a wrong index, a missing term or a skipped write
/// (inputs are at least 0.05 in magnitude). Below 1 the bound is absolute, for outputs near zero.
fn assert_close(what: &str, got: &[bf16], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        assert!(!g.is_nan(), "{what}: element {i} is NaN (never written?)");
        let tol = 1e-2 * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: gpu {g} vs reference {w}"
        );
    }
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn rms_norm_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let eps = 1e-5f32;
    let mut cases = vec![(2, 1), (4, 13)];
    for rows in [1, 3, 37] {
        for cols in [576, 577, 4096] {
            cases.push((rows, cols));
        }
    }
    for (rows, cols) in cases {
        let what = format!("rms_norm rows={rows} cols={cols}");
        let x = random_bf16(&mut rng, rows * cols, 2.0);
        let w = random_bf16(&mut rng, cols, 2.0);
        let (x_d, w_d) = (upload(&dev, &x), upload(&dev, &w));
        let mut out_d = poisoned(&dev, rows * cols);
        ops::norm::rms_norm(&dev, &x_d, &w_d, rows, cols, eps, &mut out_d).unwrap();
        let got = download(&dev, &out_d);

        let (xf, wf) = (to_f32(&x), to_f32(&w));
        let mut want = vec![0f64; rows * cols];
        for r in 0..rows {
            let row = &xf[r * cols..(r + 1) * cols];
            let ss = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ss + eps as f64).sqrt();
            for c in 0..cols {
                want[r * cols + c] = row[c] as f64 * inv * wf[c] as f64;
            }
        }
        assert_close(&what, &got, &want);

        let mut cpu = vec![f32::NAN; rows * cols];
        turbo_core::cpu::ops::rms_norm(&xf, &wf, eps, &mut cpu);
        assert_close(&format!("{what} (vs turbo-core)"), &got, &widen(&cpu));
    }
}

#[test]
fn rope_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let theta = 500_000f64;
    for (tokens, heads, head_dim) in [
        (1, 32, 128),
        (3, 8, 128),
        (37, 14, 64),
        (7, 5, 96),
        (5, 3, 2),
    ] {
        let what = format!("rope tokens={tokens} heads={heads} head_dim={head_dim}");
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32)
            .collect();
        // Large positions included: 100000 and 0 always, the rest anywhere up to 100000.
        let mut positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..=100_000)).collect();
        positions[0] = 100_000;
        if tokens > 1 {
            positions[1] = 0;
        }
        let n = tokens * heads * head_dim;
        let x = random_bf16(&mut rng, n, 2.0);
        let mut x_d = upload(&dev, &x);
        let (pos_d, freq_d) = (upload(&dev, &positions), upload(&dev, &inv_freq));
        ops::elementwise::rope(
            &dev,
            &mut x_d,
            tokens,
            heads,
            head_dim,
            &pos_d.slice(..),
            &freq_d,
        )
        .unwrap();
        let got = download(&dev, &x_d);

        let xf = to_f32(&x);
        let mut want = vec![0f64; n];
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..heads {
                for (i, &f) in inv_freq.iter().enumerate() {
                    let at = (t * heads + h) * head_dim + 2 * i;
                    let (a, b) = (xf[at] as f64, xf[at + 1] as f64);
                    let (sin, cos) = (pos as f64 * f as f64).sin_cos();
                    want[at] = a * cos - b * sin;
                    want[at + 1] = a * sin + b * cos;
                }
            }
        }
        assert_close(&what, &got, &want);
        // Tighter: one bf16 rounding (at most 2^-9 relative) plus 1e-4 for f32 arithmetic, with
        // 2x margin. An angle rounded to f32 as a whole would be off by up to ulp(1e5) / 2 ≈ 0.004
        // rad at position 100000, i.e. by up to ~0.01 in the output, and fail this.
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let g = g.to_f32() as f64;
            let tol = w.abs() / 256.0 + 1e-4;
            assert!(
                (g - w).abs() <= tol,
                "{what}: element {i}: gpu {g} vs reference {w} (tight)"
            );
        }

        let mut cpu = xf.clone();
        turbo_core::cpu::ops::rope_interleaved(&mut cpu, head_dim, &positions, &inv_freq);
        assert_close(&format!("{what} (vs turbo-core)"), &got, &widen(&cpu));
    }
}

/// Sizes for the flat elementwise ops: tails of every length mod 8, tiny and large.
const FLAT_SIZES: [usize; 7] = [1, 7, 8, 577, 4096 * 3, 14336 * 37 + 5, 100_003];

/// Extra elements past `n` in the buffers: the kernels must leave them alone.
const SLACK: usize = 11;

#[test]
fn silu_mul_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for n in FLAT_SIZES {
        let what = format!("silu_mul n={n}");
        let gate = random_bf16(&mut rng, n + SLACK, 4.0);
        let up = random_bf16(&mut rng, n + SLACK, 2.0);
        let (mut gate_d, up_d) = (upload(&dev, &gate), upload(&dev, &up));
        ops::elementwise::silu_mul(&dev, &mut gate_d, &up_d, n).unwrap();
        let got = download(&dev, &gate_d);
        assert!(
            got[n..]
                .iter()
                .zip(&gate[n..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: wrote past n"
        );
        let got = &got[..n];

        let (gf, uf) = (to_f32(&gate[..n]), to_f32(&up[..n]));
        let want: Vec<f64> = gf
            .iter()
            .zip(&uf)
            .map(|(&g, &u)| {
                let g = g as f64;
                g / (1.0 + (-g).exp()) * u as f64
            })
            .collect();
        assert_close(&what, got, &want);

        let mut cpu = gf.clone();
        turbo_core::cpu::ops::silu_mul(&mut cpu, &uf);
        assert_close(&format!("{what} (vs turbo-core)"), got, &widen(&cpu));
    }
}

#[test]
fn add_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for n in FLAT_SIZES {
        let what = format!("add n={n}");
        let x = random_bf16(&mut rng, n + SLACK, 2.0);
        let y = random_bf16(&mut rng, n + SLACK, 2.0);
        let (mut x_d, y_d) = (upload(&dev, &x), upload(&dev, &y));
        ops::elementwise::add(&dev, &mut x_d, &y_d, n).unwrap();
        let got = download(&dev, &x_d);
        assert!(
            got[n..]
                .iter()
                .zip(&x[n..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: wrote past n"
        );
        let want: Vec<f64> = x[..n]
            .iter()
            .zip(&y[..n])
            .map(|(a, b)| a.to_f32() as f64 + b.to_f32() as f64)
            .collect();
        assert_close(&what, &got[..n], &want);
    }
}

/// Checks that row `i` of `got` (`[n, cols]`) is bit-for-bit row `idx[i]` of `src`.
fn assert_gathered(what: &str, got: &[bf16], src: &[bf16], idx: &[u32], cols: usize) {
    assert_eq!(got.len(), idx.len() * cols, "{what}: length");
    for (i, &r) in idx.iter().enumerate() {
        let (g, s) = (
            &got[i * cols..(i + 1) * cols],
            &src[r as usize * cols..(r as usize + 1) * cols],
        );
        for c in 0..cols {
            assert_eq!(
                g[c].to_bits(),
                s[c].to_bits(),
                "{what}: out[{i}][{c}] = {} but source row {r} has {}",
                g[c],
                s[c]
            );
        }
    }
}

/// Ids naming the previous step's tokens ([`CARRIED_TOKEN`]) take the sampled token of the row
/// they name, in place; plain ids stay; a row past the sampled ones becomes an id no vocabulary
/// holds (the embedding then gives NaN); ids past `n` are not touched.
#[test]
fn carried_tokens_take_the_sampled_ones() {
    use turbo_core::backend::CARRIED_TOKEN;
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for (n, sampled_len) in [(1usize, 1usize), (5, 3), (300, 257), (1100, 1024)] {
        let sampled: Vec<u32> = (0..sampled_len)
            .map(|_| rng.random_range(0..50_000))
            .collect();
        let mut ids: Vec<u32> = (0..n + 4)
            .map(|_| match rng.random_range(0..3) {
                0 => rng.random_range(0..50_000),
                1 => CARRIED_TOKEN | rng.random_range(0..sampled_len as u32),
                _ => CARRIED_TOKEN | rng.random_range(0..sampled_len as u32 + 8),
            })
            .collect();
        ids[0] = CARRIED_TOKEN | (sampled_len as u32 - 1);
        let want: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| match (i < n, id & CARRIED_TOKEN) {
                (false, _) | (true, 0) => id,
                _ => sampled
                    .get((id & !CARRIED_TOKEN) as usize)
                    .copied()
                    .unwrap_or(u32::MAX),
            })
            .collect();
        let mut ids_d = upload(&dev, &ids);
        let sampled_d = upload(&dev, &sampled);
        ops::elementwise::resolve_carried_tokens(&dev, &mut ids_d.slice_mut(..), &sampled_d, n)
            .unwrap();
        assert_eq!(download(&dev, &ids_d), want, "n={n} sampled={sampled_len}");
    }
}

#[test]
fn embed_copies_table_rows() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let vocab = 1000usize;
    for dim in [1, 576, 577, 4096] {
        let table = random_bf16(&mut rng, vocab * dim, 2.0);
        let table_d = upload(&dev, &table);
        for n in [1, 3, 37] {
            let what = format!("embed n={n} dim={dim}");
            let mut ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
            ids[0] = vocab as u32 - 1;
            if n > 2 {
                ids[1] = 0;
                ids[2] = ids[0]; // a repeat
            }
            let ids_d = upload(&dev, &ids);
            let mut out_d = poisoned(&dev, n * dim);
            ops::elementwise::embed(&dev, &table_d, &ids_d.slice(..), n, dim, &mut out_d).unwrap();
            assert_gathered(&what, &download(&dev, &out_d), &table, &ids, dim);
        }
    }

    // An id past the table reads nothing and gives a row of NaN; its neighbours are unaffected.
    let dim = 64;
    let table = random_bf16(&mut rng, vocab * dim, 2.0);
    let ids = [3u32, vocab as u32 + 5, 7];
    let (table_d, ids_d) = (upload(&dev, &table), upload(&dev, &ids));
    // Ones, not NaN, so that NaN in row 1 must come from the kernel.
    let mut out_d = upload(&dev, &vec![bf16::ONE; 3 * dim]);
    ops::elementwise::embed(&dev, &table_d, &ids_d.slice(..), 3, dim, &mut out_d).unwrap();
    let got = download(&dev, &out_d);
    assert!(
        got[dim..2 * dim].iter().all(|v| v.is_nan()),
        "embed: out-of-range id not NaN"
    );
    assert_gathered("embed row 0", &got[..dim], &table, &ids[..1], dim);
    assert_gathered("embed row 2", &got[2 * dim..], &table, &ids[2..], dim);
}

#[test]
fn gather_rows_copies_rows() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let src_rows = 37usize;
    for cols in [1, 576, 577, 4096] {
        let x = random_bf16(&mut rng, src_rows * cols, 2.0);
        let x_d = upload(&dev, &x);
        for n in [1, 3, 37, 50] {
            let what = format!("gather_rows n={n} cols={cols}");
            let idx: Vec<u32> = (0..n)
                .map(|_| rng.random_range(0..src_rows as u32))
                .collect();
            let idx_d = upload(&dev, &idx);
            let mut out_d = poisoned(&dev, n * cols);
            ops::elementwise::gather_rows(&dev, &x_d, &idx_d.slice(..), n, cols, &mut out_d)
                .unwrap();
            assert_gathered(&what, &download(&dev, &out_d), &x, &idx, cols);
        }
    }
}

#[test]
fn write_kv_scatters_to_slots() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (blocks, block_size) = (16usize, 16usize);
    let cache_slots = blocks * block_size;
    // slot_len = n_kv_heads · head_dim: 8 × 128, 9 × 64, 3 × 65 (not a multiple of 8).
    for slot_len in [1024, 576, 195] {
        for tokens in [1, 3, 37] {
            let what = format!("write_kv slot_len={slot_len} tokens={tokens}");
            let mut all: Vec<u32> = (0..cache_slots as u32).collect();
            all.shuffle(&mut rng);
            let slots = &all[..tokens]; // distinct, in random order
            let k = random_bf16(&mut rng, tokens * slot_len, 2.0);
            let v = random_bf16(&mut rng, tokens * slot_len, 2.0);
            let (k_d, v_d, slots_d) = (upload(&dev, &k), upload(&dev, &v), upload(&dev, slots));
            let mut k_cache = poisoned(&dev, cache_slots * slot_len);
            let mut v_cache = poisoned(&dev, cache_slots * slot_len);
            ops::elementwise::write_kv(
                &dev,
                &mut k_cache,
                &mut v_cache,
                &k_d,
                &v_d,
                &slots_d.slice(..),
                tokens,
                slot_len,
            )
            .unwrap();
            for (name, cache, src) in [("keys", &k_cache, &k), ("values", &v_cache, &v)] {
                let got = download(&dev, cache);
                for s in 0..cache_slots {
                    let row = &got[s * slot_len..(s + 1) * slot_len];
                    match slots.iter().position(|&x| x as usize == s) {
                        Some(t) => {
                            let want = &src[t * slot_len..(t + 1) * slot_len];
                            for j in 0..slot_len {
                                assert_eq!(
                                    row[j].to_bits(),
                                    want[j].to_bits(),
                                    "{what}: {name} slot {s} (token {t}) element {j}"
                                );
                            }
                        }
                        None => assert!(
                            row.iter().all(|x| x.to_bits() == NAN_BITS),
                            "{what}: {name} slot {s} was not in slots but was written"
                        ),
                    }
                }
            }
        }
    }
}

/// The lowest index of the largest value (the values hold no NaN).
fn argmax_ref(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits for argmax, `rows × cols`, with a different pattern per row: plain random values
/// (bf16-rounded in the bf16 test, so ties happen), all negative, a planted three-way tie, a
/// constant row (answer 0), and the maximum in the last two columns (a tie, in the scalar tail
/// when cols % 8 != 0).
fn argmax_logits(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let mut row: Vec<f32> = match r % 5 {
            0 => (0..cols).map(|_| rng.random_range(-2.0..2.0)).collect(),
            1 => (0..cols).map(|_| rng.random_range(-20.0..-1.0)).collect(),
            3 => vec![-3.0; cols],
            _ => (0..cols).map(|_| rng.random_range(-5.0..5.0)).collect(),
        };
        if r % 5 == 2 {
            for _ in 0..3 {
                let j = rng.random_range(0..cols);
                row[j] = 8.0;
            }
        }
        if r % 5 == 4 {
            row[cols - 1] = 10.0;
            if cols > 1 {
                row[cols - 2] = 10.0;
            }
        }
        x.extend(row);
    }
    x
}

const ARGMAX_SHAPES: [(usize, usize); 8] = [
    (1, 1),
    (3, 8),
    (5, 577),
    (37, 4096),
    (3, 32_001),
    (37, 128_256),
    (1, 128_256),
    (10, 1003),
];

#[test]
fn argmax_bf16_lowest_index_of_max() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (rows, cols) in ARGMAX_SHAPES {
        let x: Vec<bf16> = argmax_logits(&mut rng, rows, cols)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let xf = to_f32(&x);
        let got = ops::sampling::argmax(&dev, &upload(&dev, &x), rows, cols).unwrap();
        let want: Vec<u32> = xf.chunks(cols).map(argmax_ref).collect();
        assert_eq!(got, want, "argmax bf16 rows={rows} cols={cols}");
    }
}

#[test]
fn argmax_f32_lowest_index_of_max() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for (rows, cols) in ARGMAX_SHAPES {
        let x = argmax_logits(&mut rng, rows, cols);
        let got = ops::sampling::argmax_f32(&dev, &upload(&dev, &x), rows, cols).unwrap();
        let want: Vec<u32> = x.chunks(cols).map(argmax_ref).collect();
        assert_eq!(got, want, "argmax f32 rows={rows} cols={cols}");
    }
}

/// Rows with nothing above -inf (all NaN, all -inf, a mix) give no token
/// (`NO_FINITE_LOGIT`), in f32 and bf16; a NaN beside finite values counts as -inf; the rows
/// around them are unaffected.
#[test]
fn argmax_of_rows_without_a_finite_value_is_no_token() {
    use turbo_core::sampling::NO_FINITE_LOGIT;
    let Some(dev) = device() else { return };
    let cols = 1003;
    let (nan, ninf) = (f32::NAN, f32::NEG_INFINITY);
    let mut mixed = vec![ninf; cols];
    mixed[7] = nan;
    let mut one = vec![nan; cols];
    one[500] = -3.0;
    let rows: Vec<Vec<f32>> = vec![
        vec![nan; cols],
        vec![ninf; cols],
        mixed,
        one,
        vec![1.0; cols],
    ];
    let want = vec![NO_FINITE_LOGIT, NO_FINITE_LOGIT, NO_FINITE_LOGIT, 500, 0];
    let x: Vec<f32> = rows.concat();
    let got = ops::sampling::argmax_f32(&dev, &upload(&dev, &x), rows.len(), cols).unwrap();
    assert_eq!(got, want, "f32");
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let got = ops::sampling::argmax(&dev, &upload(&dev, &xb), rows.len(), cols).unwrap();
    assert_eq!(got, want, "bf16");
}

#[test]
fn swiglu_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (rows, cols) in [
        (1usize, 1536usize),
        (3, 577),
        (37, 14336),
        (1024, 14336),
        (5, 8),
    ] {
        let what = format!("swiglu {rows}x{cols}");
        let gu = random_bf16(&mut rng, rows * 2 * cols, 4.0);
        let gu_d = upload(&dev, &gu);
        let mut out = poisoned(&dev, rows * cols);
        ops::elementwise::swiglu(&dev, &gu_d, rows, cols, &mut out).unwrap();
        let got = download(&dev, &out);
        let guf = to_f32(&gu);
        let want: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                let g = guf[r * 2 * cols + c] as f64;
                g / (1.0 + (-g).exp()) * guf[r * 2 * cols + cols + c] as f64
            })
            .collect();
        assert_close(&what, &got, &want);
        let mut cpu = vec![0f32; rows * cols];
        turbo_core::cpu::ops::swiglu(&guf, &mut cpu, cols);
        assert_close(&format!("{what} (vs turbo-core)"), &got, &widen(&cpu));
    }
}

/// Rows of `w` (`[rows, k]`) times each token of `x` (`[tokens, k]`), in f64: `[tokens, rows]`,
/// with each token scaled by `g` and its 1/rms first when `norm` is given.
/// An f32-out product of `k` terms against f64: only the f32 accumulation's error, far below one
/// term (|term| >= 0.0025).
fn assert_f32_product(what: &str, got: &[f32], want: &[f64], k: usize) {
    for (i, (got, want)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * (k as f64) + 1e-6 * want.abs();
        assert!(
            (*got as f64 - want).abs() <= tol,
            "{what}: element {i}: gpu {got} vs reference {want}"
        );
    }
}

fn gemv_ref(w: &[f32], x: &[f32], k: usize, norm: Option<(&[f32], f64)>) -> Vec<f64> {
    let rows = w.len() / k;
    let mut out = Vec::new();
    for xt in x.chunks_exact(k) {
        let (scale, g) = match norm {
            Some((g, eps)) => {
                let ms = xt.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / k as f64;
                (1.0 / (ms + eps).sqrt(), Some(g))
            }
            None => (1.0, None),
        };
        for r in 0..rows {
            let wr = &w[r * k..(r + 1) * k];
            let dot: f64 = (0..k)
                .map(|i| wr[i] as f64 * xt[i] as f64 * g.map_or(1.0, |g| g[i] as f64))
                .sum();
            out.push(dot * scale);
        }
    }
    out
}

/// Every token count the stream kernels take (1-8), widths that end mid-span and span many
/// unrolled loads, row counts that leave a block part-empty; each epilogue against f64.
#[test]
fn gemv_matches_reference() {
    use ops::gemv::{gemv, GemvNorm, GemvOut};
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let eps = 1e-5f32;
    for tokens in 1..=ops::gemv::GEMV_MAX_TOKENS {
        for (rows, k) in [(37usize, 8usize), (200, 264), (13, 4096), (70, 14336)] {
            let what = |op: &str| format!("gemv {op} tokens={tokens} rows={rows} k={k}");
            let w = random_bf16(&mut rng, rows * k, 1.0);
            let x = random_bf16(&mut rng, tokens * k, 2.0);
            let g = random_bf16(&mut rng, k, 1.5);
            let (wf, xf, gf) = (to_f32(&w), to_f32(&x), to_f32(&g));
            let (w_d, x_d, g_d) = (upload(&dev, &w), upload(&dev, &x), upload(&dev, &g));
            let n = tokens * rows;
            let run = |norm: Option<GemvNorm>, out: GemvOut| {
                gemv(&dev, &x_d, tokens, &w_d, rows, k, norm, out).unwrap()
            };

            let plain = gemv_ref(&wf, &xf, k, None);
            let mut out = poisoned(&dev, n);
            run(None, GemvOut::Bf16(&mut out));
            assert_close(&what("bf16"), &download(&dev, &out), &plain);

            let mut logits = upload(&dev, &vec![f32::NAN; n]);
            run(None, GemvOut::F32(&mut logits));
            assert_f32_product(&what("f32"), &download(&dev, &logits), &plain, k);

            let residual = random_bf16(&mut rng, n, 2.0);
            let mut res_d = upload(&dev, &residual);
            run(None, GemvOut::AddTo(&mut res_d));
            let want: Vec<f64> = plain
                .iter()
                .zip(&residual)
                .map(|(p, r)| p + r.to_f32() as f64)
                .collect();
            assert_close(&what("residual"), &download(&dev, &res_d), &want);

            let normed = gemv_ref(&wf, &xf, k, Some((&gf, eps as f64)));
            let mut out = poisoned(&dev, n);
            let norm = GemvNorm { weight: &g_d, eps };
            run(Some(norm), GemvOut::Bf16(&mut out));
            assert_close(&what("norm"), &download(&dev, &out), &normed);

            if rows % 2 == 0 {
                // Gate rows first, then up rows; each rounded to bf16 as a stored product would be.
                let half_n = tokens * rows / 2;
                let want: Vec<f64> = (0..half_n)
                    .map(|i| {
                        let (t, j) = (i / (rows / 2), i % (rows / 2));
                        let round = |v: f64| bf16::from_f64(v).to_f64();
                        let gate = round(normed[t * rows + j]);
                        let up = round(normed[t * rows + rows / 2 + j]);
                        gate / (1.0 + (-gate).exp()) * up
                    })
                    .collect();
                let mut out = poisoned(&dev, half_n);
                let norm = GemvNorm { weight: &g_d, eps };
                run(Some(norm), GemvOut::SwiGlu(&mut out));
                assert_close(&what("swiglu"), &download(&dev, &out), &want);
            }
        }
    }
}

/// The ring forms the tests compare against gemv.cu's kernels: the default, a ring of two
/// short stages (8 KiB: the stage count is raised to two), and one large block an SM with long
/// chunks.
fn rings() -> [ops::gemv::GemvRing; 3] {
    use ops::gemv::GemvRing;
    [
        GemvRing {
            ring_bytes: 96 << 10,
            blocks_per_sm: 2,
            chunk: 1024,
        },
        GemvRing {
            ring_bytes: 8 << 10,
            blocks_per_sm: 1,
            chunk: 256,
        },
        GemvRing {
            ring_bytes: 200 << 10,
            blocks_per_sm: 1,
            chunk: 4096,
        },
    ]
}

/// Whether this device runs the ring kernels (`kernels/gemv_sm90a.cu`, Hopper only).
fn ring_device() -> Option<CudaDevice> {
    let dev = device()?;
    if !dev.supports_module("gemv_sm90a") {
        println!("skipping: the ring-fed products run on sm_90 only");
        return None;
    }
    Some(dev)
}

fn bits(dev: &CudaDevice, s: &CudaSlice<bf16>) -> Vec<u16> {
    download(dev, s).iter().map(|x| x.to_bits()).collect()
}

/// One-token products streamed through the shared-memory ring give gemv.cu's bits: every
/// epilogue, widths of one chunk, several, and a partial last one, unit counts that leave groups
/// and blocks part-empty, rings of two to eight stages and one or two blocks an SM.
#[test]
fn gemv_ring_equals_stream_kernels_bit_for_bit() {
    use ops::gemv::{gemv_with_ring, GemvNorm, GemvOut};
    let Some(dev) = ring_device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(26);
    for (rows, k) in [
        (37usize, 8usize),
        (200, 264),
        (13, 4096),
        (70, 14336),
        (998, 4104),
        (4100, 576),
        (6144, 4096),
    ] {
        let w = upload(&dev, &random_bf16(&mut rng, rows * k, 1.0));
        let x = upload(&dev, &random_bf16(&mut rng, k, 2.0));
        let g = upload(&dev, &random_bf16(&mut rng, k, 1.5));
        let residual = random_bf16(&mut rng, rows, 2.0);
        let norm = || {
            Some(GemvNorm {
                weight: &g,
                eps: 1e-5,
            })
        };
        // (bf16, f32, residual, norm, swiglu) outputs of one form.
        let run = |ring| {
            let go = |norm, out| gemv_with_ring(&dev, ring, &x, 1, &w, rows, k, norm, out).unwrap();
            let mut plain = poisoned(&dev, rows);
            go(None, GemvOut::Bf16(&mut plain));
            let mut logits = upload(&dev, &vec![f32::NAN; rows]);
            go(None, GemvOut::F32(&mut logits));
            let mut res = upload(&dev, &residual);
            go(None, GemvOut::AddTo(&mut res));
            let mut normed = poisoned(&dev, rows);
            go(norm(), GemvOut::Bf16(&mut normed));
            let mut swiglu = poisoned(&dev, rows / 2);
            if rows % 2 == 0 {
                go(norm(), GemvOut::SwiGlu(&mut swiglu));
            }
            let logits: Vec<u32> = download(&dev, &logits)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (
                bits(&dev, &plain),
                logits,
                bits(&dev, &res),
                bits(&dev, &normed),
                bits(&dev, &swiglu),
            )
        };
        let want = run(None);
        assert!(
            want.0.iter().all(|&b| b != NAN_BITS),
            "rows={rows} k={k}: unwritten"
        );
        for ring in rings() {
            let got = run(Some(ring));
            let what = format!("rows={rows} k={k} {ring:?}");
            assert_eq!(got.0, want.0, "{what}: bf16");
            assert_eq!(got.1, want.1, "{what}: f32");
            assert_eq!(got.2, want.2, "{what}: residual");
            assert_eq!(got.3, want.3, "{what}: norm");
            assert_eq!(got.4, want.4, "{what}: swiglu");
        }
    }
}

/// A chain of ring products, each launched as a dependent of the one before and reading what
/// it wrote (a feed-forward block's SwiGLU product and the down product into the residual
/// stream, six times), gives the bits of the same chain of gemv.cu's launches: no product reads
/// its input before the one ahead has written it.
#[test]
fn dependent_ring_launches_read_what_the_kernel_ahead_wrote() {
    use ops::gemv::{gemv_with_ring, GemvNorm, GemvOut};
    let Some(dev) = ring_device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(27);
    let (k, ffn, layers) = (2048usize, 5632usize, 6);
    let up: Vec<CudaSlice<bf16>> = (0..layers)
        .map(|_| upload(&dev, &random_bf16(&mut rng, 2 * ffn * k, 0.08)))
        .collect();
    let down: Vec<CudaSlice<bf16>> = (0..layers)
        .map(|_| upload(&dev, &random_bf16(&mut rng, k * ffn, 0.08)))
        .collect();
    let g = upload(&dev, &random_bf16(&mut rng, k, 1.5));
    let h0 = random_bf16(&mut rng, k, 2.0);
    let run = |ring| {
        let mut h = upload(&dev, &h0);
        let mut act = poisoned(&dev, ffn);
        for (u, d) in up.iter().zip(&down) {
            let norm = Some(GemvNorm {
                weight: &g,
                eps: 1e-5,
            });
            gemv_with_ring(
                &dev,
                ring,
                &h,
                1,
                u,
                2 * ffn,
                k,
                norm,
                GemvOut::SwiGlu(&mut act),
            )
            .unwrap();
            gemv_with_ring(&dev, ring, &act, 1, d, k, ffn, None, GemvOut::AddTo(&mut h)).unwrap();
        }
        bits(&dev, &h)
    };
    let want = run(None);
    assert!(
        want.iter().all(|&b| bf16::from_bits(b).is_finite()),
        "the chain overflowed"
    );
    for ring in rings() {
        assert_eq!(run(Some(ring)), want, "{ring:?}");
    }
}

/// The fused QKV product streamed through the ring gives gemv.cu's bits (queries and both caches).
#[test]
fn gemv_qkv_rope_ring_equals_stream_kernel_bit_for_bit() {
    use ops::gemv::{gemv_qkv_rope_with_ring, GemvNorm, QkvRopeOut};
    let Some(dev) = ring_device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(28);
    for (heads, kv_heads, head_dim, k) in [
        (32, 8, 128, 4096),
        (9, 3, 64, 576),
        (4, 4, 32, 264),
        (6, 2, 64, 14336),
    ] {
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        let rows = q_cols + 2 * kv_cols;
        let (inv_freq, positions, slots, cache_slots) = rope_step(&mut rng, 1, head_dim, 500_000.0);
        let w = upload(&dev, &random_bf16(&mut rng, rows * k, 0.1));
        let x = upload(&dev, &random_bf16(&mut rng, k, 2.0));
        let g = upload(&dev, &random_bf16(&mut rng, k, 1.5));
        let (pos_d, slots_d, freq_d) = (
            upload(&dev, &positions),
            upload(&dev, &slots),
            upload(&dev, &inv_freq),
        );
        let run = |ring| {
            let mut q = poisoned(&dev, q_cols);
            let mut k_cache = poisoned(&dev, cache_slots * kv_cols);
            let mut v_cache = poisoned(&dev, cache_slots * kv_cols);
            gemv_qkv_rope_with_ring(
                &dev,
                ring,
                &x,
                1,
                &w,
                k,
                GemvNorm {
                    weight: &g,
                    eps: 1e-5,
                },
                QkvRopeOut {
                    q: &mut q,
                    k_cache: &mut k_cache,
                    v_cache: &mut v_cache,
                    positions: &pos_d.slice(..),
                    slots: &slots_d.slice(..),
                    inv_freq: &freq_d,
                    widths: (q_cols, kv_cols, head_dim),
                },
            )
            .unwrap();
            [q, k_cache, v_cache]
        };
        let want = run(None);
        for ring in rings() {
            let got = run(Some(ring));
            assert_same_qkv(
                &dev,
                &format!("heads={heads}/{kv_heads} d={head_dim} k={k} {ring:?}"),
                [&got[0], &got[1], &got[2]],
                [&want[0], &want[1], &want[2]],
                kv_cols,
                &slots,
            );
        }
    }
}

/// The cuBLASLt products (`ops::linear`) against f64: bf16 out, added to a residual, and f32 out;
/// token counts from one to a prefill's, widths and row counts that are no multiple of 8, each
/// shape twice (the second run reuses the shape's cached plan).
#[test]
fn linear_matches_reference() {
    use ops::linear::{linear, linear_add, linear_f32_out};
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for (n, k, m) in [
        (1usize, 64usize, 96usize),
        (5, 264, 200),
        (17, 4096, 13),
        (130, 1000, 333),
        (512, 2048, 1024),
    ] {
        for round in 0..2 {
            let what = |op: &str| format!("linear {op} n={n} k={k} m={m} round {round}");
            let w = random_bf16(&mut rng, m * k, 1.0);
            let x = random_bf16(&mut rng, n * k, 2.0);
            let want = gemv_ref(&to_f32(&w), &to_f32(&x), k, None);
            let (w_d, x_d) = (upload(&dev, &w), upload(&dev, &x));

            let mut out = poisoned(&dev, n * m);
            linear(&dev, &x_d, &w_d, n, k, m, &mut out).unwrap();
            assert_close(&what("bf16"), &download(&dev, &out), &want);

            let residual = random_bf16(&mut rng, n * m, 2.0);
            let mut res_d = upload(&dev, &residual);
            linear_add(&dev, &x_d, &w_d, n, k, m, &mut res_d).unwrap();
            // cuBLASLt may round the product to bf16 before adding the residual (as an unfused
            // product then add would): the error is then up to a bf16 step of the largest of the
            // product, the residual and the sum, which the 1e-2 relative bound is taken against.
            for (i, (got, (p, r))) in download(&dev, &res_d)
                .iter()
                .zip(want.iter().zip(&residual))
                .enumerate()
            {
                let r = r.to_f32() as f64;
                let tol = 1e-2 * p.abs().max(r.abs()).max((p + r).abs()).max(1.0);
                assert!(
                    (got.to_f32() as f64 - (p + r)).abs() <= tol,
                    "{}: element {i}: gpu {got} vs reference {}",
                    what("residual"),
                    p + r
                );
            }

            let mut logits = upload(&dev, &vec![f32::NAN; n * m]);
            linear_f32_out(&dev, &x_d, &w_d, n, k, m, &mut logits).unwrap();
            assert_f32_product(&what("f32"), &download(&dev, &logits), &want, k);
        }
    }
    // Too-small buffers are errors, not launches.
    let (w_d, x_d) = (
        upload(&dev, &[bf16::ONE; 64]),
        upload(&dev, &[bf16::ONE; 8]),
    );
    let mut out = poisoned(&dev, 8);
    assert!(linear(&dev, &x_d, &w_d, 2, 8, 8, &mut out).is_err());
}

/// Shapes the kernels cannot take are refused, not launched.
#[test]
fn gemv_refuses_what_it_cannot_take() {
    use ops::gemv::{gemv, GemvNorm, GemvOut};
    let Some(dev) = device() else { return };
    let (w, x, g) = (
        upload(&dev, &[bf16::ONE; 64 * 16]),
        upload(&dev, &[bf16::ONE; 9 * 16]),
        upload(&dev, &[bf16::ONE; 16]),
    );
    let mut out = poisoned(&dev, 9 * 64);
    for (tokens, k) in [(0, 16), (5, 16), (1, 12)] {
        let r = gemv(
            &dev,
            &x,
            tokens,
            &w,
            64 * 16 / k,
            k,
            None,
            GemvOut::Bf16(&mut out),
        );
        assert!(r.is_err(), "tokens={tokens} k={k} accepted");
    }
    let r = gemv(&dev, &x, 1, &w, 64, 16, None, GemvOut::SwiGlu(&mut out));
    assert!(r.is_err(), "SwiGLU without a norm accepted");
    let norm = GemvNorm {
        weight: &g,
        eps: 1e-5,
    };
    let r = gemv(&dev, &x, 1, &w, 65, 16, Some(norm), GemvOut::Bf16(&mut out));
    assert!(r.is_err(), "more rows than the weight holds accepted");
}

#[test]
fn split3_splits_columns() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for (rows, (ca, cb, cc)) in [
        (1usize, (4096usize, 1024usize, 1024usize)),
        (5, (576, 192, 192)),
        (3, (7, 1, 9)),
    ] {
        let x = random_bf16(&mut rng, rows * (ca + cb + cc), 2.0);
        let x_d = upload(&dev, &x);
        let (mut a, mut b, mut c) = (
            poisoned(&dev, rows * ca),
            poisoned(&dev, rows * cb),
            poisoned(&dev, rows * cc),
        );
        ops::elementwise::split3(&dev, &x_d, rows, (ca, cb, cc), &mut a, &mut b, &mut c).unwrap();
        let (a, b, c) = (download(&dev, &a), download(&dev, &b), download(&dev, &c));
        let w = ca + cb + cc;
        for r in 0..rows {
            let row = &x[r * w..(r + 1) * w];
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a[r * ca..(r + 1) * ca]), bits(&row[..ca]));
            assert_eq!(bits(&b[r * cb..(r + 1) * cb]), bits(&row[ca..ca + cb]));
            assert_eq!(bits(&c[r * cc..(r + 1) * cc]), bits(&row[ca + cb..]));
        }
    }
}

/// The fused step after the QKV product equals its parts (split3, rope of q and k, write_kv,
/// each tested against references above) on fresh random rows: the same rotation rounded once to
/// bf16, so equal to the bit; padded rows with a slot past the cache write nothing.
/// A decode-like step's rotary inputs: inverse frequencies for `theta`, a random position per
/// token, and distinct shuffled KV slots among `tokens + 5` (row 1 padded when there are more
/// than two rows); `(inv_freq, positions, slots, cache_slots)`.
fn rope_step(
    rng: &mut ChaCha8Rng,
    tokens: usize,
    head_dim: usize,
    theta: f32,
) -> (Vec<f32>, Vec<u32>, Vec<u32>, usize) {
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32))
        .collect();
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..=40_000)).collect();
    let cache_slots = tokens + 5;
    let mut slots: Vec<u32> = (0..cache_slots as u32).collect();
    slots.shuffle(rng);
    slots.truncate(tokens);
    if tokens > 2 {
        slots[1] = u32::MAX; // a padded row
    }
    (inv_freq, positions, slots, cache_slots)
}

/// `qkv_rope_kv` into fresh poisoned buffers: `(q, k cache, v cache)`.
fn qkv_rope_kv_poisoned(
    dev: &CudaDevice,
    qkv: &CudaSlice<bf16>,
    tokens: usize,
    (q_cols, kv_cols, head_dim): (usize, usize, usize),
    rope: (&CudaSlice<u32>, &CudaSlice<u32>, &CudaSlice<f32>),
    cache_slots: usize,
) -> [CudaSlice<bf16>; 3] {
    let (positions, slots, inv_freq) = rope;
    let mut q = poisoned(dev, tokens * q_cols);
    let mut k_cache = poisoned(dev, cache_slots * kv_cols);
    let mut v_cache = poisoned(dev, cache_slots * kv_cols);
    ops::elementwise::qkv_rope_kv(
        dev,
        qkv,
        &mut q,
        &mut k_cache,
        &mut v_cache,
        tokens,
        (q_cols, kv_cols, head_dim),
        &positions.slice(..),
        &slots.slice(..),
        inv_freq,
    )
    .unwrap();
    [q, k_cache, v_cache]
}

/// Asserts two `(q, k cache, v cache)` results equal bit for bit, and that the caches hold
/// exactly the unpadded `slots`' rows.
fn assert_same_qkv(
    dev: &CudaDevice,
    what: &str,
    got: [&CudaSlice<bf16>; 3],
    want: [&CudaSlice<bf16>; 3],
    kv_cols: usize,
    slots: &[u32],
) {
    let bits = |s: &CudaSlice<bf16>| -> Vec<u16> {
        download(dev, s).iter().map(|x| x.to_bits()).collect()
    };
    for ((g, w), part) in got.iter().zip(want).zip(["queries", "keys", "values"]) {
        assert_eq!(bits(g), bits(w), "{what}: {part}");
    }
    let written = bits(got[1])
        .chunks(kv_cols)
        .filter(|row| row.iter().all(|&b| b != NAN_BITS))
        .count();
    let valid = slots.iter().filter(|&&s| s != u32::MAX).count();
    assert_eq!(written, valid, "{what}: slots written");
}

#[test]
fn qkv_rope_kv_equals_its_parts() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (tokens, heads, kv_heads, head_dim) in [(1, 32, 8, 128), (19, 9, 3, 64), (4, 4, 4, 32)] {
        let what = format!("qkv_rope_kv tokens={tokens} heads={heads}/{kv_heads} d={head_dim}");
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        let width = q_cols + 2 * kv_cols;
        let (inv_freq, positions, slots, cache_slots) =
            rope_step(&mut rng, tokens, head_dim, 10_000.0);
        let qkv = random_bf16(&mut rng, tokens * width, 2.0);
        let (qkv_d, pos_d, slots_d, freq_d) = (
            upload(&dev, &qkv),
            upload(&dev, &positions),
            upload(&dev, &slots),
            upload(&dev, &inv_freq),
        );

        let [q, k_cache, v_cache] = qkv_rope_kv_poisoned(
            &dev,
            &qkv_d,
            tokens,
            (q_cols, kv_cols, head_dim),
            (&pos_d, &slots_d, &freq_d),
            cache_slots,
        );

        let (mut q2, mut k2, mut v2) = (
            poisoned(&dev, tokens * q_cols),
            poisoned(&dev, tokens * kv_cols),
            poisoned(&dev, tokens * kv_cols),
        );
        ops::elementwise::split3(
            &dev,
            &qkv_d,
            tokens,
            (q_cols, kv_cols, kv_cols),
            &mut q2,
            &mut k2,
            &mut v2,
        )
        .unwrap();
        for (x, cols) in [(&mut q2, q_cols), (&mut k2, kv_cols)] {
            let heads = cols / head_dim;
            ops::elementwise::rope(&dev, x, tokens, heads, head_dim, &pos_d.slice(..), &freq_d)
                .unwrap();
        }
        let mut k_cache2 = poisoned(&dev, cache_slots * kv_cols);
        let mut v_cache2 = poisoned(&dev, cache_slots * kv_cols);
        ops::elementwise::write_kv(
            &dev,
            &mut k_cache2,
            &mut v_cache2,
            &k2,
            &v2,
            &slots_d.slice(..),
            tokens,
            kv_cols,
        )
        .unwrap();
        assert_same_qkv(
            &dev,
            &what,
            [&q, &k_cache, &v_cache],
            [&q2, &k_cache2, &v_cache2],
            kv_cols,
            &slots,
        );
    }
}

/// The decode step's fused QKV product (norm, product, RoPE, KV write in one kernel) equals the
/// normalised product followed by `qkv_rope_kv`, bit for bit: each product is rounded to bf16
/// before its rotation, as a stored QKV row is.
#[test]
fn gemv_qkv_rope_equals_product_then_qkv_rope_kv() {
    use ops::gemv::{gemv, gemv_qkv_rope, GemvNorm, GemvOut, QkvRopeOut};
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    for (tokens, heads, kv_heads, head_dim, k) in [
        (1, 32, 8, 128, 4096),
        (2, 9, 3, 64, 576),
        (3, 4, 4, 32, 264),
        (4, 6, 2, 64, 1024),
    ] {
        let what =
            format!("gemv_qkv_rope tokens={tokens} heads={heads}/{kv_heads} d={head_dim} k={k}");
        let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
        let rows = q_cols + 2 * kv_cols;
        let (inv_freq, positions, slots, cache_slots) =
            rope_step(&mut rng, tokens, head_dim, 500_000.0);
        let (w, x, g) = (
            random_bf16(&mut rng, rows * k, 0.1),
            random_bf16(&mut rng, tokens * k, 2.0),
            random_bf16(&mut rng, k, 1.5),
        );
        let (w_d, x_d, g_d, pos_d, slots_d, freq_d) = (
            upload(&dev, &w),
            upload(&dev, &x),
            upload(&dev, &g),
            upload(&dev, &positions),
            upload(&dev, &slots),
            upload(&dev, &inv_freq),
        );
        let norm = || GemvNorm {
            weight: &g_d,
            eps: 1e-5,
        };

        let mut q = poisoned(&dev, tokens * q_cols);
        let mut k_cache = poisoned(&dev, cache_slots * kv_cols);
        let mut v_cache = poisoned(&dev, cache_slots * kv_cols);
        gemv_qkv_rope(
            &dev,
            &x_d,
            tokens,
            &w_d,
            k,
            norm(),
            QkvRopeOut {
                q: &mut q,
                k_cache: &mut k_cache,
                v_cache: &mut v_cache,
                positions: &pos_d.slice(..),
                slots: &slots_d.slice(..),
                inv_freq: &freq_d,
                widths: (q_cols, kv_cols, head_dim),
            },
        )
        .unwrap();

        let mut qkv = poisoned(&dev, tokens * rows);
        gemv(
            &dev,
            &x_d,
            tokens,
            &w_d,
            rows,
            k,
            Some(norm()),
            GemvOut::Bf16(&mut qkv),
        )
        .unwrap();
        let [q2, k_cache2, v_cache2] = qkv_rope_kv_poisoned(
            &dev,
            &qkv,
            tokens,
            (q_cols, kv_cols, head_dim),
            (&pos_d, &slots_d, &freq_d),
            cache_slots,
        );

        assert_same_qkv(
            &dev,
            &what,
            [&q, &k_cache, &v_cache],
            [&q2, &k_cache2, &v_cache2],
            kv_cols,
            &slots,
        );
    }
}

/// Kept keys chosen on the device (`ops::scores::select_kept`) equal `KeepRule::select_into` on
/// the same scores, exactly: scores full of ties (small integers), NaNs and signed zeros, rows
/// reached through a shuffled block table, keys from a few to several thousand, and rules of
/// every shape (sinks only, recent only, by score in between).
#[test]
fn kept_keys_chosen_on_the_device_equal_the_host_rule() {
    use turbo_keyformer::KeepRule;
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let (n_layers, n_kv_heads, block_size) = (3usize, 2usize, 16usize);
    for (keys, k, sinks, recent) in [
        (40usize, 20usize, 0usize, 6usize),
        (40, 20, 4, 6),
        (100, 37, 0, 0),
        (1000, 500, 4, 150),
        (5000, 2500, 0, 750),
        (300, 100, 0, usize::MAX),
        (300, 100, 7, usize::MAX),
        (70, 69, 3, 3),
    ] {
        let blocks = keys.div_ceil(block_size) + 3;
        let mut table: Vec<u32> = (0..blocks as u32).collect();
        table.shuffle(&mut rng);
        let slots = blocks * block_size;
        let layers: Vec<Vec<f32>> = (0..n_layers)
            .map(|_| {
                (0..slots * n_kv_heads)
                    .map(|_| match rng.random_range(0..10) {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        3..=6 => rng.random_range(-3i32..4) as f32,
                        _ => rng.random_range(-5.0f32..5.0),
                    })
                    .collect()
            })
            .collect();
        let bufs: Vec<CudaSlice<f32>> = layers.iter().map(|l| upload(&dev, l)).collect();
        let addresses: Vec<u64> = {
            use cudarc::driver::DevicePtr;
            bufs.iter().map(|b| b.device_ptr(&dev.stream).0).collect()
        };
        let addresses = upload(&dev, &addresses);
        let table_dev = upload(&dev, &table);
        let rule = KeepRule { sinks, recent };
        let (s, r, top) = rule.split(k);
        let kept = ops::scores::select_kept(
            &dev,
            &addresses.as_view(),
            &table_dev.as_view(),
            n_layers,
            ops::scores::ScoreGeometry {
                n_kv_heads,
                head_dim: 64,
                block_size,
                dtype: turbo_attention::KvDtype::Full,
            },
            ops::scores::KeepSplit {
                keys,
                sinks: s,
                top,
                recent: r,
            },
        )
        .unwrap();
        let got = download(&dev, &kept);
        let mut want = Vec::new();
        for (layer, scores) in layers.iter().enumerate() {
            for head in 0..n_kv_heads {
                let row: Vec<f32> = (0..keys)
                    .map(|j| {
                        let slot = table[j / block_size] as usize * block_size + j % block_size;
                        scores[slot * n_kv_heads + head]
                    })
                    .collect();
                rule.select_into(&row, keys, k, &mut want);
                let at = (layer * n_kv_heads + head) * k;
                let got_row: Vec<usize> = got[at..at + k].iter().map(|&j| j as usize).collect();
                assert_eq!(
                    got_row, want,
                    "keys {keys}, k {k}, {rule:?}: layer {layer} head {head}"
                );
            }
        }
    }
}
