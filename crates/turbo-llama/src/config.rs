//! Model hyper-parameters, read from HF `config.json`, GGUF metadata, or a native `turbo.json`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// The largest any dimension or row width of a model may be. Backends index rows of weights and
/// activations with 32-bit signed integers (the CUDA kernels take `int` widths), and the largest
/// real models are far below it (Llama-3-405B: hidden size 16384, vocabulary 128256), so
/// anything above is a corrupt file, refused before it sizes anything.
pub const MAX_DIM: usize = i32::MAX as usize;

/// The longest context a model may declare: token positions are 32-bit. Models legitimately
/// declare long contexts (131072, a million), so this bounds only what later arithmetic can
/// hold, not what is sensible.
pub const MAX_CONTEXT: usize = u32::MAX as usize;

impl LlamaConfig {
    /// Checks everything the numbers alone can say: every dimension positive and at most
    /// [`MAX_DIM`], the shape relations the forward pass relies on, every row width and the
    /// parameter count computable without overflow, the context length in `1..=MAX_CONTEXT`,
    /// and the floating-point hyper-parameters positive and finite (RoPE scaling included).
    ///
    /// A model file's numbers are untrusted: loaders call this before sizing anything by them,
    /// then check every dimension against the tensors actually present.
    pub fn validate(&self) -> Result<(), String> {
        self.check()
            .map_err(|m| format!("invalid model config: {m}"))
    }

