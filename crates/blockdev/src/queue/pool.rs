//! A queue whose requests run on a bounded pool of worker threads.
//!
//! For devices that block in the submitting thread: where the kernel does
//! a request's work in the caller of `pwrite` (zram compresses there) and
//! refuses NOWAIT, io_uring hands every request to one of its own workers
//! and the [`InlineQueue`](super::InlineQueue) runs them one after another
//! in the caller, so either way one core does them all. A [`WorkerPool`]
//! of a few threads calling the device's synchronous methods keeps as many
//! requests in the device at once as there are workers.
//!
//! # Threads
//!
//! A pool has a fixed number of workers, started with it and stopped when
//! the last [`PoolQueue`] on it and its owner are gone: the number of
//! threads never grows with queues or requests. Every queue of the pool
//! shares its workers, which take submitted requests in submission order
//! (first come, first run; a queue's requests may finish in any order).
//! An idle worker sleeps on a condition variable; a queue wakes one per
//! request it submits, and only idle ones. A thread that waits for its
//! queue's completions first runs the queue's requests no worker has taken
//! yet itself, and sleeps only once all of them are taken: for short
//! requests the hand-offs cost more than the requests, and a deep queue
//! then keeps the workers and its own thread busy.
//!
//! # Within the queue contract
//!
//! (See "Contract, in one place" in [`crate::queue`].)
//!
//! - A request reaches the device at [`submit`](DeviceQueue::submit) (or a
//!   reap that waits, which submits first), through the device's own
//!   `read_at`/`write_at`/`flush`: its checks, counters and faults apply.
//! - Completions come back in the order requests finish. A flush runs when
//!   a worker takes it, so it covers every write completed before it was
//!   submitted, and maybe more.
//! - Dropping a queue submits what it holds and waits until every request
//!   of it has finished: a worker never touches a buffer that was freed.
//! - A worker that panics in the device completes the request with an
//!   error (its buffer, dropped while unwinding, does not come back) and
//!   goes on with the next.

use std::collections::VecDeque;
use std::io;
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::{
    clamp_depth, refuse_if_full, DeviceCompletion, DeviceQueue, DeviceRequest, QueueFull, Token,
};
use crate::error::IoOp;
use crate::{BlockDevice, DeviceError};

/// A fixed set of threads running queued requests on one device. Make
/// queues on it with [`WorkerPool::queue`].
pub struct WorkerPool {
    shared: Arc<PoolShared>,
    workers: Vec<JoinHandle<()>>,
}

/// What the workers and the queues share.
struct PoolShared {
    dev: Arc<dyn BlockDevice>,
    state: Mutex<PoolState>,
    /// Signalled when a job arrives or the pool stops.
    work: Condvar,
}

struct PoolState {
    /// Submitted requests no worker has taken yet, oldest first.
    jobs: VecDeque<Job>,
    /// Workers asleep waiting for a job.
    idle: usize,
    stopping: bool,
}

/// One submitted request and the queue its completion goes to.
struct Job {
    token: Token,
    request: DeviceRequest,
    queue: Arc<Completions>,
}

/// A queue's side shared with the workers: its finished requests.
struct Completions {
    state: Mutex<CompletionState>,
    /// Signalled when `done` reaches `wake_at`.
    finished: Condvar,
}

struct CompletionState {
    /// Finished, not yet reaped.
    done: Vec<DeviceCompletion>,
    /// Handed to the pool, not yet finished.
    running: usize,
    /// The queue's owner sleeps until `done.len()` reaches this; 0 when it
    /// does not sleep, so a worker wakes it only when it has enough.
    wake_at: usize,
}

