//! End-to-end test support: tiny random LLaMA models, writers for the file formats Turbo loads,
//! an independent f64 decoder of their element types, and a naive f64 reference forward pass.
//!
//! - [`TinySpec`] / [`TinyWeights`]: a model's shape and its seeded random f32 weights, in the
//!   native layout (W_q/W_k rows in interleaved-pair RoPE order, as GGUF holds them).
//! - [`vocab`]: a tiny byte-level BPE vocabulary (GPT-2 byte characters, a few merges, ChatML
//!   control tokens) that Turbo's GGUF tokenizer builder accepts.
//! - [`write_gguf`] / [`write_hf`]: write a model; both return the weights as stored (after
//!   quantization or rounding), decoded in f64 by [`decode`], for the reference.
//! - [`reference_logits`]: the f64 forward pass, with [`RopeStyle`] choosing GGUF's interleaved
//!   pairs or HF's rotate-half.
//! - [`engine`]: Turbo's logits for a loaded model, to compare with [`max_rel_err`].
//! - [`alone`]: a request run alone on a fresh persistent batch of one slot, the reference for
//!   batched, cached and GPU generation.

pub mod alone;
pub mod decode;
pub mod default_model;
pub mod engine;
pub mod files;
pub mod reference;
pub mod tiny;
pub mod vocab;

pub use engine::{cpu_model, cpu_model_split, engine_logits, load_and_run};
pub use files::{gguf_metadata, gguf_tensors, gguf_writer, write_gguf, write_hf, GgufTensor};
pub use reference::{
    max_rel_diff, max_rel_err, reference_logits, reference_logits_masked, RopeStyle,
};
pub use tiny::{random_tokens, RefWeights, TinySpec, TinyWeights, Weights};
pub use turbo_core::DType;
