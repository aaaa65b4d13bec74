//! The CPU backend: f32 compute over rayon's thread pool.

mod kv;
pub mod linear;
pub mod ops;

pub use kv::{CpuKvCache, KvCacheSpec};

use crate::backend::{Backend, Result};
use crate::WeightMatrix;
use turbo_attention::{paged_attention, QuerySpan};

/// A row-major `[rows, cols]` f32 tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Tensor = HostTensor;
    type Matrix = WeightMatrix;
    type KvCache = CpuKvCache;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload_matrix(&self, w: &WeightMatrix) -> Result<WeightMatrix> {
        Ok(w.clone())
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<HostTensor> {
        assert_eq!(data.len(), rows * cols);
        Ok(HostTensor {
            data: data.to_vec(),
            rows,
            cols,
        })
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<HostTensor> {
        Ok(HostTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        })
    }

    fn download(&self, t: &HostTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn kv_cache(&self, spec: KvCacheSpec) -> Result<CpuKvCache> {
        Ok(CpuKvCache::new(spec))
    }

    fn kv_spec(&self, cache: &CpuKvCache) -> KvCacheSpec {
        *cache.spec()
    }

    fn embed(&self, table: &WeightMatrix, ids: &[u32], out: &mut HostTensor) -> Result<()> {
        for (row, &id) in out.data.chunks_exact_mut(table.cols).zip(ids) {
            table.dequantize_row(id as usize, row);
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &HostTensor,
        w: &HostTensor,
        eps: f32,
        out: &mut HostTensor,
    ) -> Result<()> {
        ops::rms_norm(&x.data, &w.data, eps, &mut out.data);
        Ok(())
    }

    fn linear(&self, x: &HostTensor, w: &WeightMatrix, out: &mut HostTensor) -> Result<()> {
        linear::linear(&x.data, x.rows, w, &mut out.data);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut HostTensor,
        head_dim: usize,
        positions: &[u32],
        inv_freq: &[f32],
    ) -> Result<()> {
        ops::rope_interleaved(&mut x.data, head_dim, positions, inv_freq);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut HostTensor, up: &HostTensor) -> Result<()> {
        ops::silu_mul(&mut gate.data, &up.data);
        Ok(())
    }

    fn add(&self, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
        ops::add(&mut x.data, &y.data);
        Ok(())
    }

    fn gather_rows(&self, x: &HostTensor, rows: &[usize], out: &mut HostTensor) -> Result<()> {
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(())
    }

    fn write_kv(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        k: &HostTensor,
        v: &HostTensor,
        slots: &[u32],
    ) -> Result<()> {
        cache.write(layer, &k.data, &v.data, slots);
        Ok(())
    }

    fn attention(
        &self,
        q: &HostTensor,
        cache: &CpuKvCache,
        layer: usize,
        n_heads: usize,
        spans: &[QuerySpan],
        scale: f32,
        out: &mut HostTensor,
    ) -> Result<()> {
        paged_attention(
            &q.data,
            n_heads,
            &cache.layer(layer),
            spans,
            scale,
            &mut out.data,
            None,
        );
        Ok(())
    }
}
