//! The in-flight I/O object and the one completion policy.
//!
//! Every I/O that leaves the engine — synchronous direct I/O, asynchronous
//! direct I/O, and (with the folio cache) buffered writeback — completes
//! here:
//! - [`IoEnd`] is one I/O in flight: the device parts still outstanding and
//!   the first error (which wins: later errors are its consequences).
//! - [`WriteEnd`] is what a write's completion asks of the file system
//!   (unwritten conversion, on-disk size) through [`IomapOps::end_io`]. The
//!   size it reports never covers bytes whose I/O did not complete, and for
//!   I/O that may not extend the file it is clamped to the in-core EOF
//!   (invariant 4).
//! - [`Durability`] decides, in one place, how a write becomes durable —
//!   native FUA or a kernel durable write, one flush shared by every waiter
//!   completed before it, or a journal commit through [`IomapOps::commit`] —
//!   and from that, [`CompletedBy`]: whether a reaper may complete it inline or
//!   a completion worker must (a reaper never blocks on a journal commit).

use blockdev::{BlockDevice, DeviceError, WriteMode};

use crate::{FlushCoalescer, IomapError, IomapOps};

/// How each write of an open file must be durable when it completes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteSync {
    /// No promise until `fsync`/`fdatasync`.
    #[default]
    None,
    /// O_DSYNC: the data and the metadata needed to read it back.
    Dsync,
    /// O_SYNC: like `Dsync`, and all inode metadata too.
    Sync,
}

/// What a completed write's file range needs from the file system.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DioEndFlags {
    /// Some of the written range was `Unwritten`: convert it to `Mapped`.
    pub unwritten: bool,
    /// The write ends past the in-memory size: raise the on-disk size.
    pub size_change: bool,
}

impl DioEndFlags {
    /// Completion needs no metadata work: a pure overwrite inside EOF.
    pub fn is_pure(&self) -> bool {
        !self.unwritten && !self.size_change
    }
}

/// What a direct write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioWriteOutcome {
    /// Bytes written from the caller's buffer (all of it on success).
    pub written: u64,
    /// What completion ([`IomapOps::end_io`]) was asked to do.
    pub end_flags: DioEndFlags,
    /// Every mapping was a pure overwrite and the size did not change: the
    /// write needed no metadata (the DSYNC and inline-completion fast paths
    /// key on this).
    pub pure_overwrite: bool,
    /// Every byte went to the device as a durable write
    /// ([`WriteMode::Fua`]): a DSYNC write that needs no metadata is durable
    /// already, with no flush.
    pub fua: bool,
}

impl DioWriteOutcome {
    /// Nothing written yet: the identity of [`DioWriteOutcome::merge`].
    pub const NOTHING: DioWriteOutcome = DioWriteOutcome {
        written: 0,
        end_flags: DioEndFlags {
            unwritten: false,
            size_change: false,
        },
        pure_overwrite: true,
        fua: true,
    };

    /// Adds the outcome of the next part of one write.
    pub fn merge(&mut self, next: &DioWriteOutcome) {
        self.written += next.written;
        self.end_flags.unwritten |= next.end_flags.unwritten;
        self.end_flags.size_change |= next.end_flags.size_change;
        self.pure_overwrite &= next.pure_overwrite;
        self.fua &= next.fua;
    }
}

/// A DSYNC pure overwrite goes out as one durable write
/// ([`WriteMode::Fua`]) when the device makes that the cheapest way: native
/// FUA, no volatile cache to flush, or a kernel that turns the write into
/// write + cache flush inside one request
/// ([`DeviceCaps::kernel_durable_writes`](blockdev::DeviceCaps)). Otherwise
/// the write goes out plain and a flush shared with concurrent DSYNC writers
/// follows it.
///
/// Why the kernel gets the flush when it can: on a loop device without FUA,
/// a plain write plus a flush from here reached 0.5–0.6× the raw device's
/// `RWF_DSYNC` writes (an io_uring fsync is always handed to a kernel worker
/// thread; that hop is the gap), the durable write 0.7–1.0×; and the block
/// layer merges concurrent flushes itself.
pub fn dsync_as_durable_write(dev: &dyn BlockDevice) -> bool {
    let caps = dev.caps();
    caps.fua || !caps.volatile_write_cache || caps.kernel_durable_writes
}

