//! The HF model target: a model directory (`config.json`, `model.safetensors` or shards with
//! their index, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
//! `chat_template.jinja`) through [`turbo_llama::LoadedModel::load`], then onto the CPU for a
//! forward pass.
//!
//! An input is a [`FileSet`]: the directory's files packed into one byte string, so that a case
//! is one file to keep and libFuzzer has one buffer to mutate. The structured mutator edits
//! `config.json` value by value (extreme numbers, wrong types, missing keys, RoPE scaling
//! objects), safetensors headers tensor by tensor (shapes, dtypes, offsets that overlap, reverse
//! or run past the end, names, the header's length), the tokenizer files and the directory's
//! make-up, and sometimes flips or cuts bytes.

use crate::json::{
    at_mut, extreme_number, extreme_value, mutate_text, mutate_value, rope_object, set as set_at,
    to_text,
};
use crate::model::{check_loaded, check_message};
use crate::mutate::interesting_u64;
use crate::rng::Rng;
use crate::scratch::CaseDir;
use crate::seeds::tiny_spec;
use serde_json::{json, Map, Value};
use std::sync::OnceLock;
use turbo_core::DType;
use turbo_llama::LoadedModel;

/// The files an input may hold, by index: an input names files by number, never by path, so
/// that nothing it says is written outside the case's directory.
pub const FILE_NAMES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "chat_template.jinja",
];

const CONFIG: usize = 0;
const WEIGHTS: usize = 1;
const TOKENIZER: usize = 2;
const TOKENIZER_CONFIG: usize = 3;
const GENERATION_CONFIG: usize = 4;
const INDEX: usize = 5;
const SHARD_1: usize = 6;
const SHARD_2: usize = 7;
const JINJA: usize = 8;

/// A model directory's files, by index into [`FILE_NAMES`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSet {
    files: Vec<(usize, Vec<u8>)>,
}

