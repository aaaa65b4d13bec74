//! Writing tiny models as GGUF files and HF directories.
//!
//! Every writer returns the weights the file actually holds, decoded by [`crate::decode`] in f64,
//! which is what the reference forward pass should run on.

use crate::decode::Stored;
use crate::tiny::{RefWeights, TinySpec, TinyWeights, Weights};
use crate::vocab::{tiny_tokenizer, tiny_vocab, BOS_ID, CONTROL_TOKENS, EOS_ID};
use std::collections::HashMap;
use std::path::Path;
use turbo_core::DType;
use turbo_gguf::{GgufWriter, MetaValue};

/// GGUF tensor name of a canonical (HF) name.
pub fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, suffix) = rest.split_once('.').unwrap();
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
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{short}.weight")
}

/// The metadata of a tiny LLaMA GGUF, in the order llama.cpp's converter writes it.
pub fn gguf_metadata(spec: &TinySpec) -> Vec<(String, MetaValue)> {
    let v = tiny_vocab(spec.vocab);
    let u = |n: usize| MetaValue::U32(n as u32);
    let meta: Vec<(&str, MetaValue)> = vec![
        ("general.architecture", "llama".into()),
        ("general.name", "tiny".into()),
        ("llama.context_length", u(spec.context)),
        ("llama.embedding_length", u(spec.hidden)),
        ("llama.block_count", u(spec.layers)),
        ("llama.feed_forward_length", u(spec.ffn)),
        ("llama.attention.head_count", u(spec.heads)),
        ("llama.attention.head_count_kv", u(spec.kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", spec.eps.into()),
        ("llama.rope.freq_base", (spec.rope_theta as f32).into()),
        ("llama.rope.dimension_count", u(spec.head_dim())),
        ("llama.vocab_size", u(spec.vocab)),
        ("tokenizer.ggml.model", v.model.as_str().into()),
        ("tokenizer.ggml.pre", v.pre.as_deref().unwrap().into()),
        ("tokenizer.ggml.tokens", v.tokens.clone().into()),
        ("tokenizer.ggml.token_type", v.token_types.clone().into()),
        ("tokenizer.ggml.merges", v.merges.clone().into()),
        ("tokenizer.ggml.bos_token_id", BOS_ID.into()),
        ("tokenizer.ggml.eos_token_id", EOS_ID.into()),
    ];
    meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// One tensor of a GGUF file: name, ggml dims (`[cols, rows]`, or `[cols]` for vectors), type id
/// and bytes.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
}

/// The tensors of a tiny GGUF: matrices as `dtype`, norms as F32, W_q/W_k in the order given
/// (native weights give llama.cpp's layout). Also returns the stored weights in f64.
pub fn gguf_tensors(
    spec: &TinySpec,
    weights: &TinyWeights,
    dtype: DType,
) -> (Vec<GgufTensor>, RefWeights) {
    let mut tensors = Vec::new();
    let stored = weights.map(spec, |name, rows, cols, values| {
        let is_vector = name.ends_with("norm.weight");
        let t = Stored::encode(
            if is_vector { DType::F32 } else { dtype },
            rows,
            cols,
            values,
        );
        let decoded = t.decode();
        tensors.push(GgufTensor {
            name: gguf_name(name),
            dims: if is_vector {
                vec![cols as u64]
            } else {
                vec![cols as u64, rows as u64]
            },
            ggml_type: t.dtype.ggml_id(),
            data: t.bytes,
        });
        decoded
    });
    (tensors, stored)
}

/// A writer holding `metadata` and `tensors`, for tests that tamper with either first.
pub fn gguf_writer(metadata: &[(String, MetaValue)], tensors: &[GgufTensor]) -> GgufWriter {
    let mut w = GgufWriter::new(3);
    for (k, v) in metadata {
        w.add_meta(k.clone(), v.clone());
    }
    for t in tensors {
        w.add_tensor(t.name.clone(), &t.dims, t.ggml_type, t.data.clone())
            .unwrap_or_else(|e| panic!("tensor {}: {e}", t.name));
    }
    w
}

/// Writes a tiny model as a GGUF file with matrices in `dtype`; returns the stored weights.
pub fn write_gguf(
    path: impl AsRef<Path>,
    spec: &TinySpec,
    weights: &TinyWeights,
    dtype: DType,
) -> RefWeights {
    let (tensors, stored) = gguf_tensors(spec, weights, dtype);
    gguf_writer(&gguf_metadata(spec), &tensors)
        .write(path.as_ref())
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.as_ref().display()));
    stored
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_string_pretty(value).unwrap())
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// HF `config.json` of a tiny model.
pub fn hf_config(spec: &TinySpec, dtype: DType) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim(),
        "rms_norm_eps": spec.eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": spec.tied,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": match dtype {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            other => panic!("HF checkpoints hold plain floats, not {other}"),
        },
    })
}

/// Writes a tiny model as an HF directory (`config.json`, `model.safetensors` with every tensor
/// in `dtype` and W_q/W_k permuted into HF's rotate-half order, `tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`).
///
/// Returns the stored weights in the HF layout: run the reference with
/// [`crate::RopeStyle::RotateHalf`] on them, as transformers does.
pub fn write_hf(
    dir: impl AsRef<Path>,
    spec: &TinySpec,
    weights: &TinyWeights,
    dtype: DType,
) -> RefWeights {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).unwrap();
    let hf: Weights<f32> = weights.native_to_hf(spec);
    let mut stored_tensors = Vec::new();
    let stored = hf.map(spec, |name, rows, cols, values| {
        let t = Stored::encode(dtype, rows, cols, values);
        let decoded = t.decode();
        stored_tensors.push((name.to_string(), t));
        decoded
    });
    let st_dtype = match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        other => panic!("HF checkpoints hold plain floats, not {other}"),
    };
    let views: Vec<(String, safetensors::tensor::TensorView)> = stored_tensors
        .iter()
        .map(|(name, t)| {
            let shape = if name.ends_with("norm.weight") {
                vec![t.cols]
            } else {
                vec![t.rows, t.cols]
            };
            let view = safetensors::tensor::TensorView::new(st_dtype, shape, &t.bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(metadata), &dir.join("model.safetensors")).unwrap();

    write_json(&dir.join("config.json"), &hf_config(spec, dtype));
    tiny_tokenizer(spec.vocab)
        .save(&dir.join("tokenizer.json"))
        .unwrap();
    write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "bos_token": CONTROL_TOKENS[BOS_ID as usize],
            "eos_token": CONTROL_TOKENS[EOS_ID as usize],
            "add_bos_token": false,
            "model_max_length": spec.context,
        }),
    );
    write_json(
        &dir.join("generation_config.json"),
        &serde_json::json!({ "bos_token_id": BOS_ID, "eos_token_id": EOS_ID }),
    );
    stored
}
