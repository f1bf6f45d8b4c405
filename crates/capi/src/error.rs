//! Errors at the boundary: negative errno values, a per-thread message, and
//! the guard every entry point runs its body in, so that no panic crosses
//! into C.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What failed: the errno returned (negated) and the message
/// [`iomapfs_last_error`] gives afterwards.
#[derive(Debug)]
pub(crate) struct Failure {
    pub errno: i32,
    pub message: String,
}

impl Failure {
    pub fn new(errno: i32, message: impl Into<String>) -> Failure {
        Failure {
            errno,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure::new(libc::EINVAL, message)
    }

    /// A file-system error: its errno, and its message (which already says
    /// which file, offset and cause).
    pub fn fs(e: &iomapfs_fs::Error) -> Failure {
        Failure::new(e.errno(), e.to_string())
    }
}

pub(crate) type Outcome<T> = Result<T, Failure>;

thread_local! {
    /// The message of the last call that failed on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (interior NULs, which a C
/// string cannot hold, become spaces).
pub(crate) fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// Runs an entry point's body: a failure becomes `-errno` (through
/// `negative`) with `func: message` recorded for [`iomapfs_last_error`]; a
/// panic is caught here, reported as `-EIO` with its message, and never
/// unwinds into the caller.
pub(crate) fn guard<T>(
    func: &'static str,
    negative: impl Fn(i32) -> T,
    body: impl FnOnce() -> Outcome<T>,
) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(failure)) => {
            set_last_error(&format!("{func}: {}", failure.message));
            negative(-failure.errno.abs().max(1))
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!(
                "{func}: internal error (a panic was stopped at the API boundary): {what}"
            ));
            negative(-libc::EIO)
        }
    }
}

/// [`guard`] for entry points returning `int`.
pub(crate) fn guard_int(func: &'static str, body: impl FnOnce() -> Outcome<i32>) -> i32 {
    guard(func, |e| e, body)
}

/// [`guard`] for entry points returning a byte count or `-errno`.
pub(crate) fn guard_i64(func: &'static str, body: impl FnOnce() -> Outcome<i64>) -> i64 {
    guard(func, i64::from, body)
}

/// The message of the last call that failed on the calling thread: which
/// function, what failed and where (file, offset, device, cause). Empty if
/// no call has failed on this thread. The string stays valid until the next
/// call into the library on this thread; copy it to keep it.
///
/// Thread-safety: per thread; safe to call from any thread.
#[no_mangle]
pub extern "C" fn iomapfs_last_error() -> *const c_char {
    // Reading a thread-local cannot panic short of thread teardown, and
    // `with` would abort, not unwind, there.
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: iomapfs_last_error returns a pointer to this thread's
        // NUL-terminated message, valid until the next call.
        unsafe { CStr::from_ptr(iomapfs_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn failures_are_negative_errno_with_a_message() {
        let r = guard_int("iomapfs_test", || {
            Err(Failure::new(libc::ENOENT, "/x: gone"))
        });
        assert_eq!(r, -libc::ENOENT);
        assert_eq!(last(), "iomapfs_test: /x: gone");
        assert_eq!(guard_int("iomapfs_test", || Ok(3)), 3);
        // Success leaves the last message alone (errno style).
        assert_eq!(last(), "iomapfs_test: /x: gone");
    }

    #[test]
    fn panics_stop_at_the_boundary() {
        let r = guard_i64("iomapfs_boom", || panic!("oops {}", 42));
        assert_eq!(r, -i64::from(libc::EIO));
        let m = last();
        assert!(m.starts_with("iomapfs_boom: internal error"), "{m}");
        assert!(m.contains("oops 42"), "{m}");
    }

    #[test]
    fn messages_are_per_thread() {
        guard_int("iomapfs_here", || Err(Failure::invalid("mine")));
        std::thread::spawn(|| {
            assert_eq!(last(), "");
            guard_int("iomapfs_there", || Err(Failure::invalid("theirs")));
        })
        .join()
        .unwrap();
        assert_eq!(last(), "iomapfs_here: mine");
    }
}
