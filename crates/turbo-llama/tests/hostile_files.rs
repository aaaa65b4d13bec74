//! Model files whose numbers lie: each must fail at load with an error naming the value and the
//! limit, quickly and without sizing anything by the lie.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use turbo_gguf::{GgufWriter, MetaValue};
use turbo_llama::{LlamaError, LoadedModel};
use turbo_tokenizer::tokenizer::{GgufVocab, TextTokenizer};

/// A tiny model: 2 layers, hidden 32, 4 heads of 8 over 2 KV heads, FFN 48, vocabulary 300.
const LAYERS: usize = 2;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 48;
const VOCAB: usize = 300;

/// Every tensor as `(HF name, rows, cols)`; vectors have one row.
fn shapes() -> Vec<(String, usize, usize)> {
    let mut out = vec![("model.embed_tokens.weight".to_string(), VOCAB, HIDDEN)];
    for i in 0..LAYERS {
        for (suffix, rows, cols) in [
            ("input_layernorm.weight", 1, HIDDEN),
            ("self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN),
            ("self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN),
            ("self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN),
            ("self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM),
            ("post_attention_layernorm.weight", 1, HIDDEN),
            ("mlp.gate_proj.weight", FFN, HIDDEN),
            ("mlp.up_proj.weight", FFN, HIDDEN),
            ("mlp.down_proj.weight", HIDDEN, FFN),
        ] {
            out.push((format!("model.layers.{i}.{suffix}"), rows, cols));
        }
    }
    out.push(("model.norm.weight".to_string(), 1, HIDDEN));
    out.push(("lm_head.weight".to_string(), VOCAB, HIDDEN));
    out
}

fn f32_bytes(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes())
        .collect()
}

/// A byte-level BPE vocabulary: an end token, the 256 bytes, two merges, unused padding.
fn vocab() -> GgufVocab {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut tokens = vec!["<|end|>".to_string()];
    let mut types = vec![3];
    let mut next = 256;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        tokens.push(char::from_u32(c).unwrap().to_string());
        types.push(1);
    }
    let merges = ["h e", "l l"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    while tokens.len() < VOCAB {
        tokens.push(format!("<unused_{}>", tokens.len()));
        types.push(5);
    }
    GgufVocab {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens,
        token_types: types,
        merges: merges.iter().map(|s| s.to_string()).collect(),
        eos_id: Some(0),
        ..GgufVocab::default()
    }
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let (layer, suffix) = hf
        .strip_prefix("model.layers.")
        .unwrap()
        .split_once('.')
        .unwrap();
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

/// The tiny model's GGUF metadata, in the order llama.cpp writes it.
fn gguf_metadata() -> Vec<(String, MetaValue)> {
    let v = vocab();
    let u = |n: usize| MetaValue::U32(n as u32);
    let meta: Vec<(&str, MetaValue)> = vec![
        ("general.architecture", "llama".into()),
        ("llama.context_length", u(128)),
        ("llama.embedding_length", u(HIDDEN)),
        ("llama.block_count", u(LAYERS)),
        ("llama.feed_forward_length", u(FFN)),
        ("llama.attention.head_count", u(HEADS)),
        ("llama.attention.head_count_kv", u(KV_HEADS)),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5f32.into()),
        ("llama.rope.freq_base", 10000f32.into()),
        ("llama.rope.dimension_count", u(HEAD_DIM)),
        ("llama.vocab_size", u(VOCAB)),
        ("tokenizer.ggml.model", v.model.as_str().into()),
        ("tokenizer.ggml.pre", v.pre.as_deref().unwrap().into()),
        ("tokenizer.ggml.tokens", v.tokens.clone().into()),
        ("tokenizer.ggml.token_type", v.token_types.clone().into()),
        ("tokenizer.ggml.merges", v.merges.clone().into()),
        ("tokenizer.ggml.eos_token_id", 0u32.into()),
    ];
    meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// A GGUF tensor: name, ggml dims, type id, bytes.
type Tensor = (String, Vec<u64>, u32, Vec<u8>);

fn gguf_tensors() -> Vec<Tensor> {
    shapes()
        .into_iter()
        .map(|(name, rows, cols)| {
            let dims = match rows {
                1 => vec![cols as u64],
                _ => vec![cols as u64, rows as u64],
            };
            (gguf_name(&name), dims, 0, f32_bytes(rows * cols))
        })
        .collect()
}

/// Writes the tiny GGUF after `edit` has tampered with its metadata and tensors.
fn gguf(dir: &Path, edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<Tensor>)) -> PathBuf {
    let (mut meta, mut tensors) = (gguf_metadata(), gguf_tensors());
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new(3);
    for (k, v) in meta {
        w.add_meta(k, v);
    }
    for (name, dims, ty, data) in tensors {
        w.add_tensor(name, &dims, ty, data).unwrap();
    }
    let path = dir.join("model.gguf");
    w.write(&path).unwrap();
    path
}

/// Replaces (or adds) one metadata value.
fn set(meta: &mut Vec<(String, MetaValue)>, key: &str, value: impl Into<MetaValue>) {
    let value = value.into();
    match meta.iter_mut().find(|(k, _)| k == key) {
        Some((_, v)) => *v = value,
        None => meta.push((key.to_string(), value)),
    }
}

fn unset(meta: &mut Vec<(String, MetaValue)>, key: &str) {
    meta.retain(|(k, _)| k != key);
}

/// Loads `path`, which must fail fast; returns the error.
fn load_err(path: &Path) -> LlamaError {
    let start = Instant::now();
    let result = LoadedModel::load(path);
    let elapsed = start.elapsed();
    assert!(
        elapsed < Duration::from_secs(2),
        "failing took {elapsed:?}: was something sized by the bad value?"
    );
    match result {
        Ok(m) => panic!("{} loaded: {:?}", path.display(), m.config),
        Err(e) => e,
    }
}

/// The message of a config error (the only kind these tests expect unless they say).
fn config_err(path: &Path) -> String {
    match load_err(path) {
        LlamaError::Config(msg) => msg,
        other => panic!("expected a config error, got {other:?}: {other}"),
    }
}

/// Whether a terminal would act on something in `s` rather than print it.
fn has_control(s: &str) -> bool {
    s.chars().any(char::is_control)
}

#[test]
fn the_untampered_files_load() {
    let dir = tempfile::tempdir().unwrap();
    let m = LoadedModel::load(gguf(dir.path(), |_, _| {})).unwrap();
    assert_eq!((m.config.n_layers, m.config.vocab_size), (LAYERS, VOCAB));
    let m = LoadedModel::load(hf(dir.path(), |_| {}, |_| {})).unwrap();
    assert_eq!(m.config.n_layers, LAYERS);
    // A long context is no reason to refuse a model.
    let m = LoadedModel::load(gguf(dir.path(), |meta, _| {
        set(meta, "llama.context_length", 1u32 << 20)
    }))
    .unwrap();
    assert_eq!(m.config.context_length, 1 << 20);
}

#[test]
fn gguf_layer_count_must_match_the_blocks_present() {
    let dir = tempfile::tempdir().unwrap();
    let count = |n: u64| gguf(dir.path(), |meta, _| set(meta, "llama.block_count", n));
    assert_eq!(
        config_err(&count(1 << 31)),
        "invalid model config: the number of layers 2147483648 is more than the limit 2147483647"
    );
    assert_eq!(
        config_err(&count((1 << 31) - 1)),
        "llama.block_count is 2147483647, but the file holds tensors of 2 layers (blk.0 to blk.1)"
    );
    assert_eq!(
        config_err(&count(1)),
        "llama.block_count is 1, but the file holds tensors of 2 layers (blk.0 to blk.1)"
    );
    assert_eq!(
        config_err(&count(1 << 40)),
        "invalid model config: the number of layers 1099511627776 is more than the limit 2147483647"
    );
    assert!(config_err(&count(0)).contains("the number of layers is 0"));
    // Blocks 0 and 2: two blocks, but not the first two.
    let path = gguf(dir.path(), |_, tensors| {
        for t in tensors.iter_mut() {
            t.0 = t.0.replace("blk.1.", "blk.2.");
        }
    });
    assert_eq!(
        config_err(&path),
        "the file holds tensors of 2 layers (blk.0 to blk.2), not numbered blk.0 to blk.1"
    );
}

#[test]
fn gguf_dimensions_must_match_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let with = |key: &str, n: u64| gguf(dir.path(), |meta, _| set(meta, key, n));
    for key in [
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.vocab_size",
    ] {
        let msg = config_err(&with(key, 1 << 32));
        assert!(msg.contains("is more than the limit"), "{key}: {msg}");
    }
    // Within the limits but not what the tensors hold: the tensor says so.
    let shape_err = |path: &Path| match load_err(path) {
        LlamaError::Shape { name, .. } => name,
        other => panic!("expected a shape error, got {other}"),
    };
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "llama.embedding_length", 1u32 << 20);
        unset(meta, "llama.rope.dimension_count");
    });
    assert_eq!(shape_err(&path), "model.embed_tokens.weight");
    // With the rope dimension given, that disagrees first.
    let msg = config_err(&with("llama.embedding_length", 1 << 20));
    assert!(
        msg.contains("rope dimension 8 of head dimension 262144"),
        "{msg}"
    );
    assert_eq!(
        shape_err(&with("llama.vocab_size", 1 << 30)),
        "model.embed_tokens.weight"
    );
    assert_eq!(
        shape_err(&with("llama.feed_forward_length", 1 << 29)),
        "model.layers.0.mlp.gate_proj.weight"
    );
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "llama.attention.head_count", 2u32);
        set(meta, "llama.attention.head_count_kv", 2u32);
        set(meta, "llama.rope.dimension_count", 16u32);
    });
    assert_eq!(shape_err(&path), "model.layers.0.self_attn.k_proj.weight");
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "llama.attention.key_length", 1u32 << 20)
    });
    let msg = load_err(&path).to_string();
    assert!(msg.contains("partial rotary"), "{msg}");

    assert!(config_err(&with("llama.attention.head_count", 0))
        .contains("llama.embedding_length 32 is not a multiple of llama.attention.head_count 0"));
    assert!(config_err(&with("llama.attention.head_count", 5)).contains("not a multiple"));
    assert_eq!(
        config_err(&with("llama.attention.head_count_kv", 3)),
        "invalid model config: 4 attention heads are not a multiple of 3 KV heads"
    );
    assert_eq!(
        config_err(&with("llama.context_length", 0)),
        "invalid model config: the context length is 0; it must be positive"
    );
    assert_eq!(
        config_err(&with("llama.context_length", 1 << 32)),
        "invalid model config: the context length 4294967296 is more than the limit 4294967295 \
         (token positions are 32-bit)"
    );
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "llama.attention.value_length", 4u32)
    });
    assert!(config_err(&path).contains("value heads of dimension 4"));
}

