use crate::{Device, EngineError, LoadedModelInfo};
use turbo_core::Backend;
use turbo_llama::Llama;

/// Share of free GPU memory (measured after the weights are loaded) that the KV cache takes when
/// no size is given: the rest is left for activations, cuBLAS workspaces and other processes.
pub const DEFAULT_GPU_KV_FRACTION: f64 = 0.9;

/// Most bytes the CPU's default KV cache may grow to (1 GiB): its storage grows as blocks are
/// used, so without a cap a server under load would take memory until the machine swaps. A
/// larger cache is asked for with an explicit size.
pub const DEFAULT_CPU_KV_BYTES: usize = 1 << 30;

/// The size of the persistent batch's KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvSize {
    Blocks(usize),
    /// Bytes (of the backend's KV element type).
    Bytes(f64),
    /// A fraction in (0, 1] of the device's free memory once the weights are loaded (on the
    /// CPU, of `MemAvailable`).
    Fraction(f64),
    /// Room for this many sequences of the model's whole context, on any device.
    Contexts(usize),
    /// A GPU takes [`DEFAULT_GPU_KV_FRACTION`] of its free memory; the CPU, whose KV storage only
    /// grows as blocks are used, room for `cpu_slots` sequences of `cpu_tokens_per_slot` tokens
    /// (at most the model's context each), at most [`DEFAULT_CPU_KV_BYTES`].
    Default {
        cpu_slots: usize,
        cpu_tokens_per_slot: usize,
    },
}

impl KvSize {
    /// KV blocks for `model`. Refuses sizes that are not positive, a fraction outside (0, 1],
    /// sizes below one block, and explicit sizes (blocks, bytes) past the device's free memory;
    /// sizes derived from the model's context (room for N contexts, the CPU default) are cut to
    /// [`DEFAULT_GPU_KV_FRACTION`] of free memory instead, so that a model declaring a huge
    /// context still runs, its requests bounded by the cache.
    pub fn num_blocks<B: Backend>(
        &self,
        model: &Llama<B>,
        info: &LoadedModelInfo,
    ) -> Result<usize, EngineError> {
        let block_size = info.block_size;
        let block_bytes = model
            .kv_spec(block_size, 1)
            .bytes_per_token_with(model.backend().kv_element_bytes())
            .checked_mul(block_size)
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                EngineError::Config(format!("a KV block of {block_size} tokens is too large"))
            })?;
        let free = model.backend().free_memory();
        let backend = model.backend().name();
        let config = |m: String| Err(EngineError::Config(m));
        // Explicit sizes past free memory are refused, naming what they need.
        let at_most_free = |blocks: usize, what: String| -> Result<usize, EngineError> {
            let bytes = (blocks as u128) * (block_bytes as u128);
            match free {
                Some(free) if bytes > free as u128 => config(format!(
                    "{what} needs {bytes} bytes of KV, more than the {free} bytes free on \
                     {backend}"
                )),
                _ => Ok(blocks),
            }
        };
        // Sizes derived from the context fit in memory instead.
        let cut_to_free = |blocks: usize, what: &str| -> usize {
            let Some(free) = free else { return blocks };
            let fits = ((free as f64 * DEFAULT_GPU_KV_FRACTION) / block_bytes as f64) as usize;
            if blocks > fits {
                tracing::warn!(
                    "{what} needs {blocks} KV blocks; {fits} fit in {DEFAULT_GPU_KV_FRACTION} of \
                     the {free} bytes free, so longer sequences are refused"
                );
                fits.max(1)
            } else {
                blocks
            }
        };
        let from_bytes = |bytes: f64, what: String| -> Result<usize, EngineError> {
            let blocks = (bytes / block_bytes as f64).floor();
            if blocks < 1.0 {
                return config(format!(
                    "{what} is less than one KV block ({block_bytes} bytes)"
                ));
            }
            Ok(blocks.min(u32::MAX as f64) as usize)
        };
        let fraction_of_free = |f: f64, what: String| -> Result<usize, EngineError> {
            let Some(free) = free else {
                return config(format!(
                    "{what}: {backend} does not report its free memory; give the KV cache's size \
                     in blocks or bytes"
                ));
            };
            from_bytes(f * free as f64, format!("{what} of {free} free bytes"))
        };
        let blocks = match *self {
            KvSize::Blocks(0) => config("the KV cache needs at least one block".into()),
            KvSize::Blocks(n) if u32::try_from(n).is_err() => config(format!(
                "{n} KV blocks is more than the {} allowed",
                u32::MAX
            )),
            KvSize::Blocks(n) => at_most_free(n, format!("a KV cache of {n} blocks")),
            KvSize::Contexts(0) => {
                config("the KV cache needs room for at least one sequence".into())
            }
            KvSize::Contexts(n) => {
                let blocks = info.context_length.div_ceil(block_size).saturating_mul(n);
                Ok(cut_to_free(
                    blocks.min(u32::MAX as usize),
                    &format!("room for {n} contexts of {} tokens", info.context_length),
                ))
            }
            KvSize::Bytes(bytes) => {
                if !(bytes.is_finite() && bytes > 0.0) {
                    return config(format!(
                        "the KV cache size must be a positive number of bytes, got {bytes:?}"
                    ));
                }
                let what = format!("a KV cache of {} bytes", shown(bytes));
                match free {
                    Some(free) if bytes > free as f64 => config(format!(
                        "{what} is more than the {free} bytes free on {backend}"
                    )),
                    _ => from_bytes(bytes, what),
                }
            }
            KvSize::Fraction(f) => {
                if !(f > 0.0 && f <= 1.0) {
                    return config(format!(
                        "the KV cache fraction must be in (0, 1], got {f:?}"
                    ));
                }
                fraction_of_free(f, format!("a KV cache fraction of {f:?}"))
            }
            KvSize::Default {
                cpu_slots,
                cpu_tokens_per_slot,
            } => match info.device {
                Device::Cuda(_) => fraction_of_free(
                    DEFAULT_GPU_KV_FRACTION,
                    format!("the default KV cache ({DEFAULT_GPU_KV_FRACTION} of free memory)"),
                ),
                _ => {
                    let tokens = cpu_tokens_per_slot.min(info.context_length);
                    let blocks = tokens
                        .div_ceil(block_size)
                        .saturating_mul(cpu_slots)
                        .min(DEFAULT_CPU_KV_BYTES / block_bytes);
                    Ok(cut_to_free(
                        blocks.clamp(1, u32::MAX as usize),
                        &format!("room for {cpu_slots} sequences of {tokens} tokens"),
                    ))
                }
            },
        }?;
        Ok(blocks)
    }
}

