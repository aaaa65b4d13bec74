//! Host storage for a paged KV cache, grown on demand.

use turbo_attention::PagedKv;

/// Shape of a model's KV cache: one slot per token holds `n_kv_heads × head_dim` keys and values in
/// each layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

impl KvCacheSpec {
    /// Bytes per token across all layers, keys and values, in f32.
    pub fn bytes_per_token(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4
    }
}

/// f32 KV for every layer in `[block][slot][kv head][head_dim]` order. Storage grows to the
/// highest block written, so a large `max_blocks` costs nothing until it is used.
pub struct CpuKvCache {
    spec: KvCacheSpec,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl CpuKvCache {
    pub fn new(spec: KvCacheSpec) -> Self {
        CpuKvCache {
            spec,
            keys: vec![Vec::new(); spec.n_layers],
            values: vec![Vec::new(); spec.n_layers],
        }
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    fn slot_len(&self) -> usize {
        self.spec.n_kv_heads * self.spec.head_dim
    }

    /// Stores rows of `k` and `v` (`[tokens, kv heads, head_dim]`) at `slots` of `layer`.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let n = self.slot_len();
        let needed = slots
            .iter()
            .map(|&s| (s as usize / self.spec.block_size + 1) * self.spec.block_size * n)
            .max()
            .unwrap_or(0);
        assert!(
            needed <= self.spec.max_blocks * self.spec.block_size * n,
            "slot past the end of the KV cache"
        );
        for store in [&mut self.keys[layer], &mut self.values[layer]] {
            if store.len() < needed {
                store.resize(needed, 0.0);
            }
        }
        for (i, &s) in slots.iter().enumerate() {
            let at = s as usize * n;
            self.keys[layer][at..at + n].copy_from_slice(&k[i * n..(i + 1) * n]);
            self.values[layer][at..at + n].copy_from_slice(&v[i * n..(i + 1) * n]);
        }
    }

    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        PagedKv {
            keys: &self.keys[layer],
            values: &self.values[layer],
            block_size: self.spec.block_size,
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: self.spec.head_dim,
        }
    }

    /// Bytes currently held.
    pub fn resident_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|v| v.len() * 4)
            .sum()
    }
}
