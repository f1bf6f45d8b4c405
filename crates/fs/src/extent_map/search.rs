//! Searching a sorted run of extents forward from a known position: the
//! walks that visit many keys in order (a checkpoint's delta, a delta
//! applied at mount) start each search where the last one ended.

use crate::types::Extent;

/// The first index at or after `from` whose extent's file offset is at
/// least `key` (`extents.len()` if none): `from` plus the partition point of
/// the rest, found by galloping from `from` (1, 2, 4... ahead) and then
/// bisecting the last step, so a key near `from` costs a few probes near it
/// (a bisection of a large map is a chain of dependent cache misses).
pub fn first_key_at_or_after(extents: &[Extent], from: usize, key: u64) -> usize {
    let rest = &extents[from..];
    let mut below = 0; // rest[..below] are all < key
    let mut step = 1;
    while below + step <= rest.len() && rest[below + step - 1].file_off < key {
        below += step;
        step *= 2;
    }
    let window = &rest[below..rest.len().min(below + step - 1)];
    from + below + window.partition_point(|e| e.file_off < key)
}
