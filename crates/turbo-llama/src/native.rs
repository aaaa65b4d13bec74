//! Turbo's native model directory: what `cargo xtask convert` writes and the engine loads without
//! any re-layout.
//!
//! - `turbo.json`: format version, [`LlamaConfig`], the W_q/W_k layout (`interleaved`), chat template.
//! - `model.safetensors`: HF tensor names, already in the native layout. Plain floats keep their
//!   type; GGUF block-quantized tensors are stored byte for byte as `U8 [rows, row_bytes]`, with
//!   their block format in the file's metadata under the tensor's name.
//! - `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`: the tokenizer in HF form.

use crate::config::LlamaConfig;
use crate::error::{io_err, LlamaError, Result};
use crate::weights::{
    assemble, check_vocab, LayerBlocks, LoadedModel, ModelFormat, SafetensorsSet,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use turbo_core::{DType, WeightMatrix};
use turbo_tokenizer::tokenizer::TextTokenizer;

pub const MANIFEST: &str = "turbo.json";
const FORMAT: &str = "turbo-native";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    /// Always "interleaved": RoPE pairs are adjacent rows of W_q and W_k.
    qk_layout: String,
    config: LlamaConfig,
    chat_template: Option<String>,
}

pub(crate) fn load(dir: &Path) -> Result<LoadedModel> {
    let path = dir.join(MANIFEST);
    let text = turbo_tokenizer::read_model_text(&path).map_err(io_err(&path))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| LlamaError::Format(format!("{}: {e}", path.display())))?;
    if manifest.format != FORMAT
        || manifest.version != VERSION
        || manifest.qk_layout != "interleaved"
    {
        return Err(LlamaError::Format(format!(
            "{}: unsupported native format {} v{} ({} layout); this build reads {FORMAT} v{VERSION}",
            path.display(),
            manifest.format,
            manifest.version,
            manifest.qk_layout
        )));
    }
    let config = manifest.config;
    config.validate().map_err(LlamaError::Config)?;
    let set = SafetensorsSet::open(&[dir.join("model.safetensors")])?;
    let blocks = LayerBlocks::find("n_layers (turbo.json)", "model.layers.", set.names());
    let weights = assemble(&config, &blocks, |name| {
        let quantized = match set.metadata.get(name) {
            None => None,
            Some(t) => Some(t.parse::<DType>().map_err(|e| {
                LlamaError::Format(format!("tensor '{name}': {e} in the file's metadata"))
            })?),
        };
        set.matrix(name, quantized)
    })?;
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    check_vocab(&config, &tokenizer)?;
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        format: ModelFormat::Native,
        config,
        weights,
        tokenizer,
        chat_template: manifest.chat_template,
    })
}

/// Writes `model` as a native directory at `out` (created if needed).
pub fn write(model: &LoadedModel, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let w = &model.weights;
    let mut entries: Vec<(String, WeightMatrix)> =
        vec![("model.embed_tokens.weight".into(), w.embed.clone())];
    let vector = |v: &[f32]| WeightMatrix::from_f32(1, v.len(), v);
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}.");
        for (suffix, m) in [
            ("self_attn.q_proj.weight", l.wq.clone()),
            ("self_attn.k_proj.weight", l.wk.clone()),
            ("self_attn.v_proj.weight", l.wv.clone()),
            ("self_attn.o_proj.weight", l.wo.clone()),
            ("mlp.gate_proj.weight", l.w_gate.clone()),
            ("mlp.up_proj.weight", l.w_up.clone()),
            ("mlp.down_proj.weight", l.w_down.clone()),
            ("input_layernorm.weight", vector(&l.attn_norm)),
            ("post_attention_layernorm.weight", vector(&l.ffn_norm)),
        ] {
            entries.push((format!("{p}{suffix}"), m));
        }
    }
    entries.push(("model.norm.weight".into(), vector(&w.final_norm)));
    if let Some(head) = &w.lm_head {
        entries.push(("lm_head.weight".into(), head.clone()));
    }

    let mut metadata = HashMap::new();
    let mut views = Vec::with_capacity(entries.len());
    for (name, m) in &entries {
        let is_vector = name.ends_with("norm.weight");
        let (dtype, shape) = match m.dtype {
            DType::F32 => (safetensors::Dtype::F32, vec![m.rows, m.cols]),
            DType::F16 => (safetensors::Dtype::F16, vec![m.rows, m.cols]),
            DType::BF16 => (safetensors::Dtype::BF16, vec![m.rows, m.cols]),
            q => {
                metadata.insert(name.clone(), q.name().to_string());
                (safetensors::Dtype::U8, vec![m.rows, m.row_bytes()])
            }
        };
        let shape = if is_vector { vec![m.cols] } else { shape };
        let view = safetensors::tensor::TensorView::new(dtype, shape, m.data.as_slice())
            .map_err(|e| LlamaError::Format(format!("tensor '{name}': {e}")))?;
        views.push((name.clone(), view));
    }
    let st_path = out.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(metadata), &st_path).map_err(|e| {
        LlamaError::Safetensors {
            file: st_path.display().to_string(),
            reason: e.to_string(),
        }
    })?;

    write_tokenizer(&model.tokenizer, out)?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        qk_layout: "interleaved".into(),
        config: model.config.clone(),
        chat_template: model.chat_template.clone(),
    };
    write_json(
        &out.join(MANIFEST),
        &serde_json::to_value(&manifest).map_err(|e| LlamaError::Format(e.to_string()))?,
    )
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| LlamaError::Format(e.to_string()))?;
    std::fs::write(path, text).map_err(io_err(path))
}

/// The tokenizer in HF form, with its BOS/EOS choices, so `from_hf_dir` restores it exactly.
fn write_tokenizer(tok: &TextTokenizer, out: &Path) -> Result<()> {
    tok.save(&out.join("tokenizer.json"))?;
    let name = |id: u32| tok.id_to_token(id);
    let config = serde_json::json!({
        "bos_token": tok.bos_id().and_then(name),
        "eos_token": tok.eos_ids().first().copied().and_then(name),
        "add_bos_token": tok.add_bos(),
    });
    write_json(&out.join("tokenizer_config.json"), &config)?;
    write_json(
        &out.join("generation_config.json"),
        &serde_json::json!({ "eos_token_id": tok.eos_ids() }),
    )
}
