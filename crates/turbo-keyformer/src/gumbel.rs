//! Counter-based Gumbel noise: a pure function of `(seed, step, layer, head, key)`.
//!
//! Stateless, so a GPU kernel can draw the noise for any element without a generator state, any
//! thread order gives the same result, and the CPU reference reproduces a kernel's noise exactly.
//!
//! # The recipe (bit-exact; port it verbatim)
//!
//! Arithmetic is on unsigned integers of the width shown, with wrap-around multiplication; `^`
//! is xor and `>>`/`<<` are logical shifts. The per-row part (seed, step, layer) is hashed once in
//! 64 bits; the per-element part (head, key), drawn for every logit, in 32 (two multiplies a
//! round instead of a 64-bit multiply's several instructions on a GPU).
//!
//! ```text
//! GAMMA = 0x9E3779B97F4A7C15
//! mix(z: u64):                  // the splitmix64 finalizer, a bijection of u64
//!     z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//!     z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//!     return z ^ (z >> 31)
//! mix32(x: u32):                // lowbias32 (Wellons), a bijection of u32
//!     x = (x ^ (x >> 16)) * 0x7FEB352D
//!     x = (x ^ (x >> 15)) * 0x846CA68B
//!     return x ^ (x >> 16)
//!
//! h = mix(seed ^ GAMMA)
//! h = mix(h ^ ((u64(step) << 32) | u64(layer)) ^ GAMMA)      // = gumbel_row(...)
//! x = mix32(u32(h) ^ key)
//! x = mix32(x ^ u32(h >> 32) ^ head)                          // = gumbel_bits(...)
//!
//! m = x >> 9                            // top 23 bits, m < 2^23
//! u = f32(2 * m + 1) * 2^-24            // exact in f32: odd numerator < 2^24
//! g = -ln(-ln(u))                       // in f32
//! ```
//!
//! `u` takes the 2^23 values `1/2^24, 3/2^24, ..., (2^24 - 1)/2^24`: never 0 or 1, so `g` is always
//! finite (between about -2.81 and 16.6), and symmetric around 1/2. The conversion and the scaling
//! by a power of two are exact, so a CUDA port (`__uint2float_rn(2u * m + 1u) * 0x1p-24f`) gets
//! bit-identical uniforms; `g` then agrees up to the ulp error of the platform's `logf`.
//!
//! Known answers, for testing a port:
//!
//! | seed, step, layer, head, key | `gumbel_bits` | `u` (f32 bits) | `u` |
//! | --- | --- | --- | --- |
//! | 0, 0, 0, 0, 0 | `0x3036A001` | `0x3E40DA84` | 0.18833357 |
//! | 1, 2, 3, 4, 5 | `0x0686B386` | `0x3CD0D660` | 0.02549285 |
//! | 0xDEADBEEF, 17, 31, 7, 4095 | `0x19746171` | `0x3DCBA308` | 0.09943205 |

