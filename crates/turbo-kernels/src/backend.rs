//! [`Backend`] on a CUDA GPU: bf16 weights and activations, f32 accumulation inside kernels.

use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ops;
use crate::ops::attention::{AttentionPlan, KvLayout, PlanOptions};
use cudarc::driver::CudaSlice;
use half::bf16;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};
use turbo_core::backend::{Backend, BatchLayout, OwnedSpans, Result};
use turbo_core::cpu::KvCacheSpec;
use turbo_core::WeightMatrix;

/// Activations: a row-major `[rows, cols]` bf16 buffer on the device.
pub struct CudaTensor {
    pub data: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

/// A weight matrix on the device, in bf16 (quantized GGUF weights are decoded at upload).
pub struct CudaMatrix {
    pub data: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

/// Paged KV for all layers: `[block][slot][kv head][head_dim]` bf16, allocated up front.
pub struct CudaKvCache {
    pub spec: KvCacheSpec,
    pub keys: Vec<CudaSlice<bf16>>,
    pub values: Vec<CudaSlice<bf16>>,
}

/// A batch layout on the device: uploaded once per forward pass.
pub struct CudaBatch {
    positions: CudaSlice<u32>,
    slots: CudaSlice<u32>,
    inv_freq: CudaSlice<f32>,
    /// For attention's plan.
    spans: OwnedSpans,
    tokens: usize,
    /// Attention's plan, made by the first layer that runs attention and reused by the others.
    attention: Mutex<Option<AttentionPlan>>,
}

#[derive(Clone)]
pub struct CudaBackend {
    dev: Arc<CudaDevice>,
}

impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(CudaBackend {
            dev: Arc::new(CudaDevice::new(ordinal)?),
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        Ok(self.dev.stream.clone_htod(v).map_err(CudaError::from)?)
    }
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|x| bf16::from_f32(*x)).collect()
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type KvCache = CudaKvCache;
    type Batch = CudaBatch;

    fn name(&self) -> String {
        format!("cuda ({})", self.dev.name())
    }

    fn upload_matrix(&self, w: &WeightMatrix) -> Result<CudaMatrix> {
        // Decode rows in parallel: an 8B model has billions of elements to convert.
        let mut host = vec![bf16::ZERO; w.rows * w.cols];
        host.par_chunks_mut(w.cols.max(1) * 64)
            .enumerate()
            .for_each(|(i, chunk)| {
                let mut row = vec![0f32; w.cols];
                for (j, dst) in chunk.chunks_exact_mut(w.cols).enumerate() {
                    w.dequantize_row(i * 64 + j, &mut row);
                    for (d, s) in dst.iter_mut().zip(&row) {
                        *d = bf16::from_f32(*s);
                    }
                }
            });
        Ok(CudaMatrix {
            data: self.dev.stream.clone_htod(&host).map_err(CudaError::from)?,
            rows: w.rows,
            cols: w.cols,
        })
    }

