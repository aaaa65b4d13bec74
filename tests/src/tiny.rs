//! Tiny random LLaMA models: their hyper-parameters and weights.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Hyper-parameters of a tiny LLaMA model.
///
/// For the block-quantized formats (Q8_0, Q4_0, Q4_1) every matrix row must be a whole number of
/// 32-element blocks, so `hidden` and `ffn` must then be multiples of 32.
#[derive(Clone, Debug, PartialEq)]
pub struct TinySpec {
    /// Vocabulary size: at least [`crate::vocab::MIN_VOCAB`] (control tokens, the 256 byte tokens
    /// and the merges); the rest is padded with unused tokens.
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub rope_theta: f64,
    pub eps: f32,
    /// Longest sequence the model accepts.
    pub context: usize,
    /// Whether the LM head is the embedding table.
    pub tied: bool,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            vocab: 300,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 96,
            rope_theta: 10000.0,
            eps: 1e-5,
            context: 128,
            tied: false,
            seed: 0,
        }
    }
}

impl TinySpec {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim()
    }

    /// Panics unless the shapes fit together.
    pub fn check(&self) {
        assert!(
            self.vocab >= crate::vocab::MIN_VOCAB,
            "vocab {} is below the tiny vocabulary's {} tokens",
            self.vocab,
            crate::vocab::MIN_VOCAB
        );
        assert!(self.heads > 0 && self.kv_heads > 0 && self.layers > 0);
        assert_eq!(self.hidden % self.heads, 0, "hidden must split into heads");
        assert_eq!(
            self.heads % self.kv_heads,
            0,
            "heads must group over KV heads"
        );
        assert_eq!(self.head_dim() % 2, 0, "RoPE needs an even head dimension");
    }

    /// Every tensor of the model as `(HF name, rows, cols)`, vectors as one row, in file order.
    pub fn tensor_shapes(&self) -> Vec<(String, usize, usize)> {
        let (d, f, v) = (self.hidden, self.ffn, self.vocab);
        let mut out = vec![("model.embed_tokens.weight".to_string(), v, d)];
        for i in 0..self.layers {
            let p = format!("model.layers.{i}.");
            for (suffix, rows, cols) in [
                ("input_layernorm.weight", 1, d),
                ("self_attn.q_proj.weight", self.q_dim(), d),
                ("self_attn.k_proj.weight", self.kv_dim(), d),
                ("self_attn.v_proj.weight", self.kv_dim(), d),
                ("self_attn.o_proj.weight", d, self.q_dim()),
                ("post_attention_layernorm.weight", 1, d),
                ("mlp.gate_proj.weight", f, d),
                ("mlp.up_proj.weight", f, d),
                ("mlp.down_proj.weight", d, f),
            ] {
                out.push((format!("{p}{suffix}"), rows, cols));
            }
        }
        out.push(("model.norm.weight".to_string(), 1, d));
        if !self.tied {
            out.push(("lm_head.weight".to_string(), v, d));
        }
        out
    }
}

/// One transformer block; matrices are row-major `[out features, in features]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer<T> {
    pub attn_norm: Vec<T>,
    pub wq: Vec<T>,
    pub wk: Vec<T>,
    pub wv: Vec<T>,
    pub wo: Vec<T>,
    pub ffn_norm: Vec<T>,
    pub w_gate: Vec<T>,
    pub w_up: Vec<T>,
    pub w_down: Vec<T>,
}

/// A whole model's weights. Whether W_q/W_k rows are in the native (interleaved-pair) or the HF
/// (rotate-half) order depends on where they came from: [`TinyWeights::random`] gives native.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights<T> {
    pub embed: Vec<T>,
    pub layers: Vec<Layer<T>>,
    pub final_norm: Vec<T>,
    /// `None` when tied to `embed`.
    pub lm_head: Option<Vec<T>>,
}

/// The f32 weights a tiny model is generated with (native layout).
pub type TinyWeights = Weights<f32>;
/// Weights as the reference forward pass consumes them.
pub type RefWeights = Weights<f64>;