impl WorkerPool {
    /// Starts `workers` threads named `{name}-0`, `{name}-1`, … (the
    /// kernel keeps 15 bytes of a thread's name) running requests on `dev`.
    pub fn new(
        dev: Arc<dyn BlockDevice>,
        workers: NonZeroUsize,
        name: &str,
    ) -> Result<WorkerPool, DeviceError> {
        let shared = Arc::new(PoolShared {
            dev,
            state: Mutex::new(PoolState {
                jobs: VecDeque::new(),
                idle: 0,
                stopping: false,
            }),
            work: Condvar::new(),
        });
        let mut pool = WorkerPool {
            shared,
            workers: Vec::with_capacity(workers.get()),
        };
        for i in 0..workers.get() {
            let shared = Arc::clone(&pool.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || shared.work());
            match spawned {
                Ok(handle) => pool.workers.push(handle),
                // Dropping `pool` stops the workers already started.
                Err(e) => {
                    return Err(DeviceError::Unusable {
                        path: pool.shared.dev.caps().name.clone().into(),
                        reason: format!("cannot start I/O worker thread {name}-{i}: {e}"),
                    })
                }
            }
        }
        Ok(pool)
    }

    /// Worker threads of this pool.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// A queue of `depth` (clamped to `1..=`[`super::MAX_QUEUE_DEPTH`])
    /// requests in flight whose requests this pool runs.
    pub fn queue(self: &Arc<Self>, depth: usize) -> PoolQueue {
        PoolQueue {
            pool: Arc::clone(self),
            depth: clamp_depth(depth),
            queued: Vec::new(),
            in_flight: 0,
            completions: Arc::new(Completions {
                state: Mutex::new(CompletionState {
                    done: Vec::new(),
                    running: 0,
                    wake_at: 0,
                }),
                finished: Condvar::new(),
            }),
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        // Every queue holds the pool, so none is left: no job either.
        self.shared.state.lock().stopping = true;
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            // A worker catches the device's panics, so it ends by returning.
            let _ = worker.join();
        }
    }
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("device", &self.shared.dev.caps().name)
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl PoolShared {
    /// A worker's life: take the oldest job, run it, post its completion;
    /// sleep while there is none; return once the pool stops.
    fn work(&self) {
        let mut state = self.state.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                MutexGuard::unlocked(&mut state, || self.run(job));
            } else if state.stopping {
                return;
            } else {
                state.idle += 1;
                self.work.wait(&mut state);
                state.idle -= 1;
            }
        }
    }

    fn run(&self, job: Job) {
        let Job {
            token,
            request,
            queue,
        } = job;
        let what = RequestSummary::of(&request);
        let completion = catch_unwind(AssertUnwindSafe(|| {
            request.run_on(self.dev.as_ref(), token)
        }))
        .unwrap_or_else(|_| what.panicked(token));
        queue.post(completion);
    }

    /// The oldest job of `queue` no worker has taken yet, if any.
    fn take_job_of(&self, queue: &Arc<Completions>) -> Option<Job> {
        let mut state = self.state.lock();
        let at = state
            .jobs
            .iter()
            .position(|job| Arc::ptr_eq(&job.queue, queue))?;
        state.jobs.remove(at)
    }

    /// Hands `jobs` to the workers, waking as many idle ones as there are
    /// new jobs.
    fn enqueue(&self, jobs: impl Iterator<Item = Job>) {
        let mut state = self.state.lock();
        let before = state.jobs.len();
        state.jobs.extend(jobs);
        let wake = (state.jobs.len() - before).min(state.idle);
        drop(state);
        for _ in 0..wake {
            self.work.notify_one();
        }
    }
}

/// Where a request was, for the error of one whose worker panicked.
struct RequestSummary {
    op: IoOp,
    offset: u64,
    len: u64,
}

impl RequestSummary {
    fn of(request: &DeviceRequest) -> RequestSummary {
        let (op, offset, len) = match request {
            DeviceRequest::Read { offset, buf } => (IoOp::Read, *offset, buf.len()),
            DeviceRequest::Write { offset, buf, .. } => (IoOp::Write, *offset, buf.len()),
            DeviceRequest::Flush => (IoOp::Flush, 0, 0),
        };
        RequestSummary {
            op,
            offset,
            len: len as u64,
        }
    }

