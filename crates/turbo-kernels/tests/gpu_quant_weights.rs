//! GGUF-quantized weights kept as blocks on the GPU (`kernels/quant.cu`), against the CPU's
//! reference decoding (`turbo_core::quant`, bit-exact with GGML's) and f64 products, on fresh
//! random blocks of every type the kernels decode; then whole models against the CPU backend.

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_core::backend::Backend;
use turbo_core::cpu::CpuBackend;
use turbo_core::storage::Bytes;
use turbo_core::{DType, WeightMatrix};
use turbo_kernels::ops::gemv::{GemvNorm, QkvRopeOut};
use turbo_kernels::ops::quant::{self, QuantOut, QuantRows, PADDING_BYTES, QGEMV_MAX_TOKENS};
use turbo_kernels::{CudaBackend, CudaDevice};
use turbo_llama::{Llama, LoadedModel};
use turbo_tests::engine::engine_logits;
use turbo_tests::files::write_gguf;
use turbo_tests::tiny::{random_tokens, TinySpec, TinyWeights};

const TYPES: [DType; 8] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

fn gpu() -> Option<CudaBackend> {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping: no CUDA device");
        return None;
    }
    Some(CudaBackend::new(0).expect("CUDA device 0"))
}

/// Byte offsets of a block's f16 fields (scales and minimums): every other byte is random.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

/// A matrix of random blocks: every code and packed scale byte random, the f16 fields small
/// finite values of either sign (so that products stay in range, as trained weights do).
fn random_matrix(dtype: DType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> WeightMatrix {
    let row_bytes = dtype.row_bytes(cols).expect("whole blocks");
    let mut bytes: Vec<u8> = (0..rows * row_bytes).map(|_| rng.random()).collect();
    let scale = if dtype.block_len() == 256 { 2e-4 } else { 4e-3 };
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &at in f16_fields(dtype) {
            let v = f16::from_f32(rng.random_range(-scale..scale));
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    WeightMatrix::new(dtype, rows, cols, Bytes::owned(bytes)).expect("valid matrix")
}

fn upload_rows(dev: &CudaDevice, w: &WeightMatrix) -> cudarc::driver::CudaSlice<u8> {
    let mut host = w.data.as_slice().to_vec();
    host.extend([0u8; PADDING_BYTES]);
    dev.stream.clone_htod(&host).unwrap()
}

/// A random `rows` x `cols` matrix of `dtype` blocks: its values in f32 and its padded rows on the
/// device.
fn random_rows(
    dev: &CudaDevice,
    dtype: DType,
    (rows, cols): (usize, usize),
    rng: &mut ChaCha8Rng,
) -> (Vec<f32>, cudarc::driver::CudaSlice<u8>) {
    let w = random_matrix(dtype, rows, cols, rng);
    (w.to_f32(), upload_rows(dev, &w))
}

/// `bytes` as the device rows of a `rows` x `cols` matrix of `dtype` blocks.
fn quant_rows(
    dtype: DType,
    bytes: &cudarc::driver::CudaSlice<u8>,
    (rows, cols): (usize, usize),
) -> QuantRows<'_> {
    QuantRows {
        dtype,
        bytes,
        rows,
        cols,
    }
}

fn bf16_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// `Σ w·x` in f64 per (token, row), and `Σ |w·x|` (the f32 accumulation's error scale).
fn reference(w: &[f32], x: &[f64], tokens: usize, rows: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; tokens * rows];
    let mut mag = vec![0.0; tokens * rows];
    for t in 0..tokens {
        for r in 0..rows {
            let (mut s, mut a) = (0.0, 0.0);
            for i in 0..k {
                let p = w[r * k + i] as f64 * x[t * k + i];
                s += p;
                a += p.abs();
            }
            out[t * rows + r] = s;
            mag[t * rows + r] = a;
        }
    }
    (out, mag)
}

/// x's RMSNorm times g per token, in f64.
fn normalized(x: &[f64], g: &[bf16], tokens: usize, cols: usize, eps: f64) -> Vec<f64> {
    let mut xn = x.to_vec();
    for row in xn.chunks_mut(cols).take(tokens) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, gv) in row.iter_mut().zip(g) {
            *v *= gv.to_f64() * inv;
        }
    }
    xn
}

/// Rounds the normalized x to bf16 in place, as tensor-core products store it, and returns per
/// (token, row) the most that values lying near a rounding tie can move the product: the kernel
/// computes them in f32 (its sum of squares in another order, rsqrtf), within a relative 2⁻¹⁸ of
/// the f64 value, so a value whose bf16 rounding changes within that distance may take either.
fn rounding_ties(w: &[f32], xn: &mut [f64], tokens: usize, rows: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; tokens * rows];
    let near = 2f64.powi(-18);
    for t in 0..tokens {
        for i in 0..k {
            let v = xn[t * k + i];
            let lo = bf16::from_f64(v * (1.0 - near)).to_f64();
            let hi = bf16::from_f64(v * (1.0 + near)).to_f64();
            xn[t * k + i] = bf16::from_f64(v).to_f64();
            if lo != hi {
                for r in 0..rows {
                    out[t * rows + r] += (w[r * k + i] as f64).abs() * (hi - lo).abs();
                }
            }
        }
    }
    out
}

