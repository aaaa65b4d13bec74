//! The state-merge kernels against the CPU merge of `turbo_attention` (`merge_states`,
//! `merge_into`), on a real GPU.
//!
//! Every test skips (passes, printing "skipping: no CUDA device") on a machine without CUDA. With a
//! GPU, each case draws fresh random states (seeded): `o` uniform in ±[0.05, 3) (never zero), `lse`
//! uniform in ±range for ranges from 5 to 1e30 (far beyond where exp overflows f32), with some
//! states empty (`lse = -inf`, their `o` set to NaN, which must never be read), some (row, head)
//! pairs empty in every state, and some with exactly one non-empty state. Outputs are filled with
//! NaN first so an element the kernel never wrote shows up.
//!
//! Tolerances (the CPU reference computes the same f32 formula, summing in the same order):
//! - f32 `o`: the kernels use CUDA's `expf` (at most 2 ulp off) and fused multiply-adds, so each
//!   weight differs by a few 2^-24 relatively and the convex combination by about n · 2^-23
//!   relative to the largest |o_i| of the pair; 2e-5 · max|o_i| covers n = 64 with room, and is
//!   far below what a wrong weight, chunk or pair would cause.
//! - bf16 `o`: the same plus one rounding to bf16 (2^-9 relative, |o| <= max|o_i|): 1e-2 ·
//!   max|o_i|, as elsewhere for bf16 outputs.
//! - lse: `M + ln Σ`. The sums of n <= 64 weights in [0, 1] differ by the weights' 2 ulp and at
//!   most half an ulp per addition, so by at most ~(2 + n/2) · 2^-24 relatively (2e-6 at n = 64),
//!   which ln turns into the same absolute error; `logf` and the addition of M add an ulp of
//!   the result: 1e-5 · (1 + |lse|).
//! - Exact: a pair whose states are all empty gives `o = 0` and `lse = -inf`; a pair with one
//!   non-empty state gives that state bit for bit (f32 output).

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::{merge_into, merge_states};
use turbo_kernels::ops::merge::{self, MergeOutput, StateShape};
use turbo_kernels::CudaDevice;

const O_F32_TOL: f32 = 2e-5;
const O_BF16_TOL: f32 = 1e-2;
const LSE_TOL: f32 = 1e-5;

fn device() -> Option<CudaDevice> {
    if !turbo_kernels::cuda_available() {
        println!("skipping: no CUDA device");
        return None;
    }
    Some(CudaDevice::new(0).expect("cannot open CUDA device 0"))
}

fn upload<T: DeviceRepr>(dev: &CudaDevice, v: &[T]) -> CudaSlice<T> {
    dev.stream.clone_htod(v).expect("upload")
}

fn download<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
    dev: &CudaDevice,
    s: &CudaSlice<T>,
) -> Vec<T> {
    dev.stream.clone_dtoh(s).expect("download")
}

/// `n` sets of random states of `shape`, `[n][pairs][d]` and `[n][pairs]`. Pair `p` is empty in
/// every set when `p % 7 == 3`, has only set `p % n` non-empty when `p % 7 == 5`, and otherwise
/// each of its states is empty with probability 1/4. Empty states carry NaN in `o`.
fn random_states(
    rng: &mut ChaCha8Rng,
    shape: StateShape,
    n: usize,
    range: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (pairs, d) = (shape.pairs(), shape.head_dim);
    let mut o = Vec::with_capacity(n * pairs * d);
    let mut lse = Vec::with_capacity(n * pairs);
    for i in 0..n {
        for p in 0..pairs {
            let empty = match p % 7 {
                3 => true,
                5 => i != p % n,
                _ => rng.random_range(0..4) == 0,
            };
            lse.push(if empty {
                f32::NEG_INFINITY
            } else {
                rng.random_range(-range..range)
            });
            o.extend((0..d).map(|_| {
                if empty {
                    f32::NAN
                } else {
                    let m: f32 = rng.random_range(0.05..3.0);
                    if rng.random::<bool>() {
                        m
                    } else {
                        -m
                    }
                }
            }));
        }
    }
    (o, lse)
}