/// The golden-ratio increment of splitmix64; xored in before each mix so that an all-zero input
/// does not map to zero.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finalizer: a bijection of `u64` with good avalanche.
const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// lowbias32: a bijection of `u32` with good avalanche for two multiplies.
const fn mix32(mut x: u32) -> u32 {
    x = (x ^ (x >> 16)).wrapping_mul(0x7FEB_352D);
    x = (x ^ (x >> 15)).wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// The 64-bit hash of a row's counter (seed, step, layer), shared by all its (head, key) draws.
pub const fn gumbel_row(seed: u64, step: u32, layer: u32) -> u64 {
    let h = mix(seed ^ GAMMA);
    mix(h ^ (((step as u64) << 32) | layer as u64) ^ GAMMA)
}

/// The 32-bit hash of one noise counter (see the module docs for the recipe).
///
/// Each round is a bijection of its new input for fixed earlier inputs, so within a row's
/// (seed, step, layer) two keys of one head, or two heads of one key, never share a hash.
pub const fn gumbel_bits(seed: u64, step: u32, layer: u32, head: u32, key: u32) -> u32 {
    let h = gumbel_row(seed, step, layer);
    let x = mix32(h as u32 ^ key);
    mix32(x ^ (h >> 32) as u32 ^ head)
}

/// Maps a hash to a uniform in the open interval (0, 1): `(2 * (bits >> 9) + 1) * 2^-24`.
pub fn uniform_from_bits(bits: u32) -> f32 {
    // 2 * m + 1 < 2^24, so the conversion is exact; so is the scaling by a power of two.
    let odd = (bits >> 9) * 2 + 1;
    odd as f32 * (1.0 / 16_777_216.0)
}

/// The uniform in (0, 1) behind one Gumbel draw; bit-identical on every platform.
pub fn gumbel_uniform(seed: u64, step: u32, layer: u32, head: u32, key: u32) -> f32 {
    uniform_from_bits(gumbel_bits(seed, step, layer, head, key))
}

/// A standard Gumbel(0, 1) draw, `-ln(-ln(u))`: mean ≈ 0.5772 (Euler–Mascheroni), variance
/// π²/6. Always finite.
///
/// Keyformer adds it to the logit of `key` for query head `head` of `layer`; the policies pass the
/// query token's position as `step`, so every prompt row and every decoding step is fresh noise.
pub fn gumbel(seed: u64, step: u32, layer: u32, head: u32, key: u32) -> f32 {
    gumbel_from_uniform(gumbel_uniform(seed, step, layer, head, key))
}

/// `-ln(-ln(u))` in f32; finite for every `u` that [`uniform_from_bits`] returns.
pub fn gumbel_from_uniform(u: f32) -> f32 {
    -(-u.ln()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn uniform_is_strictly_inside_the_unit_interval() {
        let lo = uniform_from_bits(0);
        let hi = uniform_from_bits(u32::MAX);
        assert_eq!(lo, 1.0 / 16_777_216.0);
        assert_eq!(hi, 1.0 - 1.0 / 16_777_216.0);
        assert!(lo > 0.0 && hi < 1.0);
        // Symmetric around 1/2.
        assert_eq!(lo + hi, 1.0);
        let (glo, ghi) = (gumbel_from_uniform(lo), gumbel_from_uniform(hi));
        assert!(glo.is_finite() && ghi.is_finite());
        assert!((-2.9..-2.7).contains(&glo), "{glo}");
        assert!((16.0..17.0).contains(&ghi), "{ghi}");
    }

    #[test]
    fn moments_match_the_standard_gumbel() {
        const N: u32 = 100_000;
        let draws: Vec<f64> = (0..N)
            .map(|i| f64::from(gumbel(42, i / 1000, (i / 100) % 10, (i / 10) % 10, i % 10)))
            .collect();
        let n = f64::from(N);
        let mean = draws.iter().sum::<f64>() / n;
        let var = draws.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1.0);
        // Standard errors: sqrt(pi^2/6 / N) ≈ 0.0041 for the mean; about 0.011 for the
        // variance (excess kurtosis 12/5). Tolerances are 5 standard errors.
        let euler_gamma = 0.577_215_664_901_532_9;
        let pi2_6 = std::f64::consts::PI.powi(2) / 6.0;
        assert!((mean - euler_gamma).abs() < 0.021, "mean {mean}");
        assert!((var - pi2_6).abs() < 0.06, "variance {var}");
    }

    #[test]
    fn cdf_matches_the_standard_gumbel() {
        const N: u32 = 100_000;
        let draws: Vec<f32> = (0..N).map(|i| gumbel(7, 3, 1, 2, i)).collect();
        for x in [-1.0f64, 0.0, 0.5, 1.0, 2.0, 4.0] {
            let expected = (-(-x).exp()).exp();
            let got = draws.iter().filter(|&&g| f64::from(g) <= x).count() as f64 / f64::from(N);
            // Binomial standard error is at most 0.0016; allow 5 of them.
            assert!(
                (got - expected).abs() < 0.008,
                "P(g <= {x}) = {got}, want {expected}"
            );
        }
    }

    #[test]
    fn distinct_counters_give_distinct_hashes_and_values() {
        let mut hashes = HashSet::new();
        let mut values = HashSet::new();
        let mut count = 0usize;
        for seed in [0u64, 1, u64::MAX] {
            for step in [0u32, 1, 1000] {
                for layer in 0..4u32 {
                    for head in 0..4u32 {
                        for key in 0..64u32 {
                            hashes.insert(gumbel_bits(seed, step, layer, head, key));
                            values.insert(gumbel(seed, step, layer, head, key).to_bits());
                            count += 1;
                        }
                    }
                }
            }
        }
        // 32-bit hashes of 9216 counters: a birthday collision has odds of about 1 in 100,000.
        assert_eq!(hashes.len(), count);
        // 23-bit uniforms: among 9216 draws a few birthday collisions are possible, but not many.
        assert!(values.len() + 16 >= count, "{} of {count}", values.len());
        // Changing any one field changes the value.
        let base = gumbel(5, 6, 7, 8, 9);
        for other in [
            gumbel(6, 6, 7, 8, 9),
            gumbel(5, 7, 7, 8, 9),
            gumbel(5, 6, 8, 8, 9),
            gumbel(5, 6, 7, 9, 9),
            gumbel(5, 6, 7, 8, 10),
        ] {
            assert_ne!(base.to_bits(), other.to_bits());
        }
    }

    #[test]
    fn fields_do_not_alias() {
        // step/layer share a 64-bit word, head/key a round each: swapping them must not collide.
        assert_ne!(gumbel_bits(1, 2, 3, 4, 5), gumbel_bits(1, 3, 2, 4, 5));
        assert_ne!(gumbel_bits(1, 2, 3, 4, 5), gumbel_bits(1, 2, 3, 5, 4));
        assert_ne!(gumbel_bits(1, 2, 3, 4, 5), gumbel_bits(1, 4, 5, 2, 3));
        assert_ne!(gumbel_bits(0, 0, 0, 0, 0), 0);
    }

    /// Frozen outputs of the recipe: a port must reproduce these bits exactly.
    #[test]
    fn known_answers() {
        for ((seed, step, layer, head, key), bits, uniform_bits) in KNOWN_ANSWERS {
            assert_eq!(
                gumbel_bits(seed, step, layer, head, key),
                bits,
                "{seed} {step} {layer} {head} {key}"
            );
            assert_eq!(
                gumbel_uniform(seed, step, layer, head, key).to_bits(),
                uniform_bits
            );
        }
    }

    /// (seed, step, layer, head, key).
    type Counter = (u64, u32, u32, u32, u32);

    /// (counter, `gumbel_bits`, `gumbel_uniform` as f32 bits), computed by an independent port
    /// of the recipe with Python integers (`scripts/gumbel_known_answers.py`).
    const KNOWN_ANSWERS: [(Counter, u32, u32); 4] = [
        ((0, 0, 0, 0, 0), 0x3036_A001, 0x3E40_DA84),
        ((1, 2, 3, 4, 5), 0x0686_B386, 0x3CD0_D660),
        ((0xDEAD_BEEF, 17, 31, 7, 4095), 0x1974_6171, 0x3DCB_A308),
        (
            (u64::MAX, u32::MAX, u32::MAX, u32::MAX, u32::MAX),
            0x4AE7_3234,
            0x3E95_CE66,
        ),
    ];
}