#[test]
fn gguf_hyper_parameters_must_make_sense() {
    let dir = tempfile::tempdir().unwrap();
    let with = |key: &str, v: MetaValue| gguf(dir.path(), |meta, _| set(meta, key, v));
    for (theta, shown) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (0.0, "0"),
        (-1.0, "-1"),
    ] {
        assert_eq!(
            config_err(&with("llama.rope.freq_base", theta.into())),
            format!(
                "invalid model config: the RoPE theta is {shown}; it must be positive and finite"
            )
        );
        let msg = config_err(&with(
            "llama.attention.layer_norm_rms_epsilon",
            theta.into(),
        ));
        assert!(
            msg.contains(&format!("the RMS norm epsilon is {shown}")),
            "{msg}"
        );
    }
    let scaled = |kind: MetaValue, factor: f32| {
        gguf(dir.path(), |meta, _| {
            set(meta, "llama.rope.scaling.type", kind);
            set(meta, "llama.rope.scaling.factor", factor);
        })
    };
    assert_eq!(
        config_err(&scaled("linear".into(), 0.0)),
        "invalid model config: the linear RoPE scaling factor is 0; it must be positive and finite"
    );
    assert!(config_err(&scaled("linear".into(), f32::NAN)).contains("factor is NaN"));
    assert_eq!(
        config_err(&scaled("yarn".into(), 4.0)),
        "unsupported rope scaling type 'yarn' in llama.rope.scaling.type (supported: none, \
         linear, or rope_freqs factors)"
    );
    assert!(matches!(
        load_err(&scaled(2u32.into(), 4.0)),
        LlamaError::Gguf(turbo_gguf::GgufError::WrongType { .. })
    ));
    LoadedModel::load(scaled("linear".into(), 4.0)).unwrap();

    // Per-frequency factors: one per rotated pair, each positive.
    let freqs = |values: &[f32]| {
        let values = values.to_vec();
        gguf(dir.path(), move |_, tensors| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((
                "rope_freqs.weight".into(),
                vec![values.len() as u64],
                0,
                bytes,
            ));
        })
    };
    LoadedModel::load(freqs(&[1.0, 2.0, 4.0, 8.0])).unwrap();
    match load_err(&freqs(&[1.0; 5])) {
        LlamaError::Shape { name, found, .. } => {
            assert_eq!(
                (name.as_str(), found.as_str()),
                ("rope_freqs.weight", "[5]")
            )
        }
        other => panic!("{other}"),
    }
    assert_eq!(
        config_err(&freqs(&[1.0, 0.0, 4.0, 8.0])),
        "invalid model config: RoPE frequency factor #1 is 0; it must be positive and finite"
    );
}