/// The CPU merge of pair `p`'s `n` states: (o, lse, largest |o_i| among its non-empty states).
fn cpu_merge(
    o: &[f32],
    lse: &[f32],
    n: usize,
    pairs: usize,
    d: usize,
    p: usize,
) -> (Vec<f32>, f32, f32) {
    let states: Vec<(&[f32], f32)> = (0..n)
        .map(|i| {
            (
                &o[(i * pairs + p) * d..(i * pairs + p + 1) * d],
                lse[i * pairs + p],
            )
        })
        .collect();
    let mut out = vec![f32::NAN; d];
    let l = merge_states(&states, &mut out);
    let scale = states
        .iter()
        .filter(|s| s.1 != f32::NEG_INFINITY)
        .flat_map(|s| s.0)
        .fold(0f32, |m, x| m.max(x.abs()));
    (out, l, scale)
}

/// Checks one pair's kernel output against the CPU merge.
#[allow(clippy::too_many_arguments)]
fn check_pair(
    what: &str,
    p: usize,
    got_o: &[f32],
    got_lse: Option<f32>,
    want: &(Vec<f32>, f32, f32),
    live: usize,
    o_tol: f32,
    exact_single: bool,
) {
    let (want_o, want_lse, scale) = want;
    if let Some(g) = got_lse {
        if *want_lse == f32::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}: pair {p}: empty lse");
        } else {
            assert!(
                (g - want_lse).abs() <= LSE_TOL * (1.0 + want_lse.abs()),
                "{what}: pair {p}: lse {g} vs {want_lse}"
            );
        }
    }
    for (k, (g, w)) in got_o.iter().zip(want_o).enumerate() {
        assert!(
            !g.is_nan(),
            "{what}: pair {p} dim {k} is NaN (never written, or read an empty state's o)"
        );
        if live == 0 {
            assert_eq!(*g, 0.0, "{what}: pair {p} dim {k}: empty set gives {g}");
        } else if live == 1 && exact_single {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what}: pair {p} dim {k}: one state, {g} vs {w}"
            );
        } else {
            assert!(
                (g - w).abs() <= o_tol * scale,
                "{what}: pair {p} dim {k}: gpu {g} vs cpu {w} (scale {scale})"
            );
        }
    }
}

/// Converts a downloaded output to f32 (the identity for f32).
trait ToF32: MergeOutput + DeviceRepr + ValidAsZeroBits + Default + Clone {
    const NAN: Self;
    const TOL: f32;
    fn to_f32(self) -> f32;
}

impl ToF32 for f32 {
    const NAN: Self = f32::NAN;
    const TOL: f32 = O_F32_TOL;
    fn to_f32(self) -> f32 {
        self
    }
}

