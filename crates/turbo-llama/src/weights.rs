//! Weights in Turbo's native layout, loaded from HF, GGUF, or native model directories.
//!
//! Native layout: W_q and W_k rows are in the original LLaMA order, where RoPE rotates adjacent
//! pairs `(2i, 2i+1)` of each head (the order GGUF files hold). A rotation then touches two
//! neighbouring values, which a GPU thread loads and stores as one vector. HF checkpoints store
//! these rows permuted for rotate-half RoPE and are de-permuted once at load (or by
//! `cargo xtask convert`).

use crate::config::{HfConfig, LlamaConfig, RopeScaling};
use crate::error::{io_err, LlamaError, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use turbo_core::{Bytes, DType, WeightMatrix};
use turbo_gguf::GgufFile;
use turbo_tokenizer::tokenizer::{GgufVocab, TextTokenizer};

/// One transformer block's weights; `M` is a matrix, `V` a vector (host or device resident).
#[derive(Clone, Debug)]
pub struct LayerWeights<M, V> {
    pub attn_norm: V,
    pub wq: M,
    pub wk: M,
    pub wv: M,
    pub wo: M,
    pub ffn_norm: V,
    pub w_gate: M,
    pub w_up: M,
    pub w_down: M,
}

#[derive(Clone, Debug)]
pub struct LlamaWeights<M, V> {
    pub embed: M,
    pub layers: Vec<LayerWeights<M, V>>,
    pub final_norm: V,
    /// `None` when the LM head is the embedding table (tied).
    pub lm_head: Option<M>,
}

pub type HostWeights = LlamaWeights<WeightMatrix, Vec<f32>>;

/// Where a model came from; native directories load without any re-layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    HfSafetensors,
    Native,
}

impl std::fmt::Display for ModelFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelFormat::Gguf => "GGUF",
            ModelFormat::HfSafetensors => "HF safetensors",
            ModelFormat::Native => "Turbo native",
        })
    }
}

/// A model ready to be placed on a backend: config, host weights (memory-mapped where the file
/// allows), tokenizer and chat template.
pub struct LoadedModel {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: LlamaConfig,
    pub weights: HostWeights,
    pub tokenizer: TextTokenizer,
    /// The chat template's Jinja source, when the model ships one.
    pub chat_template: Option<String>,
}

impl LoadedModel {
    /// Loads a GGUF file, a directory holding one, an HF directory, or a native directory.
    pub fn load(path: impl AsRef<Path>) -> Result<LoadedModel> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(io_err(path))?;
        if meta.is_file() {
            return load_gguf(path);
        }
        if path.join(crate::native::MANIFEST).is_file() {
            return crate::native::load(path);
        }
        if path.join("config.json").is_file() {
            return load_hf(path);
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io_err(path))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        match ggufs.as_slice() {
            [one] => load_gguf(one),
            [] => Err(LlamaError::Format(format!(
                "{}: not a model: expected a .gguf file, or a directory with config.json (HF) or {} (Turbo native)",
                path.display(),
                crate::native::MANIFEST
            ))),
            _ => Err(LlamaError::Format(format!(
                "{}: holds several .gguf files; pass one of them",
                path.display()
            ))),
        }
    }

    /// Distinct weight storage types, for `info`.
    pub fn tensor_types(&self) -> BTreeMap<String, usize> {
        let mut types = BTreeMap::new();
        let mut count = |m: &WeightMatrix| *types.entry(m.dtype.to_string()).or_insert(0) += 1;
        count(&self.weights.embed);
        for l in &self.weights.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                count(m);
            }
        }
        if let Some(m) = &self.weights.lm_head {
            count(m);
        }
        types
    }
}

/// Row order turning HF's rotate-half W_q/W_k into interleaved pairs: native row `2i + p` of a
/// head is HF row `p · head_dim/2 + i`.
pub fn hf_to_interleaved_order(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..n_heads * head_dim)
        .map(|r| {
            let (h, j) = (r / head_dim, r % head_dim);
            h * head_dim + (j % 2) * half + j / 2
        })
        .collect()
}

/// Checks a matrix's shape against what the config implies.
pub(crate) fn expect_shape(name: &str, m: &WeightMatrix, rows: usize, cols: usize) -> Result<()> {
    if m.rows != rows || m.cols != cols {
        return Err(LlamaError::Shape {
            name: name.into(),
            found: format!("[{}, {}]", m.rows, m.cols),
            expected: format!("[{rows}, {cols}]"),
        });
    }
    Ok(())
}

