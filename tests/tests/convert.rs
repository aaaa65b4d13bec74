//! Conversion to Turbo's native directory (`turbo_llama::native::write`, which `cargo xtask
//! convert` wraps): the converted model must compute bit-identical logits to its source, and carry
//! the same config, tokenizer and chat template.

use std::path::Path;
use turbo_llama::{LoadedModel, ModelFormat};
use turbo_tests::files::{gguf_metadata, gguf_tensors, gguf_writer};
use turbo_tests::{
    cpu_model, engine_logits, random_tokens, write_gguf, write_hf, DType, TinySpec, TinyWeights,
};

/// Converts `source` into `out` and checks the native copy against it.
fn convert_and_compare(source: &Path, out: &Path, spec: &TinySpec) -> (LoadedModel, LoadedModel) {
    let original = LoadedModel::load(source).unwrap();
    turbo_llama::native::write(&original, out).unwrap();
    assert!(out.join(turbo_llama::native::MANIFEST).is_file());
    let native = LoadedModel::load(out).unwrap();
    assert_eq!(native.format, ModelFormat::Native);
    assert_eq!(native.config, original.config);
    assert_eq!(native.tensor_types(), original.tensor_types());
    assert_eq!(native.chat_template, original.chat_template);

    // Weights byte for byte, so the same kernels run on the same data.
    let (a, b) = (&original.weights, &native.weights);
    let same = |x: &turbo_core::WeightMatrix, y: &turbo_core::WeightMatrix, what: &str| {
        assert_eq!(
            (x.dtype, x.rows, x.cols),
            (y.dtype, y.rows, y.cols),
            "{what}"
        );
        assert!(
            x.data.as_slice() == y.data.as_slice(),
            "{what}: bytes differ"
        );
    };
    same(&a.embed, &b.embed, "embed");
    for (i, (la, lb)) in a.layers.iter().zip(&b.layers).enumerate() {
        for (x, y, name) in [
            (&la.wq, &lb.wq, "wq"),
            (&la.wk, &lb.wk, "wk"),
            (&la.wv, &lb.wv, "wv"),
            (&la.wo, &lb.wo, "wo"),
            (&la.w_gate, &lb.w_gate, "w_gate"),
            (&la.w_up, &lb.w_up, "w_up"),
            (&la.w_down, &lb.w_down, "w_down"),
        ] {
            same(x, y, &format!("layer {i} {name}"));
        }
        assert_eq!(la.attn_norm, lb.attn_norm);
        assert_eq!(la.ffn_norm, lb.ffn_norm);
    }
    assert_eq!(a.final_norm, b.final_norm);
    assert_eq!(a.lm_head.is_some(), b.lm_head.is_some());
    if let (Some(x), Some(y)) = (&a.lm_head, &b.lm_head) {
        same(x, y, "lm_head");
    }

    // The tokenizer: same ids, same special tokens.
    let (ta, tb) = (&original.tokenizer, &native.tokenizer);
    assert_eq!(ta.vocab_size(), tb.vocab_size());
    assert_eq!(ta.bos_id(), tb.bos_id());
    assert_eq!(ta.eos_ids(), tb.eos_ids());
    assert_eq!(ta.add_bos(), tb.add_bos());
    for s in [
        "<|im_start|>user\nin the 1234 héllo 🍕<|im_end|>\n",
        "  the  there\tre",
    ] {
        assert_eq!(ta.encode(s).unwrap(), tb.encode(s).unwrap(), "{s:?}");
        assert_eq!(
            ta.encode_with_bos(s).unwrap(),
            tb.encode_with_bos(s).unwrap()
        );
    }

    // Bit-identical logits at every position.
    let tokens = random_tokens(spec, 20, spec.seed + 1);
    let want = engine_logits(&cpu_model(&original), &tokens);
    let got = engine_logits(&cpu_model(&native), &tokens);
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
        let wb: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
        assert!(gb == wb, "position {t}: logits differ");
    }
    (original, native)
}