#[test]
fn gguf_bpe_vocabulary_needs_its_merges() {
    let dir = tempfile::tempdir().unwrap();
    for path in [
        gguf(dir.path(), |meta, _| unset(meta, "tokenizer.ggml.merges")),
        gguf(dir.path(), |meta, _| {
            set(meta, "tokenizer.ggml.merges", Vec::<String>::new())
        }),
    ] {
        match load_err(&path) {
            LlamaError::Tokenizer(e) => assert!(
                e.to_string()
                    .contains("tokenizer.ggml.merges is missing or empty"),
                "{e}"
            ),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn gguf_strings_are_escaped_in_messages() {
    let dir = tempfile::tempdir().unwrap();
    let evil = "llama\u{1b}[2J\r\u{7}";
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "general.architecture", evil)
    });
    let msg = load_err(&path).to_string();
    assert!(!has_control(&msg), "{msg:?}");
    assert!(msg.contains(r"'llama\u{1b}[2J\r\u{7}'"), "{msg}");
    let path = gguf(dir.path(), |meta, _| set(meta, "tokenizer.ggml.pre", evil));
    let msg = load_err(&path).to_string();
    assert!(!has_control(&msg) && msg.contains(r"\u{1b}"), "{msg:?}");
    let path = gguf(dir.path(), |meta, _| {
        set(meta, "llama.rope.scaling.type", evil)
    });
    let msg = load_err(&path).to_string();
    assert!(!has_control(&msg) && msg.contains(r"\u{1b}"), "{msg:?}");
}