pub(crate) fn vector(name: &str, m: &WeightMatrix, len: usize) -> Result<Vec<f32>> {
    if m.rows * m.cols != len {
        return Err(LlamaError::Shape {
            name: name.into(),
            found: format!("[{}, {}]", m.rows, m.cols),
            expected: format!("[{len}]"),
        });
    }
    Ok(m.to_f32())
}

/// Assembles weights from a lookup by canonical (HF) tensor name, checking every shape.
pub(crate) fn assemble(
    config: &LlamaConfig,
    mut get: impl FnMut(&str) -> Result<Option<WeightMatrix>>,
) -> Result<HostWeights> {
    let (d, f, v) = (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
    );
    let mut req = |name: String| get(&name)?.ok_or(LlamaError::MissingTensor(name));
    let embed = req("model.embed_tokens.weight".into())?;
    expect_shape("model.embed_tokens.weight", &embed, v, d)?;
    let mut layers = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let p = format!("model.layers.{i}.");
        let mut mat = |suffix: &str, rows: usize, cols: usize| -> Result<WeightMatrix> {
            let name = format!("{p}{suffix}");
            let m = req(name.clone())?;
            expect_shape(&name, &m, rows, cols)?;
            Ok(m)
        };
        let wq = mat("self_attn.q_proj.weight", config.q_dim(), d)?;
        let wk = mat("self_attn.k_proj.weight", config.kv_dim(), d)?;
        let wv = mat("self_attn.v_proj.weight", config.kv_dim(), d)?;
        let wo = mat("self_attn.o_proj.weight", d, config.q_dim())?;
        let w_gate = mat("mlp.gate_proj.weight", f, d)?;
        let w_up = mat("mlp.up_proj.weight", f, d)?;
        let w_down = mat("mlp.down_proj.weight", d, f)?;
        let attn_norm_name = format!("{p}input_layernorm.weight");
        let attn_norm = vector(&attn_norm_name, &req(attn_norm_name.clone())?, d)?;
        let ffn_norm_name = format!("{p}post_attention_layernorm.weight");
        let ffn_norm = vector(&ffn_norm_name, &req(ffn_norm_name.clone())?, d)?;
        layers.push(LayerWeights {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            ffn_norm,
            w_gate,
            w_up,
            w_down,
        });
    }
    let final_norm = vector("model.norm.weight", &req("model.norm.weight".into())?, d)?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        let m = req("lm_head.weight".into())?;
        expect_shape("lm_head.weight", &m, v, d)?;
        Some(m)
    };
    Ok(LlamaWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// GGUF tensor name for a canonical (HF) name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let short = match suffix {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{short}.weight"))
}

fn gguf_config(file: &GgufFile) -> Result<LlamaConfig> {
    let arch = file.architecture()?;
    if arch != "llama" {
        return Err(LlamaError::Config(format!(
            "unsupported GGUF architecture '{arch}': Turbo runs 'llama' models"
        )));
    }
    let key = |k: &str| format!("llama.{k}");
    let opt_u = |k: &str| -> Result<Option<usize>> {
        match file.get(&key(k)) {
            None => Ok(None),
            Some(_) => Ok(Some(file.get_u64(&key(k))? as usize)),
        }
    };
    let req_u = |k: &str| -> Result<usize> { Ok(file.get_u64(&key(k))? as usize) };
    let hidden = req_u("embedding_length")?;
    let n_heads = req_u("attention.head_count")?;
    let embed = file
        .tensor("token_embd.weight")
        .ok_or_else(|| LlamaError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match opt_u("vocab_size")? {
        Some(v) => v,
        None => embed.dims.get(1).copied().unwrap_or(0) as usize,
    };
    let head_dim = match opt_u("attention.key_length")? {
        Some(h) => h,
        None => hidden / n_heads.max(1),
    };
    if let Some(rot) = opt_u("rope.dimension_count")? {
        if rot != head_dim {
            return Err(LlamaError::Config(format!(
                "partial rotary embeddings (rope dimension {rot} of head dimension {head_dim}) are not supported"
            )));
        }
    }
    let mut rope_scaling = None;
    if let Some(kind) = file.get(&key("rope.scaling.type")) {
        match kind.as_str() {
            Some("none") => {}
            Some("linear") => {
                rope_scaling = Some(RopeScaling::Linear {
                    factor: file.get_f32(&key("rope.scaling.factor"))? as f64,
                })
            }
            other => {
                return Err(LlamaError::Config(format!(
                    "GGUF rope scaling {other:?} is not supported (supported: linear, or rope_freqs factors)"
                )))
            }
        }
    }
    if file.tensor("rope_freqs.weight").is_some() {
        let m = file.matrix("rope_freqs.weight")?;
        rope_scaling = Some(RopeScaling::Factors {
            factors: m.to_f32(),
        });
    }
    let config = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: req_u("feed_forward_length")?,
        n_layers: req_u("block_count")?,
        n_heads,
        n_kv_heads: opt_u("attention.head_count_kv")?.unwrap_or(n_heads),
        head_dim,
        rms_norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: match file.get(&key("rope.freq_base")) {
            Some(_) => file.get_f32(&key("rope.freq_base"))? as f64,
            None => 10000.0,
        },
        rope_scaling,
        context_length: opt_u("context_length")?.unwrap_or(2048),
        tie_word_embeddings: file.tensor("output.weight").is_none(),
    };
    config.validate().map_err(LlamaError::Config)?;
    Ok(config)
}

