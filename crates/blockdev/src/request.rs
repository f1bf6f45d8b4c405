//! The prologue every backend runs before a request reaches the device:
//! validate it, then count it.
//!
//! Counters are read as "requests issued to the device" by tests and
//! benchmarks (writes, FUA writes and flushes per DSYNC write), and callers
//! match on the error an invalid request gets, so both must be the same on
//! every backend and every path (synchronous call or queue). The rule, in
//! one place:
//!
//! - A request that is not aligned to the logical block size, runs past the
//!   end of the device, or writes to a read-only handle fails with that error
//!   and is *not* counted: it never reached the device.
//! - Any other request is counted *before* it is tried, so one that then
//!   fails in the device (an I/O error, an injected fault) still counts.

use std::path::Path;

use crate::{check_request, DeviceCaps, DeviceCounters, DeviceError, WriteMode};

/// The checks and counters one device applies to every request.
pub(crate) struct Admission<'a> {
    caps: &'a DeviceCaps,
    counters: &'a DeviceCounters,
    /// The path to name when refusing a write: `Some` on a handle opened
    /// read-only.
    read_only: Option<&'a Path>,
}

impl<'a> Admission<'a> {
    pub(crate) fn new(caps: &'a DeviceCaps, counters: &'a DeviceCounters) -> Admission<'a> {
        Admission {
            caps,
            counters,
            read_only: None,
        }
    }

    /// Writes are refused, naming `path`.
    pub(crate) fn read_only(self, path: &'a Path) -> Admission<'a> {
        Admission {
            read_only: Some(path),
            ..self
        }
    }

    pub(crate) fn read(&self, offset: u64, len: usize) -> Result<(), DeviceError> {
        check_request(self.caps, offset, len)?;
        self.counters.record_read(len);
        Ok(())
    }

    pub(crate) fn write(
        &self,
        offset: u64,
        len: usize,
        mode: WriteMode,
    ) -> Result<(), DeviceError> {
        check_request(self.caps, offset, len)?;
        if let Some(path) = self.read_only {
            return Err(DeviceError::ReadOnly {
                path: path.to_owned(),
                offset,
                len: len as u64,
            });
        }
        self.counters.record_write(len, mode == WriteMode::Fua);
        Ok(())
    }

    /// A flush has nothing to validate.
    pub(crate) fn flush(&self) {
        self.counters.record_flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceKind, RequestCounts};

    fn caps() -> DeviceCaps {
        DeviceCaps {
            kind: DeviceKind::Memory,
            name: "test".into(),
            logical_block_size: 512,
            memory_alignment: 1,
            size_bytes: 8 * 512,
            volatile_write_cache: true,
            fua: false,
            kernel_durable_writes: false,
            direct_io: false,
        }
    }

    #[test]
    fn refused_requests_are_not_counted_admitted_ones_are() {
        let (caps, counters) = (caps(), DeviceCounters::default());
        let admit = Admission::new(&caps, &counters);
        assert!(matches!(
            admit.read(1, 512),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            admit.write(0, 100, WriteMode::Normal),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            admit.write(8 * 512, 512, WriteMode::Fua),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert_eq!(counters.snapshot(), RequestCounts::default());

        admit.read(0, 1024).unwrap();
        admit.write(512, 512, WriteMode::Normal).unwrap();
        admit.write(0, 2048, WriteMode::Fua).unwrap();
        admit.flush();
        assert_eq!(
            counters.snapshot(),
            RequestCounts {
                reads: 1,
                writes: 2,
                fua_writes: 1,
                flushes: 1,
                bytes_read: 1024,
                bytes_written: 2560,
            }
        );
    }

    #[test]
    fn a_read_only_handle_refuses_valid_writes_uncounted_after_validation() {
        let (caps, counters) = (caps(), DeviceCounters::default());
        let path = Path::new("/dev/ro");
        let admit = Admission::new(&caps, &counters).read_only(path);
        match admit.write(512, 512, WriteMode::Normal) {
            Err(DeviceError::ReadOnly {
                path: p,
                offset: 512,
                len: 512,
            }) => assert_eq!(p, path),
            other => panic!("unexpected {other:?}"),
        }
        // Validation comes first: an invalid write says what is invalid.
        assert!(matches!(
            admit.write(1, 512, WriteMode::Normal),
            Err(DeviceError::Unaligned { .. })
        ));
        admit.read(0, 512).unwrap();
        let c = counters.snapshot();
        assert_eq!((c.reads, c.writes), (1, 0));
    }
}