    fn check(&self) -> Result<(), String> {
        for (what, n) in [
            ("number of layers", self.n_layers),
            ("hidden size", self.hidden_size),
            ("intermediate size", self.intermediate_size),
            ("number of attention heads", self.n_heads),
            ("number of KV heads", self.n_kv_heads),
            ("head dimension", self.head_dim),
            ("vocabulary size", self.vocab_size),
        ] {
            if n == 0 {
                return Err(format!("the {what} is 0; it must be positive"));
            }
            if n > MAX_DIM {
                return Err(format!("the {what} {n} is more than the limit {MAX_DIM}"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head dimension {} must be even (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        let width = |what: &str, n: Option<usize>| match n {
            Some(n) if n <= MAX_DIM => Ok(()),
            _ => Err(format!(
                "the {what} ({} heads of {}) is more than the limit {MAX_DIM}",
                self.n_heads, self.head_dim
            )),
        };
        let q = self.n_heads.checked_mul(self.head_dim);
        width("query width", q)?;
        let kv = self.n_kv_heads.checked_mul(self.head_dim);
        let qkv = q
            .zip(kv)
            .and_then(|(q, kv)| q.checked_add(kv.checked_mul(2)?));
        width("fused QKV width", qkv)?;
        if self.intermediate_size > MAX_DIM / 2 {
            return Err(format!(
                "the intermediate size {} is more than the limit {} (gate and up projections \
                 are fused into one product of twice its width)",
                self.intermediate_size,
                MAX_DIM / 2
            ));
        }
        if self.checked_parameter_count().is_none() {
            return Err(format!(
                "{} layers of hidden size {}, intermediate size {} and vocabulary {} would have \
                 more parameters than memory can address",
                self.n_layers, self.hidden_size, self.intermediate_size, self.vocab_size
            ));
        }
        if self.context_length == 0 {
            return Err("the context length is 0; it must be positive".into());
        }
        if self.context_length > MAX_CONTEXT {
            return Err(format!(
                "the context length {} is more than the limit {MAX_CONTEXT} (token positions \
                 are 32-bit)",
                self.context_length
            ));
        }
        positive_finite("RMS norm epsilon", self.rms_norm_eps.into())?;
        positive_finite("RoPE theta", self.rope_theta)?;
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                positive_finite("linear RoPE scaling factor", *factor)?
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                positive_finite("llama3 RoPE scaling factor", *factor)?;
                positive_finite("llama3 RoPE low_freq_factor", *low_freq_factor)?;
                positive_finite("llama3 RoPE high_freq_factor", *high_freq_factor)?;
                positive_finite(
                    "llama3 RoPE original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                // The blend between kept and scaled frequencies divides by their difference.
                if high_freq_factor <= low_freq_factor {
                    return Err(format!(
                        "llama3 RoPE high_freq_factor {high_freq_factor} must be greater than \
                         low_freq_factor {low_freq_factor}"
                    ));
                }
            }
            Some(RopeScaling::Factors { factors }) => {
                if factors.len() != self.head_dim / 2 {
                    return Err(format!(
                        "{} RoPE frequency factors for head dimension {} (expected {})",
                        factors.len(),
                        self.head_dim,
                        self.head_dim / 2
                    ));
                }
                if let Some((i, f)) = factors
                    .iter()
                    .enumerate()
                    .find(|(_, f)| !(f.is_finite() && **f > 0.0))
                {
                    return Err(format!(
                        "RoPE frequency factor #{i} is {f}; it must be positive and finite"
                    ));
                }
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

    /// Parameters, counting a tied embedding once. Saturates; a validated config never does.
    pub fn parameter_count(&self) -> usize {
        self.checked_parameter_count().unwrap_or(usize::MAX)
    }

    /// Parameters, or `None` if the count overflows (so would every product sized by the config).
    fn checked_parameter_count(&self) -> Option<usize> {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let q = self.n_heads.checked_mul(self.head_dim)?;
        let kv = self.n_kv_heads.checked_mul(self.head_dim)?;
        let attn = d.checked_mul(q.checked_add(kv)?)?.checked_mul(2)?;
        let ffn = d.checked_mul(f)?.checked_mul(3)?;
        let layer = attn.checked_add(ffn)?.checked_add(d.checked_mul(2)?)?;
        let embed = self.vocab_size.checked_mul(d)?;
        let embeds = embed.checked_mul(if self.tie_word_embeddings { 1 } else { 2 })?;
        self.n_layers
            .checked_mul(layer)?
            .checked_add(embeds)?
            .checked_add(d)
    }
}

/// Refuses NaN, infinities, zero and negative values where only a positive number makes sense.
fn positive_finite(what: &str, x: f64) -> Result<(), String> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(format!("the {what} is {x}; it must be positive and finite"))
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
    pub rope_scaling: Option<Value>,
    /// transformers >= 5 keeps theta and scaling together here.
    pub rope_parameters: Option<Value>,
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
        // transformers 5 keeps theta and scaling in `rope_parameters`; earlier versions put
        // them at the top level, which wins when both are present.
        let params = match &self.rope_parameters {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v),
            Some(v) => {
                return Err(format!(
                    "rope_parameters must be an object or null, found {}",
                    json_kind(v)
                ))
            }
        };
        let rope_theta = match (self.rope_theta, params.and_then(|p| p.get("rope_theta"))) {
            (Some(theta), _) => theta,
            (None, Some(v)) => v.as_f64().ok_or_else(|| {
                format!(
                    "rope_parameters.rope_theta must be a number, found {}",
                    json_kind(v)
                )
            })?,
            (None, None) => 10000.0,
        };
        let rope_scaling = match (&self.rope_scaling, params) {
            (Some(v), _) if !v.is_null() => parse_hf_rope_scaling("rope_scaling", v)?,
            (_, Some(p)) => parse_hf_rope_scaling("rope_parameters", p)?,
            _ => None,
        };
        let head_dim = match self.head_dim {
            Some(h) => h,
            None => {
                let heads = self.num_attention_heads;
                if heads == 0 || !self.hidden_size.is_multiple_of(heads) {
                    return Err(format!(
                        "invalid model config: hidden_size {} is not a multiple of \
                         num_attention_heads {heads}, and head_dim is not given",
                        self.hidden_size
                    ));
                }
                self.hidden_size / heads
            }
        };
        let config = LlamaConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            n_layers: self.num_hidden_layers,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
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

/// The RoPE scaling HF describes in `field` (`rope_scaling`, or transformers 5's
/// `rope_parameters`); `None` for plain RoPE.
///
/// The kind is named by `rope_type`, or by `type` in older configs (transformers reads
/// `rope_type` first). Anything malformed is an error rather than ignored: a model run with the
/// wrong RoPE still produces text, just worse text, and nobody would notice why.
fn parse_hf_rope_scaling(field: &str, v: &Value) -> Result<Option<RopeScaling>, String> {
    let Value::Object(obj) = v else {
        return Err(format!(
            "{field} must be an object or null, found {}",
            json_kind(v)
        ));
    };
    let kind = match obj.get("rope_type").or_else(|| obj.get("type")) {
        Some(Value::String(kind)) => kind.as_str(),
        Some(other) => {
            return Err(format!(
                "{field}.rope_type must be a string, found {}",
                json_kind(other)
            ))
        }
        None => return Err(format!("{field} has no 'rope_type' (or 'type')")),
    };
    let num = |key: &str| match obj.get(key) {
        Some(x) => x.as_f64().ok_or_else(|| {
            format!(
                "{field}.{key} of rope type '{kind}' must be a number, found {}",
                json_kind(x)
            )
        }),
        None => Err(format!("{field} of rope type '{kind}' needs '{key}'")),
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
            "unsupported rope scaling type '{other}' in {field} (supported: default, linear, \
             llama3)"
        )),
    }
}

/// A JSON value as a message should show it: its kind, and its text when short (strings in
/// JSON form, so escaped).
fn json_kind(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let text = v.to_string();
    if text.len() <= 40 {
        format!("{kind} ({text})")
    } else {
        kind.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3.1-8B's config.json as published (trimmed of keys Turbo ignores).
    fn llama3_8b() -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3"
            },
            "max_position_embeddings": 131072,
            "tie_word_embeddings": false
        })
    }

    fn parse(json: &Value) -> Result<LlamaConfig, String> {
        serde_json::from_value::<HfConfig>(json.clone())
            .map_err(|e| e.to_string())?
            .into_config()
    }

    /// `llama3_8b` with `edit` applied.
    fn with(edit: impl FnOnce(&mut Value)) -> Result<LlamaConfig, String> {
        let mut json = llama3_8b();
        edit(&mut json);
        parse(&json)
    }

    fn fails(edit: impl FnOnce(&mut Value), expected: &str) {
        match with(edit) {
            Ok(c) => panic!("accepted {c:?}; expected {expected:?}"),
            Err(e) => assert!(e.contains(expected), "{e:?} does not say {expected:?}"),
        }
    }

    #[test]
    fn real_llama_configs_load() {
        let c = parse(&llama3_8b()).unwrap();
        assert_eq!(
            (c.n_layers, c.hidden_size, c.head_dim, c.n_kv_heads),
            (32, 4096, 128, 8)
        );
        assert_eq!(c.context_length, 131072);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        // 8192-token Llama-3, 70B and 405B shapes, a million-token context.
        with(|j| {
            j["max_position_embeddings"] = 8192.into();
            j["rope_scaling"] = Value::Null;
        })
        .unwrap();
        for (layers, hidden, ffn, heads) in [(80, 8192, 28672, 64), (126, 16384, 53248, 128)] {
            let c = with(|j| {
                j["num_hidden_layers"] = layers.into();
                j["hidden_size"] = hidden.into();
                j["intermediate_size"] = ffn.into();
                j["num_attention_heads"] = heads.into();
            })
            .unwrap();
            assert_eq!(c.head_dim, 128);
            assert!(c.parameter_count() > 60_000_000_000);
        }
        with(|j| j["max_position_embeddings"] = 1_048_576.into()).unwrap();
        with(|j| j["max_position_embeddings"] = u32::MAX.into()).unwrap();
        // Older spellings of the scaling, and transformers 5's rope_parameters.
        let c = with(|j| j["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2}))
            .unwrap();
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
        let c = with(|j| j["rope_scaling"] = serde_json::json!({"type": "default", "unused": [1]}))
            .unwrap();
        assert_eq!(c.rope_scaling, None);
        let c = with(|j| {
            let scaling = j["rope_scaling"].take();
            j.as_object_mut().unwrap().remove("rope_theta");
            let mut params = scaling;
            params["rope_theta"] = 500000.0.into();
            j["rope_parameters"] = params;
        })
        .unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        // An explicit head_dim need not be hidden / heads: the tensors decide.
        let c = with(|j| j["head_dim"] = 64.into()).unwrap();
        assert_eq!((c.head_dim, c.q_dim()), (64, 2048));
    }

    #[test]
    fn dimensions_are_bounded_and_consistent() {
        for (key, n) in [
            ("num_hidden_layers", 1u64 << 62),
            ("num_hidden_layers", 1 << 32),
            ("hidden_size", 1 << 62),
            ("hidden_size", 1 << 32),
            ("intermediate_size", 1 << 32),
            ("vocab_size", 1 << 32),
            ("head_dim", 1 << 32),
        ] {
            fails(|j| j[key] = n.into(), "is more than the limit 2147483647");
        }
        fails(
            |j| {
                j["num_attention_heads"] = (1u64 << 32).into();
                j["head_dim"] = 128.into();
            },
            "the number of attention heads 4294967296 is more than the limit 2147483647",
        );
        fails(
            |j| j["num_hidden_layers"] = 0.into(),
            "the number of layers is 0",
        );
        fails(|j| j["vocab_size"] = 0.into(), "the vocabulary size is 0");
        fails(
            |j| j["num_attention_heads"] = 0.into(),
            "hidden_size 4096 is not a multiple of num_attention_heads 0",
        );
        fails(
            |j| j["num_attention_heads"] = 24.into(),
            "hidden_size 4096 is not a multiple of num_attention_heads 24",
        );
        fails(
            |j| j["num_key_value_heads"] = 5.into(),
            "32 attention heads are not a multiple of 5 KV heads",
        );
        fails(
            |j| j["num_key_value_heads"] = 0.into(),
            "number of KV heads is 0",
        );
        fails(
            |j| j["head_dim"] = 7.into(),
            "head dimension 7 must be even",
        );
        // Each fits, their products do not.
        fails(
            |j| {
                j["num_attention_heads"] = (1 << 20).into();
                j["num_key_value_heads"] = (1 << 20).into();
                j["head_dim"] = (1 << 12).into();
            },
            "the query width (1048576 heads of 4096) is more than the limit 2147483647",
        );
        fails(
            |j| j["intermediate_size"] = (1u64 << 30).into(),
            "the intermediate size 1073741824 is more than the limit 1073741823",
        );
        fails(
            |j| j["max_position_embeddings"] = 0.into(),
            "the context length is 0",
        );
        fails(
            |j| j["max_position_embeddings"] = (1u64 << 32).into(),
            "the context length 4294967296 is more than the limit 4294967295",
        );
        fails(|j| j["num_hidden_layers"] = (-1).into(), "invalid value");
    }

    #[test]
    fn hyper_parameters_must_be_positive_and_finite() {
        for theta in [0.0, -1.0] {
            fails(|j| j["rope_theta"] = theta.into(), "the RoPE theta is ");
        }
        // Large but finite: the numbers allow it.
        with(|j| j["rope_theta"] = 1e30.into()).unwrap();
        for eps in [0.0, -1e-5, 1e-60, 1e60] {
            fails(
                |j| j["rms_norm_eps"] = eps.into(),
                "the RMS norm epsilon is ",
            );
        }
        let scaling = |j: &mut Value, key: &str, v: Value| j["rope_scaling"][key] = v;
        for factor in [0.0, -8.0] {
            fails(
                |j| scaling(j, "factor", factor.into()),
                "the llama3 RoPE scaling factor is ",
            );
        }
        fails(
            |j| scaling(j, "high_freq_factor", 1.0.into()),
            "llama3 RoPE high_freq_factor 1 must be greater than low_freq_factor 1",
        );
        fails(
            |j| scaling(j, "low_freq_factor", 0.0.into()),
            "the llama3 RoPE low_freq_factor is 0",
        );
        fails(
            |j| scaling(j, "original_max_position_embeddings", 0.into()),
            "the llama3 RoPE original_max_position_embeddings is 0",
        );
        fails(
            |j| j["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 0}),
            "the linear RoPE scaling factor is 0",
        );
    }

    #[test]
    fn malformed_rope_scaling_is_an_error() {
        for kind in ["yarn", "dynamic", "longrope", "su", "Linear"] {
            fails(
                |j| j["rope_scaling"]["rope_type"] = kind.into(),
                &format!("unsupported rope scaling type '{kind}' in rope_scaling"),
            );
        }
        fails(
            |j| {
                j["rope_scaling"].as_object_mut().unwrap().remove("factor");
            },
            "rope_scaling of rope type 'llama3' needs 'factor'",
        );
        fails(
            |j| j["rope_scaling"]["factor"] = "8".into(),
            "rope_scaling.factor of rope type 'llama3' must be a number, found a string (\"8\")",
        );
        fails(
            |j| {
                j["rope_scaling"]
                    .as_object_mut()
                    .unwrap()
                    .remove("rope_type");
            },
            "rope_scaling has no 'rope_type' (or 'type')",
        );
        fails(
            |j| j["rope_scaling"]["rope_type"] = 3.into(),
            "rope_scaling.rope_type must be a string, found a number (3)",
        );
        fails(
            |j| j["rope_scaling"] = "llama3".into(),
            "rope_scaling must be an object or null, found a string",
        );
        fails(
            |j| j["rope_parameters"] = serde_json::json!([1]),
            "rope_parameters must be an object or null",
        );
        fails(
            |j| {
                j["rope_scaling"] = Value::Null;
                j["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
            },
            "unsupported rope scaling type 'yarn' in rope_parameters",
        );
        fails(
            |j| {
                j.as_object_mut().unwrap().remove("rope_theta");
                j["rope_parameters"] =
                    serde_json::json!({"rope_type": "default", "rope_theta": "big"});
            },
            "rope_parameters.rope_theta must be a number",
        );
    }

    #[test]
    fn native_configs_are_checked_too() {
        let mut c = parse(&llama3_8b()).unwrap();
        c.validate().unwrap();
        c.rope_scaling = Some(RopeScaling::Factors {
            factors: vec![1.0; 64],
        });
        c.validate().unwrap();
        c.rope_scaling = Some(RopeScaling::Factors {
            factors: vec![1.0; 63],
        });
        assert!(c
            .validate()
            .unwrap_err()
            .contains("63 RoPE frequency factors"));
        let mut factors = vec![1.0; 64];
        factors[5] = f32::NAN;
        c.rope_scaling = Some(RopeScaling::Factors { factors });
        assert_eq!(
            c.validate().unwrap_err(),
            "invalid model config: RoPE frequency factor #5 is NaN; it must be positive and finite"
        );
        c.rope_scaling = Some(RopeScaling::Linear {
            factor: f64::INFINITY,
        });
        assert!(c.validate().unwrap_err().contains("factor is inf"));
        c.rope_scaling = None;
        c.rope_theta = f64::NAN;
        assert_eq!(
            c.validate().unwrap_err(),
            "invalid model config: the RoPE theta is NaN; it must be positive and finite"
        );
    }

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
