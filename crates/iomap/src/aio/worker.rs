//! The completion worker of an asynchronous queue: a thread that runs, in
//! order, the requests a reaper must never block on — allocation, unwritten
//! conversion, size changes, journal commits, byte-granular
//! read-modify-writes — through the synchronous entry points, and posts
//! each completion back to its queue.

use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use blockdev::AlignedBuf;

use super::Completion;
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

/// One queue's worker, started on first use.
pub(super) struct Worker<F: IomapFile> {
    jobs: Option<Sender<Job<F>>>,
    thread: Option<JoinHandle<()>>,
    done_tx: Sender<Completion<FileError<F>>>,
    done_rx: Receiver<Completion<FileError<F>>>,
    /// Jobs handed over and not yet back.
    pending: usize,
}

impl<F: IomapFile> Worker<F> {
    pub fn new() -> Worker<F> {
        let (done_tx, done_rx) = mpsc::channel();
        Worker {
            jobs: None,
            thread: None,
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
            let (tx, rx) = mpsc::channel::<Job<F>>();
            let done = self.done_tx.clone();
            let spawned = std::thread::Builder::new()
                .name("iomap-completion".to_string())
                .spawn(move || run(rx, done));
            match spawned {
                Ok(thread) => {
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

    /// A completion the worker has posted, if any, without waiting.
    pub fn try_take(&mut self) -> Option<Completion<FileError<F>>> {
        // Nothing sent, nothing to look for: the channel's receive costs
        // more than this check on every reap of the inline fast path.
        if self.pending == 0 {
            return None;
        }
        let done = self.done_rx.try_recv().ok()?;
        self.pending -= 1;
        Some(done)
    }

    /// Waits for the worker's next completion.
    pub fn take(&mut self) -> Result<Completion<FileError<F>>, IomapError> {
        let done = self.done_rx.recv().map_err(|_| IomapError::Worker {
            reason: "the thread has exited".to_string(),
        })?;
        self.pending -= 1;
        Ok(done)
    }
}

impl<F: IomapFile> Drop for Worker<F> {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the jobs it holds.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run<F: IomapFile>(jobs: Receiver<Job<F>>, done: Sender<Completion<FileError<F>>>) {
    for job in jobs {
        let completion = match job {
            Job::Read {
                file,
                pos,
                mut buf,
                token,
            } => Completion {
                token,
                result: file_io::read(&file, pos, &mut buf).map_err(|e| file.error_at(pos, e)),
                buf,
                completed_by: CompletedBy::Worker,
            },
            Job::Write {
                file,
                pos,
                buf,
                token,
            } => Completion {
                token,
                result: file_io::write(&file, pos, &buf)
                    .map(|_| buf.len())
                    .map_err(|e| file.error_at(pos, e)),
                buf,
                completed_by: CompletedBy::Worker,
            },
        };
        if done.send(completion).is_err() {
            return;
        }
    }
}
