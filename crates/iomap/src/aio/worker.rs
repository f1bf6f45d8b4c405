//! The completion worker of an asynchronous queue: a thread that runs, in
//! order, the requests a reaper must never block on — allocation, unwritten
//! conversion, size changes, journal commits, byte-granular
//! read-modify-writes — through the synchronous entry points, and posts
//! each completion back to its queue. A second thread updates the cache
//! after direct writes whose folios a reaper found locked: it only waits
//! for folio locks, never behind the first thread's jobs (one of which may
//! wait for those very writes' in-flight counts to drain).

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use blockdev::AlignedBuf;

use super::{Completion, FinishedRequest};
use crate::ioend::CompletedBy;
use crate::{file_io, FileError, IomapError, IomapFile};

/// A request handed to the worker, with the handle that keeps its file open.
pub(super) enum Job<F> {
    Read {
        file: F,
        pos: u64,
        buf: AlignedBuf,
        token: u64,
    },
    Write {
        file: F,
        pos: u64,
        buf: AlignedBuf,
        token: u64,
    },
}

/// What the worker posts back.
pub(super) enum Done<F: IomapFile> {
    /// A job run to its end.
    Completed(Completion<FileError<F>>),
    /// A finished request whose cache update is done: the queue completes it.
    CacheUpdated(Box<FinishedRequest<F>>),
}

/// One queue's worker, its threads started on first use.
pub(super) struct Worker<F: IomapFile> {
    jobs: Option<Sender<Job<F>>>,
    thread: Option<JoinHandle<()>>,
    cache_updates: Option<Sender<Box<FinishedRequest<F>>>>,
    cache_thread: Option<JoinHandle<()>>,
    done_tx: Sender<Done<F>>,
    done_rx: Receiver<Done<F>>,
    /// Jobs and cache updates handed over and not yet back.
    pending: usize,
}

impl<F: IomapFile> Worker<F> {
    pub fn new() -> Worker<F> {
        let (done_tx, done_rx) = mpsc::channel();
        Worker {
            jobs: None,
            thread: None,
            cache_updates: None,
            cache_thread: None,
            done_tx,
            done_rx,
            pending: 0,
        }
    }

    /// Jobs handed over whose completion has not been taken back.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Hands `job` to the worker, starting it if needed. On failure the job
    /// comes back (boxed: the failure is rare, the job large).
    pub fn send(&mut self, job: Job<F>) -> Result<(), Box<(Job<F>, IomapError)>> {
        if self.jobs.is_none() {
            match start("iomap-completion", &self.done_tx, run) {
                Ok((tx, thread)) => {
                    self.jobs = Some(tx);
                    self.thread = Some(thread);
                }
                Err(e) => {
                    let reason = format!("cannot start the thread: {e}");
                    return Err(Box::new((job, IomapError::Worker { reason })));
                }
            }
        }
        let jobs = self.jobs.as_ref().expect("started above");
        match jobs.send(job) {
            Ok(()) => {
                self.pending += 1;
                Ok(())
            }
            Err(mpsc::SendError(job)) => {
                let reason = "the thread has exited".to_string();
                Err(Box::new((job, IomapError::Worker { reason })))
            }
        }
    }

    /// Hands `finished` to the cache-update thread, starting it if needed:
    /// it runs [`file_io::update_cache_after_direct_write`] and posts it
    /// back as [`Done::CacheUpdated`]. On failure it comes back.
    pub fn update_cache(
        &mut self,
        finished: Box<FinishedRequest<F>>,
    ) -> Result<(), Box<FinishedRequest<F>>> {
        if self.cache_updates.is_none() {
            match start("iomap-cache-update", &self.done_tx, update_caches) {
                Ok((tx, thread)) => {
                    self.cache_updates = Some(tx);
                    self.cache_thread = Some(thread);
                }
                Err(_) => return Err(finished),
            }
        }
        let updates = self.cache_updates.as_ref().expect("started above");
        match updates.send(finished) {
            Ok(()) => {
                self.pending += 1;
                Ok(())
            }
            Err(mpsc::SendError(finished)) => Err(finished),
        }
    }

    /// What the worker has posted, if anything, without waiting.
    pub fn try_take(&mut self) -> Option<Done<F>> {
        // Nothing sent, nothing to look for: the channel's receive costs
        // more than this check on every reap of the inline fast path.
        if self.pending == 0 {
            return None;
        }
        let done = self.done_rx.try_recv().ok()?;
        self.pending -= 1;
        Some(done)
    }

    /// Waits for what the worker posts next.
    pub fn take(&mut self) -> Result<Done<F>, IomapError> {
        let done = self.done_rx.recv().map_err(|_| IomapError::Worker {
            reason: "the thread has exited".to_string(),
        })?;
        self.pending -= 1;
        Ok(done)
    }
}

impl<F: IomapFile> Drop for Worker<F> {
    fn drop(&mut self) {
        // Closing the channels ends the threads after the jobs they hold.
        self.jobs = None;
        self.cache_updates = None;
        for thread in [self.thread.take(), self.cache_thread.take()]
            .into_iter()
            .flatten()
        {
            let _ = thread.join();
        }
    }
}

/// Starts a thread named `name` running `body` over the jobs sent on the
/// returned channel, posting to `done`.
fn start<J: Send + 'static, F: IomapFile>(
    name: &str,
    done: &Sender<Done<F>>,
    body: fn(Receiver<J>, Sender<Done<F>>),
) -> std::io::Result<(Sender<J>, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<J>();
    let done = done.clone();
    let thread = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || body(rx, done))?;
    Ok((tx, thread))
}

/// What a job that panicked (a bug) completes with: an error, so that the
/// queue never waits for a completion that cannot come.
fn panicked(what: &str) -> IomapError {
    IomapError::Worker {
        reason: format!("the {what} panicked"),
    }
}

fn update_caches<F: IomapFile>(updates: Receiver<Box<FinishedRequest<F>>>, done: Sender<Done<F>>) {
    for mut finished in updates {
        let update = std::panic::catch_unwind(AssertUnwindSafe(|| {
            file_io::update_cache_after_direct_write(
                finished.holds.owner(),
                finished.pos,
                &finished.buf,
                finished.written(),
            )
        }));
        if update.is_err() {
            // The cache may not hold the write's bytes: the write fails.
            finished.result = Err(panicked("cache update after a direct write"));
        }
        if done.send(Done::CacheUpdated(finished)).is_err() {
            return;
        }
    }
}

fn run<F: IomapFile>(jobs: Receiver<Job<F>>, done: Sender<Done<F>>) {
    for job in jobs {
        let (file, pos, buf, token, write) = match job {
            Job::Read {
                file,
                pos,
                buf,
                token,
            } => (file, pos, buf, token, false),
            Job::Write {
                file,
                pos,
                buf,
                token,
            } => (file, pos, buf, token, true),
        };
        // Through the synchronous entry points.
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut buf = buf;
            let result = if write {
                file_io::write(&file, pos, &buf).map(|_| buf.len())
            } else {
                file_io::read(&file, pos, &mut buf)
            };
            (result, buf)
        }));
        let (result, buf) = match outcome {
            Ok((result, buf)) => (result, buf),
            Err(_) => (
                Err(panicked("completion worker").into()),
                super::empty_buf(),
            ),
        };
        let completion = Completion {
            token,
            result: result.map_err(|e| file.error_at(pos, e)),
            buf,
            completed_by: CompletedBy::Worker,
        };
        if done.send(Done::Completed(completion)).is_err() {
            return;
        }
    }
}
