//! Model hyper-parameters, read from HF `config.json`, GGUF metadata, or a native `turbo.json`.

use serde::{Deserialize, Serialize};

/// RoPE frequency scaling beyond the base theta.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Llama 3.1's piecewise scaling: long wavelengths divided by `factor`, short ones kept,
    /// a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Per-frequency divisors, as GGUF stores them in the `rope_freqs` tensor.
    Factors { factors: Vec<f32> },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// Longest sequence the model was trained for; prompts beyond it are refused.
    pub context_length: usize,
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// Checks the shape relations the forward pass relies on.
    pub fn validate(&self) -> Result<(), String> {
        let fail = |m: String| Err(format!("invalid model config: {m}"));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.n_layers == 0 || self.vocab_size == 0 {
            return fail("heads, KV heads, layers and vocabulary must be positive".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return fail(format!(
                "{} heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return fail(format!("head dimension {} must be even", self.head_dim));
        }
        if let Some(RopeScaling::Factors { factors }) = &self.rope_scaling {
            if factors.len() != self.head_dim / 2 {
                return fail(format!(
                    "{} RoPE frequency factors for head dimension {}",
                    factors.len(),
                    self.head_dim
                ));
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Inverse RoPE frequencies, one per rotated pair, with scaling applied (as HF computes them).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64))
            .collect();
        let scaled: Vec<f64> = match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Factors { factors }) => base
                .iter()
                .zip(factors)
                .map(|(f, s)| f / *s as f64)
                .collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    /// Parameters, counting a tied embedding once.
    pub fn parameter_count(&self) -> usize {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let attn = d * self.q_dim() * 2 + d * self.kv_dim() * 2;
        let layer = attn + 3 * d * f + 2 * d;
        let embed = self.vocab_size * d;
        embed * if self.tie_word_embeddings { 1 } else { 2 } + self.n_layers * layer + d
    }
}

/// The subset of HF's `config.json` that describes a LLaMA model.
#[derive(Deserialize)]
pub(crate) struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 keeps theta and scaling together here.
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_context() -> usize {
    2048
}

impl HfConfig {
    pub fn into_config(self) -> Result<LlamaConfig, String> {
        let is_llama = self.model_type.as_deref() == Some("llama")
            || self.architectures.iter().any(|a| a == "LlamaForCausalLM");
        if !is_llama {
            return Err(format!(
                "unsupported architecture {:?} (model_type {:?}): Turbo runs LLaMA models",
                self.architectures, self.model_type
            ));
        }
        if self.attention_bias || self.mlp_bias {
            return Err("LLaMA variants with attention or MLP biases are not supported".into());
        }
        let params = self.rope_parameters.as_ref().filter(|v| v.is_object());
        let rope_theta = self
            .rope_theta
            .or_else(|| {
                params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(|t| t.as_f64())
            })
            .unwrap_or(10000.0);
        let rope_scaling = match self
            .rope_scaling
            .as_ref()
            .filter(|v| !v.is_null())
            .or(params)
        {
            None => None,
            Some(v) => parse_hf_rope_scaling(v)?,
        };
        let config = LlamaConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            n_layers: self.num_hidden_layers,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            context_length: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
        };
        config.validate()?;
        Ok(config)
    }
}

fn parse_hf_rope_scaling(v: &serde_json::Value) -> Result<Option<RopeScaling>, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |key: &str| {
        v.get(key)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| format!("rope_scaling of type {kind} needs '{key}'"))
    };
    match kind {
        "default" => Ok(None),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        })),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor")?,
        })),
        other => Err(format!(
            "rope_scaling type '{other}' is not supported (supported: llama3, linear)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_matches_hf() {
        // Llama-3.1-8B: theta 500000, factor 8, low 1, high 4, original 8192. Expected values from
        // transformers' _compute_llama3_parameters for head_dim 128: the first frequency is kept
        // (short wavelength), the last is divided by 8, index 30 lies in the blended band.
        let config = LlamaConfig {
            vocab_size: 1,
            hidden_size: 4096,
            intermediate_size: 1,
            n_layers: 1,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
            context_length: 131072,
            tie_word_embeddings: false,
        };
        let f = config.rope_inv_freq();
        let base = |i: usize| 1.0 / 500000f64.powf(2.0 * i as f64 / 128.0);
        assert_eq!(f[0], 1.0);
        assert!((f[63] as f64 - base(63) / 8.0).abs() < 1e-12);
        let wavelen = 2.0 * std::f64::consts::PI / base(30);
        let smooth = (8192.0 / wavelen - 1.0) / 3.0;
        assert!(
            smooth > 0.0 && smooth < 1.0,
            "index 30 is in the blend band"
        );
        let want = (1.0 - smooth) * base(30) / 8.0 + smooth * base(30);
        assert!((f[30] as f64 - want).abs() / want < 1e-6);
    }
}