    fn upload_stacked(&self, parts: &[&WeightMatrix]) -> Result<CudaMatrix> {
        let stacked = WeightMatrix::stack(parts).map_err(turbo_core::BackendError::Unsupported)?;
        self.upload_matrix(&stacked)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        assert_eq!(data.len(), rows * cols);
        Ok(CudaTensor {
            data: self
                .dev
                .stream
                .clone_htod(&to_bf16(data))
                .map_err(CudaError::from)?,
            rows,
            cols,
        })
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            data: self
                .dev
                .stream
                .alloc_zeros::<bf16>((rows * cols).max(1))
                .map_err(CudaError::from)?,
            rows,
            cols,
        })
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        let host = self
            .dev
            .stream
            .clone_dtoh(&t.data)
            .map_err(CudaError::from)?;
        Ok(host[..t.rows * t.cols].iter().map(|x| x.to_f32()).collect())
    }

    fn kv_cache(&self, spec: KvCacheSpec) -> Result<CudaKvCache> {
        if !ops::attention::SUPPORTED_HEAD_DIMS.contains(&spec.head_dim) {
            return Err(turbo_core::BackendError::Unsupported(format!(
                "the CUDA backend has no attention kernel for head dimension {} (supported: {:?})",
                spec.head_dim,
                ops::attention::SUPPORTED_HEAD_DIMS
            )));
        }
        let len = spec.max_blocks * spec.block_size * spec.n_kv_heads * spec.head_dim;
        let alloc = || -> Result<Vec<CudaSlice<bf16>>> {
            (0..spec.n_layers)
                .map(|_| {
                    Ok(self
                        .dev
                        .stream
                        .alloc_zeros::<bf16>(len.max(1))
                        .map_err(CudaError::from)?)
                })
                .collect()
        };
        Ok(CudaKvCache {
            spec,
            keys: alloc()?,
            values: alloc()?,
        })
    }

    fn kv_spec(&self, cache: &CudaKvCache) -> KvCacheSpec {
        cache.spec
    }

    fn kv_element_bytes(&self) -> usize {
        2
    }

    fn prepare_batch(&self, layout: &BatchLayout) -> Result<CudaBatch> {
        Ok(CudaBatch {
            positions: self.upload_u32(layout.positions)?,
            slots: self.upload_u32(layout.slots)?,
            inv_freq: self
                .dev
                .stream
                .clone_htod(layout.inv_freq)
                .map_err(CudaError::from)?,
            spans: OwnedSpans::new(layout.spans),
            tokens: layout.positions.len(),
            attention: Mutex::new(None),
        })
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
        let ids_dev = self.upload_u32(ids)?;
        Ok(ops::elementwise::embed(
            &self.dev,
            &table.data,
            &ids_dev,
            ids.len(),
            table.cols,
            &mut out.data,
        )?)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        Ok(ops::norm::rms_norm(
            &self.dev,
            &x.data,
            &w.data,
            x.rows,
            x.cols,
            eps,
            &mut out.data,
        )?)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaMatrix, out: &mut CudaTensor) -> Result<()> {
        Ok(ops::linear::linear(
            &self.dev,
            &x.data,
            &w.data,
            x.rows,
            w.cols,
            w.rows,
            &mut out.data,
        )?)
    }

    fn rope(&self, x: &mut CudaTensor, head_dim: usize, batch: &CudaBatch) -> Result<()> {
        let heads = x.cols / head_dim;
        Ok(ops::elementwise::rope(
            &self.dev,
            &mut x.data,
            x.rows,
            heads,
            head_dim,
            &batch.positions,
            &batch.inv_freq,
        )?)
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) -> Result<()> {
        let n = gate.rows * gate.cols;
        Ok(ops::elementwise::silu_mul(
            &self.dev,
            &mut gate.data,
            &up.data,
            n,
        )?)
    }

    fn swiglu(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<()> {
        Ok(ops::elementwise::swiglu(
            &self.dev,
            &gate_up.data,
            out.rows,
            out.cols,
            &mut out.data,
        )?)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (rows, cols) = (x.rows, x.cols);
        Ok(ops::norm::add_rms_norm(
            &self.dev,
            &mut x.data,
            &y.data,
            &weight.data,
            rows,
            cols,
            eps,
            &mut out.data,
        )?)
    }

    fn split3(
        &self,
        x: &CudaTensor,
        a: &mut CudaTensor,
        b: &mut CudaTensor,
        c: &mut CudaTensor,
    ) -> Result<()> {
        let widths = (a.cols, b.cols, c.cols);
        Ok(ops::elementwise::split3(
            &self.dev,
            &x.data,
            x.rows,
            widths,
            &mut a.data,
            &mut b.data,
            &mut c.data,
        )?)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let n = x.rows * x.cols;
        Ok(ops::elementwise::add(&self.dev, &mut x.data, &y.data, n)?)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) -> Result<()> {
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.upload_u32(&idx)?;
        Ok(ops::elementwise::gather_rows(
            &self.dev,
            &x.data,
            &idx,
            rows.len(),
            x.cols,
            &mut out.data,
        )?)
    }

    fn write_kv(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        batch: &CudaBatch,
    ) -> Result<()> {
        let slot_len = cache.spec.n_kv_heads * cache.spec.head_dim;
        let (keys, values) = (&mut cache.keys[layer], &mut cache.values[layer]);
        Ok(ops::elementwise::write_kv(
            &self.dev,
            keys,
            values,
            &k.data,
            &v.data,
            &batch.slots,
            batch.tokens,
            slot_len,
        )?)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        n_heads: usize,
        batch: &CudaBatch,
        scale: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let layout = KvLayout {
            block_size: cache.spec.block_size,
            n_kv_heads: cache.spec.n_kv_heads,
            head_dim: cache.spec.head_dim,
        };
        let n_blocks = cache.spec.max_blocks;
        let mut plan = batch
            .attention
            .lock()
            .map_err(|_| CudaError::Shape("attention plan lock poisoned".into()))?;
        let fits = plan
            .as_ref()
            .is_some_and(|p| p.fits(layout, n_heads, batch.tokens, n_blocks));
        if !fits {
            *plan = Some(AttentionPlan::new(
                &self.dev,
                layout,
                n_heads,
                batch.tokens,
                &batch.spans.spans(),
                n_blocks,
                PlanOptions::default(),
            )?);
        }
        let plan = plan.as_mut().expect("planned above");
        Ok(plan.run(
            &self.dev,
            &q.data,
            &cache.keys[layer],
            &cache.values[layer],
            scale,
            &mut out.data,
            None,
        )?)
    }

    /// Free device memory as the driver reports it (`cuMemGetInfo` in this device's context),
    /// after the stream's pending work, so that buffers freed by earlier steps are counted.
    fn free_memory(&self) -> Option<usize> {
        self.dev.stream.synchronize().ok()?;
        self.dev.ctx.mem_get_info().ok().map(|(free, _total)| free)
    }
}
