//! Injected request failures: which requests fail, and how many.
//!
//! The crash tests need "the k-th write to this range fails" to be exact and
//! repeatable, so a rule counts the requests it matches rather than drawing
//! at random; randomness, where a test wants it, comes from the test's seed.
//! What a failure does (nothing at all) is part of the device's fault model,
//! in the parent module.

use std::ops::Range;

use super::MemDevice;
use crate::error::IoOp;

/// Whether a request kind is subject to a [`FaultRule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    /// Reads, writes and flushes alike.
    Any,
}

/// Makes matching requests fail with `EIO`.
///
/// Every active rule sees every request, and counts the ones that match it,
/// independently of other rules; a request fails if any rule fails it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    pub op: FaultOp,
    /// Let this many matching requests succeed before failing any.
    pub skip: u64,
    /// Fail this many matching requests after the skipped ones, then let
    /// everything through again; `None` fails them forever.
    pub count: Option<u64>,
    /// Only requests overlapping these device bytes match. A flush has no
    /// bytes, so a rule with a range never fails a flush.
    pub range: Option<Range<u64>>,
}

impl FaultRule {
    /// Fails every request of kind `op`, forever; narrow it with the
    /// builder methods.
    pub fn new(op: FaultOp) -> FaultRule {
        FaultRule {
            op,
            skip: 0,
            count: None,
            range: None,
        }
    }

    pub fn skip(self, skip: u64) -> FaultRule {
        FaultRule { skip, ..self }
    }

    pub fn count(self, count: u64) -> FaultRule {
        FaultRule {
            count: Some(count),
            ..self
        }
    }

    pub fn range(self, range: Range<u64>) -> FaultRule {
        FaultRule {
            range: Some(range),
            ..self
        }
    }

    pub(super) fn matches(&self, op: IoOp, offset: u64, len: u64) -> bool {
        let op_matches = matches!(
            (self.op, op),
            (FaultOp::Any, _)
                | (FaultOp::Read, IoOp::Read)
                | (FaultOp::Write, IoOp::Write)
                | (FaultOp::Flush, IoOp::Flush)
        );
        let range_matches = match &self.range {
            None => true,
            Some(r) => op != IoOp::Flush && offset < r.end && r.start < offset.saturating_add(len),
        };
        op_matches && range_matches
    }
}

/// The rules a device is running, each with its own counts.
#[derive(Default)]
pub(super) struct Faults {
    active: Vec<ActiveFault>,
}

struct ActiveFault {
    rule: FaultRule,
    matched: u64,
    failed: u64,
}

impl Faults {
    pub(super) fn len(&self) -> usize {
        self.active.len()
    }

    /// Runs every rule against one request, counting it in each rule that
    /// matches; `true` if any rule fails it.
    pub(super) fn should_fail(&mut self, op: IoOp, offset: u64, len: u64) -> bool {
        let mut fail = false;
        for f in &mut self.active {
            if !f.rule.matches(op, offset, len) {
                continue;
            }
            f.matched += 1;
            if f.matched <= f.rule.skip {
                continue;
            }
            let exhausted = match f.rule.count {
                Some(count) => f.failed >= count,
                None => false,
            };
            if !exhausted {
                f.failed += 1;
                fail = true;
            }
        }
        fail
    }
}

impl MemDevice {
    pub fn inject(&self, rule: FaultRule) {
        self.state.lock().faults.active.push(ActiveFault {
            rule,
            matched: 0,
            failed: 0,
        });
    }

    pub fn clear_faults(&self) {
        self.state.lock().faults.active.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{block, blocks_of, read, write, LBS};
    use super::*;
    use crate::{BlockDevice, DeviceError, Survival, WriteMode};

    #[test]
    fn faults_respect_skip_count_and_op() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        dev.inject(FaultRule::new(FaultOp::Write).skip(2).count(2));
        let results: Vec<bool> = (0..6)
            .map(|i| {
                dev.write_at(&block(i as u8 + 1, 1), (i * LBS) as u64, WriteMode::Normal)
                    .is_ok()
            })
            .collect();
        assert_eq!(results, [true, true, false, false, true, true]);
        // Failed writes changed nothing and are not pending.
        assert_eq!(&blocks_of(&dev)[0..6], &[1, 2, 0, 0, 5, 6]);
        assert_eq!(dev.pending_writes(), 4);
        // Reads and flushes do not match a write rule.
        read(&dev, 0, LBS);
        dev.flush().unwrap();

        let err = {
            dev.inject(FaultRule::new(FaultOp::Read));
            let mut buf = vec![0x55; LBS];
            let err = dev.read_at(&mut buf, 0).unwrap_err();
            assert_eq!(
                buf,
                vec![0x55; LBS],
                "a failed read leaves the buffer alone"
            );
            err
        };
        match err {
            DeviceError::Io {
                op: IoOp::Read,
                offset: 0,
                len,
                ref source,
            } => {
                assert_eq!(len, LBS as u64);
                assert_eq!(source.raw_os_error(), Some(libc::EIO));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(err.errno(), libc::EIO);
        dev.clear_faults();
        read(&dev, 0, LBS);
    }

    #[test]
    fn fault_ranges_match_only_overlapping_requests() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        // Bytes 1000..1100 span blocks 1 and 2 (block 2 starts at 1024).
        dev.inject(FaultRule::new(FaultOp::Any).range(1000..1100));
        let w = |blk: usize, n: usize| {
            dev.write_at(&block(7, n), (blk * LBS) as u64, WriteMode::Normal)
                .is_ok()
        };
        assert!(w(0, 1));
        assert!(!w(1, 1));
        assert!(!w(0, 2), "overlaps the range partially");
        assert!(!w(2, 4), "block 2 starts at byte 1024, inside the range");
        assert!(w(3, 4));
        let mut buf = vec![0; LBS];
        assert!(dev.read_at(&mut buf, LBS as u64).is_err());
        assert!(dev.flush().is_ok(), "a flush has no bytes to overlap");
    }

    #[test]
    fn a_failed_flush_makes_nothing_durable() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Normal);
        dev.inject(FaultRule::new(FaultOp::Flush).count(1));
        let err = dev.flush().unwrap_err();
        assert!(matches!(err, DeviceError::Flush { .. }), "{err}");
        assert_eq!(err.errno(), libc::EIO);
        assert_eq!(dev.pending_writes(), 1);
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Lost))[0], 0);
        dev.flush().unwrap();
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Lost))[0], 1);
    }
}
