//! Which handles are open: closing one that is not (twice, or a pointer
//! that never came from this library) is an error (`-EBADF`), not a double
//! free. Only opens and closes consult it; other calls trust the handle,
//! as the header's contracts say.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::error::{Failure, Outcome};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum HandleKind {
    Volume,
    File,
    Queue,
}

impl HandleKind {
    fn name(self) -> &'static str {
        match self {
            HandleKind::Volume => "volume",
            HandleKind::File => "file",
            HandleKind::Queue => "queue",
        }
    }
}

static OPEN: Mutex<Option<HashSet<(HandleKind, usize)>>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut HashSet<(HandleKind, usize)>) -> T) -> T {
    // A panic while holding this lock cannot leave the set half-changed
    // (each change is one insert or remove): a poisoned lock is still good.
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    f(open.get_or_insert_with(HashSet::new))
}

/// Records a handle just opened.
pub(crate) fn register(kind: HandleKind, addr: usize) {
    with(|open| open.insert((kind, addr)));
}

/// Fails with `-EBADF` unless `addr` is an open handle of `kind`.
pub(crate) fn check(kind: HandleKind, addr: usize) -> Outcome<()> {
    if with(|open| open.contains(&(kind, addr))) {
        Ok(())
    } else {
        Err(not_open(kind, addr))
    }
}

/// Forgets a handle being closed; fails with `-EBADF` if it was not open
/// (so only one of two racing closes frees it).
pub(crate) fn unregister(kind: HandleKind, addr: usize) -> Outcome<()> {
    if with(|open| open.remove(&(kind, addr))) {
        Ok(())
    } else {
        Err(not_open(kind, addr))
    }
}

fn not_open(kind: HandleKind, addr: usize) -> Failure {
    Failure::new(
        libc::EBADF,
        format!(
            "{addr:#x} is not an open iomapfs {} (closed already, or not from this library)",
            kind.name()
        ),
    )
}
