//! Host storage for a paged KV cache, grown on demand.

use crate::backend::{BackendError, KvCompaction};
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

/// f32 KV for every layer in `[block][slot][kv head][head_dim]` order, and each key's eviction
/// score in `[block][slot][kv head]`. Storage grows to the highest block written, so a large
/// `max_blocks` costs nothing until it is used.
pub struct CpuKvCache {
    spec: KvCacheSpec,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    scores: Vec<Vec<f32>>,
}

impl CpuKvCache {
    pub fn new(spec: KvCacheSpec) -> Self {
        CpuKvCache {
            spec,
            keys: vec![Vec::new(); spec.n_layers],
            values: vec![Vec::new(); spec.n_layers],
            scores: vec![Vec::new(); spec.n_layers],
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
        let heads = self.spec.n_kv_heads;
        let scores = &mut self.scores[layer];
        if scores.len() < needed / self.spec.head_dim {
            scores.resize(needed / self.spec.head_dim, 0.0);
        }
        for (i, &s) in slots.iter().enumerate() {
            let at = s as usize * n;
            self.keys[layer][at..at + n].copy_from_slice(&k[i * n..(i + 1) * n]);
            self.values[layer][at..at + n].copy_from_slice(&v[i * n..(i + 1) * n]);
            // A new key starts unscored.
            scores[s as usize * heads..(s as usize + 1) * heads].fill(0.0);
        }
    }

    /// `layer`'s keys (read) and eviction scores (written), for accumulating scores.
    pub fn layer_with_scores(&mut self, layer: usize) -> (PagedKv<'_>, &mut [f32]) {
        let kv = PagedKv {
            keys: &self.keys[layer],
            values: &self.values[layer],
            block_size: self.spec.block_size,
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: self.spec.head_dim,
            quant: None,
        };
        (kv, &mut self.scores[layer])
    }

    /// The scores of the first `keys` key indices of `block_table`, `[layers][kv_heads][keys]`.
    pub fn read_scores(
        &self,
        block_table: &[u32],
        keys: usize,
    ) -> crate::backend::Result<Vec<f32>> {
        let (heads, bs) = (self.spec.n_kv_heads, self.spec.block_size);
        if keys > block_table.len() * bs {
            return Err(BackendError::Unsupported(format!(
                "scores of {keys} keys from a block table of {} blocks",
                block_table.len()
            )));
        }
        let mut out = Vec::with_capacity(self.spec.n_layers * heads * keys);
        for layer in 0..self.spec.n_layers {
            let scores = &self.scores[layer];
            for head in 0..heads {
                for key in 0..keys {
                    let slot = block_table[key / bs] as usize * bs + key % bs;
                    out.push(scores.get(slot * heads + head).copied().ok_or_else(|| {
                        BackendError::Unsupported("scores of a key never written".into())
                    })?);
                }
            }
        }
        Ok(out)
    }

    /// Moves every row's kept keys and values to its leading key indices (see [`KvCompaction`]).
    pub fn compact(&mut self, compaction: &KvCompaction) -> crate::backend::Result<()> {
        compaction.check(&self.spec)?;
        let (hd, heads, bs) = (
            self.spec.head_dim,
            self.spec.n_kv_heads,
            self.spec.block_size,
        );
        let n = self.slot_len();
        let k = compaction.kept_per_row;
        for layer in 0..self.spec.n_layers {
            for store in [&mut self.keys[layer], &mut self.values[layer]] {
                for head in 0..heads {
                    let row = &compaction.kept[(layer * heads + head) * k..][..k];
                    for (to, &from) in row.iter().enumerate() {
                        let from = from as usize;
                        if from == to {
                            continue;
                        }
                        let src = compaction.slot(from, bs) * n + head * hd;
                        let dst = compaction.slot(to, bs) * n + head * hd;
                        if src + hd > store.len() || dst + hd > store.len() {
                            return Err(BackendError::Unsupported(
                                "KV compaction: a key that was never written".into(),
                            ));
                        }
                        store.copy_within(src..src + hd, dst);
                    }
                }
            }
            let scores = &mut self.scores[layer];
            for head in 0..heads {
                let row = &compaction.kept[(layer * heads + head) * k..][..k];
                for (to, &from) in row.iter().enumerate() {
                    let src = compaction.slot(from as usize, bs) * heads + head;
                    let dst = compaction.slot(to, bs) * heads + head;
                    if let (Some(&score), true) = (scores.get(src), dst < scores.len()) {
                        scores[dst] = score;
                    }
                }
            }
        }
        Ok(())
    }

    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        PagedKv {
            keys: &self.keys[layer],
            values: &self.values[layer],
            block_size: self.spec.block_size,
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: self.spec.head_dim,
            quant: None,
        }
    }

    /// Bytes currently held.
    pub fn resident_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .chain(&self.scores)
            .map(|v| v.len() * 4)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvCacheSpec {
        KvCacheSpec {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 3,
            block_size: 2,
            max_blocks: 8,
        }
    }

    /// Each (layer, head) row moves its own kept keys, in order, to the leading key indices of a
    /// scattered block table; the keys it did not keep and the other rows' data are left alone.
    #[test]
    fn compaction_moves_each_rows_kept_keys_to_the_front() {
        let spec = spec();
        let mut cache = CpuKvCache::new(spec);
        let table = [5u32, 1, 6];
        let n = spec.n_kv_heads * spec.head_dim;
        // Key index i of the sequence holds value 100 * layer + 10 * head + i in every element.
        let value = |layer: usize, head: usize, i: usize| (100 * layer + 10 * head + i) as f32;
        for layer in 0..spec.n_layers {
            let slots: Vec<u32> = (0..6).map(|i| table[i / 2] * 2 + (i % 2) as u32).collect();
            let rows: Vec<f32> = (0..6)
                .flat_map(|i| (0..n).map(move |e| value(layer, e / spec.head_dim, i)))
                .collect();
            cache.write(layer, &rows, &rows, &slots);
        }
        // [layer][head][3]
        let kept = [0u32, 2, 5, 1, 3, 4, 2, 3, 5, 0, 1, 2];
        cache
            .compact(&KvCompaction {
                block_table: &table,
                kept: &kept,
                kept_per_row: 3,
            })
            .unwrap();
        for layer in 0..spec.n_layers {
            for head in 0..spec.n_kv_heads {
                let row = &kept[(layer * 2 + head) * 3..][..3];
                for (j, &from) in row.iter().enumerate() {
                    let slot = (table[j / 2] * 2 + (j % 2) as u32) as usize;
                    for store in [&cache.keys[layer], &cache.values[layer]] {
                        let at = slot * n + head * spec.head_dim;
                        assert_eq!(
                            store[at..at + spec.head_dim],
                            [value(layer, head, from as usize); 3],
                            "layer {layer} head {head} key {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_compactions_are_refused() {
        let mut cache = CpuKvCache::new(spec());
        let table = [0u32, 1];
        for (kept, per_row) in [
            (vec![1u32, 0, 2, 3, 0, 1, 2, 3], 2), // decreasing
            (vec![0, 1, 0, 1, 0, 1], 2),          // too few rows
            (vec![0, 4, 0, 1, 0, 1, 0, 1], 2),    // past the table
        ] {
            let c = KvCompaction {
                block_table: &table,
                kept: &kept,
                kept_per_row: per_row,
            };
            assert!(cache.compact(&c).is_err(), "{kept:?}");
        }
        let past_cache = [9u32];
        let c = KvCompaction {
            block_table: &past_cache,
            kept: &[0; 4],
            kept_per_row: 1,
        };
        assert!(cache.compact(&c).is_err());
    }
}
