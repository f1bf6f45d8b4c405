//! How the process's memory allocator (glibc malloc) is set up.
//!
//! Volume metadata is many mid-sized blocks (extent chunks of 16 KiB,
//! free-space tree nodes) allocated and freed by different threads, plus
//! large transient buffers (checkpoint images, their encodings, journal
//! batches). With glibc's defaults the process keeps far more than it uses:
//! each thread that frees into its own arena keeps those pages, and the
//! mmap threshold rises after the first large free, so later large
//! buffers come from the heap, where they fragment it. `iomapfs bench
//! --workload metadata-scale` at a million extents: max RSS 445–464 MiB
//! with the defaults, 329 MiB with a fixed 128 KiB mmap threshold, 248–260
//! MiB with one arena as well. One arena did not slow the direct or
//! buffered I/O rows beyond the noise of two alternated runs.
//!
//! A user who sets malloc's own environment variables keeps them.

/// glibc settings applied at start-up unless the environment sets malloc
/// up itself.
#[derive(Debug, PartialEq, Eq)]
pub struct MallocSettings {
    /// `M_ARENA_MAX`: one arena. Small blocks still come from each thread's
    /// cache without a lock; larger ones share one heap instead of keeping
    /// freed memory per thread.
    pub arena_max: i32,
    /// `M_MMAP_THRESHOLD`: a fixed value, which also stops glibc from
    /// raising it after large frees.
    pub mmap_threshold: i32,
}

/// The environment variables through which a user sets glibc malloc up.
const MALLOC_ENVIRONMENT: [&str; 4] = [
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
];

/// What to apply, given whether each environment variable is set: nothing
/// if the user set malloc up.
pub fn settings(is_set: impl Fn(&str) -> bool) -> Option<MallocSettings> {
    if MALLOC_ENVIRONMENT.iter().any(|name| is_set(name)) {
        return None;
    }
    Some(MallocSettings {
        arena_max: 1,
        mmap_threshold: 128 << 10,
    })
}

/// Applies [`settings`] for this process's environment. Call first thing in
/// `main`, before any other thread exists.
pub fn set_up() {
    let Some(s) = settings(|name| std::env::var_os(name).is_some()) else {
        return;
    };
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes parameters of glibc's allocator; it takes
    // the allocator's own lock, has no pointer arguments, and a rejected
    // value is reported by its return value (ignored: the defaults stay).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, s.arena_max);
        libc::mallopt(libc::M_MMAP_THRESHOLD, s.mmap_threshold);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = s;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuned_unless_the_user_set_malloc_up() {
        let tuned = settings(|_| false).expect("nothing set: tuned");
        assert_eq!(tuned.arena_max, 1);
        assert_eq!(tuned.mmap_threshold, 128 << 10);
        for name in MALLOC_ENVIRONMENT {
            assert_eq!(settings(|n| n == name), None, "{name} set");
        }
    }
}
