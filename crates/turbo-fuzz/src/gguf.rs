//! The GGUF target: a file's bytes through [`turbo_gguf::GgufFile`] (header, metadata, tensor
//! directory, every typed getter and tensor window), then, when the file parses, through
//! [`turbo_llama::LoadedModel::load`] (config from metadata, tokenizer from the vocabulary,
//! weights) and onto the CPU for a forward pass.
//!
//! The structured mutator edits a parsed file ([`GgufDoc`]: metadata values of every type,
//! vocabulary arrays, tensor dimensions, types, offsets and names) and writes it again with a
//! writer that, unlike [`turbo_gguf::GgufWriter`], writes whatever it is given; it records where
//! every count, length and offset lies, so that a second pass can set those to extreme values.

use crate::model::{check_loaded, check_message};
use crate::mutate::{interesting_f64, interesting_u64};
use crate::rng::Rng;
use crate::scratch::CaseDir;
use crate::seeds::tiny_spec;
use std::sync::OnceLock;
use turbo_core::DType;
use turbo_gguf::{GgufFile, MetaValue};
use turbo_llama::LoadedModel;

/// Data sections longer than this are not written (a mutated offset may point anywhere).
const DATA_CAP: u64 = 8 << 20;

/// Metadata keys the loader reads, for mutations that add a key back with the wrong value.
const KNOWN_KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.vocab_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
];

/// A GGUF file as a list of parts, which may contradict each other.
#[derive(Clone, Debug)]
pub struct GgufDoc {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<Tensor>,
    /// The data section's length; `None`: as long as the tensors need.
    pub data_len: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Relative to the data section, as in the file.
    pub offset: u64,
    pub data: Vec<u8>,
}

/// A written file and where its numeric header fields lie (offset, width in bytes).
pub struct Encoded {
    pub bytes: Vec<u8>,
    pub fields: Vec<(usize, usize)>,
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

struct Writer {
    out: Vec<u8>,
    fields: Vec<(usize, usize)>,
}

impl Writer {
    fn field(&mut self, bytes: &[u8]) {
        self.fields.push((self.out.len(), bytes.len()));
        self.out.extend_from_slice(bytes);
    }