/// The extra accumulation error of types whose 4- and 5-bit codes the products sum as
/// `(1 + c/128)·x` (kernels/quant.cu's `code_unit`): those terms are `|x|` in size, not `|c·x|`,
/// so a sub-block's f32 sum errs by up to `2⁻²⁴·32` of `128·|scale|·(1.25 + 1 + offset/128)·Σ|x|`.
/// A row's scales are at most its value range / 15 (random codes reach 0 and 15 in every
/// sub-block), which bounds it by `2⁻²⁴·32·128·2.4/15·range·Σ|x| < 4e-5·range·Σ|x|`. Products on
/// tensor cores (`mma`) sum `(128 + c)·x` and take 128 + offset times Σx off: for Q6_K's codes
/// (< 64, scales at most range / 63) `2⁻²⁴·32·191/63·range·Σ|x| < 6e-6·range·Σ|x|`, within the
/// same bound.
fn unit_code_bound(
    (dtype, mma): (DType, bool),
    w: &[f32],
    x: &[f64],
    tokens: usize,
    rows: usize,
    k: usize,
) -> Vec<f64> {
    let unit = mma
        || matches!(
            dtype,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K
        );
    let mut out = vec![0.0; tokens * rows];
    if !unit {
        return out;
    }
    for r in 0..rows {
        let row = &w[r * k..(r + 1) * k];
        let (lo, hi) = row
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        for t in 0..tokens {
            let sx: f64 = x[t * k..(t + 1) * k].iter().map(|v| v.abs()).sum();
            out[t * rows + r] = 5e-5 * (hi - lo) as f64 * sx;
        }
    }
    out
}

#[test]
fn decoded_rows_equal_the_reference_dequantizer() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for dtype in TYPES {
        for (rows, cols) in [(7, 256), (33, 768), (5, 4096)] {
            let (want, bytes) = random_rows(dev, dtype, (rows, cols), &mut rng);
            let q = quant_rows(dtype, &bytes, (rows, cols));
            // Rows 1.. only: the band starts inside the matrix.
            let mut out = dev.stream.alloc_zeros::<bf16>((rows - 1) * cols).unwrap();
            quant::dequant(dev, &q, 1, rows - 1, &mut out).unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for (i, (g, v)) in got.iter().zip(&want[cols..]).enumerate() {
                assert_eq!(
                    g.to_f32(),
                    bf16::from_f32(*v).to_f32(),
                    "{dtype} {rows}x{cols}: value {i} decodes to {g}, the reference to {v}"
                );
            }
        }
    }
}

