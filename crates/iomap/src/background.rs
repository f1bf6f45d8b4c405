//! A background job thread of the folio cache: jobs run in order on one
//! thread, started on first use and ended when the cache is dropped (its
//! channel closes). Readahead and write-behind each have one, so neither
//! waits behind the other's device I/O.

use std::sync::mpsc::{self, Sender};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Worker {
    /// The thread's name (shown by `top -H`, `perf`, debuggers).
    name: &'static str,
    jobs: Mutex<Option<Sender<Job>>>,
    /// Jobs queued and not finished, and its wake-up for [`Self::wait_idle`].
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Worker {
    pub(crate) fn new(name: &'static str) -> Worker {
        Worker {
            name,
            jobs: Mutex::new(None),
            pending: Arc::default(),
        }
    }

    /// Queues `job` (starting the thread if needed). Returns false when no
    /// thread could start: the caller's work is a hint and is skipped.
    pub(crate) fn submit(&self, job: Job) -> bool {
        let mut jobs = self.jobs.lock();
        if jobs.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let pending = self.pending.clone();
            let spawned = std::thread::Builder::new()
                .name(self.name.to_string())
                .spawn(move || {
                    for job in rx {
                        // A job that panics (a bug) must not take the thread
                        // and the count of pending jobs with it: waiters in
                        // `wait_idle` would hang, and later jobs never run.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        let (count, idle) = &*pending;
                        let mut count = count.lock();
                        *count -= 1;
                        if *count == 0 {
                            idle.notify_all();
                        }
                    }
                });
            if spawned.is_err() {
                return false;
            }
            // Detached: the channel's closing (the cache dropped) ends it.
            *jobs = Some(tx);
        }
        let Some(tx) = jobs.as_ref() else {
            return false;
        };
        *self.pending.0.lock() += 1;
        if tx.send(job).is_err() {
            *self.pending.0.lock() -= 1;
            return false;
        }
        true
    }

    /// Waits until every job queued so far is done.
    pub(crate) fn wait_idle(&self) {
        let (count, idle) = &*self.pending;
        let mut count = count.lock();
        while *count > 0 {
            idle.wait(&mut count);
        }
    }
}
