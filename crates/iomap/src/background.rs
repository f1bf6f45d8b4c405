//! A background job thread of the folio cache: jobs run in order on one
//! thread, started on first use and ended when the cache is dropped (its
//! channel closes). Readahead and write-behind each have one, so neither
//! waits behind the other's device I/O.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Worker {
    /// The thread's name (shown by `top -H`, `perf`, debuggers).
    name: &'static str,
    jobs: Mutex<Option<Sender<Job>>>,
    /// Jobs queued and finished so far, and the wake-up for
    /// [`Self::wait_idle`].
    tickets: Arc<(Mutex<Tickets>, Condvar)>,
    /// Set by [`Self::stop`]: jobs still queued are dropped unrun.
    stopped: Arc<AtomicBool>,
}

/// Counts, not a number pending: a waiter waits for the jobs queued before
/// it, not for a moment with nothing queued (which a steady stream of jobs
/// would never give it).
#[derive(Default)]
struct Tickets {
    queued: u64,
    done: u64,
}

impl Worker {
    pub(crate) fn new(name: &'static str) -> Worker {
        Worker {
            name,
            jobs: Mutex::new(None),
            tickets: Arc::default(),
            stopped: Arc::default(),
        }
    }

    /// Queues `job` (starting the thread if needed). Returns false when no
    /// thread could start: the caller's work is a hint and is skipped.
    pub(crate) fn submit(&self, job: Job) -> bool {
        let mut jobs = self.jobs.lock();
        if jobs.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let tickets = self.tickets.clone();
            let stopped = self.stopped.clone();
            let spawned = std::thread::Builder::new()
                .name(self.name.to_string())
                .spawn(move || {
                    for job in rx {
                        if !stopped.load(Ordering::Acquire) {
                            // A job that panics (a bug) must not take the
                            // thread and the count of finished jobs with
                            // it: waiters in `wait_idle` would hang, and
                            // later jobs never run.
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        let (tickets, idle) = &*tickets;
                        tickets.lock().done += 1;
                        idle.notify_all();
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
        if self.stopped.load(Ordering::Acquire) {
            return false;
        }
        // Counted under the jobs lock, so tickets are in queue order.
        self.tickets.0.lock().queued += 1;
        if tx.send(job).is_err() {
            self.tickets.0.lock().done += 1;
            return false;
        }
        true
    }

    /// Waits until every job queued before this call is done (jobs queued
    /// while it waits are not waited for).
    pub(crate) fn wait_idle(&self) {
        let queued = self.tickets.0.lock().queued;
        self.wait_for(queued);
    }

    /// Waits until the first `queued` jobs are done.
    fn wait_for(&self, queued: u64) {
        let (tickets, idle) = &*self.tickets;
        let mut tickets = tickets.lock();
        while tickets.done < queued {
            idle.wait(&mut tickets);
        }
    }

    /// Runs no more jobs: those still queued are dropped unrun, later ones
    /// refused. Returns once the job running now (if any) is done, so
    /// nothing of this worker touches the device after it.
    pub(crate) fn stop(&self) {
        {
            // Under the jobs lock: a `submit` racing this one either queued
            // before (and is waited for below) or sees the flag.
            let _jobs = self.jobs.lock();
            self.stopped.store(true, Ordering::Release);
        }
        self.wait_idle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::sync_channel;

    #[test]
    fn wait_idle_waits_for_jobs_queued_before_it_not_after() {
        let worker = Arc::new(Worker::new("test-worker"));
        let (release_first, first_waits) = sync_channel::<()>(0);
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        assert!(worker.submit(Box::new(move || {
            first_waits.recv().unwrap();
            r.lock().push(1);
        })));
        // What `wait_idle` entered now waits for: job 1 only.
        let queued_now = worker.tickets.0.lock().queued;
        // Job 2 queues behind job 1 and blocks until the waiter returned:
        // with "wait for nothing pending" the waiter would wait for job 2,
        // which waits for the waiter — a hang, caught by the timeout below.
        let (job2_go_tx, job2_go) = sync_channel::<()>(1);
        let r = ran.clone();
        assert!(worker.submit(Box::new(move || {
            job2_go.recv().unwrap();
            r.lock().push(2);
        })));
        let (waited_tx, waited) = sync_channel::<Vec<i32>>(1);
        let (w, r) = (worker.clone(), ran.clone());
        let waiter = std::thread::spawn(move || {
            w.wait_for(queued_now);
            waited_tx.send(r.lock().clone()).unwrap();
        });
        release_first.send(()).unwrap();
        let seen = waited
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("wait_idle waited for a job queued after it");
        assert_eq!(seen, vec![1]);
        job2_go_tx.send(()).unwrap();
        waiter.join().unwrap();
        worker.wait_idle();
        assert_eq!(*ran.lock(), vec![1, 2]);
    }

    #[test]
    fn a_stopped_worker_runs_nothing_queued_and_refuses_more() {
        let worker = Worker::new("test-worker");
        let (release_first, first_waits) = sync_channel::<()>(0);
        let (first_started, started) = sync_channel::<()>(1);
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        assert!(worker.submit(Box::new(move || {
            first_started.send(()).unwrap();
            first_waits.recv().unwrap();
            r.lock().push(1);
        })));
        let r = ran.clone();
        assert!(worker.submit(Box::new(move || r.lock().push(2))));
        // Job 1 is running (a job not started when the worker stops is
        // dropped, as job 2 will be).
        started.recv().unwrap();
        let stopper = std::thread::scope(|s| {
            let h = s.spawn(|| worker.stop());
            // Job 1 may finish only once stop has begun.
            while !worker.stopped.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            release_first.send(()).unwrap();
            h.join()
        });
        stopper.unwrap();
        // Job 1 was running and finished before stop returned; job 2 never ran.
        assert_eq!(*ran.lock(), vec![1]);
        let r = ran.clone();
        assert!(!worker.submit(Box::new(move || r.lock().push(3))));
        worker.wait_idle();
        assert_eq!(*ran.lock(), vec![1]);
    }
}
