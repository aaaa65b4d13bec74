use proptest::prelude::*;
use turbo_core::quant::quantize_row;
use turbo_core::DType;
use turbo_gguf::{GgufError, GgufFile, GgufWriter, MetaValue};

/// One value of every GGUF type, including arrays nested in arrays.
fn every_value_type() -> Vec<(String, MetaValue)> {
    use MetaValue::*;
    let values = vec![
        U8(200),
        I8(-100),
        U16(60_000),
        I16(-30_000),
        U32(4_000_000_000),
        I32(-2_000_000_000),
        F32(1.5e-3),
        Bool(true),
        String("héllo ▁world".into()),
        Array(vec![String("a".into()), String(std::string::String::new())]),
        U64(u64::MAX),
        I64(i64::MIN),
        F64(-2.5e300),
        Array(vec![]),
        Array(vec![
            Array(vec![I32(1), I32(-2)]),
            Array(vec![Bool(false)]),
            Array(vec![Array(vec![F64(0.25)])]),
        ]),
    ];
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| (format!("test.{}.{i}", v.type_name()), v))
        .collect()
}

/// A small valid file: metadata of several types, an odd-sized tensor (so padding follows it) and
/// a last tensor that ends exactly on the alignment, so every strict prefix loses data.
fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new(3);
    w.add_meta("general.architecture", "llama")
        .add_meta("llama.block_count", 2u32)
        .add_meta("tokenizer.ggml.tokens", vec!["<s>", "a", "b"])
        .add_meta("tokenizer.ggml.scores", vec![0.0f32, -1.0, -2.0])
        .add_meta("nested", MetaValue::Array(vec![vec![1i32, 2].into()]));
    let odd = quantize_row(DType::F32, &[1.0, 2.0, 3.0]);
    w.add_tensor("odd", &[3], DType::F32.ggml_id(), odd)
        .unwrap();
    let values: Vec<f32> = (0..64).map(|i| i as f32 / 7.0 - 4.0).collect();
    let q = quantize_row(DType::Q4_0, &values);
    w.add_tensor("q", &[32, 2], DType::Q4_0.ggml_id(), q.clone())
        .unwrap();
    w.add_tensor("last", &[8], DType::F32.ggml_id(), vec![7; 32])
        .unwrap();
    w.to_bytes()
}

/// Little-endian byte builder for files the writer refuses to produce.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend(b);
        self
    }
    fn str(self, s: &[u8]) -> Self {
        self.u64(s.len() as u64).bytes(s)
    }
}

