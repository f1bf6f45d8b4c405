//! Searching a sorted run of extents forward from a known position: the
//! walks that visit many keys in order (a checkpoint's delta, a delta
//! applied at mount) start each search where the last one ended.
//!
//! Such a walk at a million extents is bound by memory latency: a
//! bisection is a chain of dependent cache misses. The search first
//! guesses where the key is from the offsets at both ends of the rest
//! (file offsets spread evenly over a map's extents in most files), then
//! gallops from the guess toward the key and bisects only the last step:
//! a good guess costs a few probes on one or two cache lines, a bad one a
//! gallop's worth.

use crate::types::Extent;

/// The first index at or after `from` whose extent's file offset is at
/// least `key` (`extents.len()` if none): `from` plus the partition point of
/// the rest (see the module docs for how it is found).
pub fn first_key_at_or_after(extents: &[Extent], from: usize, key: u64) -> usize {
    let rest = &extents[from..];
    let Some(last) = rest.len().checked_sub(1) else {
        return from;
    };
    let (low, high) = (rest[0].file_off, rest[last].file_off);
    if key <= low {
        return from;
    }
    if key > high {
        return extents.len();
    }
    // rest[0] < key <= rest[last]: the answer is in 1..=last.
    let guess = ((u128::from(key - low) * last as u128) / u128::from(high - low)) as usize;
    let guess = guess.clamp(1, last);
    let (mut below, mut at_or_above) = if rest[guess].file_off < key {
        // rest[..=guess] are < key: gallop up.
        let mut below = guess;
        let mut step = 1;
        while below + step < last && rest[below + step].file_off < key {
            below += step;
            step *= 2;
        }
        (below, (below + step).min(last))
    } else {
        // rest[guess] >= key: gallop down.
        let mut above = guess;
        let mut step = 1;
        while above > step && rest[above - step].file_off >= key {
            above -= step;
            step *= 2;
        }
        (above.saturating_sub(step), above)
    };
    // rest[below] < key <= rest[at_or_above]: bisect between.
    while at_or_above - below > 1 {
        let mid = below + (at_or_above - below) / 2;
        if rest[mid].file_off < key {
            below = mid;
        } else {
            at_or_above = mid;
        }
    }
    from + at_or_above
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(file_off: u64) -> Extent {
        Extent {
            file_off,
            len: 1,
            addr: file_off,
            state: crate::types::ExtentState::Written,
        }
    }

    proptest! {
        /// Against the plain partition point, on offsets spread evenly
        /// and clustered (where the guess is far off), for every start.
        #[test]
        fn matches_the_partition_point(
            spread in prop::collection::btree_set(0..1000u64, 0..80),
            cluster in prop::collection::btree_set(1_000_000..1_000_050u64, 0..30),
            key in 0..1_000_100u64,
        ) {
            let extents: Vec<Extent> = spread.iter().chain(&cluster).map(|&o| at(o)).collect();
            for from in 0..=extents.len() {
                let want = from + extents[from..].partition_point(|e| e.file_off < key);
                prop_assert_eq!(first_key_at_or_after(&extents, from, key), want, "from {}", from);
            }
        }
    }
}