#[test]
fn decode_products_match_f64_on_every_type_and_token_count() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for dtype in TYPES {
        // Columns past a tile of x at 5-8 tokens (2048 values), with a short last tile.
        let (rows, cols) = (40, if dtype.block_len() == 256 { 2560 } else { 2080 });
        let (wf, bytes) = random_rows(dev, dtype, (rows, cols), &mut rng);
        let q = quant_rows(dtype, &bytes, (rows, cols));
        for tokens in 1..=QGEMV_MAX_TOKENS {
            let x = bf16_values(&mut rng, tokens * cols);
            let g = bf16_values(&mut rng, cols);
            let x_dev = dev.stream.clone_htod(&x).unwrap();
            let g_dev = dev.stream.clone_htod(&g).unwrap();
            let xf = to_f64(&x);
            let (want, mag) = reference(&wf, &xf, tokens, rows, cols);
            let mma = quant::on_tensor_cores(dev, dtype, (rows, cols), tokens);
            let unit = unit_code_bound((dtype, mma), &wf, &xf, tokens, rows, cols);

            // f32 out: only the f32 accumulation's rounding.
            let ld = rows + 3;
            let mut out = dev.stream.alloc_zeros::<f32>(tokens * ld).unwrap();
            let mut view = out.slice_mut(0..);
            quant::qgemv(dev, &x_dev, tokens, &q, None, QuantOut::F32(&mut view), ld).unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for t in 0..tokens {
                for r in 0..rows {
                    let (g, w) = (got[t * ld + r] as f64, want[t * rows + r]);
                    let tol = 2e-6 * mag[t * rows + r] + unit[t * rows + r] + 1e-30;
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype} tokens {tokens}: out[{t},{r}] = {g}, f64 {w} (tolerance {tol})"
                    );
                }
                for r in rows..ld {
                    assert_eq!(got[t * ld + r], 0.0, "{dtype}: wrote past the rows");
                }
            }

            // Added to a residual stream in bf16: rounded once.
            let resid = bf16_values(&mut rng, tokens * rows);
            let mut out = dev.stream.clone_htod(&resid).unwrap();
            let mut view = out.slice_mut(0..);
            quant::qgemv(
                dev,
                &x_dev,
                tokens,
                &q,
                None,
                QuantOut::AddTo(&mut view),
                rows,
            )
            .unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for i in 0..tokens * rows {
                let w = want[i] + resid[i].to_f64();
                let tol = 2e-6 * mag[i] + unit[i] + w.abs() * 2f64.powi(-8);
                assert!(
                    (got[i].to_f64() - w).abs() <= tol,
                    "{dtype} tokens {tokens}: residual {i} = {}, f64 {w}",
                    got[i]
                );
            }

            // With the RMSNorm first. CUDA-core products keep the normalized x in f32; tensor-core
            // products round it to bf16, and those that do not apply a norm themselves refuse
            // one: they take x normalized by the unfused kernel, and the reference is then taken
            // from those values.
            let eps = 1e-5;
            let norm = GemvNorm {
                weight: &g_dev,
                eps,
            };
            let unfused = quant::takes_normalized_x(dev, dtype, (rows, cols), tokens);
            let mut xn_dev = dev.stream.alloc_zeros::<bf16>(tokens * cols).unwrap();
            let mut ties = vec![0.0; tokens * rows];
            let xn = if unfused {
                let mut unused = dev.stream.alloc_zeros::<bf16>(rows).unwrap();
                let mut view = unused.slice_mut(0..);
                let refused = quant::qgemv(
                    dev,
                    &x_dev,
                    tokens,
                    &q,
                    Some(norm),
                    QuantOut::Bf16(&mut view),
                    rows,
                );
                assert!(refused.is_err(), "{dtype}: a norm it does not apply");
                turbo_kernels::ops::norm::rms_norm(
                    dev,
                    &x_dev,
                    &g_dev,
                    tokens,
                    cols,
                    eps,
                    &mut xn_dev,
                )
                .unwrap();
                to_f64(&dev.stream.clone_dtoh(&xn_dev).unwrap())
            } else {
                let mut xn = normalized(&xf, &g, tokens, cols, eps as f64);
                if mma {
                    ties = rounding_ties(&wf, &mut xn, tokens, rows, cols);
                }
                xn
            };
            let (x_in, norm_in) = match unfused {
                true => (&xn_dev, None),
                false => (&x_dev, Some(norm)),
            };
            let (want_n, mag_n) = reference(&wf, &xn, tokens, rows, cols);
            let unit_n = unit_code_bound((dtype, mma), &wf, &xn, tokens, rows, cols);
            let mut out = dev.stream.alloc_zeros::<bf16>(tokens * rows).unwrap();
            let mut view = out.slice_mut(0..);
            quant::qgemv(
                dev,
                x_in,
                tokens,
                &q,
                norm_in,
                QuantOut::Bf16(&mut view),
                rows,
            )
            .unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for i in 0..tokens * rows {
                let tol = 1e-5 * mag_n[i] + unit_n[i] + ties[i] + want_n[i].abs() * 2f64.powi(-8);
                assert!(
                    (got[i].to_f64() - want_n[i]).abs() <= tol,
                    "{dtype} tokens {tokens}: normed {i} = {}, f64 {}",
                    got[i],
                    want_n[i]
                );
            }

            // SwiGLU over [gate; up] (rows / 2 units), each rounded to bf16 first.
            let units = rows / 2;
            let mut out = dev.stream.alloc_zeros::<bf16>(tokens * units).unwrap();
            let mut view = out.slice_mut(0..);
            let norm_in = norm_in.map(|_| GemvNorm {
                weight: &g_dev,
                eps,
            });
            quant::qgemv(
                dev,
                x_in,
                tokens,
                &q,
                norm_in,
                QuantOut::SwiGlu(&mut view),
                units,
            )
            .unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for t in 0..tokens {
                for u in 0..units {
                    let (gate, up) = (want_n[t * rows + u], want_n[t * rows + units + u]);
                    let w = gate / (1.0 + (-gate).exp()) * up;
                    // A bf16 rounding of gate, of up and of the result, plus accumulation.
                    let (gi, ui) = (t * rows + u, t * rows + units + u);
                    let scale = (gate.abs() + mag_n[gi] * 1e-5 + unit_n[gi] + ties[gi])
                        * (up.abs() + mag_n[ui] * 1e-5 + unit_n[ui] + ties[ui]);
                    let tol = 4.0 * 2f64.powi(-8) * scale + 1e-6;
                    let g = got[t * units + u].to_f64();
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype} tokens {tokens}: swiglu[{t},{u}] = {g}, f64 {w} (tolerance {tol})"
                    );
                }
            }
        }
    }
}

#[test]
fn tensor_core_products_that_do_not_normalize_take_normalized_x() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    // Rows wider than the kernels normalize in shared memory, and a product of so many 16-row
    // blocks that each repeating the norm would cost more than a separate launch.
    let many = 16 * 4 * dev.sm_count() + 8;
    for (dtype, rows, cols) in [
        (DType::Q4_K, 24, 8448),
        (DType::Q6_K, 24, 8448),
        (DType::Q4_K, many, 256),
    ] {
        assert!(quant::takes_normalized_x(dev, dtype, (rows, cols), 1));
        let (wf, bytes) = random_rows(dev, dtype, (rows, cols), &mut rng);
        let q = quant_rows(dtype, &bytes, (rows, cols));
        let x = bf16_values(&mut rng, cols);
        let g = bf16_values(&mut rng, cols);
        let x_dev = dev.stream.clone_htod(&x).unwrap();
        let g_dev = dev.stream.clone_htod(&g).unwrap();
        let mut out = dev.stream.alloc_zeros::<bf16>(rows).unwrap();
        let norm = GemvNorm {
            weight: &g_dev,
            eps: 1e-5,
        };
        let mut view = out.slice_mut(0..);
        let refused = quant::qgemv(
            dev,
            &x_dev,
            1,
            &q,
            Some(norm),
            QuantOut::Bf16(&mut view),
            rows,
        );
        let message = refused
            .expect_err("a norm the product does not apply")
            .to_string();
        assert!(message.contains("takes normalized x"), "{message}");
        let mut xn_dev = dev.stream.alloc_zeros::<bf16>(cols).unwrap();
        turbo_kernels::ops::norm::rms_norm(dev, &x_dev, &g_dev, 1, cols, 1e-5, &mut xn_dev)
            .unwrap();
        let mut view = out.slice_mut(0..);
        quant::qgemv(dev, &xn_dev, 1, &q, None, QuantOut::Bf16(&mut view), rows).unwrap();
        let got = dev.stream.clone_dtoh(&out).unwrap();
        let xn = to_f64(&dev.stream.clone_dtoh(&xn_dev).unwrap());
        let (want, mag) = reference(&wf, &xn, 1, rows, cols);
        let unit = unit_code_bound((dtype, true), &wf, &xn, 1, rows, cols);
        for r in 0..rows {
            let tol = 1e-5 * mag[r] + unit[r] + want[r].abs() * 2f64.powi(-8);
            let g = got[r].to_f64();
            assert!(
                (g - want[r]).abs() <= tol,
                "{dtype} {rows}x{cols}: out[{r}] = {g}, f64 {} (tolerance {tol})",
                want[r]
            );
        }
    }
}