    fn panicked(self, token: Token) -> DeviceCompletion {
        DeviceCompletion {
            token,
            result: Err(DeviceError::Io {
                op: self.op,
                offset: self.offset,
                len: self.len,
                source: io::Error::other("the I/O worker thread panicked in the device"),
            }),
            buf: None,
        }
    }
}

impl Completions {
    fn post(&self, completion: DeviceCompletion) {
        let mut state = self.state.lock();
        state.done.push(completion);
        state.running -= 1;
        let wake = state.wake_at != 0 && state.done.len() >= state.wake_at;
        drop(state);
        if wake {
            self.finished.notify_one();
        }
    }

    /// Sleeps until `done` holds at least `n` completions; only once every
    /// request needed for that is running (`n` at most what is done and
    /// running).
    fn sleep_until_done(&self, n: usize) {
        let mut state = self.state.lock();
        if state.done.len() < n {
            debug_assert!(state.done.len() + state.running >= n);
            state.wake_at = n;
            while state.done.len() < n {
                self.finished.wait(&mut state);
            }
            state.wake_at = 0;
        }
    }

    fn done(&self) -> usize {
        self.state.lock().done.len()
    }
}

/// A [`DeviceQueue`] whose requests run on a [`WorkerPool`]: see the
/// [module docs](self).
pub struct PoolQueue {
    pool: Arc<WorkerPool>,
    depth: usize,
    /// Pushed, not yet submitted, in push order.
    queued: Vec<(Token, DeviceRequest)>,
    /// Pushed and not yet reaped.
    in_flight: usize,
    completions: Arc<Completions>,
}

impl PoolQueue {
    /// Waits until `n` of the submitted requests are done (`n` at most
    /// what is in flight, all of it submitted). While some of this queue's
    /// requests wait for a worker, the calling thread runs them itself
    /// instead of sleeping: it would only wait for them, and a request it
    /// runs needs no wake-up of a worker or of itself.
    fn wait_until_done(&self, n: usize) {
        let shared = &self.pool.shared;
        while self.completions.done() < n {
            match shared.take_job_of(&self.completions) {
                Some(job) => shared.run(job),
                None => return self.completions.sleep_until_done(n),
            }
        }
    }
}

impl DeviceQueue for PoolQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn push(&mut self, token: Token, request: DeviceRequest) -> Result<(), QueueFull> {
        let request = refuse_if_full(self.in_flight, self.depth, token, request)?;
        self.queued.push((token, request));
        self.in_flight += 1;
        Ok(())
    }

    fn submit(&mut self) -> Result<usize, DeviceError> {
        let sent = self.queued.len();
        if sent == 0 {
            return Ok(0);
        }
        // Counted before any worker can finish one.
        self.completions.state.lock().running += sent;
        let queue = &self.completions;
        self.pool
            .shared
            .enqueue(self.queued.drain(..).map(|(token, request)| Job {
                token,
                request,
                queue: Arc::clone(queue),
            }));
        Ok(sent)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<DeviceCompletion>) -> Result<usize, DeviceError> {
        let wait_for = min.min(self.in_flight);
        if self.completions.done() < wait_for {
            self.submit()?;
            self.wait_until_done(wait_for);
        }
        let mut state = self.completions.state.lock();
        let n = state.done.len();
        out.append(&mut state.done);
        drop(state);
        self.in_flight -= n;
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for PoolQueue {
    fn drop(&mut self) {
        // As an io_uring queue does: what was pushed goes to the device,
        // and the buffers go only once no worker holds any of them.
        let _ = self.submit();
        self.wait_until_done(self.in_flight);
    }
}

impl std::fmt::Debug for PoolQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolQueue")
            .field("depth", &self.depth)
            .field("queued", &self.queued.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}