/// How a completed write reaches the durability its file promises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Nothing promised (no O_DSYNC/O_SYNC).
    NotRequired,
    /// Its data went out as durable writes (native FUA, a device without a
    /// volatile cache, or a kernel durable write): nothing is left to do.
    DurableWrites,
    /// A device flush issued after the data completed, shared with every
    /// other waiter it covers ([`FlushCoalescer`]).
    SharedFlush,
    /// A journal commit ([`IomapOps::commit`]): the write needs metadata, or
    /// the file is O_SYNC.
    JournalCommit,
}

/// Which context completes a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletedBy {
    /// The thread that reaps the device completion (inline completion).
    Reaper,
    /// The completion worker (metadata or journal work is needed).
    Worker,
}

impl Durability {
    /// The policy for a pure overwrite, decided before it is issued (the
    /// asynchronous fast path): O_SYNC commits; O_DSYNC is a durable write
    /// where the device makes that cheapest, else a shared flush.
    pub fn for_pure_overwrite(sync: WriteSync, dev: &dyn BlockDevice) -> Durability {
        match sync {
            WriteSync::None => Durability::NotRequired,
            WriteSync::Sync => Durability::JournalCommit,
            WriteSync::Dsync if dsync_as_durable_write(dev) => Durability::DurableWrites,
            WriteSync::Dsync => Durability::SharedFlush,
        }
    }

    /// The policy for a write that has been issued, from what it did: any
    /// metadata (or O_SYNC) commits the journal, whose preflush covers the
    /// data too.
    pub fn after_write(sync: WriteSync, outcome: &DioWriteOutcome) -> Durability {
        match sync {
            WriteSync::None => Durability::NotRequired,
            WriteSync::Sync => Durability::JournalCommit,
            WriteSync::Dsync if !outcome.pure_overwrite => Durability::JournalCommit,
            WriteSync::Dsync if outcome.fua => Durability::DurableWrites,
            WriteSync::Dsync => Durability::SharedFlush,
        }
    }

    /// How the data requests go out.
    pub fn write_mode(self) -> WriteMode {
        match self {
            Durability::DurableWrites => WriteMode::Fua,
            _ => WriteMode::Normal,
        }
    }

    /// Who completes a write with this durability: nothing a reaper does may
    /// wait for a journal commit.
    pub fn completed_by(self) -> CompletedBy {
        match self {
            Durability::JournalCommit => CompletedBy::Worker,
            _ => CompletedBy::Reaper,
        }
    }

    /// Reaches this durability for a write that has completed, waiting as a
    /// synchronous caller may.
    pub fn wait<O: IomapOps>(
        self,
        ops: &O,
        dev: &dyn BlockDevice,
        flushes: &FlushCoalescer,
    ) -> Result<(), O::Error> {
        match self {
            Durability::NotRequired | Durability::DurableWrites => Ok(()),
            Durability::SharedFlush => flushes
                .flush_completed_write(dev)
                .map_err(|source| IomapError::Flush { source }.into()),
            Durability::JournalCommit => ops.commit(),
        }
    }
}

/// One I/O in flight, split into device parts: it is done when the last
/// part is, with the first error any part met.
#[derive(Debug)]
pub struct IoEnd {
    /// File bytes the I/O covers, and what it reports on success.
    pos: u64,
    len: usize,
    outstanding: usize,
    error: Option<IomapError>,
}

impl IoEnd {
    /// An I/O of `len` bytes at file offset `pos`, sent as `parts` device
    /// requests.
    pub fn new(pos: u64, len: usize, parts: usize) -> IoEnd {
        IoEnd {
            pos,
            len,
            outstanding: parts,
            error: None,
        }
    }

    /// File offset of the I/O.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// The part for file bytes at `part_pos` finished with `result`. Returns
    /// true when it was the last outstanding part.
    pub fn part_done(&mut self, part_pos: u64, result: Result<usize, DeviceError>) -> bool {
        debug_assert!(self.outstanding > 0, "more parts completed than sent");
        if let Err(source) = result {
            // The first error is the cause; later ones are its consequences.
            self.error.get_or_insert(IomapError::Device {
                file_offset: part_pos,
                source,
            });
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        self.outstanding == 0
    }

    /// Parts not yet completed.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// The I/O's result once every part completed: its length, or the first
    /// error.
    pub fn finish(self) -> Result<usize, IomapError> {
        debug_assert_eq!(self.outstanding, 0, "finished with parts in flight");
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.len),
        }
    }
}