impl FileSet {
    /// Unpacks an input: entries of a file index (one byte), a length (u32, little-endian) and
    /// the bytes. Anything goes: indices wrap, lengths are cut to what is left, a later file
    /// replaces an earlier one of the same name.
    pub fn decode(mut data: &[u8]) -> FileSet {
        let mut set = FileSet::default();
        while data.len() >= 5 {
            let index = usize::from(data[0]) % FILE_NAMES.len();
            let len = u32::from_le_bytes(data[1..5].try_into().expect("4 bytes")) as usize;
            let body = &data[5..];
            let len = len.min(body.len());
            set.set(index, body[..len].to_vec());
            data = &body[len..];
        }
        set
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (index, bytes) in &self.files {
            out.push(*index as u8);
            out.extend((bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    pub fn get(&self, index: usize) -> Option<&[u8]> {
        self.files
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, b)| b.as_slice())
    }

    pub fn set(&mut self, index: usize, bytes: Vec<u8>) {
        match self.files.iter_mut().find(|(i, _)| *i == index) {
            Some((_, b)) => *b = bytes,
            None => self.files.push((index, bytes)),
        }
    }

    pub fn remove(&mut self, index: usize) {
        self.files.retain(|(i, _)| *i != index);
    }

    /// `(name, bytes)` of every file.
    pub fn files(&self) -> impl Iterator<Item = (&'static str, &[u8])> {
        self.files
            .iter()
            .map(|(i, b)| (FILE_NAMES[*i], b.as_slice()))
    }

    fn json(&self, index: usize) -> Option<Value> {
        serde_json::from_slice(self.get(index)?).ok()
    }

    /// Reads a model directory's files (those of [`FILE_NAMES`] it has).
    pub fn read_dir(dir: &std::path::Path) -> FileSet {
        let mut set = FileSet::default();
        for (i, name) in FILE_NAMES.iter().enumerate() {
            if let Ok(bytes) = std::fs::read(dir.join(name)) {
                set.set(i, bytes);
            }
        }
        set
    }
}

/// A safetensors file: its JSON header and the data after it.
#[derive(Clone, Debug)]
pub struct Safetensors {
    pub header: Value,
    pub data: Vec<u8>,
}

impl Safetensors {
    pub fn parse(bytes: &[u8]) -> Option<Safetensors> {
        let len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
        let header = serde_json::from_slice(bytes.get(8..8usize.checked_add(len)?)?).ok()?;
        Some(Safetensors {
            header,
            data: bytes[8 + len..].to_vec(),
        })
    }

    /// The file, its header padded with spaces to a multiple of 8 bytes as writers do.
    pub fn encode(&self) -> Vec<u8> {
        let mut text = self.header.to_string();
        while !text.len().is_multiple_of(8) {
            text.push(' ');
        }
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(&self.data);
        out
    }

    fn tensor_names(&self) -> Vec<String> {
        self.header
            .as_object()
            .map(|m| m.keys().filter(|k| *k != "__metadata__").cloned().collect())
            .unwrap_or_default()
    }

    /// Two files holding the tensors alternately, each laid out from offset 0, and the index
    /// naming them.
    fn split(&self) -> Option<(Safetensors, Safetensors, Value)> {
        let mut shards = [Map::new(), Map::new()];
        let mut data = [Vec::new(), Vec::new()];
        let mut weight_map = Map::new();
        for (i, name) in self.tensor_names().iter().enumerate() {
            let info = &self.header[name];
            let offsets = info["data_offsets"].as_array()?;
            let (b, e) = (offsets[0].as_u64()? as usize, offsets[1].as_u64()? as usize);
            let k = i % 2;
            let start = data[k].len();
            data[k].extend_from_slice(self.data.get(b..e)?);
            let mut info = info.clone();
            info["data_offsets"] = json!([start, data[k].len()]);
            shards[k].insert(name.clone(), info);
            weight_map.insert(name.clone(), json!(FILE_NAMES[SHARD_1 + k]));
        }
        let [h1, h2] = shards;
        let [d1, d2] = data;
        let total = d1.len() + d2.len();
        Some((
            Safetensors {
                header: Value::Object(h1),
                data: d1,
            },
            Safetensors {
                header: Value::Object(h2),
                data: d2,
            },
            json!({ "metadata": { "total_size": total }, "weight_map": weight_map }),
        ))
    }
}

/// The seed directories: tiny models in F16, BF16 and F32, tied and not, one with a chat
/// template and llama3 RoPE scaling, one sharded with an index, one in transformers 5's layout
/// with `chat_template.jinja`.
pub fn seed_sets() -> &'static [FileSet] {
    static SETS: OnceLock<Vec<FileSet>> = OnceLock::new();
    SETS.get_or_init(|| {
        let variants = [
            (tiny_spec(1, 1, false, 11), DType::F16),
            (tiny_spec(2, 2, true, 12), DType::BF16),
            (tiny_spec(1, 2, false, 13), DType::F32),
            (tiny_spec(1, 1, true, 14), DType::F16),
        ];
        variants
            .iter()
            .enumerate()
            .map(|(i, (spec, dtype))| {
                let dir = tempfile::tempdir().expect("a temporary directory");
                let weights = turbo_tests::TinyWeights::random(spec);
                turbo_tests::write_hf(dir.path(), spec, &weights, *dtype);
                let mut set = FileSet::read_dir(dir.path());
                let mut config = set.json(CONFIG).expect("config.json");
                match i {
                    1 => {
                        let mut tc = set.json(TOKENIZER_CONFIG).expect("tokenizer_config.json");
                        tc["chat_template"] = json!(crate::seeds::TEMPLATES[0]);
                        set.set(TOKENIZER_CONFIG, tc.to_string().into_bytes());
                        config["rope_scaling"] = json!({
                            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32
                        });
                    }
                    2 => {
                        let st = Safetensors::parse(set.get(WEIGHTS).expect("weights"))
                            .expect("a safetensors file");
                        let (a, b, index) = st.split().expect("tensors to split");
                        set.remove(WEIGHTS);
                        set.set(SHARD_1, a.encode());
                        set.set(SHARD_2, b.encode());
                        set.set(INDEX, index.to_string().into_bytes());
                    }
                    3 => {
                        let theta = config["rope_theta"].take();
                        config
                            .as_object_mut()
                            .expect("an object")
                            .remove("rope_theta");
                        config["rope_parameters"] =
                            json!({ "rope_type": "default", "rope_theta": theta });
                        set.set(JINJA, crate::seeds::TEMPLATES[2].as_bytes().to_vec());
                    }
                    _ => {}
                }
                set.set(CONFIG, config.to_string().into_bytes());
                set
            })
            .collect()
    })
}

/// `config.json` keys the loader reads (and a few it ignores).
const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "model_type",
    "architectures",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
];

