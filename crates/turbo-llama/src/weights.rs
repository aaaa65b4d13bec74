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
use std::collections::{BTreeMap, BTreeSet};
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

/// A weight file that is not a regular file: opening a FIFO would block, and a device has
/// nothing to map.
fn not_a_regular_file(path: &Path) -> LlamaError {
    LlamaError::Format(format!(
        "{}: not a regular file (a directory, device or pipe)",
        path.display()
    ))
}

impl LoadedModel {
    /// Loads a GGUF file, a directory holding one, an HF directory, or a native directory.
    pub fn load(path: impl AsRef<Path>) -> Result<LoadedModel> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(io_err(path))?;
        if meta.is_file() {
            return load_gguf(path);
        }
        if !meta.is_dir() {
            // A device or a pipe (`/dev/null`, a FIFO): neither a file to map nor a directory.
            return Err(LlamaError::Format(format!(
                "{}: not a model: expected a .gguf file or a model directory, not a device or pipe",
                path.display()
            )));
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
            [one] if !one.is_file() => Err(not_a_regular_file(one)),
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

/// The transformer blocks a file holds tensors of, by the block numbers in their names
/// (`blk.3.attn_q.weight`, `model.layers.3.mlp.up_proj.weight`).
///
/// A config's layer count is only a number in a file; the blocks present are what the loader
/// reads. Checking one against the other before anything is sized by the count turns a corrupt
/// count (2^31 blocks) into an error in microseconds instead of an allocation of terabytes, and
/// a count smaller than the blocks present into an error instead of a model with layers missing.
pub(crate) struct LayerBlocks {
    /// Where the count came from, for messages: `llama.block_count`, `num_hidden_layers`.
    count_key: &'static str,
    /// The prefix of block tensor names: `blk.` or `model.layers.`.
    prefix: &'static str,
    numbers: BTreeSet<usize>,
}

impl LayerBlocks {
    /// The blocks among `names`: those `prefix` followed by a block number (decimal digits, no
    /// leading zero, as every converter writes them) and a dot.
    pub fn find<'a>(
        count_key: &'static str,
        prefix: &'static str,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let numbers = names
            .into_iter()
            .filter_map(|name| {
                let (number, _) = name.strip_prefix(prefix)?.split_once('.')?;
                let canonical = number.bytes().all(|b| b.is_ascii_digit())
                    && (number == "0" || !number.starts_with('0'));
                canonical.then(|| number.parse().ok()).flatten()
            })
            .collect();
        LayerBlocks {
            count_key,
            prefix,
            numbers,
        }
    }

    /// Checks that the blocks present are exactly `0..n_layers`.
    fn check(&self, n_layers: usize) -> Result<()> {
        let (key, prefix, count) = (self.count_key, self.prefix, self.numbers.len());
        let span = match (self.numbers.first(), self.numbers.last()) {
            (Some(first), Some(last)) => format!(" ({prefix}{first} to {prefix}{last})"),
            _ => String::new(),
        };
        if count != n_layers {
            return Err(LlamaError::Config(format!(
                "{key} is {n_layers}, but the file holds tensors of {count} layers{span}"
            )));
        }
        if self.numbers.last().is_some_and(|&last| last != count - 1) {
            return Err(LlamaError::Config(format!(
                "the file holds tensors of {count} layers{span}, not numbered {prefix}0 to \
                 {prefix}{}",
                count - 1
            )));
        }
        Ok(())
    }
}

/// Assembles weights from a lookup by canonical (HF) tensor name, checking every shape.
///
/// The layer count is checked against the blocks the file holds first: it sizes the layer list.
/// Every other dimension is checked against the shape of a tensor before anything is sized by
/// it, so a config that passed [`LlamaConfig::validate`] but disagrees with the file is an error
/// naming the tensor.
pub(crate) fn assemble(
    config: &LlamaConfig,
    blocks: &LayerBlocks,
    mut get: impl FnMut(&str) -> Result<Option<WeightMatrix>>,
) -> Result<HostWeights> {
    blocks.check(config.n_layers)?;
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
    // Counts are u64 in the file; a value beyond usize cannot be a dimension (validate() bounds
    // the rest).
    let to_usize = |k: &str, n: u64| {
        usize::try_from(n).map_err(|_| {
            LlamaError::Config(format!(
                "{} is {n}, more than this machine can address",
                key(k)
            ))
        })
    };
    let opt_u = |k: &str| -> Result<Option<usize>> {
        match file.get(&key(k)) {
            None => Ok(None),
            Some(_) => Ok(Some(to_usize(k, file.get_u64(&key(k))?)?)),
        }
    };
    let req_u = |k: &str| -> Result<usize> { to_usize(k, file.get_u64(&key(k))?) };
    let hidden = req_u("embedding_length")?;
    let n_heads = req_u("attention.head_count")?;
    let embed = file
        .tensor("token_embd.weight")
        .ok_or_else(|| LlamaError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match opt_u("vocab_size")? {
        Some(v) => v,
        None => to_usize("vocab_size", embed.dims.get(1).copied().unwrap_or(0))?,
    };
    let head_dim = match opt_u("attention.key_length")? {
        Some(h) => h,
        None if n_heads > 0 && hidden.is_multiple_of(n_heads) => hidden / n_heads,
        None => {
            return Err(LlamaError::Config(format!(
                "invalid model config: llama.embedding_length {hidden} is not a multiple of \
                 llama.attention.head_count {n_heads}, and llama.attention.key_length is not given"
            )))
        }
    };
    let mut rope_scaling = None;
    if file.get(&key("rope.scaling.type")).is_some() {
        match file.get_str(&key("rope.scaling.type"))? {
            "none" => {}
            "linear" => {
                rope_scaling = Some(RopeScaling::Linear {
                    factor: file.get_f32(&key("rope.scaling.factor"))? as f64,
                })
            }
            other => {
                return Err(LlamaError::Config(format!(
                    "unsupported rope scaling type '{other}' in llama.rope.scaling.type \
                     (supported: none, linear, or rope_freqs factors)"
                )))
            }
        }
    }
    let mut config = LlamaConfig {
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
    // The numbers alone first: the checks below trust the head dimension.
    config.validate().map_err(LlamaError::Config)?;
    if let Some(v) = opt_u("attention.value_length")? {
        if v != head_dim {
            return Err(LlamaError::Config(format!(
                "value heads of dimension {v} (llama.attention.value_length) differ from key heads \
                 of dimension {head_dim}, which Turbo does not support"
            )));
        }
    }
    if let Some(rot) = opt_u("rope.dimension_count")? {
        if rot != head_dim {
            return Err(LlamaError::Config(format!(
                "partial rotary embeddings (rope dimension {rot} of head dimension {head_dim}) are not supported"
            )));
        }
    }
    if let Some(info) = file.tensor("rope_freqs.weight") {
        // Checked before decoding: the tensor is as large as the file says.
        if info.dims != [head_dim as u64 / 2] {
            return Err(LlamaError::Shape {
                name: info.name.clone(),
                found: format!("{:?}", info.dims),
                expected: format!("[{}] (half the head dimension {head_dim})", head_dim / 2),
            });
        }
        config.rope_scaling = Some(RopeScaling::Factors {
            factors: file.matrix("rope_freqs.weight")?.to_f32(),
        });
        config.validate().map_err(LlamaError::Config)?;
    }
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
    let blocks = LayerBlocks::find(
        "llama.block_count",
        "blk.",
        file.tensors().iter().map(|t| t.name.as_str()),
    );
    let weights = assemble(&config, &blocks, |hf| {
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
    // Ids need not be dense: every id the tokenizer can produce needs an embedding row.
    let specials = tokenizer
        .bos_id()
        .into_iter()
        .chain(tokenizer.eos_ids().iter().copied());
    if let Some(id) = tokenizer.max_token_id().into_iter().chain(specials).max() {
        if id as usize >= config.vocab_size {
            return Err(LlamaError::Config(format!(
                "the tokenizer has a token id {id}, past the embedding's {} rows",
                config.vocab_size
            )));
        }
    }
    Ok(())
}

/// The tensors of a set of memory-mapped safetensors files, by name.
///
/// The `safetensors` crate checks each file's header: tensors laid out one after the other
/// without gaps or overlaps, each as long as its shape and dtype say, together covering the
/// file. Across shards, a name may appear only once.
pub(crate) struct SafetensorsSet {
    tensors: BTreeMap<String, (Arc<Mmap>, safetensors::tensor::TensorInfo, usize)>,
    /// String metadata (`__metadata__`) of all files, merged.
    pub metadata: BTreeMap<String, String>,
}

impl SafetensorsSet {
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        let mut origin: BTreeMap<String, &Path> = BTreeMap::new();
        for path in files {
            if !path.is_file() {
                return Err(not_a_regular_file(path));
            }
            let file = std::fs::File::open(path).map_err(io_err(path))?;
            // SAFETY: the map is read-only; model files are not expected to change while loaded.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(io_err(path))?);
            let bad = |reason: String| LlamaError::Safetensors {
                file: path.display().to_string(),
                reason: first_chars(reason, REASON_CHARS),
            };
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
                    bad(match e {
                        safetensors::SafeTensorError::TensorInvalidInfo => {
                            explain_invalid_info(&map[..]).unwrap_or_else(|| e.to_string())
                        }
                        e => e.to_string(),
                    })
                })?;
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
                if let Some(first) = origin.insert(name.clone(), path) {
                    return Err(bad(format!(
                        "tensor '{name}' is also in {}; which one holds the weights?",
                        first.display()
                    )));
                }
                tensors.insert(name, (map.clone(), info.clone(), data_start));
            }
        }
        Ok(SafetensorsSet { tensors, metadata })
    }

    /// Every tensor's name, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
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
            (S::U8, Some(q)) => {
                if !last.is_multiple_of(q.block_bytes()) {
                    return Err(LlamaError::Shape {
                        name: name.into(),
                        found: format!("rows of {last} bytes"),
                        expected: format!(
                            "rows of whole {q} blocks of {} bytes, as the file's metadata says",
                            q.block_bytes()
                        ),
                    });
                }
                (q, last / q.block_bytes() * q.block_len())
            }
            (other, Some(q)) => {
                return Err(LlamaError::Format(format!(
                    "tensor '{name}' is {q} by the file's metadata, but stored as {other:?} \
                     instead of the U8 bytes of its blocks"
                )))
            }
            (other, None) => {
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

/// Which tensor of a safetensors header is not as long as its shape and dtype say: the
/// `safetensors` crate only says that one is not. `None` if the header cannot be read this way.
fn explain_invalid_info(file: &[u8]) -> Option<String> {
    let len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(file.get(8..8usize.checked_add(len)?)?).ok()?;
    let mut tensors: Vec<(String, safetensors::tensor::TensorInfo)> = header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .filter_map(|(name, v)| Some((name, serde_json::from_value(v).ok()?)))
        .collect();
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    tensors.into_iter().find_map(|(name, info)| {
        let (begin, end) = info.data_offsets;
        let bits = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize(), |n, &d| n.checked_mul(d));
        let held = end.checked_sub(begin);
        (bits.map(|b| b.div_ceil(8)) != held).then(|| {
            let needs = bits.map_or("more than can be addressed".into(), |b| {
                format!("{}", b.div_ceil(8))
            });
            format!(
                "tensor '{name}' holds {} bytes, but shape {:?} of {:?} needs {needs}",
                held.map_or("a negative number of".into(), |n| n.to_string()),
                info.shape,
                info.dtype
            )
        })
    })
}

/// The safetensors files of an HF directory: single file, or shards listed in the index.
fn hf_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = turbo_tokenizer::read_model_text(&index).map_err(io_err(&index))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LlamaError::Format(format!("{}: {e}", index.display())))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LlamaError::Format(format!("{}: no weight_map", index.display())))?;
        // Shards are files beside the index. A name with directories in it (`../x`, `/dev/zero`)
        // would read a file outside the model directory: refused.
        let mut files = Vec::with_capacity(map.len());
        for v in map.values() {
            let name = v.as_str().ok_or_else(|| {
                LlamaError::Format(format!(
                    "{}: weight_map holds {v}, not a file name",
                    index.display()
                ))
            })?;
            let mut parts = Path::new(name).components();
            match (parts.next(), parts.next()) {
                (Some(std::path::Component::Normal(_)), None) => files.push(dir.join(name)),
                _ => {
                    return Err(LlamaError::Format(format!(
                        "{}: weight_map names '{name}', which is not a file in the model directory",
                        index.display()
                    )))
                }
            }
        }
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
    let text = turbo_tokenizer::read_model_text(&config_path).map_err(io_err(&config_path))?;
    let hf: HfConfig = serde_json::from_str(&text)
        .map_err(|e| LlamaError::Config(format!("{}: {e}", config_path.display())))?;
    let config = hf
        .into_config()
        .map_err(|e| LlamaError::Config(format!("{}: {e}", config_path.display())))?;
    let set = SafetensorsSet::open(&hf_weight_files(dir)?)?;
    let blocks = LayerBlocks::find("num_hidden_layers", "model.layers.", set.names());
    let mut weights = assemble(&config, &blocks, |name| set.matrix(name, None))?;
    // Sized by the head counts only now that W_q and W_k are known to have that many rows.
    let q_order = hf_to_interleaved_order(config.n_heads, config.head_dim);
    let k_order = hf_to_interleaved_order(config.n_kv_heads, config.head_dim);
    for layer in &mut weights.layers {
        layer.wq = layer.wq.permute_rows(&q_order);
        layer.wk = layer.wk.permute_rows(&k_order);
    }
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
    if jinja.exists() {
        return Ok(Some(
            turbo_tokenizer::read_model_text(&jinja).map_err(io_err(&jinja))?,
        ));
    }
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = turbo_tokenizer::read_model_text(&path).map_err(io_err(&path))?;
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

/// How much of a parser's message a refusal quotes: serde lists every variant it expected
/// (30 dtypes), which would make the one-line error hundreds of characters long.
const REASON_CHARS: usize = 100;

/// `text` cut to its first `n` characters, marked when cut.
fn first_chars(text: String, n: usize) -> String {
    match text.char_indices().nth(n) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
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