/// A norm split between two one-token tensor-core products (`NormLink`): the residual step writes
/// the same stream as without it, x · g rounded to bf16 and per-16-row sums of squares; the
/// product over x · g, finished from those sums, matches f64 `rsqrt(mean x² + eps) · Σ w · (x · g)`
/// in every output mode. Steps of several tokens and CUDA-core products are refused.
#[test]
fn split_norm_products_match_f64() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (hidden, k_in, rows) = (1024, 512, 48);
    let eps = 1e-5f32;
    for (step_type, next_type) in [
        (DType::Q4_K, DType::Q4_K),
        (DType::Q6_K, DType::Q6_K),
        (DType::Q6_K, DType::Q4_K),
    ] {
        let (_, step_bytes) = random_rows(dev, step_type, (hidden, k_in), &mut rng);
        let step_w = quant_rows(step_type, &step_bytes, (hidden, k_in));
        let (wf, next_bytes) = random_rows(dev, next_type, (rows, hidden), &mut rng);
        let next_w = quant_rows(next_type, &next_bytes, (rows, hidden));
        assert!(!quant::links_norm(dev, step_type, (hidden, k_in), 2));
        // Fresh values in each round.
        for tokens in [1, 1] {
            assert!(quant::links_norm(dev, step_type, (hidden, k_in), tokens));
            assert!(quant::links_norm(dev, next_type, (rows, hidden), tokens));
            let a = dev
                .stream
                .clone_htod(&bf16_values(&mut rng, tokens * k_in))
                .unwrap();
            let resid = bf16_values(&mut rng, tokens * hidden);
            let g = bf16_values(&mut rng, hidden);
            let g_dev = dev.stream.clone_htod(&g).unwrap();

            // The residual step, plain and linked: the same stream.
            let mut plain = dev.stream.clone_htod(&resid).unwrap();
            let mut view = plain.slice_mut(0..);
            let out = QuantOut::AddTo(&mut view);
            quant::qgemv(dev, &a, tokens, &step_w, None, out, hidden).unwrap();
            let mut linked = dev.stream.clone_htod(&resid).unwrap();
            let mut scaled = dev.stream.alloc_zeros::<bf16>(tokens * hidden).unwrap();
            let mut parts = dev.stream.alloc_zeros::<f32>(tokens * hidden / 16).unwrap();
            let link = quant::NormLink::Ahead {
                weight: &g_dev,
                scaled: &mut scaled,
                parts: &mut parts,
            };
            let mut view = linked.slice_mut(0..);
            let out = QuantOut::AddTo(&mut view);
            quant::qgemv_linked(dev, (&a, tokens), &step_w, (None, link), out, hidden).unwrap();
            let h = dev.stream.clone_dtoh(&linked).unwrap();
            assert_eq!(
                h,
                dev.stream.clone_dtoh(&plain).unwrap(),
                "{step_type} tokens {tokens}"
            );
            let scaled_host = dev.stream.clone_dtoh(&scaled).unwrap();
            let parts_host = dev.stream.clone_dtoh(&parts).unwrap();
            let mut inv = vec![0.0f64; tokens];
            for t in 0..tokens {
                for j in 0..hidden {
                    let want = bf16::from_f32(h[t * hidden + j].to_f32() * g[j].to_f32());
                    assert_eq!(
                        scaled_host[t * hidden + j],
                        want,
                        "{step_type} x·g [{t},{j}]"
                    );
                }
                for (b, &p) in parts_host[t * hidden / 16..(t + 1) * hidden / 16]
                    .iter()
                    .enumerate()
                {
                    let want: f64 = h[t * hidden + 16 * b..t * hidden + 16 * (b + 1)]
                        .iter()
                        .map(|v| v.to_f64() * v.to_f64())
                        .sum();
                    assert!(
                        (p as f64 - want).abs() <= want * 1e-6,
                        "{step_type} tokens {tokens}: part [{t},{b}] = {p}, f64 {want}"
                    );
                }
                let ss: f64 = h[t * hidden..(t + 1) * hidden]
                    .iter()
                    .map(|v| v.to_f64().powi(2))
                    .sum();
                inv[t] = 1.0 / (ss / hidden as f64 + eps as f64).sqrt();
            }

            // The product over x · g, finished from the parts: f32, bf16 and SwiGLU outputs.
            let xg = to_f64(&scaled_host);
            let (sums, mag) = reference(&wf, &xg, tokens, rows, hidden);
            let unit = unit_code_bound((next_type, true), &wf, &xg, tokens, rows, hidden);
            let want: Vec<f64> = (0..tokens * rows)
                .map(|i| sums[i] * inv[i / rows])
                .collect();
            // The sums' accumulation error, scaled; rsqrtf and the parts' f32 sum: 2⁻²⁰.
            let tol: Vec<f64> = (0..tokens * rows)
                .map(|i| (2e-6 * mag[i] + unit[i]) * inv[i / rows] + want[i].abs() * 2f64.powi(-20))
                .collect();
            let finish = || quant::NormLink::Finish { parts: &parts, eps };
            let product = |out: QuantOut, ld: usize| {
                let x = (&scaled, tokens);
                quant::qgemv_linked(dev, x, &next_w, (None, finish()), out, ld).unwrap()
            };
            let mut out = dev.stream.alloc_zeros::<f32>(tokens * rows).unwrap();
            product(QuantOut::F32(&mut out.slice_mut(0..)), rows);
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for i in 0..tokens * rows {
                assert!(
                    (got[i] as f64 - want[i]).abs() <= tol[i],
                    "{next_type} tokens {tokens}: out {i} = {}, f64 {} (tolerance {})",
                    got[i],
                    want[i],
                    tol[i]
                );
            }
            let mut out = dev.stream.alloc_zeros::<bf16>(tokens * rows).unwrap();
            product(QuantOut::Bf16(&mut out.slice_mut(0..)), rows);
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for i in 0..tokens * rows {
                let t = tol[i] + want[i].abs() * 2f64.powi(-8);
                assert!(
                    (got[i].to_f64() - want[i]).abs() <= t,
                    "{next_type} tokens {tokens}: bf16 out {i} = {}, f64 {}",
                    got[i],
                    want[i]
                );
            }
            let units = rows / 2;
            let mut out = dev.stream.alloc_zeros::<bf16>(tokens * units).unwrap();
            product(QuantOut::SwiGlu(&mut out.slice_mut(0..)), units);
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for t in 0..tokens {
                for u in 0..units {
                    let (gi, ui) = (t * rows + u, t * rows + units + u);
                    let (gate, up) = (want[gi], want[ui]);
                    let w = gate / (1.0 + (-gate).exp()) * up;
                    let scale = (gate.abs() + tol[gi]) * (up.abs() + tol[ui]);
                    let tol = 4.0 * 2f64.powi(-8) * scale + 1e-6;
                    let v = got[t * units + u].to_f64();
                    assert!(
                        (v - w).abs() <= tol,
                        "{next_type} tokens {tokens}: swiglu[{t},{u}] = {v}, f64 {w} (tolerance {tol})"
                    );
                }
            }
        }
    }
    // A split norm is refused where a product cannot take part: CUDA-core products, and a norm
    // of the product's own beside it.
    let (_, bytes) = random_rows(dev, DType::Q8_0, (32, 256), &mut rng);
    let q8 = quant_rows(DType::Q8_0, &bytes, (32, 256));
    let x = dev.stream.clone_htod(&bf16_values(&mut rng, 256)).unwrap();
    let parts = dev.stream.alloc_zeros::<f32>(16).unwrap();
    let mut out = dev.stream.alloc_zeros::<f32>(32).unwrap();
    let mut view = out.slice_mut(0..);
    let link = quant::NormLink::Finish { parts: &parts, eps };
    let refused = quant::qgemv_linked(
        dev,
        (&x, 1),
        &q8,
        (None, link),
        QuantOut::F32(&mut view),
        32,
    );
    assert!(refused.is_err(), "a split norm on a CUDA-core product");
    let (_, bytes) = random_rows(dev, DType::Q4_K, (32, 256), &mut rng);
    let q4 = quant_rows(DType::Q4_K, &bytes, (32, 256));
    let x2 = dev.stream.clone_htod(&bf16_values(&mut rng, 512)).unwrap();
    let mut out = dev.stream.alloc_zeros::<f32>(64).unwrap();
    let mut view = out.slice_mut(0..);
    let link = quant::NormLink::Finish { parts: &parts, eps };
    let out = QuantOut::F32(&mut view);
    let refused = quant::qgemv_linked(dev, (&x2, 2), &q4, (None, link), out, 32);
    assert!(refused.is_err(), "a split norm over two tokens");
}

