//! The signal from foreground work to a background thread of the mount
//! ([`crate::background_thread`]: checkpoints, commits), apart so that the
//! mount state holds it without depending on the thread.

use parking_lot::{Condvar, Mutex};

/// How foreground work asks a background thread for its job.
#[derive(Default)]
pub(crate) struct BackgroundRequest {
    state: Mutex<RequestState>,
    changed: Condvar,
}

#[derive(Default)]
struct RequestState {
    asked: bool,
    running: bool,
    stop: bool,
    /// A thread answers asks: set when it starts, cleared when it stops
    /// (a caller with nobody to ask does the job itself).
    served: bool,
    /// Asks so far, folded ones included.
    asks: u64,
}

impl BackgroundRequest {
    /// Asks for the job; returns at once. Asks made while one is pending
    /// or running fold into one more after it (which the job may find
    /// needless by then: a checkpoint when the journal is no longer half
    /// full, a commit when nothing is queued).
    pub(crate) fn ask(&self) {
        let mut state = self.state.lock();
        state.asks += 1;
        if !state.asked {
            state.asked = true;
            self.changed.notify_all();
        }
    }

    /// The thread: waits for an ask and marks it running; false once the
    /// mount stops.
    pub(crate) fn take(&self) -> bool {
        let mut state = self.state.lock();
        while !state.asked && !state.stop {
            self.changed.wait(&mut state);
        }
        state.asked = false;
        state.running = !state.stop;
        state.running
    }

    /// The thread: what [`BackgroundRequest::take`] returned is done.
    pub(crate) fn finished(&self) {
        self.state.lock().running = false;
        self.changed.notify_all();
    }

    /// The thread has started: asks are answered from now on.
    pub(crate) fn serve(&self) {
        self.state.lock().served = true;
    }

    /// Whether a thread answers asks (started, not stopped).
    pub(crate) fn is_served(&self) -> bool {
        self.state.lock().served
    }

    pub(crate) fn stop(&self) {
        let mut state = self.state.lock();
        state.stop = true;
        state.served = false;
        self.changed.notify_all();
    }

    /// Asks so far.
    #[cfg(test)]
    pub(crate) fn asks(&self) -> u64 {
        self.state.lock().asks
    }

    /// Waits until no ask is pending or running (or the mount stopped, or
    /// no thread answers).
    pub(crate) fn wait_idle(&self) {
        let mut state = self.state.lock();
        while (state.asked || state.running) && !state.stop && state.served {
            self.changed.wait(&mut state);
        }
    }
}
