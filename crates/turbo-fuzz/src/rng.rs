//! A small seeded generator (SplitMix64). Every case of a run is a pure function of the run's
//! seed and the case's index, so any one case is made again without making the others.

/// SplitMix64: tiny, fast, and good enough to choose mutations.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The generator of case `index` of a run seeded with `seed`.
    pub fn for_case(seed: u64, index: u64) -> Self {
        let mut mix = Rng::new(seed ^ index.wrapping_mul(GOLDEN).rotate_left(17));
        let a = mix.next_u64();
        Rng::new(a ^ index)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `0..n`; `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True once in `n` times on average.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    pub fn bool(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// One of `items`, as the `&str` it is (`pick` would give a `&&str`).
    pub fn pick_str<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }

    /// A count in `0..=max` that is usually small: each power of two is as likely as the next,
    /// so long inputs come up without dominating.
    pub fn small(&mut self, max: usize) -> usize {
        let bits = usize::BITS - max.leading_zeros();
        let cap = 1usize
            .checked_shl(self.below(bits as usize + 1) as u32)
            .unwrap_or(usize::MAX);
        self.below(cap.min(max.saturating_add(1)).max(1))
    }

    /// How many edits to make to a seed: usually one (deep cases), sometimes two or three.
    pub fn edits(&mut self) -> usize {
        match self.below(20) {
            0 => 0,
            1..=11 => 1,
            12..=16 => 2,
            _ => 3,
        }
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// A position in `0..=len` (inclusive: inserting at the end is a position too).
    pub fn position(&mut self, len: usize) -> usize {
        self.below(len + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::for_case(7, 3).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            Rng::for_case(7, 3).next_u64(),
            Rng::for_case(7, 4).next_u64()
        );
        assert_ne!(
            Rng::for_case(7, 3).next_u64(),
            Rng::for_case(8, 3).next_u64()
        );
    }

    #[test]
    fn bounded_draws_stay_in_range() {
        let mut rng = Rng::new(1);
        for _ in 0..10_000 {
            assert!(rng.below(7) < 7);
            assert!(rng.small(100) <= 100);
            let r = rng.range(3, 5);
            assert!((3..=5).contains(&r));
        }
        assert_eq!(rng.small(0), 0);
    }
}