/// A byte count as people read it: whole bytes, or in exponent form where that would take
/// hundreds of digits (a size of 5e-324 bytes).
fn shown(bytes: f64) -> String {
    if (1.0..1e18).contains(&bytes) {
        format!("{bytes:.0}")
    } else {
        format!("{bytes:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use turbo_core::cpu::CpuBackend;
    use turbo_tests::{write_gguf, DType, TinySpec, TinyWeights};

    fn tiny() -> (Llama<CpuBackend>, LoadedModelInfo, tempfile::TempDir) {
        let spec = TinySpec {
            context: 128,
            ..TinySpec::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F32);
        let loaded = turbo_llama::LoadedModel::load(&path).unwrap();
        let model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
        let info = LoadedModelInfo {
            path: PathBuf::from("tiny.gguf"),
            context_length: 128,
            vocab_size: spec.vocab,
            chat_template: None,
            block_size: 16,
            device: Device::Cpu,
        };
        (model, info, dir)
    }

    /// The CPU default is room for the slots asked for, but never more than
    /// [`DEFAULT_CPU_KV_BYTES`]: a server under load stays within a known amount of memory.
    #[test]
    fn cpu_default_is_capped_in_bytes() {
        let (model, info, _dir) = tiny();
        let block_bytes = model
            .kv_spec(16, 1)
            .bytes_per_token_with(model.backend().kv_element_bytes())
            * 16;
        let small = KvSize::Default {
            cpu_slots: 4,
            cpu_tokens_per_slot: 4096,
        };
        // The context (128 tokens) bounds each slot: 8 blocks each.
        assert_eq!(small.num_blocks(&model, &info).unwrap(), 4 * 8);
        let huge = KvSize::Default {
            cpu_slots: 1 << 30,
            cpu_tokens_per_slot: 4096,
        };
        let blocks = huge.num_blocks(&model, &info).unwrap();
        let bytes = blocks * block_bytes;
        assert!(
            bytes <= DEFAULT_CPU_KV_BYTES && bytes + block_bytes > DEFAULT_CPU_KV_BYTES,
            "{blocks} blocks of {block_bytes} bytes"
        );
        // An explicit size is not capped.
        let explicit = KvSize::Blocks(blocks * 2);
        assert_eq!(explicit.num_blocks(&model, &info).unwrap(), blocks * 2);
    }

    /// A byte budget holds blocks of the cache's own dtype: codes and a scale per (token, KV
    /// head) instead of f32 rows, so INT8 and FP8 fit (4 head_dim) / (head_dim + 4) times the
    /// blocks of f32 on the CPU.
    #[test]
    fn byte_budgets_count_the_kv_dtype() {
        let (mut model, info, _dir) = tiny();
        let c = model.config.clone();
        let bytes = 1e6;
        let full = KvSize::Bytes(bytes).num_blocks(&model, &info).unwrap();
        let row = |d: usize| c.n_layers * 2 * c.n_kv_heads * d * info.block_size;
        assert_eq!(full, bytes as usize / row(c.head_dim * 4));
        for dtype in [turbo_core::KvDtype::Int8, turbo_core::KvDtype::Fp8] {
            model.set_kv_dtype(dtype);
            let quant = KvSize::Bytes(bytes).num_blocks(&model, &info).unwrap();
            assert_eq!(quant, bytes as usize / row(c.head_dim + 4), "{dtype}");
            assert!(quant > 2 * full, "{dtype}: {quant} blocks against {full}");
        }
    }
}