fn corrupt_msg(result: Result<GgufFile, GgufError>) -> String {
    match result {
        Err(GgufError::Corrupt(msg)) => msg,
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

/// Where the `offset` field of `name`'s directory entry sits in `bytes`.
fn offset_field(bytes: &[u8], name: &str, n_dims: usize) -> usize {
    let pos = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .unwrap();
    pos + name.len() + 4 + 8 * n_dims + 4
}

#[test]
fn every_value_type_round_trips() {
    let mut w = GgufWriter::default();
    for (k, v) in every_value_type() {
        w.add_meta(k, v);
    }
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata(), &every_value_type()[..]);
    assert!(f.tensors().is_empty());
}

#[test]
fn tensor_offsets_are_aligned() {
    for alignment in [None, Some(64u32), Some(8)] {
        let mut w = GgufWriter::new(2);
        if let Some(a) = alignment {
            w.add_meta("general.alignment", a);
        }
        w.add_meta("general.name", "x".repeat(13));
        let sizes = [12usize, 1, 40, 64, 3];
        for (i, n) in sizes.iter().enumerate() {
            // A ggml type Turbo does not know takes data of any length.
            w.add_tensor(format!("t{i}"), &[*n as u64], 27, vec![i as u8 + 1; *n])
                .unwrap();
        }
        let bytes = w.to_bytes();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        let a = u64::from(alignment.unwrap_or(32));
        assert_eq!(f.alignment() as u64, a);
        assert_eq!(f.data_offset() % a, 0);
        let mut expected_offset = 0;
        for (t, n) in f.tensors().iter().zip(sizes) {
            assert_eq!(t.offset % a, 0, "{t:?}");
            assert_eq!(t.offset, expected_offset);
            let start = (f.data_offset() + t.offset) as usize;
            assert!(bytes[start..start + n]
                .iter()
                .all(|&b| b == t.name.as_bytes()[1] - b'0' + 1));
            expected_offset = (t.offset + n as u64).next_multiple_of(a);
        }
        assert_eq!(bytes.len() as u64, f.data_offset() + expected_offset);
    }
}

#[test]
fn open_maps_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::default();
    w.add_meta("general.architecture", "llama");
    let row = quantize_row(DType::Q8_0, &[0.5; 64]);
    w.add_tensor("w", &[64], DType::Q8_0.ggml_id(), row.clone())
        .unwrap();
    w.write(&path).unwrap();

    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture().unwrap(), "llama");
    let bytes = f.tensor_bytes(f.tensor("w").unwrap()).unwrap();
    assert!(bytes.is_mapped());
    assert_eq!(bytes.as_slice(), &row[..]);
    let m = f.matrix("w").unwrap();
    assert_eq!((m.rows, m.cols, m.dtype), (1, 64, DType::Q8_0));
    assert!(m.to_f32().iter().all(|&v| (v - 0.5).abs() < 1e-2));

    let missing = dir.path().join("nope.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(&err, GgufError::Io { path, .. } if *path == missing));
    assert!(err.to_string().contains("nope.gguf"), "{err}");
}

#[test]
fn matrices_take_ggml_dim_order() {
    let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let mut w = GgufWriter::default();
    let data = quantize_row(DType::F32, &values);
    w.add_tensor("m", &[3, 2], 0, data.clone()).unwrap();
    w.add_tensor("v", &[6], 0, data.clone()).unwrap();
    w.add_tensor("cube", &[3, 2, 1], 0, data).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();

    let m = f.matrix("m").unwrap();
    assert_eq!((m.rows, m.cols), (2, 3));
    assert_eq!(m.to_f32(), values);
    let v = f.matrix("v").unwrap();
    assert_eq!((v.rows, v.cols), (1, 6));
    assert_eq!(f.tensor("cube").unwrap().n_elements(), 6);
    assert!(matches!(f.matrix("cube"), Err(GgufError::BadShape { .. })));
    assert!(matches!(f.matrix("nope"), Err(GgufError::MissingTensor(n)) if n == "nope"));
}

#[test]
fn typed_getters_accept_compatible_types_and_name_the_found_one() {
    let mut w = GgufWriter::default();
    w.add_meta("u8", 7u8)
        .add_meta("neg", -1i32)
        .add_meta("big", u64::MAX)
        .add_meta("f64", 0.5f64)
        .add_meta("flag", true)
        .add_meta("ints", vec![1u8, 2])
        .add_meta("too_big", vec![u32::MAX])
        .add_meta("floats", vec![1.0f64, 2.0])
        .add_meta("strs", vec!["x", "y"])
        .add_meta("empty", Vec::<u8>::new());
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();

    assert_eq!(f.get_u32("u8").unwrap(), 7);
    assert_eq!(f.get_u64("big").unwrap(), u64::MAX);
    assert_eq!(f.get_f32("f64").unwrap(), 0.5);
    assert!(f.get_bool("flag").unwrap());
    assert_eq!(f.get_i32_array("ints").unwrap(), [1, 2]);
    assert_eq!(f.get_f32_array("floats").unwrap(), [1.0, 2.0]);
    assert_eq!(f.get_str_array("strs").unwrap(), ["x", "y"]);
    assert!(f.get_str_array("empty").unwrap().is_empty());

    let err = f.get_u32("neg").unwrap_err();
    assert!(
        matches!(&err, GgufError::WrongType { key, found, .. } if key == "neg" && found == "i32")
    );
    assert_eq!(
        err.to_string(),
        "metadata key 'neg' has type i32, expected an integer that fits in u32"
    );
    assert!(f.get_u32("big").is_err());
    assert!(f.get_i32_array("too_big").is_err());
    let err = f.get_str("ints").unwrap_err().to_string();
    assert!(
        err.contains("'ints'") && err.contains("array of u8"),
        "{err}"
    );
    assert!(matches!(
        f.get_str("general.architecture"),
        Err(GgufError::MissingKey(_))
    ));
    assert!(
        matches!(f.architecture(), Err(GgufError::MissingKey(k)) if k == "general.architecture")
    );
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small_file();
    GgufFile::from_bytes(bytes.clone()).unwrap();
    for len in 0..bytes.len() {
        assert!(
            GgufFile::from_bytes(bytes[..len].to_vec()).is_err(),
            "prefix of {len} bytes parsed"
        );
    }
}

