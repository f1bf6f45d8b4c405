//! The workspace's one seeded pseudo-random generator: SplitMix64 (Steele,
//! Lea, Flood, "Fast splittable pseudorandom number generators", 2014).
//!
//! Simulation decisions (which writes a power cut keeps, in which order a
//! queue completes), benchmark offsets and test patterns all come from a
//! seed, so that a failing seed is a reproducer. That only holds while every
//! one of them draws from the same, fixed sequence: a generator copied into
//! each crate drifts. This one is a few lines, has no dependencies (so `rand`
//! stays out of the library), and is statistically fine for all of these
//! uses; it is not cryptographic.
//!
//! The sequences are pinned by known-answer tests: a seed saved in a bug
//! report must give the same run after any refactoring.

/// Added to the state at each step: 2^64 divided by the golden ratio, odd,
/// so the state walks through all 2^64 values before repeating.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijective 64-bit mix of `x + γ`.
///
/// The same as the first [`SplitMix64::next_u64`] of a generator seeded
/// with `x`, which makes it a stateless hash for deriving sub-seeds and
/// position-dependent patterns (`mix64(seed ^ position)`).
pub const fn mix64(x: u64) -> u64 {
    finalize(x.wrapping_add(GOLDEN_GAMMA))
}

const fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded SplitMix64 stream. Cloning forks it: both copies go on to
/// produce the same values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub const fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        let value = mix64(self.state);
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        value
    }

    /// Uniform in `0..n`, by multiply-shift (Lemire): no division, and a
    /// bias of at most `n / 2^64`, which no test or benchmark here can see.
    /// `below(0)` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Fills `buf` with the next values, little-endian, 8 bytes each; a
    /// tail shorter than 8 bytes takes the first bytes of one more value.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference outputs for seed 0 (as published with the algorithm),
    /// and a seed the crash simulator uses: any change to the constants or
    /// the order of update and output breaks these.
    #[test]
    fn known_answers() {
        let mut rng = SplitMix64::new(0);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            first,
            [
                0xe220_a839_7b1d_cdaf,
                0x6e78_9e6a_a1b9_65f4,
                0x06c4_5d18_8009_454f
            ]
        );
        let mut rng = SplitMix64::new(42);
        assert_eq!(rng.next_u64(), 0xbdd7_3226_2feb_6e95);
        assert_eq!(rng.next_u64(), 0x28ef_e333_b266_f103);
    }

    #[test]
    fn mix64_is_the_first_draw() {
        for seed in [0, 1, 42, u64::MAX, 0x5eed] {
            assert_eq!(mix64(seed), SplitMix64::new(seed).next_u64());
        }
        assert_eq!(mix64(0), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn below_stays_in_range_and_reaches_both_ends() {
        let mut rng = SplitMix64::new(7);
        let draws: Vec<u64> = (0..1000).map(|_| rng.below(5)).collect();
        assert!(draws.iter().all(|&d| d < 5));
        for v in 0..5 {
            assert!(draws.contains(&v), "{v} never drawn");
        }
        assert_eq!(rng.below(1), 0);
        assert_eq!(rng.below(0), 0);
        // The top of the range is the top of the u64.
        let mut top = SplitMix64::new(0);
        assert_eq!(top.below(1 << 32), 0xe220_a839);
    }

    #[test]
    fn fill_is_the_little_endian_stream_with_a_partial_tail() {
        let mut a = SplitMix64::new(3);
        let mut buf = [0u8; 19];
        a.fill(&mut buf);
        let mut b = SplitMix64::new(3);
        let mut want = Vec::new();
        for _ in 0..3 {
            want.extend_from_slice(&b.next_u64().to_le_bytes());
        }
        assert_eq!(buf[..], want[..19]);
        // The tail consumed a whole value.
        assert_eq!(a, b);
    }
}
