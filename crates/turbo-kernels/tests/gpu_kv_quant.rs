//! The quantized KV cache's write kernels (INT8 and FP8) against the CPU quantizer,
//! `turbo_attention::kv_quant::quantize_row`, bit for bit, on a real GPU.
//!
//! Every case poisons each layer range (and a tail past it) with a byte pattern, so that a byte
//! written where it should not be shows up, and compares the whole downloaded range with the
//! expected image: the poison with the CPU's codes and scales of every written row put where the
//! layout (`kernels/common.cuh`, "Quantized KV cache") says. Rows draw magnitudes over many
//! binades, some with a few large values among tiny ones (FP8 subnormal codes, INT8 zeros), some
//! all zero, some with signed zeros; slots come from a shuffled block table, a padded token and a
//! slot just past the cache are skipped.

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::kv_quant::{hadamard_rotate, quantize_row, rotated_query_scale};
use turbo_attention::KvDtype;
use turbo_kernels::ops::elementwise::{self, CompactShape, QuantGeometry};
use turbo_kernels::CudaDevice;

macro_rules! require_gpu {
    () => {
        if !turbo_kernels::cuda_available() {
            eprintln!("skipping: no CUDA device");
            return;
        }
    };
}

const QUANT: [KvDtype; 2] = [KvDtype::Int8, KvDtype::Fp8];

/// (head_dim, n_kv_heads, block_size): every head_dim the kernels split differently over a warp
/// (a quarter of the lanes, all, one and a half, two groups of four each).
const GEOMETRIES: [(usize, usize, usize); 6] = [
    (32, 1, 4),
    (64, 2, 16),
    (96, 3, 4),
    (128, 4, 4),
    (192, 1, 16),
    (256, 2, 16),
];

/// Bytes past each range that the kernels must not touch.
const TAIL: usize = 64;

fn device() -> CudaDevice {
    CudaDevice::new(0).expect("cannot open CUDA device 0")
}

fn upload<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, v: &[T]) -> CudaSlice<T> {
    dev.stream.clone_htod(v).expect("upload")
}

fn download<T: cudarc::driver::DeviceRepr>(dev: &CudaDevice, s: &CudaSlice<T>) -> Vec<T> {
    dev.stream.clone_dtoh(s).expect("download")
}