#[test]
fn bad_magic_and_versions_are_rejected() {
    let mut bytes = small_file();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(GgufError::BadMagic { found }) if &found == b"GGML"
    ));
    for version in [0, 1, 4, 0x0300_0000] {
        let mut w = GgufWriter::new(version);
        w.add_meta("a", 1u8);
        let r = GgufFile::from_bytes(w.to_bytes());
        assert!(matches!(r, Err(GgufError::UnsupportedVersion(v)) if v == version));
    }
    let mut w = GgufWriter::new(2);
    w.add_meta("a", 1u8);
    assert_eq!(GgufFile::from_bytes(w.to_bytes()).unwrap().version(), 2);
}

#[test]
fn tensor_data_past_the_end_is_rejected() {
    let good = small_file();
    let at = offset_field(&good, "last", 1);
    let original = u64::from_le_bytes(good[at..at + 8].try_into().unwrap());

    let mut bytes = good.clone();
    bytes[at..at + 8].copy_from_slice(&(original + 32).to_le_bytes());
    let msg = corrupt_msg(GgufFile::from_bytes(bytes));
    assert!(
        msg.contains("'last'") && msg.contains("past the end"),
        "{msg}"
    );

    let mut bytes = good.clone();
    bytes[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    corrupt_msg(GgufFile::from_bytes(bytes));

    let mut bytes = good;
    bytes[at..at + 8].copy_from_slice(&(original + 4).to_le_bytes());
    let msg = corrupt_msg(GgufFile::from_bytes(bytes));
    assert!(msg.contains("alignment"), "{msg}");
}

#[test]
fn overlapping_tensors_are_rejected() {
    // small_file: "odd" (12 bytes at 0), "q" (36 bytes at 32, to 68), "last" (32 bytes at 96).
    let good = small_file();
    let at = offset_field(&good, "last", 1);
    let moved = |offset: u64| {
        let mut bytes = good.clone();
        bytes[at..at + 8].copy_from_slice(&offset.to_le_bytes());
        corrupt_msg(GgufFile::from_bytes(bytes))
    };
    // Onto "odd": both would read the same weights.
    let msg = moved(0);
    assert_eq!(
        msg,
        "tensors 'odd' (data bytes 0..12) and 'last' (data bytes 0..32) overlap"
    );
    // Into the tail of "q".
    let msg = moved(64);
    assert!(
        msg.contains("'q'") && msg.contains("'last'") && msg.contains("overlap"),
        "{msg}"
    );

    // A tensor of a type Turbo does not know may not start inside another one either.
    let mut w = GgufWriter::default();
    w.add_tensor("known", &[16], DType::F32.ggml_id(), vec![0; 64])
        .unwrap();
    w.add_tensor("unknown", &[256], 12, vec![0; 144]).unwrap();
    let good = w.to_bytes();
    GgufFile::from_bytes(good.clone()).unwrap();
    let at = offset_field(&good, "unknown", 1);
    let mut bytes = good;
    bytes[at..at + 8].copy_from_slice(&32u64.to_le_bytes());
    let msg = corrupt_msg(GgufFile::from_bytes(bytes));
    assert!(
        msg.contains("'known'") && msg.contains("'unknown'"),
        "{msg}"
    );

    // Empty tensors hold no bytes, so they may share an offset with anything.
    let mut w = GgufWriter::default();
    w.add_tensor("a", &[0], 0, vec![]).unwrap();
    w.add_tensor("b", &[4], 0, vec![1; 16]).unwrap();
    w.add_tensor("c", &[0, 3], 0, vec![]).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.tensor("a").unwrap().offset, f.tensor("b").unwrap().offset);
}