fn mutate_config(v: &mut Value, rng: &mut Rng) {
    if !v.is_object() {
        *v = json!({});
    }
    let key = *rng.pick(CONFIG_KEYS);
    match rng.below(9) {
        0 => {
            v.as_object_mut().expect("an object").remove(key);
        }
        1 | 2 => v[key] = extreme_number(rng),
        3 => v[key] = extreme_value(rng),
        4 => v[*rng.pick(&["rope_scaling", "rope_parameters"])] = rope_object(rng),
        5 => {
            // Shapes that agree with each other but not with the tensors.
            let factor = *rng.pick(&[2u64, 3, 1 << 16, 1 << 31]);
            let k = *rng.pick(&[
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "num_hidden_layers",
            ]);
            let n = v[k].as_u64().unwrap_or(1);
            v[k] = json!(n.saturating_mul(factor));
        }
        6 => {
            v["head_dim"] = json!(*rng.pick(&[0u64, 1, 3, 8, 15, 16, 17, 1 << 31]));
        }
        _ => mutate_value(v, rng, CONFIG_KEYS),
    }
}

const DTYPES: &[&str] = &[
    "F32", "F16", "BF16", "U8", "I8", "I16", "I32", "I64", "F64", "BOOL", "F8_E4M3", "F8_E5M2",
    "F4", "f32", "",
];

fn mutate_header(st: &mut Safetensors, rng: &mut Rng) {
    let names = st.tensor_names();
    let data_len = st.data.len() as u64;
    let Some(h) = st.header.as_object_mut() else {
        st.header = json!({});
        return;
    };
    let name = match names.len() {
        0 => String::from("model.embed_tokens.weight"),
        n => names[rng.below(n)].clone(),
    };
    let other = match names.len() {
        0 => Value::Null,
        n => h[&names[rng.below(n)]]["data_offsets"].clone(),
    };
    let entry = h.entry(name.clone()).or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    match rng.below(12) {
        0 => {
            entry["dtype"] = match rng.below(5) {
                0 => extreme_value(rng),
                _ => json!(*rng.pick(DTYPES)),
            }
        }
        1 | 2 => {
            let shape = entry["shape"].as_array().cloned().unwrap_or_default();
            let mut shape = shape;
            match rng.below(4) {
                0 if !shape.is_empty() => {
                    let i = rng.below(shape.len());
                    shape[i] = extreme_number(rng);
                }
                1 => shape.push(json!(*rng.pick(&[1u64, 0, 2, 1 << 32]))),
                2 => {
                    shape.pop();
                }
                _ => shape.reverse(),
            }
            entry["shape"] = Value::Array(shape);
        }
        3..=5 => {
            let (b, e) = (
                entry["data_offsets"][0].as_u64().unwrap_or(0),
                entry["data_offsets"][1].as_u64().unwrap_or(0),
            );
            entry["data_offsets"] = match rng.below(8) {
                0 => other,
                1 => json!([e, b]),
                2 => json!([b, e.saturating_add(1)]),
                3 => json!([b.saturating_sub(2), e.saturating_sub(2)]),
                4 => json!([b, data_len + rng.below(64) as u64]),
                5 => json!([interesting_u64(rng), interesting_u64(rng)]),
                6 => json!([b]),
                _ => json!([b, e, e]),
            };
        }
        6 => {
            let v = h.remove(&name).unwrap_or(Value::Null);
            let new = match rng.below(5) {
                0 => name.replacen("layers.0.", "layers.01.", 1),
                1 => name.replacen("layers.0.", &format!("layers.{}.", interesting_u64(rng)), 1),
                2 => format!("{name}.bias"),
                3 => name.replacen("model.", "", 1),
                _ => format!("{name}\u{7}"),
            };
            if rng.bool() {
                h.insert(name, v.clone());
            }
            h.insert(new, v);
        }
        7 => {
            h.remove(&name);
        }
        8 => {
            h.insert(
                "__metadata__".into(),
                match rng.below(4) {
                    0 => json!({ "format": extreme_value(rng) }),
                    1 => json!({ "format": { "nested": 1 } }),
                    2 => json!(["pt"]),
                    _ => json!({ "format": "pt", "quantization": "q4_0" }),
                },
            );
        }
        9 => {
            h.insert(
                format!("model.layers.{}.mlp.up_proj.weight", rng.below(4)),
                json!({ "dtype": "F32", "shape": [1], "data_offsets": [data_len, data_len + 4] }),
            );
            st.data.extend_from_slice(&1.0f32.to_le_bytes());
        }
        _ => mutate_value(&mut st.header, rng, &["dtype", "shape", "data_offsets"]),
    }
}