/// Writes the tiny model as an HF directory (F32 safetensors, W_q/W_k order irrelevant here),
/// after `edit_config` and `edit_tensors` have tampered with it.
fn hf(
    root: &Path,
    edit_config: impl FnOnce(&mut serde_json::Value),
    edit_tensors: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let dir = root.join("hf");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "max_position_embeddings": 128,
        "tie_word_embeddings": false,
    });
    edit_config(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<_> = shapes()
        .into_iter()
        .map(|(name, rows, cols)| {
            let shape = if rows == 1 {
                vec![cols]
            } else {
                vec![rows, cols]
            };
            (name, safetensors::Dtype::F32, shape, f32_bytes(rows * cols))
        })
        .collect();
    edit_tensors(&mut tensors);
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    TextTokenizer::from_gguf_vocab(&vocab())
        .unwrap()
        .save(&dir.join("tokenizer.json"))
        .unwrap();
    dir
}

fn write_safetensors(path: &Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<_> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn hf_sizes_are_checked_before_anything_is_sized_by_them() {
    let dir = tempfile::tempdir().unwrap();
    let with = |key: &str, n: u64| hf(dir.path(), |c| c[key] = n.into(), |_| {});
    for (key, n) in [
        ("num_hidden_layers", 1u64 << 62),
        ("num_hidden_layers", 1 << 32),
        ("hidden_size", 1 << 62),
        ("hidden_size", 1 << 32),
    ] {
        let msg = config_err(&with(key, n));
        assert!(
            msg.contains("is more than the limit 2147483647"),
            "{key} {n}: {msg}"
        );
        assert!(msg.contains(&n.to_string()), "{msg}");
    }
    let msg = config_err(&with("num_hidden_layers", (1 << 31) - 1));
    assert!(
        msg.ends_with(
            "num_hidden_layers is 2147483647, but the file holds tensors of 2 layers \
             (model.layers.0 to model.layers.1)"
        ),
        "{msg}"
    );
    // A hidden size whose heads pass every check but the tensors'.
    match load_err(&with("hidden_size", 1 << 28)) {
        LlamaError::Shape { name, .. } => assert_eq!(name, "model.embed_tokens.weight"),
        other => panic!("{other}"),
    }
    let msg = config_err(&with("max_position_embeddings", 0));
    assert!(
        msg.ends_with("the context length is 0; it must be positive"),
        "{msg}"
    );
    let msg = config_err(&hf(
        dir.path(),
        |c| c["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
        |_| {},
    ));
    assert!(
        msg.ends_with(
            "unsupported rope scaling type 'dynamic' in rope_scaling (supported: default, \
             linear, llama3)"
        ),
        "{msg}"
    );
}

#[test]
fn hf_tensors_must_be_what_their_names_say() {
    let dir = tempfile::tempdir().unwrap();
    let q = "model.layers.1.self_attn.q_proj.weight";
    let retype = |dtype: safetensors::Dtype, shape: Vec<usize>| {
        hf(
            dir.path(),
            |_| {},
            move |tensors| {
                let t = tensors.iter_mut().find(|t| t.0 == q).unwrap();
                let bits = shape.iter().product::<usize>() * dtype.bitsize();
                (t.1, t.2, t.3) = (dtype, shape, vec![0; bits / 8]);
            },
        )
    };
    match load_err(&retype(safetensors::Dtype::I32, vec![HIDDEN, HIDDEN])) {
        LlamaError::UnsupportedDtype { name, dtype, .. } => {
            assert_eq!((name.as_str(), dtype.as_str()), (q, "I32"))
        }
        other => panic!("{other}"),
    }
    match load_err(&retype(safetensors::Dtype::F32, vec![HIDDEN, HIDDEN + 2])) {
        LlamaError::Shape {
            name,
            found,
            expected,
        } => assert_eq!(
            (name.as_str(), found.as_str(), expected.as_str()),
            (q, "[32, 34]", "[32, 32]")
        ),
        other => panic!("{other}"),
    }
    match load_err(&retype(
        safetensors::Dtype::F32,
        vec![2, HIDDEN, HIDDEN / 2],
    )) {
        LlamaError::Shape { name, .. } => assert_eq!(name, q),
        other => panic!("{other}"),
    }
    // A tensor missing altogether, and one extra layer's worth.
    let path = hf(dir.path(), |_| {}, |t| t.retain(|t| t.0 != q));
    assert!(matches!(load_err(&path), LlamaError::MissingTensor(n) if n == q));
    let path = hf(
        dir.path(),
        |_| {},
        |t| {
            let extra = t.iter().find(|t| t.0 == q).unwrap().clone();
            t.push((extra.0.replace(".1.", ".2."), extra.1, extra.2, extra.3));
        },
    );
    assert!(config_err(&path).ends_with("num_hidden_layers is 2, but the file holds tensors of 3 layers (model.layers.0 to model.layers.2)"));
}

#[test]
fn hf_safetensors_headers_that_lie_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = hf(dir.path(), |_| {}, |_| {});
    let file = path.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    // Claim a shape twice as large for the first [vocab, hidden] tensor in the header (the
    // embedding or the LM head), keeping the header's length (digits for digits).
    let old = format!("\"shape\":[{VOCAB},{HIDDEN}]");
    assert!(header.contains(&old), "{header}");
    let header = header.replacen(&old, &format!("\"shape\":[{VOCAB},{}]", HIDDEN * 2), 1);
    assert_eq!(header.len(), n);
    let mut tampered = bytes[..8].to_vec();
    tampered.extend(header.as_bytes());
    tampered.extend(&bytes[8 + n..]);
    std::fs::write(&file, tampered).unwrap();
    match load_err(&path) {
        LlamaError::Safetensors { reason, .. } => {
            let named = ["lm_head.weight", "model.embed_tokens.weight"]
                .iter()
                .any(|name| reason.starts_with(&format!("tensor '{name}' ")));
            assert!(
                named
                    && reason
                        .ends_with("holds 38400 bytes, but shape [300, 64] of F32 needs 76800"),
                "{reason}"
            )
        }
        other => panic!("{other}"),
    }
}

#[test]
fn hf_shards_stay_in_the_model_directory_and_do_not_repeat() {
    let dir = tempfile::tempdir().unwrap();
    let path = hf(dir.path(), |_| {}, |_| {});
    std::fs::rename(path.join("model.safetensors"), path.join("a.safetensors")).unwrap();
    let index = |files: &[&str]| {
        let map: serde_json::Map<String, serde_json::Value> = files
            .iter()
            .enumerate()
            .map(|(i, f)| (format!("t{i}"), (*f).into()))
            .collect();
        std::fs::write(
            path.join("model.safetensors.index.json"),
            serde_json::json!({ "weight_map": map }).to_string(),
        )
        .unwrap();
    };
    for evil in ["../a.safetensors", "/dev/zero", "sub/a.safetensors", ".."] {
        index(&["a.safetensors", evil]);
        match load_err(&path) {
            LlamaError::Format(msg) => {
                assert!(msg.contains(&format!("weight_map names '{evil}'")), "{msg}")
            }
            other => panic!("{evil}: {other}"),
        }
    }
    std::fs::copy(path.join("a.safetensors"), path.join("b.safetensors")).unwrap();
    index(&["a.safetensors", "b.safetensors"]);
    match load_err(&path) {
        LlamaError::Safetensors { reason, .. } => {
            assert!(
                reason.contains("is also in") && reason.contains("a.safetensors"),
                "{reason}"
            )
        }
        other => panic!("{other}"),
    }
    index(&["a.safetensors"]);
    LoadedModel::load(&path).unwrap();
}

#[test]
fn native_layer_count_must_match_the_blocks_present() {
    let dir = tempfile::tempdir().unwrap();
    let model = LoadedModel::load(gguf(dir.path(), |_, _| {})).unwrap();
    let native = dir.path().join("native");
    turbo_llama::native::write(&model, &native).unwrap();
    LoadedModel::load(&native).unwrap();
    let manifest = native.join(turbo_llama::native::MANIFEST);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    json["config"]["n_layers"] = ((1u64 << 31) - 1).into();
    std::fs::write(&manifest, json.to_string()).unwrap();
    assert_eq!(
        config_err(&native),
        "n_layers (turbo.json) is 2147483647, but the file holds tensors of 2 layers \
         (model.layers.0 to model.layers.1)"
    );
    json["config"]["n_layers"] = 2.into();
    json["config"]["rms_norm_eps"] = 0.0.into();
    std::fs::write(&manifest, json.to_string()).unwrap();
    assert!(config_err(&native).contains("the RMS norm epsilon is 0"));
}

/// A model directory's files that are not regular files (a device that never ends, a pipe that
/// would block the open) are refused by name before anything is read from them.
#[cfg(unix)]
#[test]
fn special_files_in_a_model_directory_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |path: &Path, name: &str| {
        let msg = load_err(path).to_string();
        assert!(
            msg.contains(name) && msg.contains("not a regular file"),
            "{name}: {msg}"
        );
    };
    for name in [
        "tokenizer_config.json",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ] {
        let model = hf(dir.path(), |_| {}, |_| {});
        let _ = std::fs::remove_file(model.join(name));
        std::os::unix::fs::symlink("/dev/zero", model.join(name)).unwrap();
        refused(&model, name);
    }
    let model = hf(dir.path(), |_| {}, |_| {});
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    mkfifo(&model.join("model.safetensors"));
    refused(&model, "model.safetensors");
    let only = dir.path().join("only");
    std::fs::create_dir(&only).unwrap();
    mkfifo(&only.join("a.gguf"));
    refused(&only, "a.gguf");
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}