/// One-token tensor-core products launched back to back as a decode step runs them (split norms
/// linking each residual step to the product after it), each reading what the one before wrote
/// and writing what it read, give the same bits as the same launches with the host waiting for
/// each: nothing is read or overwritten before the kernel ahead is done with it, and the values
/// do not depend on how the launches overlap.
#[test]
fn chained_one_token_products_read_what_the_kernel_ahead_wrote() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let (hidden, ffn, layers, eps) = (2048, 4096, 4, 1e-5f32);
    // Per layer: O (Q4_K), gate/up (Q4_K, SwiGLU), down (Q6_K), the next layer's input (Q4_K).
    let shapes = [
        (DType::Q4_K, (hidden, hidden)),
        (DType::Q4_K, (2 * ffn, hidden)),
        (DType::Q6_K, (hidden, ffn)),
        (DType::Q4_K, (hidden, hidden)),
    ];
    let weights: Vec<Vec<_>> = (0..layers)
        .map(|_| {
            let layer: Vec<_> = shapes
                .iter()
                .map(|&(dtype, shape)| {
                    assert!(quant::links_norm(dev, dtype, shape, 1), "{dtype} {shape:?}");
                    (dtype, random_rows(dev, dtype, shape, &mut rng).1, shape)
                })
                .collect();
            layer
        })
        .collect();
    let g = [0, 1].map(|_| {
        dev.stream
            .clone_htod(&bf16_values(&mut rng, hidden))
            .unwrap()
    });
    let (resid, a0) = (bf16_values(&mut rng, hidden), bf16_values(&mut rng, hidden));
    let run = |wait: bool| -> (Vec<bf16>, Vec<bf16>) {
        let mut h = dev.stream.clone_htod(&resid).unwrap();
        let mut a = dev.stream.clone_htod(&a0).unwrap();
        let mut scaled = dev.stream.alloc_zeros::<bf16>(hidden).unwrap();
        let mut parts = dev.stream.alloc_zeros::<f32>(hidden / 16).unwrap();
        let mut act = dev.stream.alloc_zeros::<bf16>(ffn).unwrap();
        let settle = || {
            if wait {
                dev.stream.synchronize().unwrap();
            }
        };
        for layer in &weights {
            let w: Vec<QuantRows> = layer
                .iter()
                .map(|(dtype, bytes, shape)| quant_rows(*dtype, bytes, *shape))
                .collect();
            for (i, norm_w) in g.iter().enumerate() {
                let (x, residual_w) = if i == 0 { (&a, &w[0]) } else { (&act, &w[2]) };
                // A residual step writing the stream, x · g and the parts of its norm...
                let ahead = quant::NormLink::Ahead {
                    weight: norm_w,
                    scaled: &mut scaled,
                    parts: &mut parts,
                };
                let mut view = h.slice_mut(0..);
                let out = QuantOut::AddTo(&mut view);
                quant::qgemv_linked(dev, (x, 1), residual_w, (None, ahead), out, hidden).unwrap();
                settle();
                // ...and the product after it finishing that norm.
                let finish = quant::NormLink::Finish { parts: &parts, eps };
                if i == 0 {
                    let out = QuantOut::SwiGlu(&mut act.slice_mut(0..));
                    quant::qgemv_linked(dev, (&scaled, 1), &w[1], (None, finish), out, ffn)
                } else {
                    let out = QuantOut::Bf16(&mut a.slice_mut(0..));
                    quant::qgemv_linked(dev, (&scaled, 1), &w[3], (None, finish), out, hidden)
                }
                .unwrap();
                settle();
            }
        }
        (
            dev.stream.clone_dtoh(&h).unwrap(),
            dev.stream.clone_dtoh(&a).unwrap(),
        )
    };
    let (h_waited, a_waited) = run(true);
    assert!(h_waited.iter().chain(&a_waited).all(|v| v.is_finite()));
    for round in 0..3 {
        let (h, a) = run(false);
        assert_eq!(h, h_waited, "round {round}: the residual stream");
        assert_eq!(a, a_waited, "round {round}: the last product");
    }
}