/// How a write's completion may move the size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeUpdate {
    /// The write may extend the file (a direct write under the exclusive
    /// lock): bytes past the size sampled before it was issued raise it.
    Extend { size_before: u64 },
    /// As `Extend`, but neither the size nor conversion reaches past
    /// `limit`: writeback after a failed write past the on-disk EOF, whose
    /// blocks the size must not cover until they are written (invariant 4).
    /// Blocks past `limit` stay unwritten though their data reached the
    /// device: a written extent past the on-disk EOF would show those bytes
    /// to a later extension after a crash (the caller keeps them dirty and
    /// writes them again).
    ExtendBelow { size_before: u64, limit: u64 },
    /// The write may not extend the file (writeback of cached data): the
    /// on-disk size rises at most to the in-core EOF, which a truncate may
    /// have lowered while the I/O was in flight.
    WithinEof,
}

/// What a completed write needs from the file system: conversion of
/// unwritten space it filled and the on-disk size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteEnd {
    pub pos: u64,
    /// Bytes whose I/O completed, contiguous from `pos`.
    pub completed: u64,
    /// Some of the range was unwritten (or new) space.
    pub unwritten: bool,
    pub size: SizeUpdate,
    /// A direct write's one completion (not writeback's, per folio): what
    /// the file system held for that write when it mapped it is done with.
    pub direct: bool,
}

/// The end-of-I/O work a file system is asked to do for one write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndIo {
    pub pos: u64,
    pub len: u64,
    /// Convert unwritten space in the range to written.
    pub convert: bool,
    /// Raise the on-disk (and in-core) size to at least this.
    pub new_size: Option<u64>,
    /// As [`WriteEnd::direct`].
    pub direct: bool,
}

impl WriteEnd {
    /// The work for the file system, with the size clamped as [`SizeUpdate`]
    /// says, given the in-core EOF now.
    pub fn end_io(&self, in_core_eof: u64) -> EndIo {
        let completed = match self.size {
            SizeUpdate::ExtendBelow { limit, .. } => {
                self.completed.min(limit.saturating_sub(self.pos))
            }
            SizeUpdate::Extend { .. } | SizeUpdate::WithinEof => self.completed,
        };
        let end = self.pos + completed;
        let new_size = match self.size {
            SizeUpdate::Extend { size_before } => (end > size_before).then_some(end),
            SizeUpdate::ExtendBelow { size_before, limit } => {
                let capped = end.min(limit);
                (capped > size_before).then_some(capped)
            }
            SizeUpdate::WithinEof => {
                let clamped = end.min(in_core_eof);
                (clamped > self.pos).then_some(clamped)
            }
        };
        // Invariant 4: the on-disk size only covers data whose I/O has
        // completed.
        if let Some(size) = new_size {
            assert!(
                size <= end,
                "size {size} reported past the completed I/O ending at {end}"
            );
        }
        EndIo {
            pos: self.pos,
            len: completed,
            convert: self.unwritten,
            new_size,
            direct: self.direct,
        }
    }

    /// What completion asked for, as flags.
    pub fn flags(&self, end_io: &EndIo) -> DioEndFlags {
        DioEndFlags {
            unwritten: end_io.convert,
            size_change: end_io.new_size.is_some(),
        }
    }

