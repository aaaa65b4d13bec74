//! Models whose matrices are in the 5-bit and K-quant formats of llama.cpp's quantizer load and
//! run: every tensor's values are the ones its blocks decode to (that decoding is checked bit for
//! bit against the gguf package's reference in turbo-core), and a file of K-quants computes what
//! the same weights stored as F32 compute, through prefill (decode-into-GEMM) and decode steps
//! (the row-streaming GEMV). Tolerance: both files hold the same f32 weights, so logits agree to
//! f32 rounding of different summation orders (`SPLIT_TOL` = 1e-5 relative, as elsewhere).

use rand::{Rng, SeedableRng};
use turbo_core::quant::{dequantize_row, random_blocks};
use turbo_llama::LoadedModel;
use turbo_scheduler::{BatchConfig, Request};
use turbo_tests::alone::run_together;
use turbo_tests::files::{gguf_metadata, gguf_tensors, gguf_writer};
use turbo_tests::{
    cpu_model, engine_logits, max_rel_diff, random_tokens, DType, TinySpec, TinyWeights,
};

const SPLIT_TOL: f64 = 1e-5;

/// Rows of 256 (whole K-quant super-blocks) in every matrix.
fn spec() -> TinySpec {
    TinySpec {
        vocab: 320,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ffn: 512,
        context: 256,
        seed: 21,
        ..TinySpec::default()
    }
}

/// Writes the same random weights twice: matrices in `types` (round-robin over the tensors, as
/// llama.cpp's mixes put several types in one file), and decoded to F32.
fn twin_files(types: &[DType], dir: &std::path::Path) -> (LoadedModel, LoadedModel) {
    let spec = spec();
    let (mut quant, _) = gguf_tensors(&spec, &TinyWeights::random(&spec), DType::F32);
    let mut plain = quant.clone();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut next = 0;
    for (q, p) in quant.iter_mut().zip(&mut plain) {
        if q.dims.len() != 2 {
            continue; // norms stay F32
        }
        let dtype = types[next % types.len()];
        next += 1;
        let (cols, rows) = (q.dims[0] as usize, q.dims[1] as usize);
        let bytes = random_blocks(dtype, rows * cols / dtype.block_len(), || rng.random());
        let mut values = vec![0f32; rows * cols];
        let row_bytes = bytes.len() / rows;
        for (r, out) in values.chunks_exact_mut(cols).enumerate() {
            dequantize_row(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], out);
        }
        q.ggml_type = dtype.ggml_id();
        q.data = bytes;
        p.data = bytemuck::cast_slice(&values).to_vec();
    }
    let meta = gguf_metadata(&spec);
    let (qp, pp) = (dir.join("quant.gguf"), dir.join("f32.gguf"));
    gguf_writer(&meta, &quant).write(&qp).unwrap();
    gguf_writer(&meta, &plain).write(&pp).unwrap();
    (
        LoadedModel::load(&qp).unwrap(),
        LoadedModel::load(&pp).unwrap(),
    )
}

fn greedy(loaded: &LoadedModel, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let config = BatchConfig {
        max_batch: 4,
        max_batched_tokens: 64,
        num_blocks: 64,
        ..BatchConfig::default()
    };
    let requests = prompts
        .iter()
        .map(|p| Request {
            max_tokens: 16,
            ignore_eos: true,
            ..Request::new(p.clone())
        })
        .collect();
    let (done, _) = run_together(cpu_model(loaded), &loaded.tokenizer, config, requests);
    done.into_iter().map(|c| c.token_ids).collect()
}

#[test]
fn kquant_files_compute_what_their_f32_weights_do() {
    let spec = spec();
    let cases: [&[DType]; 7] = [
        &[DType::Q4_K, DType::Q6_K, DType::Q5_0],
        &[DType::Q5_K, DType::Q6_K, DType::Q5_1],
        &[DType::Q2_K, DType::Q3_K, DType::Q4_K],
        &[DType::Q3_K],
        &[DType::Q6_K],
        &[DType::Q5_0],
        &[DType::Q5_1],
    ];
    for types in cases {
        let dir = tempfile::tempdir().unwrap();
        let (quant, plain) = twin_files(types, dir.path());
        let tokens = random_tokens(&spec, 40, 2);
        let d = max_rel_diff(
            &engine_logits(&cpu_model(&quant), &tokens),
            &engine_logits(&cpu_model(&plain), &tokens),
        );
        eprintln!("{types:?}: prefill logits vs F32 {d:.2e}");
        assert!(d < SPLIT_TOL, "{types:?}: {d:e}");
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| random_tokens(&spec, 5 + 7 * i, 30 + i as u64))
            .collect();
        assert_eq!(
            greedy(&quant, &prompts),
            greedy(&plain, &prompts),
            "{types:?}"
        );
    }
}