fn gguf_vocab(file: &GgufFile) -> Result<GgufVocab> {
    let opt_id = |k: &str| -> Result<Option<u32>> {
        match file.get(k) {
            None => Ok(None),
            Some(_) => Ok(Some(file.get_u32(k)?)),
        }
    };
    Ok(GgufVocab {
        model: file.get_str("tokenizer.ggml.model")?.to_string(),
        pre: match file.get("tokenizer.ggml.pre") {
            None => None,
            Some(_) => Some(file.get_str("tokenizer.ggml.pre")?.to_string()),
        },
        tokens: file
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(|s| s.to_string())
            .collect(),
        token_types: match file.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => file.get_i32_array("tokenizer.ggml.token_type")?,
        },
        merges: match file.get("tokenizer.ggml.merges") {
            None => Vec::new(),
            Some(_) => file
                .get_str_array("tokenizer.ggml.merges")?
                .into_iter()
                .map(|s| s.to_string())
                .collect(),
        },
        bos_id: opt_id("tokenizer.ggml.bos_token_id")?,
        eos_id: opt_id("tokenizer.ggml.eos_token_id")?,
        add_bos: match file.get("tokenizer.ggml.add_bos_token") {
            None => None,
            Some(_) => Some(file.get_bool("tokenizer.ggml.add_bos_token")?),
        },
        eot_id: opt_id("tokenizer.ggml.eot_token_id")?,
        eom_id: opt_id("tokenizer.ggml.eom_token_id")?,
    })
}

fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let file = GgufFile::open(path)?;
    let config = gguf_config(&file)?;
    let weights = assemble(&config, |hf| {
        let Some(name) = gguf_name(hf) else {
            return Ok(None);
        };
        if file.tensor(&name).is_none() {
            return Ok(None);
        }
        Ok(Some(file.matrix(&name)?))
    })?;
    let tokenizer = TextTokenizer::from_gguf_vocab(&gguf_vocab(&file)?)?;
    check_vocab(&config, &tokenizer)?;
    let chat_template = match file.get("tokenizer.chat_template") {
        None => None,
        Some(_) => Some(file.get_str("tokenizer.chat_template")?.to_string()),
    };
    Ok(LoadedModel {
        path: path.to_path_buf(),
        format: ModelFormat::Gguf,
        config,
        weights,
        tokenizer,
        chat_template,
    })
}

