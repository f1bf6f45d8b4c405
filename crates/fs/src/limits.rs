//! Named limits of the file system, in one place, with the compile-time
//! assertions that tie them together: changing one limit so that it no longer
//! fits another fails the build, not a test (or a user's volume).
//!
//! Bounds that need a lower-level constant as well (a codec length, a
//! checkpoint header) are asserted next to the code that relies on them:
//! `codec` for name lengths, `mount_state` for the estimates.

use crate::types::{Ino, ROOT_INO};

/// Largest file size: keeps every offset computation far from overflow.
pub const MAX_FILE_SIZE: u64 = 1 << 60;

/// Longest directory entry name, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Most directory entries that may name one inode (hard links), as ext4.
pub const MAX_LINKS: u32 = 65_000;

/// Longest symlink target, in bytes: `PATH_MAX` less its NUL.
pub const MAX_SYMLINK_LEN: usize = 4095;

/// Longest extended attribute name (with its `user.` prefix), in bytes, and
/// largest value: Linux's `XATTR_NAME_MAX` and `XATTR_SIZE_MAX`.
pub const MAX_XATTR_NAME_LEN: usize = 255;
pub const MAX_XATTR_VALUE_LEN: usize = 65_536;
/// Most bytes of names and values one inode's extended attributes may hold
/// together: every attribute lives in the checkpoint image, so this keeps
/// one inode from taking a large share of it.
pub const MAX_XATTR_BYTES_PER_INODE: usize = 1 << 20;
/// The one extended attribute namespace stored: the others have kernel
/// meaning (`trusted.`, `security.`, `system.` ACLs) that a FUSE file
/// system would have to enforce.
pub const XATTR_USER_PREFIX: &str = "user.";

/// Most delta checkpoints chained after one base before a checkpoint
/// writes a whole image again: mount reads and applies every delta, so
/// this bounds what a chain adds to mount time.
pub const MAX_CHAIN_DELTAS: u32 = 16;
/// A chain's deltas may take at most 1/this of its base's bytes: past
/// that, a whole image costs little more than the deltas mount would read,
/// and starts a new chain.
pub const CHAIN_DELTA_BYTES_DIVISOR: u64 = 4;
/// ... or, whatever the base's size, this many bytes: reading them costs
/// mount next to nothing, and small volumes chain deltas too.
pub const CHAIN_DELTA_BYTES_MIN: u64 = 64 << 10;

/// Inode numbers stay below this, so `ino + 1` never overflows.
pub const MAX_INO: Ino = 1 << 62;

/// Smallest and largest file-system block size a volume may have.
pub const MIN_BLOCK_SIZE: u32 = 512;
pub const MAX_BLOCK_SIZE: u32 = 65536;

/// Longest single read or write: its buffer is a Rust slice, which never
/// exceeds `isize::MAX` bytes. Not enforced here: a fact the bounds use.
pub const MAX_REQUEST_BYTES: u64 = isize::MAX as u64;

/// Uncommitted records past which an operation commits the journal itself,
/// as a fraction of the journal: keeps a crash from losing more than a slice
/// of work and keeps one batch well inside the journal.
pub const COMMIT_THRESHOLD_DIVISOR: u64 = 8;

/// The most the commit threshold may be, whatever the journal: the queued
/// records are memory outside the metadata budget (with a 128 MiB journal,
/// a 16 MiB threshold let a session making extents without fsync queue
/// 86 MB of records, and encode them into 17 MB more). About 44k records.
pub const COMMIT_THRESHOLD_BYTES_MOST: u64 = 2 << 20;

/// Key spans changed since the last checkpoint (16 bytes each, what the
/// next delta reads) past which a commit asks for a checkpoint, however
/// empty the journal: they are memory outside the metadata budget too
/// (a 128 MiB journal holds about four million records' spans).
pub const CHANGED_SPANS_MOST: usize = 1 << 17;

/// With background commits, a writer whose uncommitted records reach this
/// many commit thresholds commits in its own thread: the commit thread
/// fell behind, and the queue (memory, what a crash loses) must not grow
/// without bound.
pub const COMMIT_BACKPRESSURE_THRESHOLDS: u64 = 2;

/// Rough encoded size of a record, for the commit threshold.
pub const RECORD_BYTES_ESTIMATE: u64 = 48;

/// Bytes kept free in a checkpoint slot for its header and estimate slack.
pub const CHECKPOINT_HEADROOM: u64 = 4096;

/// Extents one hole may fragment into, at worst, for the metadata-space
/// check: the allocator returns few, large chunks in practice.
pub const EXTENTS_PER_HOLE_ESTIMATE: u64 = 4;

// Any offset inside a file plus the longest request stays a valid u64, so
// `offset + len` on a checked range cannot wrap.
const _: () = assert!(MAX_FILE_SIZE.checked_add(MAX_REQUEST_BYTES).is_some());
// Two file positions add without overflow (range ends, extent ends).
const _: () = assert!(MAX_FILE_SIZE.checked_add(MAX_FILE_SIZE).is_some());
// The largest file is whole blocks at every block size: rounding a valid
// size up to a block never passes MAX_FILE_SIZE.
const _: () = assert!(MAX_FILE_SIZE.is_multiple_of(MAX_BLOCK_SIZE as u64));
const _: () = assert!(MIN_BLOCK_SIZE.is_power_of_two() && MAX_BLOCK_SIZE.is_power_of_two());
const _: () = assert!(MIN_BLOCK_SIZE <= MAX_BLOCK_SIZE);
// `ino + 1` (the next inode number) never overflows, and the root is a
// valid inode number.
const _: () = assert!(MAX_INO < Ino::MAX);
const _: () = assert!(ROOT_INO > 0 && ROOT_INO < MAX_INO);
const _: () = assert!(MAX_NAME_LEN > 0);
const _: () = assert!(MAX_XATTR_VALUE_LEN <= MAX_XATTR_BYTES_PER_INODE);
const _: () = assert!(MAX_LINKS > 1);
// The threshold is a proper fraction of the journal: work that reaches it
// still leaves room for the batch that commits it.
const _: () = assert!(COMMIT_THRESHOLD_DIVISOR >= 2);
// A commit still carries a batch worth a device write and two flushes.
const _: () = assert!(COMMIT_THRESHOLD_BYTES_MOST >= 64 * RECORD_BYTES_ESTIMATE);
const _: () = assert!(EXTENTS_PER_HOLE_ESTIMATE >= 1);
