//! Turbo's logits against the naive f64 reference forward pass, on tiny random models in every
//! format and element type Turbo loads.
//!
//! Tolerance: the engine computes in f32 (f32 accumulation over dot products of at most ~100
//! terms, f32 softmax and RMSNorm), so its logits carry rounding errors of a few f32 ulps of the
//! logit scale, ~1e-6 relative. We require `max |engine − reference| / (1 + max |reference|)`
//! below `TOL` = 1e-4: two orders of magnitude of headroom for rounding, while any real mistake
//! (a wrong RoPE pair or frequency, a wrong KV head, an off-by-one position, a misdecoded block,
//! a missing norm weight) moves logits by 1e-2 or more. Quantized models are compared with the
//! reference run on the *dequantized* weights (decoded independently in `turbo_tests::decode`),
//! so quantization error itself is not part of the difference.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use turbo_core::Backend;
use turbo_llama::{LoadedModel, Logits, SequenceChunk};
use turbo_tests::engine::rows;
use turbo_tests::{
    cpu_model, engine_logits, max_rel_diff, max_rel_err, random_tokens, reference_logits,
    write_gguf, write_hf, DType, RefWeights, RopeStyle, TinySpec, TinyWeights,
};

const TOL: f64 = 1e-4;

/// Runs of the same model that differ only in how the work is split (prefill chunks vs one pass,
/// GEMM vs GEMV, block placement) must agree to f32 rounding of the different summation orders.
const SPLIT_TOL: f64 = 1e-5;

fn gguf(spec: &TinySpec, dtype: DType) -> (tempfile::TempDir, LoadedModel, RefWeights) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let stored = write_gguf(&path, spec, &TinyWeights::random(spec), dtype);
    let loaded = LoadedModel::load(&path).unwrap();
    (dir, loaded, stored)
}

fn hf(spec: &TinySpec, dtype: DType) -> (tempfile::TempDir, LoadedModel, RefWeights) {
    let dir = tempfile::tempdir().unwrap();
    let stored = write_hf(dir.path(), spec, &TinyWeights::random(spec), dtype);
    let loaded = LoadedModel::load(dir.path()).unwrap();
    (dir, loaded, stored)
}

/// Checks the engine's logits at every position against the reference.
fn check(
    label: &str,
    spec: &TinySpec,
    loaded: &LoadedModel,
    stored: &RefWeights,
    style: RopeStyle,
) {
    let tokens = random_tokens(spec, 24, spec.seed);
    let got = engine_logits(&cpu_model(loaded), &tokens);
    let want = reference_logits(spec, stored, &tokens, style);
    let err = max_rel_err(&got, &want);
    let scale = want.iter().flatten().fold(0f64, |a, b| a.max(b.abs()));
    eprintln!("{label}: max |logit| {scale:.2}, error {err:.2e}");
    assert!(err < TOL, "{label}: error {err:e} (tolerance {TOL:e})");
}

/// Every type a test can write; the types only read from files (K-quants, Q5_0/Q5_1) are
/// checked against the gguf package's decoder and their F32 twins in `kquants.rs`.
#[test]
fn gguf_every_dtype_matches_reference() {
    for (i, dtype) in DType::WRITABLE.into_iter().enumerate() {
        let spec = TinySpec {
            seed: 10 + i as u64,
            ..TinySpec::default()
        };
        let (_dir, loaded, stored) = gguf(&spec, dtype);
        assert_eq!(wq_dtype(&loaded), dtype);
        check(
            &format!("GGUF {dtype}"),
            &spec,
            &loaded,
            &stored,
            RopeStyle::Interleaved,
        );
    }
}

/// GQA ratios 1, 2 and 4 (head dims 16, 16 and 8), tied and untied heads, one to three layers.
#[test]
fn gguf_gqa_ratios_and_tied_heads() {
    for (heads, kv_heads, layers) in [(4, 4, 1), (4, 2, 2), (8, 2, 3)] {
        for tied in [false, true] {
            for dtype in [DType::F32, DType::Q8_0] {
                let spec = TinySpec {
                    heads,
                    kv_heads,
                    layers,
                    tied,
                    seed: (heads * 100 + kv_heads * 10 + tied as usize) as u64,
                    ..TinySpec::default()
                };
                let (_dir, loaded, stored) = gguf(&spec, dtype);
                assert_eq!(loaded.config.tie_word_embeddings, tied);
                assert_eq!(loaded.weights.lm_head.is_none(), tied);
                let label = format!("GGUF {dtype} heads {heads}/{kv_heads} tied {tied}");
                check(&label, &spec, &loaded, &stored, RopeStyle::Interleaved);
            }
        }
    }
}

