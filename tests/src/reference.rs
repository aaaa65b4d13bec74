//! A naive f64 LLaMA forward pass, written from the model's definition (no engine code), as the
//! reference the engine's logits are checked against.

use crate::tiny::{RefWeights, TinySpec};

/// Which dimensions of a head RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Original LLaMA / GGUF / Turbo native: pairs `(2i, 2i + 1)`.
    Interleaved,
    /// HF transformers (`rotate_half`): pairs `(i, i + head_dim / 2)`.
    RotateHalf,
}

/// `y = W x` for a row-major `[rows, cols]` matrix.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    assert_eq!(w.len() % cols, 0);
    w.chunks_exact(cols)
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// `x / sqrt(mean(x²) + eps) · w`.
fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

/// Rotates every head of `x` (`[heads · head_dim]`) for position `pos`: pair `i` turns by
/// `pos · theta^(-2i / head_dim)`.
fn rope(x: &mut [f64], head_dim: usize, pos: usize, theta: f64, style: RopeStyle) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-((2 * i) as f64) / head_dim as f64);
            let (sin, cos) = angle.sin_cos();
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::RotateHalf => (i, i + half),
            };
            let (xa, xb) = (head[a], head[b]);
            head[a] = xa * cos - xb * sin;
            head[b] = xa * sin + xb * cos;
        }
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Logits (`[tokens][vocab]`) at every position of `tokens`, run as one causal sequence from
/// position 0.
///
/// Attention is grouped-query: query head `h` reads KV head `h / (heads / kv_heads)` (HF's
/// `repeat_kv`), scores scaled by `1 / sqrt(head_dim)`, softmax over positions `0..=t`.
pub fn reference_logits(
    spec: &TinySpec,
    w: &RefWeights,
    tokens: &[u32],
    style: RopeStyle,
) -> Vec<Vec<f64>> {
    reference_logits_masked(spec, w, tokens, style, &|_, _, _, _| true)
}

/// [`reference_logits`] where query `t` of layer `l` attends through KV head `h` only to the keys
/// `j <= t` with `visible(l, h, t, j)`: KV eviction's reference (each token's keys and values are
/// those it computed when it ran, over what it could see then).
pub fn reference_logits_masked(
    spec: &TinySpec,
    w: &RefWeights,
    tokens: &[u32],
    style: RopeStyle,
    visible: &dyn Fn(usize, usize, usize, usize) -> bool,
) -> Vec<Vec<f64>> {
    let (d, hd) = (spec.hidden, spec.head_dim());
    let group = spec.heads / spec.kv_heads;
    let eps = spec.eps as f64;
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| w.embed[t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    for (l, layer) in w.layers.iter().enumerate() {
        let mut keys = Vec::with_capacity(tokens.len());
        let mut values = Vec::with_capacity(tokens.len());
        let mut queries = Vec::with_capacity(tokens.len());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &layer.attn_norm, eps);
            let mut q = matvec(&layer.wq, &h);
            let mut k = matvec(&layer.wk, &h);
            rope(&mut q, hd, pos, spec.rope_theta, style);
            rope(&mut k, hd, pos, spec.rope_theta, style);
            queries.push(q);
            keys.push(k);
            values.push(matvec(&layer.wv, &h));
        }
        for (t, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f64; spec.q_dim()];
            for head in 0..spec.heads {
                let kvh = head / group;
                let q = &queries[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        if !visible(l, kvh, t, j) {
                            return f64::NEG_INFINITY;
                        }
                        let k = &keys[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                let out = &mut attn[head * hd..(head + 1) * hd];
                for (j, e) in exps.iter().enumerate() {
                    let v = &values[j][kvh * hd..(kvh + 1) * hd];
                    for (o, vv) in out.iter_mut().zip(v) {
                        *o += e / total * vv;
                    }
                }
            }
            let o = matvec(&layer.wo, &attn);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms_norm(x, &layer.ffn_norm, eps);
            let gate = matvec(&layer.w_gate, &h);
            let up = matvec(&layer.w_up, &h);
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            let down = matvec(&layer.w_down, &act);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    xs.iter()
        .map(|x| matvec(head, &rms_norm(x, &w.final_norm, eps)))
        .collect()
}

/// The error measure of the tests: `max |a − b| / (1 + max |b|)` over every logit, i.e. the
/// largest absolute error relative to the logits' scale (absolute for logits below 1).
pub fn max_rel_err(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    assert_eq!(got.len(), want.len(), "different numbers of positions");
    let mut err = 0f64;
    let mut scale = 0f64;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "different vocabulary sizes");
        for (a, b) in g.iter().zip(w) {
            assert!(a.is_finite(), "non-finite logit {a}");
            err = err.max((*a as f64 - b).abs());
            scale = scale.max(b.abs());
        }
    }
    err / (1.0 + scale)
}

/// [`max_rel_err`] between two f32 runs (the second is the yardstick).
pub fn max_rel_diff(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    let want: Vec<Vec<f64>> = want
        .iter()
        .map(|r| r.iter().map(|&x| x as f64).collect())
        .collect();
    max_rel_err(got, &want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::TinyWeights;

    #[test]
    fn rotate_half_on_hf_weights_equals_interleaved_on_native() {
        // The HF permutation is a relabelling of each head's dimensions applied to q and k
        // alike, so q·k and hence the logits are unchanged.
        for (heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
            let spec = TinySpec {
                heads,
                kv_heads,
                layers: 1,
                ..TinySpec::default()
            };
            let native = TinyWeights::random(&spec).to_f64(&spec);
            let hf = native.native_to_hf(&spec);
            assert_ne!(native, hf);
            let tokens = crate::random_tokens(&spec, 9, 1);
            let a = reference_logits(&spec, &native, &tokens, RopeStyle::Interleaved);
            let b = reference_logits(&spec, &hf, &tokens, RopeStyle::RotateHalf);
            let b32: Vec<Vec<f32>> = b
                .iter()
                .map(|r| r.iter().map(|&x| x as f32).collect())
                .collect();
            assert!(max_rel_err(&b32, &a) < 1e-6);
            // ... while the wrong style on the same weights gives different logits.
            let c = reference_logits(&spec, &hf, &tokens, RopeStyle::Interleaved);
            let c32: Vec<Vec<f32>> = c
                .iter()
                .map(|r| r.iter().map(|&x| x as f32).collect())
                .collect();
            assert!(max_rel_err(&c32, &a) > 1e-3);
        }
    }

    #[test]
    fn logits_have_a_useful_scale() {
        for tied in [false, true] {
            let spec = TinySpec {
                tied,
                ..TinySpec::default()
            };
            let w = TinyWeights::random(&spec).to_f64(&spec);
            let tokens = crate::random_tokens(&spec, 12, 2);
            let logits = reference_logits(&spec, &w, &tokens, RopeStyle::Interleaved);
            let max = logits.iter().flatten().fold(0f64, |a, b| a.max(b.abs()));
            assert!((1.0..100.0).contains(&max), "max |logit| {max}");
            // Positions see different contexts, so their logits differ.
            assert!(logits.windows(2).all(|p| p[0] != p[1]));
        }
    }
}