pub(crate) fn check_vocab(config: &LlamaConfig, tokenizer: &TextTokenizer) -> Result<()> {
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(LlamaError::Config(format!(
            "the tokenizer has {} tokens but the embedding only {} rows",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    Ok(())
}

/// The tensors of a set of memory-mapped safetensors files, by name.
pub(crate) struct SafetensorsSet {
    tensors: BTreeMap<String, (Arc<Mmap>, safetensors::tensor::TensorInfo, usize)>,
    /// String metadata (`__metadata__`) of all files, merged.
    pub metadata: BTreeMap<String, String>,
}

impl SafetensorsSet {
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for path in files {
            let file = std::fs::File::open(path).map_err(io_err(path))?;
            // SAFETY: the map is read-only; model files are not expected to change while loaded.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(io_err(path))?);
            let bad = |reason: String| LlamaError::Safetensors {
                file: path.display().to_string(),
                reason,
            };
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..])
                .map_err(|e| bad(e.to_string()))?;
            let data_start = 8 + header_len;
            if let Some(m) = meta.metadata() {
                metadata.extend(m.clone());
            }
            for (name, info) in meta.tensors() {
                let (begin, end) = info.data_offsets;
                if data_start + end > map.len() || begin > end {
                    return Err(bad(format!(
                        "tensor '{name}' lies past the end of the file"
                    )));
                }
                tensors.insert(name, (map.clone(), info.clone(), data_start));
            }
        }
        Ok(SafetensorsSet { tensors, metadata })
    }

    /// A tensor as a matrix; `quantized` names the block format of tensors stored as raw bytes.
    pub fn matrix(&self, name: &str, quantized: Option<DType>) -> Result<Option<WeightMatrix>> {
        use safetensors::Dtype as S;
        let Some((map, info, start)) = self.tensors.get(name) else {
            return Ok(None);
        };
        let (begin, end) = info.data_offsets;
        let bytes = Bytes::mapped(map.clone(), start + begin..start + end);
        let (rows, last) = match info.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            other => {
                return Err(LlamaError::Shape {
                    name: name.into(),
                    found: format!("{other:?}"),
                    expected: "a vector or a matrix".into(),
                })
            }
        };
        let (dtype, cols) = match (info.dtype, quantized) {
            (S::F32, None) => (DType::F32, last),
            (S::F16, None) => (DType::F16, last),
            (S::BF16, None) => (DType::BF16, last),
            (S::U8, Some(q)) => (q, last / q.block_bytes() * q.block_len()),
            (other, _) => {
                return Err(LlamaError::UnsupportedDtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                    supported: "F32, F16, BF16",
                })
            }
        };
        WeightMatrix::new(dtype, rows, cols, bytes)
            .map(Some)
            .map_err(|reason| LlamaError::Shape {
                name: name.into(),
                found: reason,
                expected: format!("{rows} rows of {cols} {dtype} elements"),
            })
    }
}

/// The safetensors files of an HF directory: single file, or shards listed in the index.
fn hf_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LlamaError::Format(format!("{}: {e}", index.display())))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LlamaError::Format(format!("{}: no weight_map", index.display())))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LlamaError::Format(format!(
            "{}: no *.safetensors weights found",
            dir.display()
        )));
    }
    Ok(files)
}

fn load_hf(dir: &Path) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(io_err(&config_path))?;
    let hf: HfConfig = serde_json::from_str(&text)
        .map_err(|e| LlamaError::Config(format!("{}: {e}", config_path.display())))?;
    let config = hf.into_config().map_err(LlamaError::Config)?;
    let set = SafetensorsSet::open(&hf_weight_files(dir)?)?;
    let q_order = hf_to_interleaved_order(config.n_heads, config.head_dim);
    let k_order = hf_to_interleaved_order(config.n_kv_heads, config.head_dim);
    let weights = assemble(&config, |name| {
        let m = set.matrix(name, None)?;
        Ok(match m {
            Some(m) if name.ends_with("q_proj.weight") && m.rows == q_order.len() => {
                Some(m.permute_rows(&q_order))
            }
            Some(m) if name.ends_with("k_proj.weight") && m.rows == k_order.len() => {
                Some(m.permute_rows(&k_order))
            }
            other => other,
        })
    })?;
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    check_vocab(&config, &tokenizer)?;
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        format: ModelFormat::HfSafetensors,
        config,
        weights,
        tokenizer,
        chat_template: hf_chat_template(dir)?,
    })
}

/// The chat template of an HF directory: `chat_template.jinja`, or `chat_template` in
/// `tokenizer_config.json` (a string, or a list of named templates of which "default" is used).
pub(crate) fn hf_chat_template(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return Ok(Some(
            std::fs::read_to_string(&jinja).map_err(io_err(&jinja))?,
        ));
    }
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| LlamaError::Format(format!("{}: {e}", path.display())))?;
    Ok(match json.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or(list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_permutation_inverts_the_hf_conversion() {
        // HF's convert script maps native row 2i+p of a head to row p*half + i.
        let (heads, hd) = (3, 8);
        let order = hf_to_interleaved_order(heads, hd);
        for h in 0..heads {
            for i in 0..hd / 2 {
                for p in 0..2 {
                    assert_eq!(order[h * hd + 2 * i + p], h * hd + p * hd / 2 + i);
                }
            }
        }
    }
}