/// HF checkpoints store W_q/W_k permuted for rotate-half RoPE; the loader de-permutes them. The
/// reference runs HF's own formulation (rotate-half on the HF-layout weights), so a wrong
/// de-permutation cannot cancel out.
#[test]
fn hf_matches_rotate_half_reference() {
    for (dtype, heads, kv_heads, tied) in [
        (DType::F32, 4, 2, false),
        (DType::F32, 8, 2, true),
        (DType::F32, 4, 4, true),
        (DType::BF16, 4, 2, true),
        (DType::BF16, 8, 2, false),
        (DType::F16, 4, 1, false),
    ] {
        let spec = TinySpec {
            heads,
            kv_heads,
            tied,
            seed: 77 + heads as u64 + kv_heads as u64,
            ..TinySpec::default()
        };
        let (_dir, loaded, stored) = hf(&spec, dtype);
        assert_eq!(wq_dtype(&loaded), dtype);
        let label = format!("HF {dtype} heads {heads}/{kv_heads} tied {tied}");
        check(&label, &spec, &loaded, &stored, RopeStyle::RotateHalf);
    }
}

/// The HF directory and the GGUF of the same f32 weights load to the same model.
#[test]
fn hf_and_gguf_of_the_same_weights_agree() {
    let spec = TinySpec {
        heads: 8,
        kv_heads: 4,
        seed: 5,
        ..TinySpec::default()
    };
    let (_d1, from_gguf, _) = gguf(&spec, DType::F32);
    let (_d2, from_hf, _) = hf(&spec, DType::F32);
    assert_eq!(from_gguf.config, from_hf.config);
    for (a, b) in from_gguf.weights.layers.iter().zip(&from_hf.weights.layers) {
        assert_eq!(a.wq.to_f32(), b.wq.to_f32());
        assert_eq!(a.wk.to_f32(), b.wk.to_f32());
    }
    let tokens = random_tokens(&spec, 20, 3);
    let a = engine_logits(&cpu_model(&from_gguf), &tokens);
    let b = engine_logits(&cpu_model(&from_hf), &tokens);
    assert_eq!(a, b, "same weights, same computation");
}

/// A block table of `n` distinct ids drawn from a shuffled pool of `pool` blocks.
fn shuffled_blocks(pool: u32, n: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..pool).collect();
    ids.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    assert_ne!(
        ids[..n],
        (ids[0]..ids[0] + n as u32).collect::<Vec<_>>()[..]
    );
    ids.truncate(n);
    ids
}

/// A prompt prefilled in two calls (7 then 5 tokens) and then decoded one token per call, over
/// 4-token blocks scattered through the cache, gives the single-shot logits.
#[test]
fn split_prefill_and_decode_over_scattered_blocks() {
    for (heads, kv_heads, dtype) in [(4, 2, DType::F32), (8, 2, DType::Q4_1), (4, 4, DType::BF16)] {
        let spec = TinySpec {
            heads,
            kv_heads,
            seed: 31 + heads as u64,
            ..TinySpec::default()
        };
        let (_dir, loaded, stored) = gguf(&spec, dtype);
        let model = cpu_model(&loaded);
        let tokens = random_tokens(&spec, 18, 9);
        let single = engine_logits(&model, &tokens);

        let block_size = 4;
        let table = shuffled_blocks(32, tokens.len().div_ceil(block_size), spec.seed);
        let mut cache = model
            .backend()
            .kv_cache(model.kv_spec(block_size, 32))
            .unwrap();
        let mut split = Vec::new();
        let mut run = |start: usize, end: usize, which: Logits| {
            let chunk = SequenceChunk {
                tokens: tokens[start..end].to_vec(),
                start,
                position: start,
                // Only the blocks the sequence needs so far.
                block_table: table[..end.div_ceil(block_size)].to_vec(),
                scoring: None,
            };
            let out = model.forward(&[chunk], &mut cache, which).unwrap();
            rows(&out, spec.vocab)
        };
        split.extend(run(0, 7, Logits::All));
        split.extend(run(7, 12, Logits::All));
        for t in 12..tokens.len() {
            let out = run(
                t,
                t + 1,
                if t % 2 == 0 {
                    Logits::Last
                } else {
                    Logits::All
                },
            );
            assert_eq!(out.len(), 1);
            split.extend(out);
        }
        let diff = max_rel_diff(&split, &single);
        let err = max_rel_err(
            &split,
            &reference_logits(&spec, &stored, &tokens, RopeStyle::Interleaved),
        );
        eprintln!("split {dtype} heads {heads}/{kv_heads}: vs single shot {diff:.2e}, vs reference {err:.2e}");
        assert!(diff < SPLIT_TOL, "split vs single shot: {diff:e}");
        assert!(err < TOL, "split vs reference: {err:e}");

        // Logits::Last of a chunk is the last row of Logits::All.
        let mut cache = model
            .backend()
            .kv_cache(model.kv_spec(block_size, 32))
            .unwrap();
        let chunk = SequenceChunk {
            tokens: tokens[..10].to_vec(),
            start: 0,
            position: 0,
            block_table: table[..3].to_vec(),
            scoring: None,
        };
        let last = model.forward(&[chunk], &mut cache, Logits::Last).unwrap();
        assert!(max_rel_diff(&[last], &single[9..10]) < SPLIT_TOL);
    }
}