fn to_bytes(v: &[bf16]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn from_bytes(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

fn geometry(
    (head_dim, n_kv_heads, block_size): (usize, usize, usize),
    max_blocks: usize,
) -> QuantGeometry {
    QuantGeometry {
        block_size,
        n_kv_heads,
        head_dim,
        max_blocks,
    }
}

/// The bytes of a poisoned range of `g` plus [`TAIL`]: a pattern no quantized row produces in
/// whole (its scales are not the scale of any row's codes).
fn poison(g: &QuantGeometry, salt: u8) -> Vec<u8> {
    (0..g.range_bytes() + TAIL)
        .map(|i| (i as u8).wrapping_mul(73) ^ 0xA5 ^ salt)
        .collect()
}

/// Byte offsets of the codes and the scale of (block, offset, KV head), from the layout's
/// definition.
fn row_at(g: &QuantGeometry, block: usize, off: usize, head: usize) -> (usize, usize) {
    let base = block * g.block_bytes();
    let row = off * g.n_kv_heads + head;
    (
        base + row * g.head_dim,
        base + g.block_size * g.n_kv_heads * g.head_dim + 4 * (head * g.block_size + off),
    )
}

/// Puts the CPU quantization of `x` at (slot, head) of the image `bytes`.
fn put_row(
    dtype: KvDtype,
    g: &QuantGeometry,
    bytes: &mut [u8],
    slot: usize,
    head: usize,
    x: &[f32],
) {
    let (codes_at, scale_at) = row_at(g, slot / g.block_size, slot % g.block_size, head);
    let mut codes = vec![0u8; g.head_dim];
    let scale = quantize_row(dtype, x, &mut codes);
    bytes[codes_at..codes_at + g.head_dim].copy_from_slice(&codes);
    bytes[scale_at..scale_at + 4].copy_from_slice(&scale.to_le_bytes());
}

/// Asserts the downloaded range equals the expected image, naming the first differing byte's row.
fn assert_image(what: &str, g: &QuantGeometry, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: range length");
    let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) else {
        return;
    };
    let place = if i >= g.range_bytes() {
        format!("the tail past the range (+{})", i - g.range_bytes())
    } else {
        let (block, r) = (i / g.block_bytes(), i % g.block_bytes());
        let rows = g.block_size * g.n_kv_heads;
        if r < rows * g.head_dim {
            let row = r / g.head_dim;
            format!(
                "block {block} slot {} head {} code {}",
                row / g.n_kv_heads,
                row % g.n_kv_heads,
                r % g.head_dim
            )
        } else {
            let row = (r - rows * g.head_dim) / 4;
            format!(
                "block {block} slot {} head {} scale",
                row / g.n_kv_heads,
                row % g.n_kv_heads
            )
        }
    };
    panic!(
        "{what}: byte {i} ({place}) is {:#04x}, want {:#04x}",
        got[i], want[i]
    );
}

/// One row of `n` values as bf16, of one of several kinds: uniform at a random binade (2^-60 to
/// 2^60), a few large values among tiny ones (down to 2^-30 of the largest: FP8 subnormals and
/// underflow to zero, INT8 zeros), all zeros, or uniform with signed zeros and exact ±max.
fn random_row(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    let mag = 2f32.powi(rng.random_range(-60..=60));
    let row: Vec<f32> = match rng.random_range(0..8) {
        0 => vec![0.0; n],
        1 | 2 => (0..n)
            .map(|_| {
                let v = if rng.random_range(0..8) == 0 {
                    1.0
                } else {
                    2f32.powf(-rng.random_range(0.0f32..30.0))
                };
                if rng.random::<bool>() {
                    v * mag
                } else {
                    -v * mag
                }
            })
            .collect(),
        3 => (0..n)
            .map(|i| match i % 7 {
                0 => -0.0,
                3 => mag,
                5 => -mag,
                _ => rng.random_range(-1.0f32..1.0) * mag,
            })
            .collect(),
        _ => (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * mag)
            .collect(),
    };
    row.into_iter().map(bf16::from_f32).collect()
}

/// `tokens` rows of `n_kv_heads` random rows each.
fn random_rows(rng: &mut ChaCha8Rng, tokens: usize, g: &QuantGeometry) -> Vec<bf16> {
    (0..tokens * g.n_kv_heads)
        .flat_map(|_| random_row(rng, g.head_dim))
        .collect()
}

/// Distinct slots for `tokens` tokens, in a shuffled block order (as a sequence's block table
/// gives them), then shuffled; token 1 padded (`u32::MAX`) and token 2 just past the cache when
/// there are enough tokens. The cache has room for all of them.
fn random_slots(rng: &mut ChaCha8Rng, tokens: usize, g: &QuantGeometry) -> Vec<u32> {
    let mut table: Vec<usize> = (0..g.max_blocks).collect();
    table.shuffle(rng);
    let mut positions: Vec<usize> = (0..g.max_blocks * g.block_size).collect();
    positions.shuffle(rng);
    let mut slots: Vec<u32> = positions[..tokens]
        .iter()
        .map(|&p| (table[p / g.block_size] * g.block_size + p % g.block_size) as u32)
        .collect();
    if tokens > 2 {
        slots[1] = u32::MAX;
        slots[2] = (g.max_blocks * g.block_size) as u32;
    }
    slots
}

fn is_stored(g: &QuantGeometry, slot: u32) -> bool {
    (slot as usize) < g.max_blocks * g.block_size
}

/// `write_kv_quant` stores every row of keys and values as `quantize_row` does, and nothing else.
#[test]
fn write_kv_quant_equals_the_cpu_quantizer() {
    require_gpu!();
    let dev = device();
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    for dtype in QUANT {
        for shape in GEOMETRIES {
            for tokens in [1usize, 7, 40] {
                let g = geometry(shape, 11);
                let what = format!("write_kv_quant {dtype} tokens={tokens} {g:?}");
                let slots = random_slots(&mut rng, tokens, &g);
                let mut k = random_rows(&mut rng, tokens, &g);
                let v = random_rows(&mut rng, tokens, &g);
                // A NaN in the last token's first key row: the row's scale is NaN, its codes 0.
                let last = (tokens - 1) * g.n_kv_heads * g.head_dim;
                k[last + g.head_dim / 3] = bf16::NAN;
                let (mut want_k, mut want_v) = (poison(&g, 0), poison(&g, 0x5A));
                let mut k_cache = upload(&dev, &from_bytes(&want_k));
                let mut v_cache = upload(&dev, &from_bytes(&want_v));
                elementwise::write_kv_quant(
                    &dev,
                    dtype,
                    &mut k_cache,
                    &mut v_cache,
                    &upload(&dev, &k),
                    &upload(&dev, &v),
                    &upload(&dev, &slots).slice(..),
                    tokens,
                    g,
                )
                .unwrap();
                let row_len = g.n_kv_heads * g.head_dim;
                for (t, &slot) in slots.iter().enumerate() {
                    if !is_stored(&g, slot) {
                        continue;
                    }
                    for h in 0..g.n_kv_heads {
                        let at = t * row_len + h * g.head_dim;
                        for (src, image) in [(&k, &mut want_k), (&v, &mut want_v)] {
                            let x: Vec<f32> = src[at..at + g.head_dim]
                                .iter()
                                .map(|b| b.to_f32())
                                .collect();
                            put_row(dtype, &g, image, slot as usize, h, &x);
                        }
                    }
                }
                let got_k = to_bytes(&download(&dev, &k_cache));
                let got_v = to_bytes(&download(&dev, &v_cache));
                assert_image(&format!("{what}: keys"), &g, &got_k, &want_k);
                assert_image(&format!("{what}: values"), &g, &got_v, &want_v);
            }
        }
    }
}

/// `qkv_rope_kv_quant` writes the same queries as `qkv_rope_kv` (bf16 cache) on the same inputs,
/// and caches equal to `quantize_row` of that bf16 cache's rows: the rotation is the bf16
/// kernel's, rounded to bf16 the same way, before quantizing. Where the dtype rotates keys (INT8
/// at power-of-two head dimensions), the keys are `hadamard_rotate` of those rows and the queries
/// `hadamard_rotate` of the bf16 kernel's, times `1 / head_dim`, rounded to bf16: bit for bit.
#[test]
fn qkv_rope_kv_quant_equals_bf16_then_the_cpu_quantizer() {
    require_gpu!();
    let dev = device();
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0de);
    for dtype in QUANT {
        for shape in GEOMETRIES {
            for (tokens, group) in [(1usize, 4usize), (5, 1), (33, 2)] {
                let g = geometry(shape, 13);
                let (head_dim, kv_cols) = (g.head_dim, g.n_kv_heads * g.head_dim);
                let q_cols = group * kv_cols;
                let width = q_cols + 2 * kv_cols;
                let what =
                    format!("qkv_rope_kv_quant {dtype} tokens={tokens} q_cols={q_cols} {g:?}");
                let inv_freq: Vec<f32> = (0..head_dim / 2)
                    .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
                    .collect();
                let positions: Vec<u32> =
                    (0..tokens).map(|_| rng.random_range(0..=40_000)).collect();
                let slots = random_slots(&mut rng, tokens, &g);
                // Each head's segment of q, k and v is a random row of its own kind.
                let qkv: Vec<bf16> = (0..tokens * width / head_dim)
                    .flat_map(|_| random_row(&mut rng, head_dim))
                    .collect();
                let (qkv_d, pos_d, slots_d, freq_d) = (
                    upload(&dev, &qkv),
                    upload(&dev, &positions),
                    upload(&dev, &slots),
                    upload(&dev, &inv_freq),
                );
                let nan = bf16::from_bits(0x7FC0);
                let cache_slots = g.max_blocks * g.block_size;

                let mut q_ref = upload(&dev, &vec![nan; tokens * q_cols]);
                let mut k_ref = upload(&dev, &vec![nan; cache_slots * kv_cols]);
                let mut v_ref = upload(&dev, &vec![nan; cache_slots * kv_cols]);
                elementwise::qkv_rope_kv(
                    &dev,
                    &qkv_d,
                    &mut q_ref,
                    &mut k_ref,
                    &mut v_ref,
                    tokens,
                    (q_cols, kv_cols, head_dim),
                    &pos_d.slice(..),
                    &slots_d.slice(..),
                    &freq_d,
                )
                .unwrap();

                let (mut want_k, mut want_v) = (poison(&g, 3), poison(&g, 0x3C));
                let mut q = upload(&dev, &vec![nan; tokens * q_cols]);
                let mut k_cache = upload(&dev, &from_bytes(&want_k));
                let mut v_cache = upload(&dev, &from_bytes(&want_v));
                elementwise::qkv_rope_kv_quant(
                    &dev,
                    dtype,
                    &qkv_d,
                    &mut q,
                    &mut k_cache,
                    &mut v_cache,
                    tokens,
                    g,
                    q_cols,
                    &pos_d.slice(..),
                    &slots_d.slice(..),
                    &freq_d,
                )
                .unwrap();

                let bits = |s: &CudaSlice<bf16>| -> Vec<u16> {
                    download(&dev, s).iter().map(|x| x.to_bits()).collect()
                };
                // A cache that rotates keys takes the bf16 kernel's rows to the Hadamard basis
                // (queries also times 1 / head_dim, rounded to bf16 again).
                let rotates = dtype.rotates_keys(head_dim);
                let rotated = |row: &[bf16], scale: f32| -> Vec<f32> {
                    let mut x: Vec<f32> = row.iter().map(|b| b.to_f32()).collect();
                    if rotates {
                        hadamard_rotate(&mut x);
                        x.iter_mut().for_each(|v| *v *= scale);
                    }
                    x
                };
                let want_q: Vec<u16> = download(&dev, &q_ref)
                    .chunks(head_dim)
                    .flat_map(|head| rotated(head, rotated_query_scale(head_dim)))
                    .map(|v| bf16::from_f32(v).to_bits())
                    .collect();
                assert_eq!(bits(&q), want_q, "{what}: queries");
                let (k_rows, v_rows) = (download(&dev, &k_ref), download(&dev, &v_ref));
                for &slot in slots.iter().filter(|&&s| is_stored(&g, s)) {
                    for h in 0..g.n_kv_heads {
                        let at = slot as usize * kv_cols + h * head_dim;
                        let k = rotated(&k_rows[at..at + head_dim], 1.0);
                        put_row(dtype, &g, &mut want_k, slot as usize, h, &k);
                        let v: Vec<f32> = v_rows[at..at + head_dim]
                            .iter()
                            .map(|b| b.to_f32())
                            .collect();
                        put_row(dtype, &g, &mut want_v, slot as usize, h, &v);
                    }
                }
                let got_k = to_bytes(&download(&dev, &k_cache));
                let got_v = to_bytes(&download(&dev, &v_cache));
                assert_image(&format!("{what}: keys"), &g, &got_k, &want_k);
                assert_image(&format!("{what}: values"), &g, &got_v, &want_v);
            }
        }
    }
}