#[test]
fn hf_to_native_is_bit_identical() {
    for (dtype, tied, heads, kv_heads) in [
        (DType::F32, false, 4, 2),
        (DType::BF16, true, 8, 2),
        (DType::F16, false, 4, 4),
    ] {
        let spec = TinySpec {
            heads,
            kv_heads,
            tied,
            seed: 40 + heads as u64,
            ..TinySpec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (hf, native) = (dir.path().join("hf"), dir.path().join("native"));
        write_hf(&hf, &spec, &TinyWeights::random(&spec), dtype);
        let (original, converted) = convert_and_compare(&hf, &native, &spec);
        assert_eq!(original.format, ModelFormat::HfSafetensors);
        assert_eq!(converted.weights.layers[0].wq.dtype, dtype);
        // The native directory holds W_q/W_k already de-permuted: loading does no re-layout, so
        // the stored bytes are the loaded ones.
        assert!(converted.weights.layers[0].wq.data.is_mapped());
    }
}

#[test]
fn gguf_to_native_is_bit_identical() {
    for (dtype, tied) in [
        (DType::Q4_1, true),
        (DType::F16, false),
        (DType::Q8_0, false),
        (DType::Q4_0, true),
    ] {
        let spec = TinySpec {
            tied,
            seed: 50,
            ..TinySpec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let (gguf, native) = (dir.path().join("tiny.gguf"), dir.path().join("native"));
        write_gguf(&gguf, &spec, &TinyWeights::random(&spec), dtype);
        let (original, converted) = convert_and_compare(&gguf, &native, &spec);
        assert_eq!(original.format, ModelFormat::Gguf);
        // Block-quantized tensors are kept byte for byte, not requantized or expanded.
        assert_eq!(converted.weights.layers[0].w_down.dtype, dtype);
        assert_eq!(converted.weights.embed.dtype, dtype);
    }
}

/// A GGUF chat template survives conversion.
#[test]
fn chat_template_is_kept() {
    let spec = TinySpec::default();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";
    let mut meta = gguf_metadata(&spec);
    meta.push(("tokenizer.chat_template".into(), template.into()));
    let (tensors, _) = gguf_tensors(&spec, &TinyWeights::random(&spec), DType::Q8_0);
    gguf_writer(&meta, &tensors).write(&gguf).unwrap();
    let (_, native) = convert_and_compare(&gguf, &dir.path().join("native"), &spec);
    assert_eq!(native.chat_template.as_deref(), Some(template));
}

/// Converting a native directory again changes nothing.
#[test]
fn native_to_native_round_trips() {
    let spec = TinySpec {
        seed: 60,
        ..TinySpec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    write_hf(&hf, &spec, &TinyWeights::random(&spec), DType::BF16);
    let once = dir.path().join("once");
    convert_and_compare(&hf, &once, &spec);
    convert_and_compare(&once, &dir.path().join("twice"), &spec);
}

/// An HF checkpoint split into shards with a `model.safetensors.index.json`, as large models are
/// published, loads to the same logits as the single-file checkpoint.
#[test]
fn sharded_hf_checkpoints_load_like_single_files() {
    let spec = TinySpec {
        layers: 3,
        seed: 21,
        ..Default::default()
    };
    let weights = TinyWeights::random(&spec);
    let single = tempfile::tempdir().unwrap();
    write_hf(single.path(), &spec, &weights, DType::BF16);

    // Re-split model.safetensors: each layer's tensors go to a shard of their own.
    let sharded = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(single.path().join(f), sharded.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(single.path().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let shard_of = |name: &str| -> String {
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .map_or(0, |l| l.parse::<usize>().unwrap() + 1);
        format!(
            "model-{:05}-of-{:05}.safetensors",
            layer + 1,
            spec.layers + 1
        )
    };
    let mut shards: std::collections::BTreeMap<
        String,
        Vec<(String, safetensors::tensor::TensorView)>,
    > = Default::default();
    let mut weight_map = serde_json::Map::new();
    for (name, view) in file.tensors() {
        let shard = shard_of(&name);
        weight_map.insert(name.clone(), serde_json::Value::String(shard.clone()));
        shards.entry(shard).or_default().push((name, view));
    }
    assert!(shards.len() > 1);
    for (shard, views) in shards {
        safetensors::serialize_to_file(views, None, &sharded.path().join(shard)).unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();

    let tokens = random_tokens(&spec, 20, 5);
    let a = engine_logits(
        &cpu_model(&LoadedModel::load(single.path()).unwrap()),
        &tokens,
    );
    let b = engine_logits(
        &cpu_model(&LoadedModel::load(sharded.path()).unwrap()),
        &tokens,
    );
    assert_eq!(a, b);
}