    /// Runs the completion through the file system, once, when any byte
    /// completed (a pure overwrite's completion asks for nothing, and the
    /// file system returns at once).
    pub fn complete<O: IomapOps>(
        &self,
        ops: &O,
        inode: &O::Inode,
    ) -> Result<DioEndFlags, O::Error> {
        let in_core_eof = match self.size {
            SizeUpdate::Extend { .. } | SizeUpdate::ExtendBelow { .. } => u64::MAX,
            SizeUpdate::WithinEof => ops.size(inode)?,
        };
        let end_io = self.end_io(in_core_eof);
        if end_io.len > 0 {
            ops.end_io(inode, &end_io)?;
        }
        Ok(self.flags(&end_io))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;

    fn io_error() -> DeviceError {
        DeviceError::Io {
            op: blockdev::error::IoOp::Write,
            offset: 4096,
            len: 512,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        }
    }

    #[test]
    fn an_ioend_finishes_with_its_last_part_and_the_first_error() {
        let mut end = IoEnd::new(8192, 12288, 3);
        assert!(!end.part_done(8192, Ok(4096)));
        assert!(!end.part_done(12288, Err(io_error())));
        assert_eq!(end.outstanding(), 1);
        let second = DeviceError::Flush {
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        assert!(end.part_done(16384, Err(second)));
        match end.finish() {
            Err(IomapError::Device {
                file_offset,
                source,
            }) => {
                assert_eq!(file_offset, 12288, "the first error wins");
                assert_eq!(source.errno(), libc::EIO);
            }
            other => panic!("{other:?}"),
        }
        let mut ok = IoEnd::new(0, 100, 1);
        assert!(ok.part_done(0, Ok(512)));
        assert_eq!(ok.finish().unwrap(), 100);
    }

    #[test]
    fn writeback_size_is_clamped_to_the_in_core_eof() {
        let w = WriteEnd {
            pos: 8192,
            completed: 8192,
            unwritten: true,
            size: SizeUpdate::WithinEof,
            direct: false,
        };
        // Truncated to 10000 while the I/O was in flight.
        assert_eq!(w.end_io(10_000).new_size, Some(10_000));
        // EOF beyond the I/O: the size covers the completed bytes only.
        assert_eq!(w.end_io(1 << 20).new_size, Some(16384));
        // Truncated below the I/O: no size to raise.
        assert_eq!(w.end_io(4096).new_size, None);
        assert!(w.end_io(4096).convert);
    }

    #[test]
    fn a_direct_write_extends_only_past_the_size_it_saw() {
        let w = |size_before| WriteEnd {
            pos: 4096,
            completed: 100,
            unwritten: false,
            size: SizeUpdate::Extend { size_before },
            direct: true,
        };
        assert_eq!(w(4000).end_io(u64::MAX).new_size, Some(4196));
        assert_eq!(w(8192).end_io(u64::MAX).new_size, None);
    }

    #[test]
    fn a_limited_extension_neither_raises_nor_converts_past_its_limit() {
        let w = |size_before, limit| WriteEnd {
            pos: 4096,
            completed: 4096,
            unwritten: true,
            size: SizeUpdate::ExtendBelow { size_before, limit },
            direct: false,
        };
        assert_eq!(w(1000, 6000).end_io(u64::MAX).new_size, Some(6000));
        assert_eq!(w(1000, u64::MAX).end_io(u64::MAX).new_size, Some(8192));
        assert_eq!(w(1000, 1000).end_io(u64::MAX).new_size, None);
        assert_eq!(w(1000, 0).end_io(u64::MAX).new_size, None);
        let e = w(1000, 6000).end_io(u64::MAX);
        assert_eq!((e.pos, e.len, e.convert), (4096, 6000 - 4096, true));
        assert_eq!(w(1000, 1000).end_io(u64::MAX).len, 0);
        assert_eq!(w(1000, u64::MAX).end_io(u64::MAX).len, 4096);
    }

    #[test]
    fn durability_policy_by_sync_mode_and_device() {
        let fua = MemDevice::with_caps(1 << 20, 512, true, true);
        let no_fua = MemDevice::with_caps(1 << 20, 512, true, false);
        let no_cache = MemDevice::with_caps(1 << 20, 512, false, false);
        let kernel = MemDevice::with_caps(1 << 20, 512, true, false).with_kernel_durable_writes();
        for (dev, durable) in [
            (&fua, true),
            (&no_fua, false),
            (&no_cache, true),
            (&kernel, true),
        ] {
            let d = Durability::for_pure_overwrite(WriteSync::Dsync, dev);
            let want = if durable {
                Durability::DurableWrites
            } else {
                Durability::SharedFlush
            };
            assert_eq!(d, want);
            assert_eq!(d.completed_by(), CompletedBy::Reaper);
            assert_eq!(d.write_mode() == WriteMode::Fua, durable);
        }
        let sync = Durability::for_pure_overwrite(WriteSync::Sync, &fua);
        assert_eq!(sync, Durability::JournalCommit);
        assert_eq!(sync.completed_by(), CompletedBy::Worker);
        assert_eq!(
            Durability::for_pure_overwrite(WriteSync::None, &no_fua),
            Durability::NotRequired
        );
        let pure = DioWriteOutcome {
            written: 4096,
            end_flags: DioEndFlags::default(),
            pure_overwrite: true,
            fua: false,
        };
        let metadata = DioWriteOutcome {
            pure_overwrite: false,
            ..pure
        };
        let fua_out = DioWriteOutcome { fua: true, ..pure };
        assert_eq!(
            Durability::after_write(WriteSync::Dsync, &pure),
            Durability::SharedFlush
        );
        assert_eq!(
            Durability::after_write(WriteSync::Dsync, &metadata),
            Durability::JournalCommit
        );
        assert_eq!(
            Durability::after_write(WriteSync::Dsync, &fua_out),
            Durability::DurableWrites
        );
        assert_eq!(
            Durability::after_write(WriteSync::Sync, &fua_out),
            Durability::JournalCommit
        );
        assert_eq!(
            Durability::after_write(WriteSync::None, &metadata),
            Durability::NotRequired
        );
    }
}
