//! Holding one request open: between "done on the device" and "returned"
//! ([`MemDevice::pause_after`]), or between "issued" and "reaching the
//! device" ([`MemDevice::pause_before`]).
//!
//! Races in the layers above (a reader slipping in while a write is done but
//! not yet reported, a flush overtaking a completion, a commit running while
//! a write's data has not reached the device) need that window held open on
//! demand, without sleeps and without each test writing its own gated
//! device. A pause is armed with a [`FaultRule`] to pick the request, and
//! released by the test through a [`PausedRequest`].

use std::sync::mpsc::{channel, Receiver, Sender};

use super::{FaultRule, MemDevice};
use crate::error::IoOp;

/// The pauses a device has armed and not yet hit.
#[derive(Default)]
pub(super) struct Pauses {
    armed: Vec<ArmedPause>,
}

/// Where in a request a pause holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PausePoint {
    /// Issued, not yet on the device: nothing of it is visible or durable.
    Before,
    /// Done on the device, not yet returned to its caller.
    After,
}

struct ArmedPause {
    at: PausePoint,
    rule: FaultRule,
    matched: u64,
    reached: Sender<()>,
    resume: Receiver<()>,
}

/// A request held by [`MemDevice::pause_after`] (done on the device, not yet
/// returned to its caller) or [`MemDevice::pause_before`] (not yet on the
/// device). Tests use it to slip other work in between.
pub struct PausedRequest {
    reached: Receiver<()>,
    resume: Sender<()>,
}

impl PausedRequest {
    /// Waits until the request is held.
    pub fn wait_reached(&self) {
        self.reached
            .recv()
            .expect("the device was dropped before the paused request came");
    }

    /// Waits up to `timeout` for the request to be held; whether it is.
    pub fn reached_within(&self, timeout: std::time::Duration) -> bool {
        self.reached.recv_timeout(timeout).is_ok()
    }

    /// Lets the held request return (or, if it has not come yet, lets it
    /// pass without stopping).
    pub fn resume(&self) {
        // The request may already have passed a dropped pause: nothing to do.
        let _ = self.resume.send(());
    }
}

impl Pauses {
    /// Counts the request in every pause armed at `at` that it matches;
    /// removes and returns the first pause it trips.
    fn trip(&mut self, at: PausePoint, op: IoOp, offset: u64, len: u64) -> Option<ArmedPause> {
        let mut hit = None;
        for (i, p) in self.armed.iter_mut().enumerate() {
            if p.at == at && p.rule.matches(op, offset, len) {
                p.matched += 1;
                if p.matched > p.rule.skip {
                    hit = Some(i);
                    break;
                }
            }
        }
        hit.map(|i| self.armed.remove(i))
    }
}

impl MemDevice {
    /// Holds the first request that matches `rule` (its `skip` counts,
    /// `count` does not) after it is done on the device and before it
    /// returns, until the test calls [`PausedRequest::resume`]. A hold
    /// takes no lock, so other requests go on meanwhile.
    pub fn pause_after(&self, rule: FaultRule) -> PausedRequest {
        self.arm_pause(PausePoint::After, rule)
    }

    /// Holds the first request that matches `rule` (its `skip` counts,
    /// `count` does not) before it reaches the device — it has no effect,
    /// is not visible to reads and cannot become durable — until the test
    /// calls [`PausedRequest::resume`]. A hold takes no lock, so other
    /// requests go on meanwhile.
    pub fn pause_before(&self, rule: FaultRule) -> PausedRequest {
        self.arm_pause(PausePoint::Before, rule)
    }

    fn arm_pause(&self, at: PausePoint, rule: FaultRule) -> PausedRequest {
        let (reached_tx, reached) = channel();
        let (resume, resume_rx) = channel();
        self.state.lock().pauses.armed.push(ArmedPause {
            at,
            rule,
            matched: 0,
            reached: reached_tx,
            resume: resume_rx,
        });
        PausedRequest { reached, resume }
    }

    /// Called before every request starts and after it is done, with no
    /// lock held.
    pub(super) fn hold_if_paused(&self, at: PausePoint, op: IoOp, offset: u64, len: u64) {
        let hit = self.state.lock().pauses.trip(at, op, offset, len);
        if let Some(pause) = hit {
            // A test that dropped its handle lets everything through.
            if pause.reached.send(()).is_ok() {
                let _ = pause.resume.recv();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::test_support::{blocks_of, write, LBS};
    use super::*;
    use crate::{BlockDevice, FaultOp, WriteMode};

    /// The held request is done on the device but has not returned; other
    /// requests go on meanwhile; `skip` picks which match is held.
    #[test]
    fn paused_request_is_done_but_held_until_resumed() {
        let dev = Arc::new(MemDevice::new(64 * LBS as u64, LBS as u32));
        let lbs = LBS as u64;
        let paused = dev.pause_after(FaultRule::new(FaultOp::Write).range(lbs..2 * lbs).skip(1));
        write(&dev, 1, 1, 1, WriteMode::Normal); // first match: skipped
        write(&dev, 3, 5, 1, WriteMode::Normal); // outside the range
        let returned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (dev, returned) = (dev.clone(), returned.clone());
            std::thread::spawn(move || {
                write(&dev, 2, 1, 1, WriteMode::Normal);
                returned.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        paused.wait_reached();
        // Done on the device, not returned; others go on.
        assert_eq!(blocks_of(&dev)[1], 2);
        assert!(!returned.load(std::sync::atomic::Ordering::SeqCst));
        write(&dev, 4, 6, 1, WriteMode::Normal);
        dev.flush().unwrap();
        paused.resume();
        writer.join().unwrap();
        assert!(returned.load(std::sync::atomic::Ordering::SeqCst));
        // One-shot: later matches pass.
        write(&dev, 5, 1, 1, WriteMode::Normal);
        assert_eq!(blocks_of(&dev)[1], 5);
    }

    /// A request held before the device has changed nothing: not visible,
    /// not made durable by a flush that overtakes it; it lands on resume.
    #[test]
    fn request_paused_before_has_no_effect_until_resumed() {
        let dev = Arc::new(MemDevice::new(64 * LBS as u64, LBS as u32));
        let lbs = LBS as u64;
        let paused = dev.pause_before(FaultRule::new(FaultOp::Write).range(lbs..2 * lbs));
        let writer = {
            let dev = dev.clone();
            std::thread::spawn(move || write(&dev, 2, 1, 1, WriteMode::Normal))
        };
        paused.wait_reached();
        assert_eq!(blocks_of(&dev)[1], 0, "not on the device yet");
        dev.flush().unwrap();
        paused.resume();
        writer.join().unwrap();
        assert_eq!(blocks_of(&dev)[1], 2);
        let cut = dev.power_cut(&mut |_| crate::Survival::Lost);
        assert_eq!(
            blocks_of(&cut)[1],
            0,
            "the overtaking flush did not cover it"
        );
    }
}