/// A safetensors file mutated: its header (usually), its header's length, its data.
fn mutate_safetensors(bytes: &[u8], rng: &mut Rng) -> Vec<u8> {
    let Some(mut st) = Safetensors::parse(bytes) else {
        let mut b = bytes.to_vec();
        crate::mutate::bytes(&mut b, rng, 3, &[]);
        return b;
    };
    if !rng.one_in(6) {
        mutate_header(&mut st, rng);
    }
    let mut out = st.encode();
    match rng.below(10) {
        0 => {
            let len = u64::from_le_bytes(out[..8].try_into().expect("8 bytes"));
            let new = match rng.below(3) {
                0 => interesting_u64(rng),
                1 => len.wrapping_add(rng.range(1, 9) as u64),
                _ => len.wrapping_sub(rng.range(1, 9) as u64),
            };
            out[..8].copy_from_slice(&new.to_le_bytes());
        }
        1 => {
            let header_end = 8 + u64::from_le_bytes(out[..8].try_into().expect("8 bytes")) as usize;
            out.truncate(rng.range(header_end.min(out.len()), out.len()));
        }
        2 => out.extend(std::iter::repeat_n(0u8, rng.small(256).max(1))),
        3 => crate::mutate::bytes(&mut out, rng, 2, &[]),
        _ => {}
    }
    out
}