/// A one-token QKV product finishing a split norm that rotates its outputs and writes the KV
/// cache itself (`RopeKvOut`) gives, bit for bit, what the product into a qkv row followed by
/// `qkv_rope_kv` gives: q, the keys and the values at the token's slot, nothing else written;
/// over two bands (Q4_K q and k, Q6_K v), and with a slot past the caches, which is skipped.
#[test]
fn qkv_product_with_rope_and_kv_write_equals_its_parts() {
    use std::sync::Mutex;
    use turbo_kernels::matrix::{self, DecodeScratch, ProductOut};
    use turbo_kernels::ops::elementwise::qkv_rope_kv;
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (hidden, head_dim, q_cols, kv_cols, slots_n) = (512, 64, 256, 128, 40);
    let wq = random_matrix(DType::Q4_K, q_cols, hidden, &mut rng);
    let wk = random_matrix(DType::Q4_K, kv_cols, hidden, &mut rng);
    let wv = random_matrix(DType::Q6_K, kv_cols, hidden, &mut rng);
    let wqkv = matrix::upload_blocks(dev, &[&wq, &wk, &wv]).unwrap();
    assert_eq!(wqkv.block_types(), vec![DType::Q4_K, DType::Q6_K]);
    assert!(wqkv.links_norm(dev, 1, false));
    let scratch = Mutex::new(DecodeScratch::default());
    let x = turbo_kernels::CudaTensor {
        data: dev
            .stream
            .clone_htod(&bf16_values(&mut rng, hidden))
            .unwrap(),
        rows: 1,
        cols: hidden,
    };
    let parts_host: Vec<f32> = (0..hidden / 16)
        .map(|_| rng.random_range(0.5..8.0))
        .collect();
    let parts = dev.stream.clone_htod(&parts_host).unwrap();
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let inv_freq = dev.stream.clone_htod(&inv_freq).unwrap();
    let poison = vec![bf16::from_f32(-7.25); slots_n * kv_cols];
    for (position, slot) in [(1234u32, 17u32), (7, 3), (50_000, slots_n as u32 + 5)] {
        let positions = dev.stream.clone_htod(&[position]).unwrap();
        let slots = dev.stream.clone_htod(&[slot]).unwrap();
        let (positions, slots) = (positions.slice(..), slots.slice(..));
        let finish = || quant::NormLink::Finish {
            parts: &parts,
            eps: 1e-5,
        };

        // The product into a qkv row, then the step after it.
        let mut qkv = dev
            .stream
            .alloc_zeros::<bf16>(q_cols + 2 * kv_cols)
            .unwrap();
        let out = ProductOut::Bf16(&mut qkv);
        matrix::product(dev, &scratch, &x, &wqkv, (None, finish()), out).unwrap();
        let mut q_want = dev.stream.alloc_zeros::<bf16>(q_cols).unwrap();
        let mut k_want = dev.stream.clone_htod(&poison).unwrap();
        let mut v_want = dev.stream.clone_htod(&poison).unwrap();
        let widths = (q_cols, kv_cols, head_dim);
        qkv_rope_kv(
            dev,
            &qkv,
            &mut q_want,
            &mut k_want,
            &mut v_want,
            1,
            widths,
            &positions,
            &slots,
            &inv_freq,
        )
        .unwrap();

        // The product that does both.
        let mut q_got = dev.stream.alloc_zeros::<bf16>(q_cols).unwrap();
        let mut k_got = dev.stream.clone_htod(&poison).unwrap();
        let mut v_got = dev.stream.clone_htod(&poison).unwrap();
        let rope = quant::RopeKvOut::new(
            dev,
            QkvRopeOut {
                q: &mut q_got,
                k_cache: &mut k_got,
                v_cache: &mut v_got,
                positions: &positions,
                slots: &slots,
                inv_freq: &inv_freq,
                widths,
            },
        )
        .unwrap();
        let out = ProductOut::RopeKv(rope);
        matrix::product(dev, &scratch, &x, &wqkv, (None, finish()), out).unwrap();
        let host = |b: &cudarc::driver::CudaSlice<bf16>| dev.stream.clone_dtoh(b).unwrap();
        assert_eq!(
            host(&q_got),
            host(&q_want),
            "queries at position {position}"
        );
        assert_eq!(host(&k_got), host(&k_want), "keys at slot {slot}");
        assert_eq!(host(&v_got), host(&v_want), "values at slot {slot}");
        if slot as usize >= slots_n {
            assert_eq!(host(&k_got), poison, "a slot past the cache is skipped");
        }
    }
    // Without a split norm to finish, or over two tokens, it is refused.
    let mut q = dev.stream.alloc_zeros::<bf16>(q_cols).unwrap();
    let mut kc = dev.stream.clone_htod(&poison).unwrap();
    let mut vc = dev.stream.clone_htod(&poison).unwrap();
    let one = dev.stream.clone_htod(&[0u32]).unwrap();
    let one = one.slice(..);
    let rope = quant::RopeKvOut::new(
        dev,
        QkvRopeOut {
            q: &mut q,
            k_cache: &mut kc,
            v_cache: &mut vc,
            positions: &one,
            slots: &one,
            inv_freq: &inv_freq,
            widths: (q_cols, kv_cols, head_dim),
        },
    )
    .unwrap();
    let unlinked = (None, quant::NormLink::None);
    assert!(matrix::product(dev, &scratch, &x, &wqkv, unlinked, ProductOut::RopeKv(rope)).is_err());
}

