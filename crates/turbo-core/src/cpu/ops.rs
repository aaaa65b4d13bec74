//! Row-wise CPU operations of the transformer block, in f32.

use rayon::prelude::*;

/// Rows below this size are processed on the calling thread: a rayon hop costs more than the work.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 14;

/// `out = x / sqrt(mean(x²) + eps) * weight` for each row of `x` (rows of `weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let norm = |(xr, or): (&[f32], &mut [f32])| {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    };
    if x.len() >= PARALLEL_MIN_ELEMENTS {
        x.par_chunks(d).zip(out.par_chunks_mut(d)).for_each(norm);
    } else {
        x.chunks(d).zip(out.chunks_mut(d)).for_each(norm);
    }
}

/// Rotary embedding in the interleaved-pair layout: dimensions `(2i, 2i+1)` of each head rotate by
/// `position · inv_freq[i]`. `x` is `[tokens, heads, head_dim]`.
pub fn rope_interleaved(x: &mut [f32], head_dim: usize, positions: &[u32], inv_freq: &[f32]) {
    assert_eq!(inv_freq.len() * 2, head_dim);
    let row = x.len() / positions.len().max(1);
    let rotate = |(xr, &pos): (&mut [f32], &u32)| {
        let (sin, cos): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .map(|f| {
                let (s, c) = (pos as f64 * *f as f64).sin_cos();
                (s as f32, c as f32)
            })
            .unzip();
        for head in xr.chunks_exact_mut(head_dim) {
            for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * cos[i] - b * sin[i];
                pair[1] = a * sin[i] + b * cos[i];
            }
        }
    };
    if x.len() >= PARALLEL_MIN_ELEMENTS {
        x.par_chunks_mut(row)
            .zip(positions.par_iter())
            .for_each(rotate);
    } else {
        x.chunks_mut(row).zip(positions.iter()).for_each(rotate);
    }
}

/// `gate = silu(gate) * up`, SwiGLU's gating.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let f = |(g, u): (&mut f32, &f32)| *g = *g / (1.0 + (-*g).exp()) * u;
    if gate.len() >= PARALLEL_MIN_ELEMENTS {
        gate.par_iter_mut().zip(up.par_iter()).for_each(f);
    } else {
        gate.iter_mut().zip(up).for_each(f);
    }
}

/// SwiGLU of fused rows `[gate | up]` (each `2 · out_cols` wide): `out = silu(gate) · up`.
pub fn swiglu(gate_up: &[f32], out: &mut [f32], out_cols: usize) {
    let f = |(gu, o): (&[f32], &mut [f32])| {
        let (g, u) = gu.split_at(out_cols);
        for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
            *o = *g / (1.0 + (-*g).exp()) * u;
        }
    };
    if out.len() >= PARALLEL_MIN_ELEMENTS {
        gate_up
            .par_chunks(2 * out_cols)
            .zip(out.par_chunks_mut(out_cols))
            .for_each(f);
    } else {
        gate_up
            .chunks(2 * out_cols)
            .zip(out.chunks_mut(out_cols))
            .for_each(f);
    }
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_f64() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 - 7.5) * 0.3).collect();
        let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut out = vec![f32::NAN; 24];
        rms_norm(&x, &w, 1e-5, &mut out);
        for r in 0..3 {
            let row = &x[r * 8..r * 8 + 8];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 8.0;
            for c in 0..8 {
                let want = row[c] as f64 / (ms + 1e-5).sqrt() * w[c] as f64;
                assert!((out[r * 8 + c] as f64 - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        let mut x = vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        // One head of dim 4 at positions 0 and 2, frequencies 1 and 0.5.
        rope_interleaved(&mut x, 4, &[0, 2], &[1.0, 0.5]);
        assert_eq!(&x[..4], &[1.0, 0.0, 0.0, 1.0]);
        let (s2, c2) = 2f32.sin_cos();
        let (s1, c1) = 1f32.sin_cos();
        let want = [c2, s2, -s1, c1];
        for (a, b) in x[4..].iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn silu_mul_gates() {
        let mut g = vec![0.0f32, 1.0, -2.0];
        silu_mul(&mut g, &[2.0, 2.0, 1.0]);
        let silu = |v: f64| v / (1.0 + (-v).exp());
        for (a, b) in g.iter().zip([0.0, 2.0 * silu(1.0), silu(-2.0)]) {
            assert!((*a as f64 - b).abs() < 1e-6);
        }
    }
}
