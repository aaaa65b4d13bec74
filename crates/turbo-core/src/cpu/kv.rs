//! Host storage for a paged KV cache, grown on demand.

use crate::backend::{BackendError, KvCompaction};
use rayon::prelude::*;
use turbo_attention::kv_quant::{quantize_row, MAX_QUANT_HEAD_DIM};
use turbo_attention::{KvDtype, PagedKv, QuantKv};

/// Rows of a KV write one parallel task quantizes at least (a decode step's few rows stay on one
/// thread).
const QUANTIZE_ROWS_A_TASK: usize = 64;

/// Shape of a model's KV cache: one slot per token holds `n_kv_heads × head_dim` keys and values in
/// each layer, stored as `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    pub dtype: KvDtype,
}

impl KvCacheSpec {
    /// Bytes per token across all layers, keys and values, on the CPU (f32 when unquantized).
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_with(4)
    }

    /// Bytes per token across all layers, keys and values, scales included, on a backend whose
    /// unquantized element takes `full_element_bytes`.
    pub fn bytes_per_token_with(&self, full_element_bytes: usize) -> usize {
        self.n_layers
            * 2
            * self.n_kv_heads
            * self.dtype.row_bytes(self.head_dim, full_element_bytes)
    }
}

/// One layer's keys and values: f32 rows, or 8-bit codes with a scale per (slot, KV head).
#[derive(Default)]
struct LayerStore {
    keys: Vec<f32>,
    values: Vec<f32>,
    key_codes: Vec<u8>,
    value_codes: Vec<u8>,
    key_scales: Vec<f32>,
    value_scales: Vec<f32>,
}

/// KV for every layer in `[block][slot][kv head][head_dim]` order (f32, or codes with one scale
/// per `[block][slot][kv head]` when quantized), and each key's eviction score in
/// `[block][slot][kv head]`. Storage grows to the highest block written, so a large `max_blocks`
/// costs nothing until it is used.
pub struct CpuKvCache {
    spec: KvCacheSpec,
    layers: Vec<LayerStore>,
    scores: Vec<Vec<f32>>,
}

/// Moves each (layer's) row of `len` elements at kept key index `from` to key index `to`, for
/// one KV head, in a store of `heads` rows per slot; `Err` if a row was never written.
fn move_kept<T: Copy>(
    store: &mut [T],
    compaction: &KvCompaction,
    row: &[u32],
    (head, heads, len, bs): (usize, usize, usize, usize),
) -> crate::backend::Result<()> {
    for (to, &from) in row.iter().enumerate() {
        let from = from as usize;
        if from == to {
            continue;
        }
        let src = (compaction.slot(from, bs) * heads + head) * len;
        let dst = (compaction.slot(to, bs) * heads + head) * len;
        if src + len > store.len() || dst + len > store.len() {
            return Err(BackendError::Unsupported(
                "KV compaction: a key that was never written".into(),
            ));
        }
        store.copy_within(src..src + len, dst);
    }
    Ok(())
}

impl CpuKvCache {
    /// An empty cache. A quantized `dtype` serves head dimensions up to
    /// [`MAX_QUANT_HEAD_DIM`]; [`crate::Backend::kv_cache`] refuses larger ones.
    pub fn new(spec: KvCacheSpec) -> Self {
        CpuKvCache {
            spec,
            layers: (0..spec.n_layers).map(|_| LayerStore::default()).collect(),
            scores: vec![Vec::new(); spec.n_layers],
        }
    }