#[test]
fn quantized_embedding_rows_are_the_decoded_rows() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for dtype in TYPES {
        let (rows, cols) = (50, 512);
        let (wf, bytes) = random_rows(dev, dtype, (rows, cols), &mut rng);
        let q = quant_rows(dtype, &bytes, (rows, cols));
        let ids: Vec<u32> = vec![3, 49, 0, 3, 50, 17];
        let ids_dev = dev.stream.clone_htod(&ids).unwrap();
        let mut out = dev.stream.alloc_zeros::<bf16>(ids.len() * cols).unwrap();
        quant::embed(dev, &q, &ids_dev.slice(0..), ids.len(), &mut out).unwrap();
        let got = dev.stream.clone_dtoh(&out).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let row = &got[t * cols..(t + 1) * cols];
            if id as usize >= rows {
                assert!(
                    row.iter().all(|v| v.is_nan()),
                    "{dtype}: id {id} past the table"
                );
                continue;
            }
            for (i, g) in row.iter().enumerate() {
                let want = bf16::from_f32(wf[id as usize * cols + i]).to_f32();
                assert_eq!(g.to_f32(), want, "{dtype}: id {id} value {i}");
            }
        }
    }
}

/// Stacked matrices of mixed types (bands) through the backend's products: decode steps and
/// larger steps (decoded to bf16 in bands, then cuBLASLt), against the f64 product.
#[test]
fn mixed_type_stacks_through_the_backend() {
    let Some(gpu) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let cols = 512;
    let parts = [
        random_matrix(DType::Q4_K, 64, cols, &mut rng),
        random_matrix(DType::Q4_K, 32, cols, &mut rng),
        random_matrix(DType::Q6_K, 32, cols, &mut rng),
        random_matrix(DType::Q8_0, 16, cols, &mut rng),
    ];
    let refs: Vec<&WeightMatrix> = parts.iter().collect();
    let m = gpu.upload_stacked(&refs).unwrap();
    assert_eq!(m.block_types(), vec![DType::Q4_K, DType::Q6_K, DType::Q8_0]);
    let file_bytes: usize = parts.iter().map(|p| p.data.len()).sum();
    assert_eq!(m.device_bytes(), file_bytes + 3 * PADDING_BYTES);
    let wf: Vec<f32> = parts.iter().flat_map(|p| p.to_f32()).collect();
    let rows = m.rows;
    for tokens in [1, 5, 8, 9, 40] {
        let x: Vec<f32> = (0..tokens * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let xb: Vec<f64> = x.iter().map(|v| bf16::from_f32(*v).to_f64()).collect();
        let xt = gpu.upload(&x, tokens, cols).unwrap();
        let mut out = gpu.tensor(tokens, rows).unwrap();
        gpu.linear(&xt, &m, &mut out).unwrap();
        let got = gpu.download(&out).unwrap();
        // Larger steps multiply bf16 roundings of the weights.
        let wr: Vec<f32> = if tokens > QGEMV_MAX_TOKENS {
            wf.iter().map(|v| bf16::from_f32(*v).to_f32()).collect()
        } else {
            wf.clone()
        };
        let (want, mag) = reference(&wr, &xb, tokens, rows, cols);
        for i in 0..tokens * rows {
            let tol = 1e-5 * mag[i] + want[i].abs() * 2f64.powi(-8);
            assert!(
                (got[i] as f64 - want[i]).abs() <= tol,
                "tokens {tokens}: out {i} = {}, f64 {}",
                got[i],
                want[i]
            );
        }
    }
}

/// Whole random models whose matrices are random blocks of each type (and a Q4_K_M-like mix),
/// GPU (blocks kept) against the CPU (exact f32), with the tolerance of the bf16 model tests.
#[test]
fn quantized_models_match_cpu() {
    let Some(gpu) = gpu() else { return };
    const TOL: f32 = 4e-2;
    let spec = TinySpec {
        heads: 4,
        kv_heads: 2,
        hidden: 256,
        ffn: 512,
        layers: 2,
        seed: 7,
        ..Default::default()
    };
    let mixes: [(&str, [DType; 3]); 4] = [
        ("Q4_K", [DType::Q4_K; 3]),
        ("Q5_K", [DType::Q5_K; 3]),
        ("Q6_K/Q5_0", [DType::Q6_K, DType::Q5_0, DType::Q6_K]),
        ("Q4_K_M-like", [DType::Q4_K, DType::Q6_K, DType::Q8_0]),
    ];
    for (name, [main, v_and_down, embed]) in mixes {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F32);
        let mut loaded = LoadedModel::load(&path).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        let mut requant =
            |m: &WeightMatrix, dtype: DType| random_matrix(dtype, m.rows, m.cols, &mut rng);
        let w = &mut loaded.weights;
        w.embed = requant(&w.embed, embed);
        for l in &mut w.layers {
            l.wq = requant(&l.wq, main);
            l.wk = requant(&l.wk, main);
            l.wv = requant(&l.wv, v_and_down);
            l.wo = requant(&l.wo, main);
            l.w_gate = requant(&l.w_gate, main);
            l.w_up = requant(&l.w_up, main);
            l.w_down = requant(&l.w_down, v_and_down);
        }
        if let Some(head) = &mut w.lm_head {
            *head = requant(head, v_and_down);
        }
        let cpu_model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
        let gpu_model = Llama::new(gpu.clone(), &loaded.config, &loaded.weights).unwrap();
        let tokens = random_tokens(&spec, 40, spec.seed + 10);
        let cpu = engine_logits(&cpu_model, &tokens);
        let got = engine_logits(&gpu_model, &tokens);
        let scale = cpu.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let diff = got
            .iter()
            .flatten()
            .zip(cpu.iter().flatten())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let d = diff / (1.0 + scale);
        eprintln!("{name}: max relative logit difference {d:.2e} (logits up to {scale:.2})");
        assert!(
            got.iter().flatten().all(|x| x.is_finite()),
            "{name}: non-finite"
        );
        assert!(d <= TOL, "{name}: GPU logits differ from CPU by {d}");
    }
}