/// `compact_kv` over quantized ranges moves each kept key's codes and scale together, per
/// (layer, KV head), and the scores as for bf16: equal to the same moves on the host, every other
/// byte untouched. Rows hold random bytes (codes and scales move as they are); some cases keep
/// more keys than one chunk of the kernel moves, one has no scores.
#[test]
fn compact_kv_quant_moves_codes_and_scales() {
    require_gpu!();
    use cudarc::driver::DevicePtr;
    let dev = device();
    let mut rng = ChaCha8Rng::seed_from_u64(0xbeef);
    let n_layers = 3;
    for dtype in QUANT {
        for shape in GEOMETRIES {
            for (keys, k, scores) in [
                (37usize, 20usize, true),
                (1000, 700, true),
                (300, 300, false),
                (64, 1, false),
            ] {
                let blocks_used = keys.div_ceil(shape.2);
                let g = geometry(shape, blocks_used + 3);
                let what = format!("compact_kv {dtype} keys={keys} k={k} scores={scores} {g:?}");
                let mut table: Vec<u32> = (0..g.max_blocks as u32).collect();
                table.shuffle(&mut rng);
                table.truncate(blocks_used);
                let slot_of =
                    |i: usize| table[i / g.block_size] as usize * g.block_size + i % g.block_size;

                // [keys | values][layer] ranges of random bytes; scores [slot][kv head] per layer.
                let mut ranges: Vec<Vec<u8>> = (0..2 * n_layers)
                    .map(|_| (0..g.range_bytes() + TAIL).map(|_| rng.random()).collect())
                    .collect();
                let score_len = g.max_blocks * g.block_size * g.n_kv_heads;
                let mut score_rows: Vec<Vec<f32>> = (0..n_layers)
                    .map(|_| {
                        (0..score_len)
                            .map(|_| rng.random_range(-5.0f32..5.0))
                            .collect()
                    })
                    .collect();
                let range_d: Vec<CudaSlice<bf16>> = ranges
                    .iter()
                    .map(|r| upload(&dev, &from_bytes(r)))
                    .collect();
                let score_d: Vec<CudaSlice<f32>> =
                    score_rows.iter().map(|s| upload(&dev, s)).collect();
                let mut addresses: Vec<u64> = range_d
                    .iter()
                    .map(|r| r.device_ptr(&dev.stream).0)
                    .collect();
                addresses.extend(score_d.iter().map(|s| {
                    if scores {
                        s.device_ptr(&dev.stream).0
                    } else {
                        0
                    }
                }));

                // Per (layer, KV head): k strictly increasing key indices below `keys`.
                let mut kept = Vec::with_capacity(n_layers * g.n_kv_heads * k);
                for _ in 0..n_layers * g.n_kv_heads {
                    let mut row: Vec<u32> = (0..keys as u32).collect();
                    row.shuffle(&mut rng);
                    row.truncate(k);
                    row.sort_unstable();
                    kept.extend(row);
                }

                elementwise::compact_kv(
                    &dev,
                    &upload(&dev, &addresses).slice(..),
                    &upload(&dev, &table).slice(..),
                    &upload(&dev, &kept).slice(..),
                    CompactShape {
                        k,
                        block_size: g.block_size,
                        n_layers,
                        n_kv_heads: g.n_kv_heads,
                        head_dim: g.head_dim,
                        dtype,
                    },
                )
                .unwrap();

                // The same moves on the host, in increasing j: kept[j] >= j, so no source is
                // overwritten before it is read.
                for layer in 0..n_layers {
                    for h in 0..g.n_kv_heads {
                        let row = &kept[(layer * g.n_kv_heads + h) * k..][..k];
                        for (j, &from) in row.iter().enumerate() {
                            let (src, dst) = (slot_of(from as usize), slot_of(j));
                            for image in [layer, n_layers + layer] {
                                let bytes = &mut ranges[image];
                                let (sc, ss) =
                                    row_at(&g, src / g.block_size, src % g.block_size, h);
                                let (dc, ds) =
                                    row_at(&g, dst / g.block_size, dst % g.block_size, h);
                                bytes.copy_within(sc..sc + g.head_dim, dc);
                                bytes.copy_within(ss..ss + 4, ds);
                            }
                            if scores {
                                let s = &mut score_rows[layer];
                                s[dst * g.n_kv_heads + h] = s[src * g.n_kv_heads + h];
                            }
                        }
                    }
                }
                for (i, (want, got)) in ranges.iter().zip(&range_d).enumerate() {
                    let part = if i < n_layers { "keys" } else { "values" };
                    let got = to_bytes(&download(&dev, got));
                    assert_image(
                        &format!("{what}: layer {} {part}", i % n_layers),
                        &g,
                        &got,
                        want,
                    );
                }
                for (layer, (want, got)) in score_rows.iter().zip(&score_d).enumerate() {
                    let got: Vec<u32> = download(&dev, got).iter().map(|x| x.to_bits()).collect();
                    let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, want, "{what}: layer {layer} scores");
                }
            }
        }
    }
}