    /// [`CpuKvCache::new`], refusing shapes the storage cannot serve.
    pub fn try_new(spec: KvCacheSpec) -> crate::backend::Result<Self> {
        if spec.dtype.is_quantized() && spec.head_dim > MAX_QUANT_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "a {} KV cache serves head dimensions up to {MAX_QUANT_HEAD_DIM}, not {}",
                spec.dtype, spec.head_dim
            )));
        }
        Ok(Self::new(spec))
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    fn slot_len(&self) -> usize {
        self.spec.n_kv_heads * self.spec.head_dim
    }

    /// Stores rows of `k` and `v` (`[tokens, kv heads, head_dim]`) at `slots` of `layer`,
    /// quantizing each (token, KV head) row when the cache is quantized.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let n = self.slot_len();
        let (hd, heads) = (self.spec.head_dim, self.spec.n_kv_heads);
        let needed = slots
            .iter()
            .map(|&s| (s as usize / self.spec.block_size + 1) * self.spec.block_size * n)
            .max()
            .unwrap_or(0);
        assert!(
            needed <= self.spec.max_blocks * self.spec.block_size * n,
            "slot past the end of the KV cache"
        );
        let dtype = self.spec.dtype;
        let store = &mut self.layers[layer];
        if dtype.is_quantized() {
            for codes in [&mut store.key_codes, &mut store.value_codes] {
                if codes.len() < needed {
                    codes.resize(needed, 0);
                }
            }
            for scales in [&mut store.key_scales, &mut store.value_scales] {
                if scales.len() < needed / hd {
                    scales.resize(needed / hd, 0.0);
                }
            }
            // Rows are quantized in parallel (an FP8 row tries seven scales), then placed.
            let quantized = |x: &[f32]| {
                let mut codes = vec![0u8; x.len()];
                let mut scales = vec![0f32; x.len() / hd];
                codes
                    .par_chunks_mut(hd)
                    .zip(scales.par_iter_mut())
                    .zip(x.par_chunks(hd))
                    .with_min_len(QUANTIZE_ROWS_A_TASK)
                    .for_each(|((c, scale), row)| *scale = quantize_row(dtype, row, c));
                (codes, scales)
            };
            let (k_codes, k_scales) = quantized(&k[..slots.len() * n]);
            let (v_codes, v_scales) = quantized(&v[..slots.len() * n]);
            for (i, &s) in slots.iter().enumerate() {
                let (row, src) = (s as usize * n, i * n);
                store.key_codes[row..row + n].copy_from_slice(&k_codes[src..src + n]);
                store.value_codes[row..row + n].copy_from_slice(&v_codes[src..src + n]);
                let (row, src) = (row / hd, src / hd);
                store.key_scales[row..row + heads].copy_from_slice(&k_scales[src..src + heads]);
                store.value_scales[row..row + heads].copy_from_slice(&v_scales[src..src + heads]);
            }
        } else {
            for rows in [&mut store.keys, &mut store.values] {
                if rows.len() < needed {
                    rows.resize(needed, 0.0);
                }
            }
            for (i, &s) in slots.iter().enumerate() {
                let at = s as usize * n;
                store.keys[at..at + n].copy_from_slice(&k[i * n..(i + 1) * n]);
                store.values[at..at + n].copy_from_slice(&v[i * n..(i + 1) * n]);
            }
        }
        let scores = &mut self.scores[layer];
        if scores.len() < needed / hd {
            scores.resize(needed / hd, 0.0);
        }
        for &s in slots {
            // A new key starts unscored.
            scores[s as usize * heads..(s as usize + 1) * heads].fill(0.0);
        }
    }

    /// `layer`'s keys (read) and eviction scores (written), for accumulating scores.
    pub fn layer_with_scores(&mut self, layer: usize) -> (PagedKv<'_>, &mut [f32]) {
        let spec = self.spec;
        let kv = Self::view(&spec, &self.layers[layer]);
        (kv, &mut self.scores[layer])
    }

    fn view<'a>(spec: &KvCacheSpec, store: &'a LayerStore) -> PagedKv<'a> {
        let mut kv = PagedKv::f32(
            &store.keys,
            &store.values,
            spec.block_size,
            spec.n_kv_heads,
            spec.head_dim,
        );
        if spec.dtype.is_quantized() {
            kv.quant = Some(QuantKv {
                dtype: spec.dtype,
                keys: &store.key_codes,
                values: &store.value_codes,
                key_scales: &store.key_scales,
                value_scales: &store.value_scales,
            });
        }
        kv
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

    /// Moves every row's kept keys and values (codes and scales, when quantized) and scores to
    /// its leading key indices (see [`KvCompaction`]).
    pub fn compact(&mut self, compaction: &KvCompaction) -> crate::backend::Result<()> {
        compaction.check(&self.spec)?;
        let (hd, heads, bs) = (
            self.spec.head_dim,
            self.spec.n_kv_heads,
            self.spec.block_size,
        );
        let k = compaction.kept_per_row;
        for layer in 0..self.spec.n_layers {
            let store = &mut self.layers[layer];
            for head in 0..heads {
                let row = &compaction.kept[(layer * heads + head) * k..][..k];
                if self.spec.dtype.is_quantized() {
                    for codes in [&mut store.key_codes, &mut store.value_codes] {
                        move_kept(codes, compaction, row, (head, heads, hd, bs))?;
                    }
                    for scales in [&mut store.key_scales, &mut store.value_scales] {
                        move_kept(scales, compaction, row, (head, heads, 1, bs))?;
                    }
                } else {
                    for rows in [&mut store.keys, &mut store.values] {
                        move_kept(rows, compaction, row, (head, heads, hd, bs))?;
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
        Self::view(&self.spec, &self.layers[layer])
    }

    /// Bytes currently held.
    pub fn resident_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                (l.keys.len() + l.values.len() + l.key_scales.len() + l.value_scales.len()) * 4
                    + l.key_codes.len()
                    + l.value_codes.len()
            })
            .sum();
        layers + self.scores.iter().map(|v| v.len() * 4).sum::<usize>()
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
            dtype: KvDtype::Full,
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
                    for store in [&cache.layers[layer].keys, &cache.layers[layer].values] {
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

    /// Quantized rows move with their scales: after compaction each kept key decodes to what it
    /// decoded to before, at its new index.
    #[test]
    fn quantized_compaction_moves_codes_and_scales() {
        for dtype in [KvDtype::Int8, KvDtype::Fp8] {
            let spec = KvCacheSpec {
                head_dim: 4,
                dtype,
                ..spec()
            };
            let mut cache = CpuKvCache::new(spec);
            let table = [5u32, 1, 6];
            let n = spec.n_kv_heads * spec.head_dim;
            let slot = |i: usize| table[i / 2] * 2 + (i % 2) as u32;
            for layer in 0..spec.n_layers {
                let slots: Vec<u32> = (0..6).map(slot).collect();
                let k: Vec<f32> = (0..6 * n)
                    .map(|e| ((e * 7 + layer * 3) % 11) as f32 - 5.0)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| x * 0.5 + 1.0).collect();
                cache.write(layer, &k, &v, &slots);
            }
            let decoded = |cache: &CpuKvCache, layer: usize, head: usize, i: usize| {
                let kv = cache.layer(layer);
                let at = (slot(i) as usize * spec.n_kv_heads + head) * spec.head_dim;
                let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
                (
                    kv.key_row(at, &mut a).to_vec(),
                    kv.value_row(at, &mut b).to_vec(),
                )
            };
            let before: Vec<Vec<Vec<_>>> = (0..2)
                .map(|l| {
                    (0..2)
                        .map(|h| (0..6).map(|i| decoded(&cache, l, h, i)).collect())
                        .collect()
                })
                .collect();
            let kept = [0u32, 2, 5, 1, 3, 4, 2, 3, 5, 0, 1, 2];
            cache
                .compact(&KvCompaction {
                    block_table: &table,
                    kept: &kept,
                    kept_per_row: 3,
                })
                .unwrap();
            for layer in 0..2 {
                for head in 0..2 {
                    for (j, &from) in kept[(layer * 2 + head) * 3..][..3].iter().enumerate() {
                        assert_eq!(
                            decoded(&cache, layer, head, j),
                            before[layer][head][from as usize],
                            "{dtype} layer {layer} head {head} key {j}"
                        );
                    }
                }
            }
            // Codes and scales: 2 layers x 6 slots x 2 heads x (4 + 4 bytes) x (keys, values),
            // in the 3 blocks the table reaches (7 blocks of storage).
            assert!(cache.resident_bytes() < 7 * 2 * n * 4 * 2 * 2);
        }
    }

    #[test]
    fn quantized_caches_refuse_head_dims_they_cannot_serve() {
        let spec = KvCacheSpec {
            head_dim: 1024,
            dtype: KvDtype::Int8,
            ..spec()
        };
        assert!(CpuKvCache::try_new(spec).is_err());
        assert!(CpuKvCache::try_new(KvCacheSpec {
            dtype: KvDtype::Full,
            ..spec
        })
        .is_ok());
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
