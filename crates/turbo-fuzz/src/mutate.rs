//! Byte-level mutations, the same kinds libFuzzer makes (bit flips, interesting integers,
//! insertions, deletions, truncation, splices), plus the "interesting" numbers every structured
//! mutator draws from: the values at which sizes overflow, wrap or stop fitting a type.

use crate::rng::Rng;

/// Numbers at the edges of the integer types and of what a machine can allocate.
pub const INTERESTING_U64: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    1023,
    1024,
    4095,
    4096,
    32767,
    32768,
    65535,
    65536,
    1 << 20,
    1 << 24,
    i32::MAX as u64,
    1 << 31,
    u32::MAX as u64 - 1,
    u32::MAX as u64,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 53,
    (1 << 53) + 1,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 31,
    u64::MAX - 1,
    u64::MAX,
];

/// Floats that break arithmetic: zeros, extremes, subnormals, infinities, NaN.
pub const INTERESTING_F64: &[f64] = &[
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-45,
    5e-324,
    1e-6,
    1e30,
    3.4e38,
    1e39,
    1e300,
    f64::MAX,
    f64::MIN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    f64::NAN,
];

/// An interesting integer, sometimes nudged by a little or replaced by a random one.
pub fn interesting_u64(rng: &mut Rng) -> u64 {
    let base = *rng.pick(INTERESTING_U64);
    match rng.below(8) {
        0 => base.wrapping_add(rng.below(3) as u64),
        1 => base.wrapping_sub(rng.below(3) as u64),
        2 => rng.next_u64() >> rng.below(64),
        _ => base,
    }
}

pub fn interesting_f64(rng: &mut Rng) -> f64 {
    match rng.below(6) {
        0 => interesting_u64(rng) as f64,
        1 => -(interesting_u64(rng) as f64),
        _ => *rng.pick(INTERESTING_F64),
    }
}

/// Longest input a mutation may make from one `len` bytes long.
fn max_len(len: usize) -> usize {
    len.saturating_mul(2).saturating_add(4096)
}

/// Applies one to `max_ops` byte-level mutations to `data`. `pool` holds other inputs to splice
/// pieces of in (other seeds of the same target).
pub fn bytes(data: &mut Vec<u8>, rng: &mut Rng, max_ops: usize, pool: &[&[u8]]) {
    let limit = max_len(data.len());
    for _ in 0..rng.range(1, max_ops.max(1)) {
        one(data, rng, pool);
        data.truncate(limit);
    }
}

fn one(data: &mut Vec<u8>, rng: &mut Rng, pool: &[&[u8]]) {
    let len = data.len();
    match rng.below(12) {
        // Flip a bit.
        0 if len > 0 => {
            let at = rng.below(len);
            data[at] ^= 1 << rng.below(8);
        }
        // An interesting byte.
        1 if len > 0 => {
            let at = rng.below(len);
            data[at] = *rng.pick(&[0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'\n', b'\\', b' ']);
        }
        // An interesting integer of 1, 2, 4 or 8 bytes, little-endian, over existing bytes.
        2 | 3 if len > 0 => {
            let width = *rng.pick(&[1usize, 2, 4, 8]);
            let at = rng.below(len);
            let v = interesting_u64(rng).to_le_bytes();
            for (i, b) in v[..width].iter().enumerate() {
                if let Some(d) = data.get_mut(at + i) {
                    *d = *b;
                }
            }
        }
        // Insert random bytes.
        4 => {
            let at = rng.position(len);
            let n = rng.small(64).max(1);
            let insert = rng.bytes(n);
            data.splice(at..at, insert);
        }
        // Delete a range.
        5 if len > 0 => {
            let at = rng.below(len);
            let n = rng.small(len - at).max(1);
            data.drain(at..at + n);
        }
        // Truncate.
        6 => {
            let at = rng.position(len);
            data.truncate(at);
        }
        // Duplicate a range in place.
        7 if len > 0 => {
            let at = rng.below(len);
            let n = rng.small((len - at).min(4096)).max(1);
            let chunk = data[at..at + n].to_vec();
            let to = rng.position(len);
            data.splice(to..to, chunk);
        }
        // Overwrite with a copy of another range (moves structure around).
        8 if len > 1 => {
            let from = rng.below(len);
            let n = rng.small((len - from).min(256)).max(1);
            let chunk = data[from..from + n].to_vec();
            let to = rng.below(len);
            for (i, b) in chunk.into_iter().enumerate() {
                if let Some(d) = data.get_mut(to + i) {
                    *d = b;
                }
            }
        }
        // Splice in a piece of another input.
        9 if !pool.is_empty() => {
            let other = *rng.pick(pool);
            if !other.is_empty() {
                let from = rng.below(other.len());
                let n = rng.small((other.len() - from).min(4096)).max(1);
                let at = rng.position(len);
                let cut = rng.small(len - at);
                data.splice(at..at + cut, other[from..from + n].iter().copied());
            }
        }
        // Add a small number to a little-endian integer.
        10 if len >= 4 => {
            let at = rng.below(len - 3);
            let mut v = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"));
            let delta = rng.range(1, 35) as u32;
            v = if rng.bool() {
                v.wrapping_add(delta)
            } else {
                v.wrapping_sub(delta)
            };
            data[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        // Zero a range.
        _ if len > 0 => {
            let at = rng.below(len);
            let n = rng.small((len - at).min(64)).max(1);
            data[at..at + n].fill(0);
        }
        _ => data.push(rng.next_u64() as u8),
    }
}

/// A byte string that is not UTF-8 in an interesting way, or random bytes.
pub fn invalid_utf8(rng: &mut Rng) -> Vec<u8> {
    const BAD: &[&[u8]] = &[
        b"\xff",
        b"\xc0\x80",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xe2\x82",
        b"\xf0\x9f\x98",
        b"\x80",
        b"\xfe\xff",
        b"\xef\xbb\xbf",
    ];
    match rng.below(3) {
        0 => {
            let n = rng.small(16).max(1);
            rng.bytes(n)
        }
        _ => rng.pick(BAD).to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_change_inputs_and_stay_bounded() {
        let mut rng = Rng::new(3);
        let seed: Vec<u8> = (0..200u8).collect();
        let mut changed = 0;
        for _ in 0..2000 {
            let mut d = seed.clone();
            bytes(&mut d, &mut rng, 4, &[b"other input"]);
            assert!(d.len() <= max_len(seed.len()));
            changed += usize::from(d != seed);
        }
        assert!(changed > 1800, "{changed}");
    }
}