/// The wrappers refuse an unquantized dtype and a geometry the kernels do not serve (before any
/// launch), and caches too short for the geometry.
#[test]
fn quantized_writes_check_their_arguments() {
    require_gpu!();
    let dev = device();
    let g = geometry((64, 2, 16), 4);
    let cache = || upload(&dev, &vec![bf16::ZERO; g.range_len()]);
    let rows = upload(&dev, &vec![bf16::ZERO; 512]);
    let slots = upload(&dev, &[0u32]);
    let write = |dtype, g: QuantGeometry, len: usize| {
        let (mut kc, mut vc) = (cache(), upload(&dev, &vec![bf16::ZERO; len]));
        elementwise::write_kv_quant(
            &dev,
            dtype,
            &mut kc,
            &mut vc,
            &rows,
            &rows,
            &slots.slice(..),
            1,
            g,
        )
    };
    assert!(write(KvDtype::Int8, g, g.range_len()).is_ok());
    assert!(
        write(KvDtype::Full, g, g.range_len()).is_err(),
        "bf16 is not quantized"
    );
    assert!(
        write(KvDtype::Fp8, g, g.range_len() - 1).is_err(),
        "short value cache"
    );
    let odd = QuantGeometry {
        block_size: 3,
        n_kv_heads: 1,
        ..g
    };
    assert!(
        write(KvDtype::Fp8, odd, g.range_len()).is_err(),
        "block_size · n_kv_heads of 3"
    );
    let wide = QuantGeometry {
        head_dim: 48 + 256,
        n_kv_heads: 1,
        max_blocks: 1,
        ..g
    };
    assert!(
        write(KvDtype::Int8, wide, g.range_len()).is_err(),
        "head_dim past 256"
    );
}