/// Two sequences in one forward call, one continuing a cached history and one starting fresh,
/// with their blocks interleaved in the cache, each get their own causal attention.
#[test]
fn batched_sequences_attend_only_to_themselves() {
    let spec = TinySpec {
        heads: 8,
        kv_heads: 2,
        seed: 4,
        ..TinySpec::default()
    };
    let (_dir, loaded, stored) = gguf(&spec, DType::Q8_0);
    let model = cpu_model(&loaded);
    let a = random_tokens(&spec, 13, 1);
    let b = random_tokens(&spec, 9, 2);
    let block_size = 4;
    let pool = shuffled_blocks(16, 7, 8);
    let (table_a, table_b) = (
        pool.iter().step_by(2).copied().collect::<Vec<_>>(),
        pool.iter().skip(1).step_by(2).copied().collect::<Vec<_>>(),
    );
    assert_eq!((table_a.len(), table_b.len()), (4, 3));
    let mut cache = model
        .backend()
        .kv_cache(model.kv_spec(block_size, 16))
        .unwrap();
    let first = model
        .forward(
            &[SequenceChunk {
                tokens: a[..6].to_vec(),
                start: 0,
                position: 0,
                block_table: table_a.clone(),
                scoring: None,
            }],
            &mut cache,
            Logits::All,
        )
        .unwrap();
    let both = model
        .forward(
            &[
                SequenceChunk {
                    tokens: a[6..].to_vec(),
                    start: 6,
                    position: 6,
                    block_table: table_a,
                    scoring: None,
                },
                SequenceChunk {
                    tokens: b.clone(),
                    start: 0,
                    position: 0,
                    block_table: table_b,
                    scoring: None,
                },
            ],
            &mut cache,
            Logits::All,
        )
        .unwrap();
    let mut got_a = rows(&first, spec.vocab);
    let both = rows(&both, spec.vocab);
    got_a.extend_from_slice(&both[..a.len() - 6]);
    let got_b = &both[a.len() - 6..];
    let ref_a = reference_logits(&spec, &stored, &a, RopeStyle::Interleaved);
    let ref_b = reference_logits(&spec, &stored, &b, RopeStyle::Interleaved);
    let (ea, eb) = (max_rel_err(&got_a, &ref_a), max_rel_err(got_b, &ref_b));
    eprintln!("batched: sequence a {ea:.2e}, sequence b {eb:.2e}");
    assert!(ea < TOL && eb < TOL);
}

/// Long enough for RoPE angles to wrap many times over at the fastest frequency.
#[test]
fn longer_sequence_matches_reference() {
    let spec = TinySpec {
        context: 256,
        rope_theta: 500000.0,
        seed: 12,
        ..TinySpec::default()
    };
    let (_dir, loaded, stored) = gguf(&spec, DType::F16);
    let tokens = random_tokens(&spec, 150, 6);
    let got = engine_logits(&cpu_model(&loaded), &tokens);
    let err = max_rel_err(
        &got,
        &reference_logits(&spec, &stored, &tokens, RopeStyle::Interleaved),
    );
    eprintln!("150 tokens: error {err:.2e}");
    assert!(err < TOL, "{err:e}");
}

fn wq_dtype(loaded: &LoadedModel) -> DType {
    loaded.weights.layers[0].wq.dtype
}

/// KV eviction: after a prefill each (layer, KV head) keeps its own random subset of the keys (the
/// same count everywhere), compacted into the leading key indices of scattered blocks; the tokens
/// after it run at their true positions (a chunk, then decode steps) over the kept keys. Their
/// logits match the f64 reference whose queries see exactly the kept keys and the later ones.
#[test]
fn compacted_kv_matches_the_masked_reference() {
    use turbo_tests::engine::Compaction;
    use turbo_tests::reference_logits_masked;
    for (heads, kv_heads, dtype, seed) in [(4, 2, DType::F32, 5), (8, 2, DType::Q8_0, 6)] {
        let spec = TinySpec {
            heads,
            kv_heads,
            seed,
            ..Default::default()
        };
        let (_dir, loaded, stored) = gguf(&spec, dtype);
        let model = cpu_model(&loaded);
        let (prefill, k, total, block_size) = (24, 10, 40, 4);
        let tokens = random_tokens(&spec, total, seed + 1);
        let scenario = Compaction {
            prefill,
            kept: Compaction::random(spec.layers, kv_heads, prefill, k, seed + 2),
            k,
            block_size,
            block_table: shuffled_blocks(
                64,
                prefill.max(k + total - prefill).div_ceil(block_size),
                seed + 3,
            ),
            chunk: 6,
        };
        let got = scenario.run(&model, &tokens);
        let visible = |l, h, t, j| scenario.visible(kv_heads, l, h, t, j);
        let want =
            reference_logits_masked(&spec, &stored, &tokens, RopeStyle::Interleaved, &visible);
        let err = max_rel_err(&got, &want[prefill..]);
        eprintln!("{dtype} {heads}/{kv_heads} heads: compacted error {err:.2e}");
        assert!(err < TOL, "{dtype}: error {err:e} (tolerance {TOL:e})");
        // Eviction changes the logits: the comparison can tell kept keys from all keys.
        let full = reference_logits(&spec, &stored, &tokens, RopeStyle::Interleaved);
        assert!(max_rel_err(&got, &full[prefill..]) > 100.0 * TOL);
    }
}