impl ToF32 for bf16 {
    const NAN: Self = bf16::NAN;
    const TOL: f32 = O_BF16_TOL;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

const SHAPES: [StateShape; 5] = [
    StateShape {
        rows: 5,
        heads: 4,
        head_dim: 128,
    },
    StateShape {
        rows: 3,
        heads: 9,
        head_dim: 64,
    },
    StateShape {
        rows: 2,
        heads: 3,
        head_dim: 256,
    },
    // Not a multiple of 4: the one-dimension-per-thread kernels.
    StateShape {
        rows: 7,
        heads: 2,
        head_dim: 7,
    },
    StateShape {
        rows: 1,
        heads: 1,
        head_dim: 1,
    },
];

fn merge_states_case<T: ToF32>(dev: &CudaDevice, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for shape in SHAPES {
        for n in [1usize, 2, 5, 64] {
            for range in [5.0f32, 80.0, 1e4, 1e30] {
                let (pairs, d) = (shape.pairs(), shape.head_dim);
                let (o, lse) = random_states(&mut rng, shape, n, range);
                let (o_dev, lse_dev) = (upload(dev, &o), upload(dev, &lse));
                let mut out = upload(dev, &vec![T::NAN; pairs * d]);
                let mut out_lse = upload(dev, &vec![f32::NAN; pairs]);
                merge::merge_states(
                    dev,
                    shape,
                    n,
                    &o_dev,
                    &lse_dev,
                    &mut out,
                    Some(&mut out_lse),
                )
                .expect("merge_states");
                let got: Vec<f32> = download(dev, &out).into_iter().map(T::to_f32).collect();
                let got_lse = download(dev, &out_lse);
                let what = format!("merge_states {shape:?} n={n} range={range}");
                for p in 0..pairs {
                    let want = cpu_merge(&o, &lse, n, pairs, d, p);
                    let live = (0..n)
                        .filter(|&i| lse[i * pairs + p] != f32::NEG_INFINITY)
                        .count();
                    let exact = std::mem::size_of::<T>() == 4;
                    check_pair(
                        &what,
                        p,
                        &got[p * d..(p + 1) * d],
                        Some(got_lse[p]),
                        &want,
                        live,
                        T::TOL,
                        exact,
                    );
                }
                // Without an lse output the same o comes out.
                let mut again = upload(dev, &vec![T::NAN; pairs * d]);
                merge::merge_states(dev, shape, n, &o_dev, &lse_dev, &mut again, None)
                    .expect("merge_states");
                let again: Vec<f32> = download(dev, &again).into_iter().map(T::to_f32).collect();
                assert!(
                    got.iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: o differs without lse output"
                );
            }
        }
    }
}

#[test]
fn merge_states_matches_cpu_f32() {
    let Some(dev) = device() else { return };
    merge_states_case::<f32>(&dev, 1);
}

#[test]
fn merge_states_matches_cpu_bf16() {
    let Some(dev) = device() else { return };
    merge_states_case::<bf16>(&dev, 2);
}

#[test]
fn merging_no_states_gives_empty_states() {
    let Some(dev) = device() else { return };
    let shape = StateShape {
        rows: 3,
        heads: 5,
        head_dim: 64,
    };
    let nothing = upload(&dev, &[f32::NAN]);
    let mut out = upload(&dev, &vec![f32::NAN; shape.pairs() * 64]);
    let mut out_lse = upload(&dev, &vec![f32::NAN; shape.pairs()]);
    merge::merge_states(
        &dev,
        shape,
        0,
        &nothing,
        &nothing,
        &mut out,
        Some(&mut out_lse),
    )
    .expect("merge_states");
    assert!(download(&dev, &out).iter().all(|&x| x == 0.0));
    assert!(download(&dev, &out_lse)
        .iter()
        .all(|&x| x == f32::NEG_INFINITY));
}

fn merge_state_case<T: ToF32>(dev: &CudaDevice, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for shape in SHAPES {
        for range in [5.0f32, 80.0, 1e30] {
            let (pairs, d) = (shape.pairs(), shape.head_dim);
            let (o, lse) = random_states(&mut rng, shape, 2, range);
            let (o_a, o_b) = o.split_at(pairs * d);
            let (lse_a, lse_b) = lse.split_at(pairs);
            let mut out = upload(dev, &vec![T::NAN; pairs * d]);
            let mut out_lse = upload(dev, &vec![f32::NAN; pairs]);
            merge::merge_state(
                dev,
                shape,
                &upload(dev, o_a),
                &upload(dev, lse_a),
                &upload(dev, o_b),
                &upload(dev, lse_b),
                &mut out,
                Some(&mut out_lse),
            )
            .expect("merge_state");
            let got: Vec<f32> = download(dev, &out).into_iter().map(T::to_f32).collect();
            let got_lse = download(dev, &out_lse);
            let what = format!("merge_state {shape:?} range={range}");
            for p in 0..pairs {
                let want = cpu_merge(&o, &lse, 2, pairs, d, p);
                let live = [lse_a[p], lse_b[p]]
                    .iter()
                    .filter(|l| **l != f32::NEG_INFINITY)
                    .count();
                let exact = std::mem::size_of::<T>() == 4;
                check_pair(
                    &what,
                    p,
                    &got[p * d..(p + 1) * d],
                    Some(got_lse[p]),
                    &want,
                    live,
                    T::TOL,
                    exact,
                );
            }
        }
    }
}

#[test]
fn merge_state_matches_cpu_f32() {
    let Some(dev) = device() else { return };
    merge_state_case::<f32>(&dev, 3);
}

#[test]
fn merge_state_matches_cpu_bf16() {
    let Some(dev) = device() else { return };
    merge_state_case::<bf16>(&dev, 4);
}

#[test]
fn merge_state_in_place_matches_merge_into() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for shape in SHAPES {
        for range in [5.0f32, 80.0, 1e30] {
            let (pairs, d) = (shape.pairs(), shape.head_dim);
            let (mut o, lse) = random_states(&mut rng, shape, 2, range);
            // An empty a is overwritten by b, so its o may hold anything; an empty b leaves a as it
            // was, NaN included. Give empty a states finite junk so that "untouched" is checkable.
            for p in 0..pairs {
                if lse[p] == f32::NEG_INFINITY {
                    o[p * d..(p + 1) * d].iter_mut().for_each(|x| *x = 9.0);
                }
            }
            let (o_a, o_b) = o.split_at(pairs * d);
            let (lse_a, lse_b) = lse.split_at(pairs);
            let mut a_dev = upload(&dev, o_a);
            let mut lse_a_dev = upload(&dev, lse_a);
            merge::merge_state_in_place(
                &dev,
                shape,
                &mut a_dev,
                &mut lse_a_dev,
                &upload(&dev, o_b),
                &upload(&dev, lse_b),
            )
            .expect("merge_state_in_place");
            let (got, got_lse) = (download(&dev, &a_dev), download(&dev, &lse_a_dev));
            for p in 0..pairs {
                let mut want = o_a[p * d..(p + 1) * d].to_vec();
                let mut want_lse = lse_a[p];
                merge_into(&mut want, &mut want_lse, &o_b[p * d..(p + 1) * d], lse_b[p]);
                let what = format!("merge_state_in_place {shape:?} range={range} pair {p}");
                let g = &got[p * d..(p + 1) * d];
                if lse_a[p] == f32::NEG_INFINITY || lse_b[p] == f32::NEG_INFINITY {
                    // One side empty: the other side, exactly.
                    assert_eq!(got_lse[p].to_bits(), want_lse.to_bits(), "{what}: lse");
                    assert!(
                        g.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{what}: o {g:?} vs {want:?}"
                    );
                    continue;
                }
                assert!(
                    (got_lse[p] - want_lse).abs() <= LSE_TOL * (1.0 + want_lse.abs()),
                    "{what}: lse {} vs {want_lse}",
                    got_lse[p]
                );
                let scale = o_a[p * d..(p + 1) * d]
                    .iter()
                    .chain(&o_b[p * d..(p + 1) * d])
                    .fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in g.iter().zip(&want) {
                    assert!(
                        (x - y).abs() <= O_F32_TOL * scale,
                        "{what}: gpu {x} vs cpu {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn mismatched_buffers_are_shape_errors() {
    let Some(dev) = device() else { return };
    let shape = StateShape {
        rows: 2,
        heads: 2,
        head_dim: 8,
    };
    let small = upload(&dev, &[0.5f32; 8]);
    let full = upload(&dev, &[0.5f32; 64]);
    let mut out = upload(&dev, &[0f32; 32]);
    let err = merge::merge_states(&dev, shape, 2, &small, &full, &mut out, None).unwrap_err();
    assert!(err.to_string().contains("merge_states"), "{err}");
    let err =
        merge::merge_state(&dev, shape, &full, &full, &small, &full, &mut out, None).unwrap_err();
    assert!(err.to_string().contains("merge_state"), "{err}");
    let wide = StateShape {
        rows: 1,
        heads: 1,
        head_dim: 1025,
    };
    let err = merge::merge_states(&dev, wide, 1, &full, &full, &mut out, None).unwrap_err();
    assert!(err.to_string().contains("head_dim"), "{err}");
}