/// Whether a terminal would act on something in `s` rather than print it.
fn has_control(s: &str) -> bool {
    s.chars()
        .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c))
}

/// Keys, tensor names and strings come from the file: messages show them escaped, never raw.
#[test]
fn names_from_the_file_are_escaped_in_messages() {
    let evil = "\u{1b}]0;pwned\u{7}\u{1b}[2J\r\nfake line\u{202e}";
    let shown = r"\u{1b}]0;pwned\u{7}\u{1b}[2J\r\nfake line\u{202e}";

    // A key whose value has an unknown type.
    let bytes = Raw::header(3, 0, 1)
        .str(evil.as_bytes())
        .u32(13)
        .bytes(&[0; 8])
        .0;
    let msg = GgufFile::from_bytes(bytes).unwrap_err().to_string();
    assert!(!has_control(&msg), "{msg:?}");
    assert!(msg.contains(&format!("metadata key '{shown}'")), "{msg}");

    // A key that is not UTF-8 is shown decoded lossily.
    let bytes = Raw::header(3, 0, 1)
        .str(b"bad\xff\x1b[31mkey")
        .u32(7)
        .bytes(&[1])
        .0;
    let msg = GgufFile::from_bytes(bytes).unwrap_err().to_string();
    assert!(!has_control(&msg), "{msg:?}");
    assert!(msg.contains("'bad\u{fffd}\\u{1b}[31mkey'"), "{msg}");

    // Tensor names, in the reader's own errors and in look-ups by name.
    let mut w = GgufWriter::default();
    w.add_tensor(evil, &[3, 1, 1], 0, vec![0; 12]).unwrap();
    w.add_tensor(format!("{evil}2"), &[256], 16, vec![0; 66])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    for err in [
        f.matrix(evil).unwrap_err(),
        f.matrix(&format!("{evil}2")).unwrap_err(),
        f.matrix(&format!("{evil}3")).unwrap_err(),
    ] {
        let msg = err.to_string();
        assert!(!has_control(&msg), "{msg:?}");
        assert!(msg.contains(shown), "{msg}");
    }
    let mut w = GgufWriter::default();
    w.add_tensor(evil, &[4], 0, vec![0; 16]).unwrap();
    let good = w.to_bytes();
    let at = offset_field(&good, evil, 1);
    let mut bytes = good;
    bytes[at..at + 8].copy_from_slice(&4u64.to_le_bytes());
    let msg = GgufFile::from_bytes(bytes).unwrap_err().to_string();
    assert!(!has_control(&msg) && msg.contains(shown), "{msg:?}");

    // Values: a string where a number belongs names the key, escaped.
    let mut w = GgufWriter::default();
    w.add_meta(evil, "x");
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let msg = f.get_u32(evil).unwrap_err().to_string();
    assert!(!has_control(&msg) && msg.contains(shown), "{msg:?}");
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    for elem_type in [0u32, 8, 9] {
        let bytes = Raw::header(3, 0, 1)
            .str(b"k")
            .u32(9)
            .u32(elem_type)
            .u64(1 << 60)
            .0;
        let msg = corrupt_msg(GgufFile::from_bytes(bytes));
        assert!(msg.contains("'k'") && msg.contains("array length"), "{msg}");
    }
    corrupt_msg(GgufFile::from_bytes(Raw::header(3, 1 << 60, 0).0));
    corrupt_msg(GgufFile::from_bytes(Raw::header(3, 0, u64::MAX).0));
    let long_key = Raw::header(3, 0, 1).u64(1 << 60).bytes(&[0; 16]).0;
    assert!(matches!(
        GgufFile::from_bytes(long_key),
        Err(GgufError::Truncated { offset: 24, .. })
    ));
}