impl<T: Clone> Weights<T> {
    /// Builds weights tensor by tensor from `(HF name, rows, cols)`, in
    /// [`TinySpec::tensor_shapes`] order.
    pub fn from_named(spec: &TinySpec, mut get: impl FnMut(&str, usize, usize) -> Vec<T>) -> Self {
        let mut take = |name: String, rows: usize, cols: usize| {
            let v = get(&name, rows, cols);
            assert_eq!(v.len(), rows * cols, "{name}: wrong element count");
            v
        };
        let (d, f, v) = (spec.hidden, spec.ffn, spec.vocab);
        let embed = take("model.embed_tokens.weight".into(), v, d);
        let layers = (0..spec.layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                Layer {
                    attn_norm: take(format!("{p}input_layernorm.weight"), 1, d),
                    wq: take(format!("{p}self_attn.q_proj.weight"), spec.q_dim(), d),
                    wk: take(format!("{p}self_attn.k_proj.weight"), spec.kv_dim(), d),
                    wv: take(format!("{p}self_attn.v_proj.weight"), spec.kv_dim(), d),
                    wo: take(format!("{p}self_attn.o_proj.weight"), d, spec.q_dim()),
                    ffn_norm: take(format!("{p}post_attention_layernorm.weight"), 1, d),
                    w_gate: take(format!("{p}mlp.gate_proj.weight"), f, d),
                    w_up: take(format!("{p}mlp.up_proj.weight"), f, d),
                    w_down: take(format!("{p}mlp.down_proj.weight"), d, f),
                }
            })
            .collect();
        let final_norm = take("model.norm.weight".into(), 1, d);
        let lm_head = (!spec.tied).then(|| take("lm_head.weight".into(), v, d));
        Weights {
            embed,
            layers,
            final_norm,
            lm_head,
        }
    }

    /// Every tensor as `(HF name, rows, cols, values)`, in [`TinySpec::tensor_shapes`] order.
    pub fn named(&self, spec: &TinySpec) -> Vec<(String, usize, usize, &[T])> {
        let mut values: Vec<&[T]> = vec![&self.embed];
        for l in &self.layers {
            values.extend([
                &l.attn_norm[..],
                &l.wq,
                &l.wk,
                &l.wv,
                &l.wo,
                &l.ffn_norm,
                &l.w_gate,
                &l.w_up,
                &l.w_down,
            ]);
        }
        values.push(&self.final_norm);
        if let Some(head) = &self.lm_head {
            values.push(head);
        }
        let shapes = spec.tensor_shapes();
        assert_eq!(shapes.len(), values.len(), "weights do not match the spec");
        shapes
            .into_iter()
            .zip(values)
            .map(|((name, rows, cols), v)| {
                assert_eq!(v.len(), rows * cols, "{name}: wrong element count");
                (name, rows, cols, v)
            })
            .collect()
    }

    /// Applies `f` to every tensor (`f(HF name, rows, cols, values)`).
    pub fn map<U: Clone>(
        &self,
        spec: &TinySpec,
        mut f: impl FnMut(&str, usize, usize, &[T]) -> Vec<U>,
    ) -> Weights<U> {
        let named = self.named(spec);
        let mut it = named.into_iter();
        Weights::from_named(spec, |name, _, _| {
            let (n, rows, cols, v) = it.next().expect("same tensor list");
            assert_eq!(n, name);
            f(&n, rows, cols, v)
        })
    }
}

impl TinyWeights {
    /// Random weights from `spec.seed`, scaled so activations stay O(1) through the layers and
    /// logits come out O(1)–O(10): matrices uniform in ±sqrt(3 / fan_in) (unit output variance for
    /// unit-variance input), embeddings uniform in ±1, norm weights in [0.5, 1.5].
    pub fn random(spec: &TinySpec) -> TinyWeights {
        spec.check();
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        Weights::from_named(spec, |name, rows, cols| {
            let (lo, hi) = if name.ends_with("norm.weight") {
                (0.5, 1.5)
            } else if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
                (-1.0, 1.0)
            } else {
                let s = (3.0 / cols as f32).sqrt();
                (-s, s)
            };
            (0..rows * cols).map(|_| rng.random_range(lo..hi)).collect()
        })
    }
}

impl<T: Copy + Into<f64>> Weights<T> {
    pub fn to_f64(&self, spec: &TinySpec) -> RefWeights {
        self.map(spec, |_, _, _, v| v.iter().map(|&x| x.into()).collect())
    }
}

/// Row order that turns native (interleaved-pair) W_q/W_k rows into HF's rotate-half order:
/// HF row `h·d + p·d/2 + i` is native row `h·d + 2i + p`. Returns, for each HF row, its native row.
pub fn native_to_hf_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..n_heads * head_dim)
        .map(|r| {
            let (h, j) = (r / head_dim, r % head_dim);
            let (p, i) = (j / half, j % half);
            h * head_dim + 2 * i + p
        })
        .collect()
}

/// Rows of a row-major matrix with `cols` columns, taken in `order` (`order[i]` = source row of
/// row `i`).
pub fn permute_rows<T: Copy>(m: &[T], cols: usize, order: &[usize]) -> Vec<T> {
    assert_eq!(m.len(), order.len() * cols);
    order
        .iter()
        .flat_map(|&r| m[r * cols..(r + 1) * cols].iter().copied())
        .collect()
}

impl<T: Copy> Weights<T> {
    /// The same weights with W_q/W_k rows moved from the native to the HF (rotate-half) order.
    pub fn native_to_hf(&self, spec: &TinySpec) -> Weights<T> {
        let q = native_to_hf_rows(spec.heads, spec.head_dim());
        let k = native_to_hf_rows(spec.kv_heads, spec.head_dim());
        self.map(spec, |name, _, cols, v| {
            if name.ends_with("q_proj.weight") {
                permute_rows(v, cols, &q)
            } else if name.ends_with("k_proj.weight") {
                permute_rows(v, cols, &k)
            } else {
                v.to_vec()
            }
        })
    }
}

/// `n` token ids drawn from the whole vocabulary (control and padding tokens included).
pub fn random_tokens(spec: &TinySpec, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x746f_6b65_6e73);
    (0..n)
        .map(|_| rng.random_range(0..spec.vocab as u32))
        .collect()
}