#[test]
fn bad_quantized_shapes_are_refused() {
    let Some(gpu) = gpu() else { return };
    let dev = gpu.device();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let w = random_matrix(DType::Q4_K, 4, 256, &mut rng);
    // No padding: refused rather than read past the end.
    let bytes = dev.stream.clone_htod(w.data.as_slice()).unwrap();
    let q = QuantRows {
        dtype: DType::Q4_K,
        bytes: &bytes,
        rows: 4,
        cols: 256,
    };
    let x = dev.stream.alloc_zeros::<bf16>(256).unwrap();
    let mut out = dev.stream.alloc_zeros::<f32>(4).unwrap();
    let mut view = out.slice_mut(0..);
    let err = quant::qgemv(dev, &x, 1, &q, None, QuantOut::F32(&mut view), 4).unwrap_err();
    assert!(err.to_string().contains("qgemv"), "{err}");
    // A type the kernels do not decode.
    let padded = upload_rows(dev, &w);
    let q = QuantRows {
        dtype: DType::Q3_K,
        bytes: &padded,
        rows: 4,
        cols: 256,
    };
    let mut view = out.slice_mut(0..);
    assert!(quant::qgemv(dev, &x, 1, &q, None, QuantOut::F32(&mut view), 4).is_err());
    // Too many tokens for a decode product.
    let q = QuantRows {
        dtype: DType::Q4_K,
        bytes: &padded,
        rows: 4,
        cols: 256,
    };
    let x9 = dev.stream.alloc_zeros::<bf16>(9 * 256).unwrap();
    let mut out9 = dev.stream.alloc_zeros::<f32>(9 * 4).unwrap();
    let mut view = out9.slice_mut(0..);
    assert!(quant::qgemv(dev, &x9, 9, &q, None, QuantOut::F32(&mut view), 4).is_err());
}