    fn string(&mut self, s: &str) {
        self.field(&(s.len() as u64).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    /// The value's payload; mixed arrays are written element by element as each element's own
    /// type, under the first element's type id, which is what a corrupt file looks like.
    fn value(&mut self, v: &MetaValue) {
        match v {
            MetaValue::U8(x) => self.out.push(*x),
            MetaValue::I8(x) => self.out.extend(x.to_le_bytes()),
            MetaValue::U16(x) => self.out.extend(x.to_le_bytes()),
            MetaValue::I16(x) => self.out.extend(x.to_le_bytes()),
            MetaValue::U32(x) => self.field(&x.to_le_bytes()),
            MetaValue::I32(x) => self.field(&x.to_le_bytes()),
            MetaValue::F32(x) => self.out.extend(x.to_le_bytes()),
            MetaValue::Bool(x) => self.out.push(u8::from(*x)),
            MetaValue::String(s) => self.string(s),
            MetaValue::Array(items) => {
                let elem = items.first().map_or(4, type_id);
                self.field(&elem.to_le_bytes());
                self.field(&(items.len() as u64).to_le_bytes());
                for item in items {
                    self.value(item);
                }
            }
            MetaValue::U64(x) => self.field(&x.to_le_bytes()),
            MetaValue::I64(x) => self.field(&x.to_le_bytes()),
            MetaValue::F64(x) => self.out.extend(x.to_le_bytes()),
        }
    }
}

impl GgufDoc {
    /// The parts of a file that parses; tensors without their data unless `with_data`.
    pub fn from_file(file: &GgufFile, with_data: bool) -> GgufDoc {
        GgufDoc {
            version: file.version(),
            metadata: file.metadata().to_vec(),
            tensors: file
                .tensors()
                .iter()
                .map(|t| Tensor {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ggml_type: t.ggml_type,
                    offset: t.offset,
                    data: match with_data {
                        true => file
                            .tensor_bytes(t)
                            .map(|b| b.as_slice().to_vec())
                            .unwrap_or_default(),
                        false => Vec::new(),
                    },
                })
                .collect(),
            data_len: None,
        }
    }

    fn alignment(&self) -> u64 {
        match self
            .metadata
            .iter()
            .find(|(k, _)| k == turbo_gguf::ALIGNMENT_KEY)
        {
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
            _ => u64::from(turbo_gguf::DEFAULT_ALIGNMENT),
        }
    }

    /// Lays tensors out one after the other from offset 0, aligned, as converters do.
    fn lay_out(&mut self) {
        let alignment = self.alignment();
        let mut offset = 0u64;
        for t in &mut self.tensors {
            t.offset = offset;
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
    }

    pub fn encode(&self) -> Encoded {
        let mut w = Writer {
            out: Vec::new(),
            fields: Vec::new(),
        };
        w.out.extend_from_slice(b"GGUF");
        w.field(&self.version.to_le_bytes());
        w.field(&(self.tensors.len() as u64).to_le_bytes());
        w.field(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            w.string(key);
            w.field(&type_id(value).to_le_bytes());
            w.value(value);
        }
        for t in &self.tensors {
            w.string(&t.name);
            w.field(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                w.field(&d.to_le_bytes());
            }
            w.field(&t.ggml_type.to_le_bytes());
            w.field(&t.offset.to_le_bytes());
        }
        // A huge alignment puts the data section gigabytes away: the file ends at its header.
        let header = w.out.len() as u64;
        let start = match header.next_multiple_of(self.alignment()) {
            start if start - header <= DATA_CAP => start,
            _ => header,
        };
        let needed = self
            .tensors
            .iter()
            .filter_map(|t| t.offset.checked_add(t.data.len() as u64))
            .filter(|&end| end <= DATA_CAP)
            .max()
            .unwrap_or(0);
        let data_len = self.data_len.unwrap_or(needed).min(DATA_CAP);
        let mut bytes = w.out;
        bytes.resize(start as usize, 0);
        let mut data = vec![0u8; data_len as usize];
        for t in &self.tensors {
            let at = t.offset as usize;
            if let Some(dst) = data.get_mut(at..at.saturating_add(t.data.len())) {
                dst.copy_from_slice(&t.data);
            }
        }
        bytes.extend_from_slice(&data);
        Encoded {
            bytes,
            fields: w.fields,
        }
    }
}

/// The seed files: tiny models of every weight type (tied and not, one and two layers, with a
/// chat template, with RoPE factors), and the default model's header where present.
pub fn seed_docs() -> &'static [GgufDoc] {
    static DOCS: OnceLock<Vec<GgufDoc>> = OnceLock::new();
    DOCS.get_or_init(|| {
        let variants = [
            (tiny_spec(1, 1, false, 1), DType::F32),
            (tiny_spec(2, 2, true, 2), DType::F16),
            (tiny_spec(1, 1, false, 3), DType::Q8_0),
            (tiny_spec(1, 2, true, 4), DType::Q4_1),
            (tiny_spec(2, 1, false, 5), DType::Q4_0),
        ];
        let mut docs: Vec<GgufDoc> = variants
            .iter()
            .enumerate()
            .map(|(i, (spec, dtype))| {
                let weights = turbo_tests::TinyWeights::random(spec);
                let (tensors, _) = turbo_tests::gguf_tensors(spec, &weights, *dtype);
                let mut doc = GgufDoc {
                    version: 3,
                    metadata: turbo_tests::gguf_metadata(spec),
                    tensors: tensors
                        .into_iter()
                        .map(|t| Tensor {
                            name: t.name,
                            dims: t.dims,
                            ggml_type: t.ggml_type,
                            offset: 0,
                            data: t.data,
                        })
                        .collect(),
                    data_len: None,
                };
                let meta = |k: &str, v: MetaValue| (k.to_string(), v);
                match i {
                    1 => {
                        doc.metadata.push(meta(
                            "tokenizer.chat_template",
                            crate::seeds::TEMPLATES[0].into(),
                        ));
                        doc.metadata
                            .push(meta("tokenizer.ggml.add_bos_token", true.into()));
                        doc.metadata
                            .push(meta("tokenizer.ggml.eot_token_id", MetaValue::U32(0)));
                    }
                    3 => {
                        doc.metadata
                            .push(meta("llama.rope.scaling.type", "linear".into()));
                        doc.metadata
                            .push(meta("llama.rope.scaling.factor", MetaValue::F32(4.0)));
                    }
                    4 => {
                        let half = (spec.hidden / spec.heads / 2) as u64;
                        let factors: Vec<u8> = (0..half)
                            .flat_map(|j| (1.0 + j as f32).to_le_bytes())
                            .collect();
                        doc.tensors.push(Tensor {
                            name: "rope_freqs.weight".into(),
                            dims: vec![half],
                            ggml_type: 0,
                            offset: 0,
                            data: factors,
                        });
                        doc.version = 2;
                    }
                    _ => {}
                }
                doc.lay_out();
                doc
            })
            .collect();
        // The default model's header: its metadata and tensor directory, without the data (the
        // file truncated where the data section starts).
        let path = crate::seeds::default_model_path();
        if let Some(file) = path.and_then(|p| GgufFile::open(p).ok()) {
            let mut doc = GgufDoc::from_file(&file, false);
            doc.data_len = Some(0);
            docs.push(doc);
        }
        docs
    })
}

fn pick_seed(rng: &mut Rng) -> GgufDoc {
    let docs = seed_docs();
    // The real header is 2 MB: one case in ten, not one in six.
    let tiny = docs.len().min(5);
    if docs.len() > tiny && rng.one_in(10) {
        docs[rng.range(tiny, docs.len() - 1)].clone()
    } else {
        docs[rng.below(tiny)].clone()
    }
}

/// A value of a random type, extreme where the type allows.
fn random_value(rng: &mut Rng, depth: usize) -> MetaValue {
    let u = interesting_u64(rng);
    match rng.below(if depth > 2 { 13 } else { 14 }) {
        0 => MetaValue::U8(u as u8),
        1 => MetaValue::I8(u as i8),
        2 => MetaValue::U16(u as u16),
        3 => MetaValue::I16(u as i16),
        4 => MetaValue::U32(u as u32),
        5 => MetaValue::I32(u as i32),
        6 => MetaValue::F32(interesting_f64(rng) as f32),
        7 => MetaValue::Bool(rng.bool()),
        8 => MetaValue::String(
            rng.pick(&[
                "llama",
                "gpt2",
                "smollm",
                "llama-bpe",
                "qwen2",
                "linear",
                "none",
                "",
                "yarn",
                "\u{1b}[2J",
                "a b",
                "Ġ Ġ",
            ])
            .to_string(),
        ),
        9 => MetaValue::U64(u),
        10 => MetaValue::I64(u as i64),
        11 => MetaValue::F64(interesting_f64(rng)),
        12 => MetaValue::String(crate::text::generate(rng, &[], 3)),
        _ => {
            let n = rng.small(8);
            let first = random_value(rng, depth + 1);
            let mut items = vec![first.clone(); n];
            if n > 0 && rng.one_in(4) {
                // A mixed array: not homogeneous, which the format cannot say.
                items[n - 1] = random_value(rng, depth + 1);
            }
            MetaValue::Array(items)
        }
    }
}

/// An extreme value of the same type as `v` (or an array edit, for arrays).
fn same_type_extreme(v: &MetaValue, rng: &mut Rng) -> MetaValue {
    let u = interesting_u64(rng);
    match v {
        MetaValue::U8(_) => MetaValue::U8(u as u8),
        MetaValue::I8(_) => MetaValue::I8(u as i8),
        MetaValue::U16(_) => MetaValue::U16(u as u16),
        MetaValue::I16(_) => MetaValue::I16(u as i16),
        MetaValue::U32(_) => MetaValue::U32(u as u32),
        MetaValue::I32(_) => MetaValue::I32(u as i32),
        MetaValue::U64(_) => MetaValue::U64(u),
        MetaValue::I64(_) => MetaValue::I64(u as i64),
        MetaValue::F32(_) => MetaValue::F32(interesting_f64(rng) as f32),
        MetaValue::F64(_) => MetaValue::F64(interesting_f64(rng)),
        MetaValue::Bool(b) => MetaValue::Bool(!b),
        MetaValue::String(s) => {
            let mut s = s.clone();
            match rng.below(4) {
                0 => s.clear(),
                1 => s.push_str(&crate::text::generate(rng, &[], 2)),
                2 => s = s.chars().rev().collect(),
                _ => s.insert(0, crate::text::random_char(rng)),
            }
            MetaValue::String(s)
        }
        MetaValue::Array(items) => {
            let mut items = items.clone();
            edit_array(&mut items, rng);
            MetaValue::Array(items)
        }
    }
}

/// Edits of vocabulary-like arrays: tokens gone, doubled, changed, reordered, retyped.
fn edit_array(items: &mut Vec<MetaValue>, rng: &mut Rng) {
    let n = items.len();
    match rng.below(8) {
        0 if n > 0 => {
            items.remove(rng.below(n));
        }
        1 if n > 0 => {
            let i = rng.below(n);
            let item = items[i].clone();
            items.insert(rng.position(n), item);
        }
        2 if n > 0 => {
            let i = rng.below(n);
            items[i] = same_type_extreme(&items[i], rng);
        }
        3 => items.truncate(rng.small(n)),
        4 if n > 1 => {
            let (a, b) = (rng.below(n), rng.below(n));
            items.swap(a, b);
        }
        5 if n > 0 => {
            // Every element the same extreme value (all tokens control, all ids huge, ...).
            let v = same_type_extreme(&items[0], rng);
            items.iter_mut().for_each(|x| *x = v.clone());
        }
        6 if n > 0 => {
            let i = rng.below(n);
            items[i] = random_value(rng, 1);
        }
        _ => {
            // A string element with odd content: merges without a space, with several, tokens
            // of special text.
            if let Some(MetaValue::String(_)) = items.first() {
                let i = rng.below(n);
                items[i] = MetaValue::String(
                    rng.pick(&[
                        "",
                        " ",
                        "a",
                        "a b c",
                        "Ġ",
                        "Ġ t",
                        "<|im_end|>",
                        "h e",
                        "\u{0}",
                        "xyz q",
                    ])
                    .to_string(),
                );
            } else {
                items.push(random_value(rng, 1));
            }
        }
    }
}

/// One structural edit of a file's parts.
pub fn mutate_doc(doc: &mut GgufDoc, rng: &mut Rng) {
    let n_meta = doc.metadata.len();
    let n_tensors = doc.tensors.len();
    match rng.below(22) {
        0..=3 if n_meta > 0 => {
            let i = rng.below(n_meta);
            let v = &doc.metadata[i].1;
            doc.metadata[i].1 = if rng.bool() {
                same_type_extreme(v, rng)
            } else {
                random_value(rng, 0)
            };
        }
        4 if n_meta > 0 => {
            doc.metadata.remove(rng.below(n_meta));
        }
        5 if n_meta > 0 => {
            let i = rng.below(n_meta);
            let (k, _) = doc.metadata[i].clone();
            doc.metadata.push((k, random_value(rng, 0)));
        }
        6 => {
            let key = rng.pick(KNOWN_KEYS).to_string();
            let value = random_value(rng, 0);
            match doc.metadata.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => *v = value,
                None => doc.metadata.push((key, value)),
            }
        }
        7..=9 => {
            let arrays: Vec<usize> = (0..n_meta)
                .filter(|&i| matches!(doc.metadata[i].1, MetaValue::Array(_)))
                .collect();
            if let Some(&i) = arrays.get(rng.below(arrays.len().max(1))) {
                if let MetaValue::Array(items) = &mut doc.metadata[i].1 {
                    edit_array(items, rng);
                }
            }
        }
        10 | 11 if n_tensors > 0 => {
            let t = &mut doc.tensors[rng.below(n_tensors)];
            match rng.below(4) {
                0 if !t.dims.is_empty() => {
                    let i = rng.below(t.dims.len());
                    t.dims[i] = interesting_u64(rng);
                }
                1 => {
                    let extreme = interesting_u64(rng);
                    t.dims.push(*rng.pick(&[1, 0, 2, 32, extreme]));
                }
                2 => {
                    t.dims.pop();
                }
                _ => t.dims.reverse(),
            }
        }
        12 if n_tensors > 0 => {
            let random = rng.below(64) as u32;
            let t = &mut doc.tensors[rng.below(n_tensors)];
            t.ggml_type = *rng.pick(&[
                0,
                1,
                2,
                3,
                8,
                30,
                10,
                12,
                14,
                16,
                24,
                39,
                40,
                255,
                u32::MAX,
                random,
            ]);
        }
        13 if n_tensors > 0 => {
            let i = rng.below(n_tensors);
            let other = doc.tensors[rng.below(n_tensors)].offset;
            let t = &mut doc.tensors[i];
            t.offset = match rng.below(5) {
                0 => other,
                1 => t.offset.wrapping_add(1),
                2 => t.offset.wrapping_add(32),
                3 => t.offset.wrapping_sub(32),
                _ => interesting_u64(rng),
            };
        }
        14 if n_tensors > 0 => {
            let i = rng.below(n_tensors);
            let other = doc.tensors[rng.below(n_tensors)].name.clone();
            let t = &mut doc.tensors[i];
            t.name = match rng.below(6) {
                0 => other,
                1 => t.name.replacen("blk.0.", "blk.01.", 1),
                2 => t
                    .name
                    .replacen("blk.0.", &format!("blk.{}.", interesting_u64(rng)), 1),
                3 => t.name.replacen("blk.", "blk.-", 1),
                4 => String::new(),
                _ => format!("{}\u{1b}[0m", t.name),
            };
        }
        15 if n_tensors > 0 => {
            let i = rng.below(n_tensors);
            if rng.bool() {
                doc.tensors.remove(i);
            } else {
                let mut t = doc.tensors[i].clone();
                t.name.push('x');
                doc.tensors.push(t);
            }
        }
        16 if n_tensors > 0 => {
            let t = &mut doc.tensors[rng.below(n_tensors)];
            match rng.below(3) {
                0 => t.data.truncate(rng.small(t.data.len())),
                1 => {
                    // NaN and infinity weights (the forward pass must not mind).
                    for chunk in t.data.chunks_exact_mut(4).step_by(rng.range(1, 7)) {
                        chunk.copy_from_slice(
                            &rng.pick(&[f32::NAN, f32::INFINITY, -0.0, 1e38])
                                .to_le_bytes(),
                        );
                    }
                }
                _ => t.data.iter_mut().for_each(|b| *b = 0xff),
            }
        }
        17 => doc.version = *rng.pick(&[0, 1, 2, 3, 4, u32::MAX]),
        18 => {
            let v = match rng.below(3) {
                0 => MetaValue::U32(interesting_u64(rng) as u32),
                1 => MetaValue::U64(interesting_u64(rng)),
                _ => MetaValue::U32(*rng.pick(&[0, 1, 3, 8, 64, 1 << 31])),
            };
            doc.metadata.retain(|(k, _)| k != turbo_gguf::ALIGNMENT_KEY);
            doc.metadata
                .insert(0, (turbo_gguf::ALIGNMENT_KEY.to_string(), v));
        }
        19 => {
            let needed = doc
                .tensors
                .iter()
                .map(|t| t.offset.saturating_add(t.data.len() as u64))
                .max()
                .unwrap_or(0);
            doc.data_len = Some(rng.small(needed.min(DATA_CAP) as usize) as u64);
        }
        20 => doc.lay_out(),
        _ => {
            // Counts that disagree: a layer's tensors gone or a layer count off by some.
            match doc
                .metadata
                .iter_mut()
                .find(|(k, _)| k == "llama.block_count")
            {
                Some((_, v)) => {
                    *v = MetaValue::U32(*rng.pick(&[0, 1, 2, 3, 1 << 31, u32::MAX]));
                }
                None => doc.tensors.retain(|t| !t.name.starts_with("blk.1.")),
            }
        }
    }
}

/// A case: a seed with structural edits, then sometimes header fields set to extreme values
/// and bytes mutated.
pub fn generate(rng: &mut Rng) -> Vec<u8> {
    let mut doc = pick_seed(rng);
    finish(&mut doc, rng)
}

fn finish(doc: &mut GgufDoc, rng: &mut Rng) -> Vec<u8> {
    let edits = rng.edits();
    for _ in 0..edits {
        mutate_doc(doc, rng);
    }
    let Encoded { mut bytes, fields } = doc.encode();
    if rng.one_in(5) && !fields.is_empty() {
        for _ in 0..rng.range(1, 2) {
            let (at, width) = *rng.pick(&fields);
            let v = interesting_u64(rng).to_le_bytes();
            bytes[at..at + width].copy_from_slice(&v[..width]);
        }
    }
    if rng.one_in(5) {
        crate::mutate::bytes(&mut bytes, rng, 3, &[]);
    }
    bytes
}

/// Mutates an input of the target (libFuzzer's custom mutator): structurally when it parses,
/// byte by byte when it does not.
pub fn mutate(data: &[u8], rng: &mut Rng) -> Vec<u8> {
    match GgufFile::from_bytes(data.to_vec()) {
        Ok(file) => finish(&mut GgufDoc::from_file(&file, true), rng),
        Err(_) if rng.one_in(8) => generate(rng),
        Err(_) => {
            let mut bytes = data.to_vec();
            crate::mutate::bytes(&mut bytes, rng, 4, &[]);
            bytes
        }
    }
}

/// Unmutated seeds, for a libFuzzer corpus.
pub fn seeds() -> Vec<Vec<u8>> {
    seed_docs().iter().map(|d| d.encode().bytes).collect()
}

/// The target.
pub fn run(data: &[u8]) {
    let file = match GgufFile::from_bytes(data.to_vec()) {
        Ok(file) => file,
        Err(e) => return check_message("GGUF", &e.to_string()),
    };
    walk(&file, data.len());
    let dir = CaseDir::new();
    let path = dir.write("model.gguf", data);
    match LoadedModel::load(&path) {
        Ok(m) => check_loaded(&m),
        Err(e) => check_message("GGUF model load", &e.to_string()),
    }
}

/// Reads everything a parsed file offers.
fn walk(file: &GgufFile, len: usize) {
    let _ = (
        file.version(),
        file.alignment(),
        file.data_offset(),
        file.architecture(),
    );
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some(), "metadata key {key:?} not found");
        let _ = (
            value.type_name(),
            value.as_u64(),
            value.as_i64(),
            value.as_f32(),
            value.as_str(),
            value.as_bool(),
            value.as_array().map(<[MetaValue]>::len),
        );
        let errors = [
            file.get_u32(key).err(),
            file.get_u64(key).err(),
            file.get_f32(key).err(),
            file.get_str(key).err(),
            file.get_bool(key).err(),
            file.get_str_array(key).err(),
            file.get_i32_array(key).err(),
            file.get_f32_array(key).err(),
        ];
        for e in errors.into_iter().flatten() {
            check_message("GGUF getter", &e.to_string());
        }
    }
    for info in file.tensors() {
        assert!(
            file.tensor(&info.name).is_some(),
            "tensor {:?} not found by name",
            info.name
        );
        let _ = info.n_elements();
        match file.tensor_bytes(info) {
            Ok(bytes) => assert!(bytes.len() <= len, "a tensor longer than the file"),
            Err(e) => {
                // Opening checked every tensor of a known type against the file's end.
                assert!(
                    info.dtype().is_none(),
                    "tensor {:?} of a known type was accepted at open but its bytes fail: {e}",
                    info.name
                );
                check_message("GGUF tensor", &e.to_string());
            }
        }
        match file.matrix(&info.name) {
            Ok(m) => {
                let n = m.rows.checked_mul(m.cols).expect("rows × cols fits");
                if n <= 1 << 16 {
                    assert_eq!(m.to_f32().len(), n);
                }
            }
            Err(e) => check_message("GGUF matrix", &e.to_string()),
        }
    }
}