#[test]
fn malformed_metadata_is_rejected() {
    let kv = |key: &[u8], ty: u32, value: &[u8]| {
        GgufFile::from_bytes(Raw::header(3, 0, 1).str(key).u32(ty).bytes(value).0)
    };
    assert!(kv(b"k", 7, &[1]).is_ok());
    assert!(corrupt_msg(kv(b"\xff", 7, &[1])).contains("UTF-8"));
    assert!(corrupt_msg(kv(b"k", 13, &[0; 8])).contains("unknown metadata value type 13"));
    assert!(corrupt_msg(kv(b"k", 7, &[2])).contains("bool"));
    let bad_alignment = kv(b"general.alignment", 4, &48u32.to_le_bytes());
    assert!(corrupt_msg(bad_alignment).contains("general.alignment"));
    let dup = Raw::header(3, 0, 2)
        .str(b"k")
        .u32(0)
        .bytes(&[1])
        .str(b"k")
        .u32(0)
        .bytes(&[2]);
    assert!(corrupt_msg(GgufFile::from_bytes(dup.0)).contains("duplicate"));

    // Arrays nested far deeper than any reader should recurse.
    let mut deep = Raw::header(3, 0, 1).str(b"k").u32(9);
    for _ in 0..100_000 {
        deep = deep.u32(9).u64(1);
    }
    assert!(corrupt_msg(GgufFile::from_bytes(deep.0)).contains("nested"));
}

#[test]
fn unsupported_tensor_types_load_but_do_not_become_matrices() {
    let mut w = GgufWriter::default();
    // IQ2_XXS: 256-element blocks of 66 bytes.
    w.add_tensor("blk.0.attn_q.weight", &[256, 2], 16, vec![0; 132])
        .unwrap();
    w.add_tensor("after", &[4], 0, vec![0; 16]).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let info = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(info.dtype(), None);
    assert_eq!(info.n_elements(), 512);
    assert!(f.matrix("after").is_ok());

    let err = f.matrix("blk.0.attn_q.weight").unwrap_err();
    assert!(
        matches!(&err, GgufError::UnsupportedTensorType { type_name, .. } if type_name == "IQ2_XXS")
    );
    assert_eq!(
        err.to_string(),
        "tensor 'blk.0.attn_q.weight' has type IQ2_XXS, which Turbo does not support \
         (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"
    );
    assert!(matches!(
        f.tensor_bytes(info),
        Err(GgufError::UnsupportedTensorType { .. })
    ));
}

#[test]
fn writer_validates_tensors() {
    let mut w = GgufWriter::default();
    let short = w.add_tensor("a", &[32], DType::Q4_1.ggml_id(), vec![0; 19]);
    assert!(matches!(short, Err(GgufError::BadShape { .. })));
    let partial_block = w.add_tensor("a", &[16], DType::Q8_0.ggml_id(), vec![0; 17]);
    assert!(matches!(partial_block, Err(GgufError::BadShape { .. })));
    w.add_tensor("a", &[2], 0, vec![0; 8]).unwrap();
    assert!(w.add_tensor("a", &[2], 0, vec![0; 8]).is_err());
    assert!(w.add_tensor("b", &[1; 5], 0, vec![0; 4]).is_err());
}

#[test]
#[should_panic(expected = "homogeneous")]
fn writer_refuses_mixed_arrays() {
    GgufWriter::default().add_meta("k", MetaValue::Array(vec![1u8.into(), 1u16.into()]));
}