fn mutate_tokenizer_json(v: &mut Value, rng: &mut Rng) {
    match rng.below(8) {
        0 => {
            if let Some(a) = at_mut(v, &["added_tokens"]).and_then(Value::as_array_mut) {
                if !a.is_empty() {
                    let i = rng.below(a.len());
                    let field = *rng.pick(&["id", "content", "special", "lstrip", "normalized"]);
                    let new = match field {
                        "id" => extreme_number(rng),
                        "content" => json!(*rng.pick(&["", "<|im_end|>", "Ġ", "a", " "])),
                        _ => extreme_value(rng),
                    };
                    set_at(&mut a[i], &[field], new);
                }
            }
        }
        1 => {
            if let Some(a) = at_mut(v, &["model", "merges"]).and_then(Value::as_array_mut) {
                if !a.is_empty() {
                    let i = rng.below(a.len());
                    a[i] = json!(*rng.pick(&["a b c", "", "Ġ", "zz qq", "h e"]));
                }
            }
        }
        2 => {
            if let Some(m) = at_mut(v, &["model", "vocab"]).and_then(Value::as_object_mut) {
                let keys: Vec<String> = m.keys().cloned().collect();
                if !keys.is_empty() {
                    let k = &keys[rng.below(keys.len())];
                    m[k] = extreme_number(rng);
                }
            }
        }
        3 => {
            let pattern = *rng.pick(&[
                "(a+)+$",
                "(",
                "\\p{Nope}",
                "",
                "(?i:'s|'t)|\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+|\\s+",
                "(?<=a)b",
                "(.*)*x",
            ]);
            let split = json!({
                "type": "Sequence",
                "pretokenizers": [
                    { "type": "Split", "pattern": { "Regex": pattern }, "behavior": "Isolated", "invert": false },
                    { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true }
                ]
            });
            set_at(v, &["pre_tokenizer"], split);
        }
        4 => {
            let normalizer = rng
                .pick(&[
                    json!({ "type": "NFC" }),
                    json!({ "type": "NFKC" }),
                    json!({ "type": "Lowercase" }),
                    json!({ "type": "Prepend", "prepend": "▁" }),
                    json!({ "type": "Replace", "pattern": { "String": " " }, "content": "▁" }),
                    json!({ "type": "Replace", "pattern": { "Regex": "(" }, "content": "" }),
                ])
                .clone();
            set_at(v, &["normalizer"], normalizer);
        }
        5 => {
            let decoder = rng
                .pick(&[
                json!({ "type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true }),
                json!({ "type": "WordPiece", "prefix": "##", "cleanup": true }),
                json!({ "type": "ByteFallback" }),
                json!({ "type": "Nope" }),
                Value::Null,
            ])
                .clone();
            set_at(v, &["decoder"], decoder);
        }
        6 => {
            let field = *rng.pick(&[
                "unk_token",
                "byte_fallback",
                "ignore_merges",
                "continuing_subword_prefix",
                "end_of_word_suffix",
                "dropout",
                "type",
            ]);
            let new = extreme_value(rng);
            set_at(v, &["model", field], new);
        }
        _ => mutate_value(
            v,
            rng,
            &[
                "model",
                "vocab",
                "merges",
                "added_tokens",
                "pre_tokenizer",
                "decoder",
                "normalizer",
                "post_processor",
                "type",
            ],
        ),
    }
}

fn token_value(rng: &mut Rng) -> Value {
    match rng.below(6) {
        0 => json!(*rng.pick(&["<|im_start|>", "<|im_end|>", "<|endoftext|>"])),
        1 => json!(*rng.pick(&["<nope>", "", "Ġ", "\u{1b}[2J"])),
        2 => json!({ "content": "<|im_end|>", "lstrip": false, "special": true }),
        3 => json!({ "content": extreme_value(rng) }),
        _ => extreme_value(rng),
    }
}

fn mutate_tokenizer_config(v: &mut Value, rng: &mut Rng) {
    if !v.is_object() {
        *v = json!({});
    }
    match rng.below(5) {
        0 => v[*rng.pick(&["bos_token", "eos_token"])] = token_value(rng),
        1 => v["add_bos_token"] = extreme_value(rng),
        2 => {
            let source = crate::chat_template::mutated_source(rng);
            v["chat_template"] = match rng.below(4) {
                0 => {
                    json!([{ "name": "tool_use", "template": "x" }, { "name": "default", "template": source }])
                }
                1 => json!([{ "name": extreme_value(rng), "template": extreme_value(rng) }]),
                2 => extreme_value(rng),
                _ => json!(source),
            };
        }
        3 => {
            v.as_object_mut().expect("an object").remove(*rng.pick(&[
                "bos_token",
                "eos_token",
                "add_bos_token",
                "chat_template",
            ]));
        }
        _ => mutate_value(
            v,
            rng,
            &["bos_token", "eos_token", "add_bos_token", "chat_template"],
        ),
    }
}

fn mutate_generation_config(v: &mut Value, rng: &mut Rng) {
    if !v.is_object() {
        *v = json!({});
    }
    let key = *rng.pick(&["eos_token_id", "bos_token_id"]);
    v[key] = match rng.below(4) {
        0 => json!([extreme_number(rng), 2]),
        1 => json!([[2]]),
        2 => extreme_number(rng),
        _ => extreme_value(rng),
    };
}

fn mutate_index(v: &mut Value, rng: &mut Rng) {
    let target = json!(*rng.pick(&[
        "model.safetensors",
        "../model.safetensors",
        "/dev/zero",
        "",
        ".",
        "model-00001-of-00002.safetensors",
        "sub/model.safetensors",
        "model-00003-of-00002.safetensors",
    ]));
    match at_mut(v, &["weight_map"]).and_then(Value::as_object_mut) {
        Some(m) if !m.is_empty() && rng.bool() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[rng.below(keys.len())];
            m[k] = if rng.one_in(4) {
                extreme_value(rng)
            } else {
                target
            };
        }
        _ => mutate_value(v, rng, &["weight_map", "metadata"]),
    }
}

/// One edit of the directory: a file's content structurally, a file gone or added, bytes.
pub fn mutate_set(set: &mut FileSet, rng: &mut Rng) {
    let roll = rng.below(100);
    let json_edit = |set: &mut FileSet,
                     index: usize,
                     rng: &mut Rng,
                     f: fn(&mut Value, &mut Rng)| match set.json(index) {
        Some(mut v) => {
            f(&mut v, rng);
            set.set(index, to_text(&v, rng).into_bytes());
        }
        None => {
            let mut bytes = set.get(index).map(<[u8]>::to_vec).unwrap_or_default();
            if rng.bool() {
                let mut text = String::from_utf8_lossy(&bytes).into_owned();
                mutate_text(&mut text, rng);
                bytes = text.into_bytes();
            } else {
                crate::mutate::bytes(&mut bytes, rng, 3, &[]);
            }
            set.set(index, bytes);
        }
    };
    match roll {
        0..=34 => json_edit(set, CONFIG, rng, mutate_config),
        35..=69 => {
            let weights: Vec<usize> = [WEIGHTS, SHARD_1, SHARD_2]
                .into_iter()
                .filter(|&i| set.get(i).is_some())
                .collect();
            if let Some(&i) = weights.get(rng.below(weights.len().max(1))) {
                let bytes = mutate_safetensors(set.get(i).expect("present"), rng);
                set.set(i, bytes);
            }
        }
        70..=78 => json_edit(set, TOKENIZER, rng, mutate_tokenizer_json),
        79..=85 => json_edit(set, TOKENIZER_CONFIG, rng, mutate_tokenizer_config),
        86..=88 => json_edit(set, GENERATION_CONFIG, rng, mutate_generation_config),
        89..=90 => json_edit(set, INDEX, rng, mutate_index),
        91 => set.set(
            JINJA,
            crate::chat_template::mutated_source(rng).into_bytes(),
        ),
        92..=94 => set.remove(rng.below(FILE_NAMES.len())),
        95 => {
            // The weights moved to a shard name, with or without an index.
            if let Some(w) = set.get(WEIGHTS).map(<[u8]>::to_vec) {
                set.remove(WEIGHTS);
                set.set(SHARD_1, w);
            }
        }
        96 => {
            // One file's content under another's name.
            let from = rng.below(FILE_NAMES.len());
            if let Some(b) = set.get(from).map(<[u8]>::to_vec) {
                set.set(rng.below(FILE_NAMES.len()), b);
            }
        }
        _ => {
            let i = rng.below(FILE_NAMES.len());
            let mut bytes = set.get(i).map(<[u8]>::to_vec).unwrap_or_default();
            crate::mutate::bytes(&mut bytes, rng, 4, &[]);
            set.set(i, bytes);
        }
    }
}

/// A case: a seed directory with one to three edits.
pub fn generate(rng: &mut Rng) -> Vec<u8> {
    let mut set = rng.pick(seed_sets()).clone();
    let edits = rng.edits();
    for _ in 0..edits {
        mutate_set(&mut set, rng);
    }
    set.encode()
}

/// Mutates an input of the target (libFuzzer's custom mutator).
pub fn mutate(data: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut set = FileSet::decode(data);
    if set.files.is_empty() && rng.bool() {
        return generate(rng);
    }
    mutate_set(&mut set, rng);
    set.encode()
}

/// Unmutated seeds, for a libFuzzer corpus.
pub fn seeds() -> Vec<Vec<u8>> {
    seed_sets().iter().map(FileSet::encode).collect()
}

/// The target.
pub fn run(data: &[u8]) {
    let set = FileSet::decode(data);
    let dir = CaseDir::new();
    for (name, bytes) in set.files() {
        dir.write(name, bytes);
    }
    match LoadedModel::load(dir.path()) {
        Ok(m) => check_loaded(&m),
        Err(e) => check_message("HF model load", &e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_sets_round_trip_and_decode_anything() {
        let mut set = FileSet::default();
        set.set(CONFIG, b"{}".to_vec());
        set.set(JINJA, vec![0xff; 3]);
        assert_eq!(FileSet::decode(&set.encode()), set);
        let mut rng = Rng::new(1);
        for _ in 0..100 {
            let n = rng.small(64);
            let bytes = rng.bytes(n);
            let _ = FileSet::decode(&bytes);
        }
    }
}