/// Any value of GGUF type `ty`, with arrays nested at most `depth` deep.
fn value_of_type(ty: u32, depth: u32) -> BoxedStrategy<MetaValue> {
    use MetaValue::*;
    let not_nan32 = any::<f32>().prop_filter("NaN != NaN", |v| !v.is_nan());
    let not_nan64 = any::<f64>().prop_filter("NaN != NaN", |v| !v.is_nan());
    match ty {
        0 => any::<u8>().prop_map(U8).boxed(),
        1 => any::<i8>().prop_map(I8).boxed(),
        2 => any::<u16>().prop_map(U16).boxed(),
        3 => any::<i16>().prop_map(I16).boxed(),
        4 => any::<u32>().prop_map(U32).boxed(),
        5 => any::<i32>().prop_map(I32).boxed(),
        6 => not_nan32.prop_map(F32).boxed(),
        7 => any::<bool>().prop_map(Bool).boxed(),
        8 => any::<std::string::String>().prop_map(String).boxed(),
        9 => (0..if depth > 0 { 13u32 } else { 9 })
            .prop_flat_map(move |elem| {
                prop::collection::vec(value_of_type(elem, depth.saturating_sub(1)), 0..5)
            })
            .prop_map(Array)
            .boxed(),
        10 => any::<u64>().prop_map(U64).boxed(),
        11 => any::<i64>().prop_map(I64).boxed(),
        _ => not_nan64.prop_map(F64).boxed(),
    }
}

fn any_value() -> impl Strategy<Value = MetaValue> {
    (0..13u32).prop_flat_map(|ty| value_of_type(ty, 2))
}

proptest! {
    #[test]
    fn files_round_trip(
        meta in prop::collection::vec(any_value(), 0..12),
        shapes in prop::collection::vec((1usize..4, 1usize..3), DType::WRITABLE.len()),
        seed in any::<u32>(),
        version in 2u32..=3,
    ) {
        let meta: Vec<_> = meta.into_iter().enumerate().map(|(i, v)| (format!("key{i}"), v)).collect();
        let mut w = GgufWriter::new(version);
        for (k, v) in &meta {
            w.add_meta(k.clone(), v.clone());
        }
        let mut expected = Vec::new();
        for (dtype, (rows, blocks)) in DType::WRITABLE.into_iter().zip(shapes) {
            let cols = blocks * dtype.block_len().max(4);
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
                .collect();
            let data = quantize_row(dtype, &values);
            let name = format!("blk.0.{dtype}");
            w.add_tensor(name.clone(), &[cols as u64, rows as u64], dtype.ggml_id(), data.clone()).unwrap();
            expected.push((name, dtype, rows, cols, data));
        }
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        prop_assert_eq!(f.version(), version);
        prop_assert_eq!(f.metadata(), &meta[..]);
        for (k, v) in &meta {
            prop_assert_eq!(f.get(k), Some(v));
        }
        prop_assert_eq!(f.tensors().len(), expected.len());
        for (name, dtype, rows, cols, data) in expected {
            prop_assert_eq!(f.tensor(&name).unwrap().dtype(), Some(dtype));
            let m = f.matrix(&name).unwrap();
            prop_assert_eq!((m.dtype, m.rows, m.cols), (dtype, rows, cols));
            prop_assert_eq!(m.data.as_slice(), &data[..]);
        }
    }

    #[test]
    fn corrupt_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = small_file();
        for (at, byte) in edits {
            let at = at.index(bytes.len());
            bytes[at] = if byte < 16 { bytes[at] ^ (1 << (byte % 8)) } else { byte };
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            for (key, _) in f.metadata() {
                let _ = (f.get_u32(key), f.get_str(key), f.get_str_array(key), f.get_i32_array(key));
                let _ = (f.get_f32(key), f.get_f32_array(key), f.get_bool(key), f.get_u64(key));
            }
            for t in f.tensors() {
                let _ = f.tensor_bytes(t);
                if let Ok(m) = f.matrix(&t.name) {
                    m.to_f32();
                }
            }
        }
    }
}
