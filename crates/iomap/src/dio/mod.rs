//! Direct I/O: file reads and writes straight between the caller's buffer and
//! the device, driven by the file system's mappings.
//!
//! The engine is split in three so the asynchronous engine can reuse the
//! first two:
//! 1. **Iteration** ([`IomapIter`]): `begin` → span of one mapping → `end`.
//! 2. **Planning** ([`plan`]): turns one span into [`ReadSegment`]s or
//!    [`WriteSegment`]s without
//!    doing any I/O.
//! 3. **Submission**: here synchronous, one segment after another
//!    ([`dio_read`], [`dio_write`]); completion through [`crate::ioend`].
//!
//! # Fault model
//!
//! - A device error stops the I/O at that request and is reported with the
//!   file offset of the failed request ([`IomapError::Device`]).
//! - A write that fails after some bytes reached the device still completes
//!   those bytes: `end_io` covers the contiguous written prefix (so size
//!   and conversion match the data on the device) and then the error is
//!   returned. In a new or unwritten mapping the prefix is cut down to a
//!   file-system block boundary, because the file system converts whole
//!   blocks and the rest of a partly written block was never zeroed.
//! - A mapping the engine cannot use safely (a hole for a write, a mapping
//!   that does not contain the offset, a shared (copy-on-write) mapping,
//!   device addresses that overflow or are misaligned, zeroing that would
//!   reach outside the mapping's blocks) is a file-system bug and becomes
//!   [`IomapError::BadMapping`], never out-of-bounds I/O or a panic.

use blockdev::{BlockDevice, WriteMode};

use crate::align::{align_down, is_aligned};
use crate::ioend::{dsync_as_durable_write, DioEndFlags, DioWriteOutcome, SizeUpdate, WriteEnd};
use crate::iter::{IomapIter, IomapSpan};
use crate::zero::zero_range;
use crate::{IomapError, IomapKind, IomapOpFlags, IomapOps};

pub mod plan;

pub use plan::{
    needs_zeroing, read_segments, write_segments, ReadSegment, ReadSegments, WriteSegment,
    WriteSegments, DIO_MAX_REQUEST_BYTES,
};

/// Simple read: a direct read of at most one file-system block inside one
/// `Mapped` extent and inside EOF skips the mapping iteration — one lookup,
/// one device request, no heap allocation, completed in the caller's
/// context. Returns `None` (having done nothing) when the read does not
/// qualify; the caller then takes the generic [`dio_read`].
pub fn dio_read_simple<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &mut [u8],
) -> Option<Result<usize, O::Error>> {
    let len = buf.len() as u64;
    let lbs = u64::from(dev.caps().logical_block_size);
    if len == 0
        || len > u64::from(ops.block_size())
        || !is_aligned(pos, lbs)
        || !is_aligned(len, lbs)
    {
        return None;
    }
    let addr = ops.simple_read_addr(inode, pos, len)?;
    Some(
        dev.read_at(buf, addr)
            .map(|()| buf.len())
            .map_err(|source| {
                IomapError::Device {
                    file_offset: pos,
                    source,
                }
                .into()
            }),
    )
}

pub(crate) fn logical_block_size(dev: &dyn BlockDevice) -> u32 {
    dev.caps().logical_block_size.max(1)
}

fn bad(pos: u64, reason: String) -> IomapError {
    IomapError::BadMapping { pos, reason }
}

/// Direct I/O must cover whole device blocks.
fn check_aligned(pos: u64, len: usize, lbs: u32) -> Result<(), IomapError> {
    let a = u64::from(lbs);
    if !is_aligned(pos, a) || !is_aligned(len as u64, a) {
        return Err(IomapError::Unaligned {
            pos,
            len: len as u64,
            alignment: lbs,
        });
    }
    Ok(())
}

/// Reads file bytes `[pos, pos + buf.len())` directly from the device into
/// `buf`. The caller has clamped the range to EOF. Holes, unwritten and
/// delalloc space read as zeros.
///
/// `pos` and `buf.len()` must be multiples of the device logical block size
/// (else [`IomapError::Unaligned`]). `flags` is added to `DIRECT` for every
/// `begin` (e.g. `NOWAIT`). Returns `buf.len()`; any error aborts the read.
pub fn dio_read<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &mut [u8],
    flags: IomapOpFlags,
) -> Result<usize, O::Error> {
    let lbs = logical_block_size(dev);
    check_aligned(pos, buf.len(), lbs)?;
    let op_flags = flags | IomapOpFlags::DIRECT;
    let mut iter = IomapIter::new(ops, inode, pos, buf.len() as u64, op_flags, lbs)?;
    while let Some(span) = iter.begin()? {
        let (done, result) = read_span(dev, &span, pos, buf, lbs);
        let end_result = iter.end(&span, done);
        result?;
        end_result?;
    }
    Ok(buf.len())
}

/// Reads one span; returns the bytes done (a contiguous prefix of the span)
/// and the first error.
fn read_span(
    dev: &dyn BlockDevice,
    span: &IomapSpan,
    req_pos: u64,
    buf: &mut [u8],
    lbs: u32,
) -> (u64, Result<(), IomapError>) {
    let segments = match read_segments(span, lbs) {
        Ok(s) => s,
        Err(e) => return (0, Err(e)),
    };
    for seg in segments {
        let Some((file_offset, dev_addr, len)) = seg.zero_fill(buf, req_pos) else {
            continue;
        };
        let at = (file_offset - req_pos) as usize;
        if let Err(source) = dev.read_at(&mut buf[at..at + len as usize], dev_addr) {
            let error = IomapError::Device {
                file_offset,
                source,
            };
            return (file_offset - span.pos, Err(error));
        }
    }
    (span.len, Ok(()))
}

/// Writes `buf` directly to file bytes `[pos, pos + buf.len())`.
///
/// `pos` and `buf.len()` must be multiples of the device logical block size
/// (else [`IomapError::Unaligned`]). Every `begin` gets `WRITE | DIRECT |
/// flags`; `flags` may carry `OVERWRITE_ONLY`, `NOWAIT` and `DSYNC`. A
/// `WouldBlock` (or any error) from `begin` is returned unchanged, with no
/// data written for that mapping. With `OVERWRITE_ONLY`, a write crossing EOF
/// fails with `WouldBlock` before any mapping is asked for.
///
/// After the data is on the device (not necessarily durable: flush policy is
/// the caller's), `end_io` is called exactly once for the written bytes,
/// with what they need (conversion, size change). If a later mapping fails
/// after some bytes were written, those bytes are completed first and then
/// the error is returned. A zero-length write, or one that fails before any
/// byte is written, calls no `end_io`.
///
/// The caller holds the inode's I/O lock: shared with `OVERWRITE_ONLY`, or
/// for a write of whole file-system blocks inside the on-disk EOF (it
/// zeroes nothing and changes no size); otherwise exclusive with direct I/O
/// drained (the edge zeroing of a new or unwritten block must not race
/// another write into that block).
pub fn dio_write<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &[u8],
    flags: IomapOpFlags,
) -> Result<DioWriteOutcome, O::Error> {
    let data_end = pos.saturating_add(buf.len() as u64);
    dio_write_padded(ops, dev, inode, pos, buf, data_end, flags)
}

/// [`dio_write`] of a read-modify-write: `buf` covers whole device blocks
/// from `pos`, but the caller's data ends at `data_end`; the bytes after it
/// are the unchanged rest of the last device block. Completion (conversion,
/// size) covers the data only, so the file does not grow to the padding.
pub fn dio_write_padded<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &[u8],
    data_end: u64,
    flags: IomapOpFlags,
) -> Result<DioWriteOutcome, O::Error> {
    let lbs = logical_block_size(dev);
    check_aligned(pos, buf.len(), lbs)?;
    let block_size = ops.block_size();
    if !is_aligned(u64::from(block_size), u64::from(lbs)) {
        return Err(bad(
            pos,
            format!(
                "file-system block size {block_size} is not a multiple of the \
                 device logical block size {lbs}"
            ),
        )
        .into());
    }
    let len = buf.len() as u64;
    if len == 0 {
        return Ok(DioWriteOutcome {
            written: 0,
            end_flags: DioEndFlags::default(),
            pure_overwrite: true,
            fua: false,
        });
    }
    let op_flags = flags | IomapOpFlags::WRITE | IomapOpFlags::DIRECT;
    let fua_if_pure = op_flags.contains(IomapOpFlags::DSYNC) && dsync_as_durable_write(dev);
    let mut all_fua = true;
    // Sampled once, before any mapping: the size this write may extend. A
    // file system that raised its in-memory size in `begin` would otherwise
    // hide the size change from completion.
    let size = ops.disk_size(inode)?;
    let mut iter = IomapIter::new(ops, inode, pos, len, op_flags, lbs)?;
    let req_end = pos + len;
    // Only data may not cross EOF; declared padding may (`PADDED_TAIL`).
    let must_fit = if op_flags.contains(IomapOpFlags::PADDED_TAIL) {
        data_end
    } else {
        req_end
    };
    if op_flags.contains(IomapOpFlags::OVERWRITE_ONLY) && must_fit > size {
        return Err(IomapError::WouldBlock.into());
    }

    let mut unwritten = false;
    let mut all_pure = true;
    let result = loop {
        let span = match iter.begin() {
            Ok(Some(span)) => span,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let unsafe_when_shared = span.iomap.kind != IomapKind::Mapped || needs_zeroing(&span.iomap);
        let (done, io_result) =
            if op_flags.contains(IomapOpFlags::OVERWRITE_ONLY) && unsafe_when_shared {
                // The file system broke the OVERWRITE_ONLY contract. Zeroing or
                // conversion under the shared lock would race other writers
                // (invariant 5): refuse, so the caller retries exclusively.
                // (`DIRTY` alone is let through: it only asks completion for
                // metadata work and does not touch other writers' blocks;
                // `pure_overwrite` still reports it.)
                (0, Err(IomapError::WouldBlock))
            } else {
                // FUA only where nothing but the data is needed for
                // durability; any other span leaves the caller a flush or
                // journal commit to do.
                let mode = if fua_if_pure && span.iomap.is_pure_overwrite() {
                    WriteMode::Fua
                } else {
                    all_fua = false;
                    WriteMode::Normal
                };
                let source = WriteSource {
                    pos,
                    end: req_end,
                    buf,
                    block_size,
                    lbs,
                };
                write_span(dev, &span, &source, mode)
            };
        if done > 0 && needs_zeroing(&span.iomap) {
            unwritten = true;
        }
        all_pure &= span.iomap.is_pure_overwrite();
        let end_result = iter.end(&span, done);
        if let Err(e) = io_result {
            break Err(e.into());
        }
        if let Err(e) = end_result {
            break Err(e);
        }
    };

    let written = iter.processed();
    // Padding past `data_end` shares the data's last device block, hence its
    // file-system block: completing the data converts the same blocks.
    let completion = WriteEnd {
        pos,
        completed: written.min(data_end.saturating_sub(pos)),
        unwritten,
        size: SizeUpdate::Extend { size_before: size },
        direct: true,
    }
    .complete(ops, inode);
    // The I/O error comes first: it is the cause; a completion error after it
    // is a consequence.
    result?;
    let end_flags = completion?;
    Ok(DioWriteOutcome {
        written,
        end_flags,
        pure_overwrite: all_pure && !end_flags.size_change,
        fua: fua_if_pure && all_fua && all_pure && !end_flags.size_change,
    })
}

/// The caller's side of a direct write: its data, where it goes, and how.
struct WriteSource<'a> {
    pos: u64,
    end: u64,
    buf: &'a [u8],
    block_size: u32,
    lbs: u32,
}

/// Writes one span (edge zeroing included), its data with `mode`; returns
/// the bytes that count as written (a contiguous prefix of the span, safe to
/// complete) and the first error.
fn write_span(
    dev: &dyn BlockDevice,
    span: &IomapSpan,
    source: &WriteSource<'_>,
    mode: WriteMode,
) -> (u64, Result<(), IomapError>) {
    let WriteSource {
        pos: req_pos,
        end: req_end,
        buf,
        block_size,
        lbs,
    } = *source;
    let segments = match write_segments(span, req_pos, req_end, block_size, lbs) {
        Ok(s) => s,
        Err(e) => return (0, Err(e)),
    };
    // End of the data written so far, contiguous from `span.pos`.
    let mut data_end = span.pos;
    for seg in segments {
        let result = match seg {
            WriteSegment::Write {
                file_offset,
                dev_addr,
                len,
            } => {
                let at = (file_offset - req_pos) as usize;
                dev.write_at(&buf[at..at + len as usize], dev_addr, mode)
            }
            WriteSegment::WriteZeroes { dev_addr, len, .. } => zero_range(dev, dev_addr, len),
        };
        match result {
            Ok(()) => {
                if let WriteSegment::Write {
                    file_offset, len, ..
                } = seg
                {
                    data_end = file_offset + len;
                }
            }
            Err(source) => {
                let error = IomapError::Device {
                    file_offset: seg.file_offset(),
                    source,
                };
                let done = if needs_zeroing(&span.iomap) {
                    // Completion converts whole blocks: only blocks whose
                    // zeroing and data are both on the device may be
                    // reported. Head zeroing comes first, so every block
                    // below the last block boundary under `data_end` is
                    // complete.
                    let bs = u64::from(block_size);
                    align_down(data_end, bs).saturating_sub(span.pos)
                } else {
                    data_end - span.pos
                };
                return (done, Err(error));
            }
        }
    }
    (span.len, Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{
        pattern, Block, FakeFs, Req, ScriptedFs, TestDev, BS, KIB, MIB, STALE,
    };
    use crate::{Iomap, IomapFlags};

    fn setup(lbs: u32, nblocks: usize) -> (TestDev, FakeFs) {
        let dev = TestDev::new(16 * MIB as usize, lbs);
        dev.fill(STALE);
        // Allocations come from the second half of the device.
        let fs = FakeFs::new(BS as u32, nblocks, 8 * MIB);
        (dev, fs)
    }

    fn read(fs: &FakeFs, dev: &TestDev, pos: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0x55; len];
        let n = dio_read(fs, dev, &(), pos, &mut buf, IomapOpFlags::READ).unwrap();
        assert_eq!(n, len);
        buf
    }

    #[test]
    fn holes_and_unwritten_read_as_zeros() {
        let (dev, fs) = setup(512, 8);
        let data = pattern(BS as usize, 1);
        dev.poke(MIB, &data);
        fs.set(0, Block::Hole);
        fs.set(1, Block::Unwritten(2 * MIB)); // device holds 0xAA there
        fs.set(2, Block::Mapped(MIB));
        let buf = read(&fs, &dev, 0, 3 * BS as usize);
        assert!(buf[..2 * BS as usize].iter().all(|&b| b == 0));
        assert_eq!(&buf[2 * BS as usize..], &data[..]);
        // Only the mapped block touched the device.
        assert_eq!(dev.requests(), vec![Req::Read { off: MIB, len: BS }]);
        fs.assert_begin_end_paired();
    }

    #[test]
    fn write_into_hole_then_read_back() {
        let (dev, fs) = setup(512, 8);
        let data = pattern(2 * BS as usize, 2);
        let out = dio_write(&fs, &dev, &(), BS, &data, IomapOpFlags::default()).unwrap();
        assert_eq!(out.written, 2 * BS);
        let want = DioEndFlags {
            unwritten: true,
            size_change: true,
        };
        assert_eq!(out.end_flags, want);
        assert!(!out.pure_overwrite);
        assert_eq!(fs.end_ios(), vec![(BS, 2 * BS, want)]);
        assert_eq!(fs.block(1), Block::Mapped(8 * MIB));
        assert_eq!(fs.block(2), Block::Mapped(8 * MIB + BS));
        assert_eq!(fs.state.lock().size, 3 * BS);
        // Block-aligned write: no zeroing, one request.
        assert_eq!(dev.writes(), vec![(8 * MIB, 2 * BS)]);

        let buf = read(&fs, &dev, 0, 3 * BS as usize);
        assert!(buf[..BS as usize].iter().all(|&b| b == 0));
        assert_eq!(&buf[BS as usize..], &data[..]);
        fs.assert_begin_end_paired();
    }

    /// A 512-byte write into the middle of a new 4 KiB block zeroes the
    /// rest of the block on the device, whether the file system returns the
    /// whole block or a mapping clipped to the write.
    #[test]
    fn sub_block_write_into_new_block_zeroes_the_rest() {
        for clip in [false, true] {
            let (dev, mut fs) = setup(512, 8);
            fs.clip = clip;
            let data = pattern(512, 3);
            let pos = BS + 1024;
            let out = dio_write(&fs, &dev, &(), pos, &data, IomapOpFlags::default()).unwrap();
            assert_eq!(out.written, 512);
            assert!(out.end_flags.unwritten);
            let base = 8 * MIB;
            assert_eq!(
                dev.writes(),
                vec![(base, 1024), (base + 1024, 512), (base + 1536, BS - 1536)],
                "clip={clip}"
            );
            let block = dev.bytes(base, BS as usize);
            assert!(block[..1024].iter().all(|&b| b == 0), "clip={clip}");
            assert_eq!(&block[1024..1536], &data[..]);
            assert!(block[1536..].iter().all(|&b| b == 0), "clip={clip}");
            // The neighbouring device block was not touched.
            assert_eq!(dev.bytes(base + BS, 16), vec![STALE; 16]);
            assert_eq!(fs.block(1), Block::Mapped(base));
            let buf = read(&fs, &dev, BS, BS as usize);
            assert_eq!(&buf[1024..1536], &data[..]);
            assert_eq!(buf.iter().filter(|&&b| b != 0).count(), {
                data.iter().filter(|&&b| b != 0).count()
            });
            fs.assert_begin_end_paired();
        }
    }

    #[test]
    fn sub_block_write_into_unwritten_block_zeroes_the_rest() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Unwritten(MIB));
        fs.set_size(BS);
        let data = pattern(512, 4);
        let out = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::default()).unwrap();
        assert_eq!(
            out.end_flags,
            DioEndFlags {
                unwritten: true,
                size_change: false
            }
        );
        assert_eq!(dev.writes(), vec![(MIB, 512), (MIB + 512, BS - 512)]);
        let block = dev.bytes(MIB, BS as usize);
        assert_eq!(&block[..512], &data[..]);
        assert!(block[512..].iter().all(|&b| b == 0));
    }

    #[test]
    fn sub_block_overwrite_of_mapped_block_is_pure_and_keeps_neighbours() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Mapped(MIB));
        fs.set_size(BS);
        let data = pattern(512, 5);
        let flags = IomapOpFlags::OVERWRITE_ONLY;
        let out = dio_write(&fs, &dev, &(), 512, &data, flags).unwrap();
        assert!(out.pure_overwrite);
        assert!(out.end_flags.is_pure());
        assert_eq!(fs.end_ios(), vec![(512, 512, DioEndFlags::default())]);
        assert_eq!(dev.writes(), vec![(MIB + 512, 512)]);
        assert_eq!(dev.bytes(MIB, 512), vec![STALE; 512]);
        assert_eq!(dev.bytes(MIB + 1024, 512), vec![STALE; 512]);
        // The flags reached the file system with WRITE and DIRECT added.
        let (_, _, seen, _) = fs.begins.lock()[0];
        assert_eq!(
            seen,
            IomapOpFlags::WRITE | IomapOpFlags::DIRECT | IomapOpFlags::OVERWRITE_ONLY
        );
    }

    #[test]
    fn unaligned_requests_are_rejected_before_any_mapping() {
        let (dev, fs) = setup(512, 8);
        let mut buf = vec![0u8; 1024];
        for (pos, len) in [(100, 512), (0, 100), (512, 1000)] {
            let err = dio_read(&fs, &dev, &(), pos, &mut buf[..len], IomapOpFlags::READ);
            assert!(
                matches!(err, Err(IomapError::Unaligned { pos: p, len: l, alignment: 512 })
                    if p == pos && l == len as u64),
                "{err:?}"
            );
            let err = dio_write(&fs, &dev, &(), pos, &buf[..len], IomapOpFlags::default());
            assert!(matches!(err, Err(IomapError::Unaligned { .. })), "{err:?}");
        }
        // With 4 KiB logical blocks, 512-byte alignment is not enough.
        let dev4k = TestDev::new(MIB as usize, 4096);
        let err = dio_write(&fs, &dev4k, &(), 512, &buf[..512], IomapOpFlags::default());
        assert!(matches!(
            err,
            Err(IomapError::Unaligned {
                alignment: 4096,
                ..
            })
        ));
        assert!(fs.begins.lock().is_empty());
        assert!(dev.requests().is_empty() && dev4k.requests().is_empty());
        assert!(fs.end_ios().is_empty());
    }

    #[test]
    fn would_block_from_overwrite_only_propagates_and_writes_nothing() {
        let (dev, fs) = setup(512, 8);
        fs.set_size(8 * BS);
        let data = pattern(512, 6);
        let flags = IomapOpFlags::OVERWRITE_ONLY | IomapOpFlags::NOWAIT;
        let err = dio_write(&fs, &dev, &(), 512, &data, flags);
        assert!(matches!(err, Err(IomapError::WouldBlock)), "{err:?}");
        assert!(dev.requests().is_empty());
        assert!(fs.end_ios().is_empty());
        assert_eq!(fs.block(0), Block::Hole, "nothing allocated");
        // The fake logs only answered `begin`s; a refused one gets no `end`.
        assert!(fs.begins.lock().is_empty());
        assert!(fs.ends.lock().is_empty(), "no end for a failed begin");
    }

    #[test]
    fn overwrite_only_crossing_eof_would_block_without_asking() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Mapped(MIB));
        fs.set(1, Block::Mapped(MIB + BS));
        fs.set_size(BS);
        let data = pattern(2 * BS as usize, 7);
        let err = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::OVERWRITE_ONLY);
        assert!(matches!(err, Err(IomapError::WouldBlock)));
        assert!(fs.begins.lock().is_empty());
        assert!(dev.requests().is_empty());
    }

    /// The first mapping is written, the second would block: the written
    /// part is completed, then `WouldBlock` is returned for the retry.
    #[test]
    fn would_block_on_a_later_mapping_completes_the_written_part() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Mapped(MIB));
        fs.set_size(4 * BS);
        let data = pattern(2 * BS as usize, 8);
        let err = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::OVERWRITE_ONLY);
        assert!(matches!(err, Err(IomapError::WouldBlock)));
        assert_eq!(dev.writes(), vec![(MIB, BS)]);
        assert_eq!(fs.end_ios(), vec![(0, BS, DioEndFlags::default())]);
        assert_eq!(fs.block(1), Block::Hole);
        fs.assert_begin_end_paired();
    }

    /// A file system that answers OVERWRITE_ONLY with a mapping needing
    /// zeroing breaks the contract; the engine refuses rather than zero under
    /// the shared lock.
    #[test]
    fn engine_refuses_zeroing_under_overwrite_only() {
        let dev = TestDev::new(MIB as usize, 512);
        let map = Iomap {
            offset: 0,
            length: BS,
            kind: IomapKind::Unwritten,
            addr: 0,
            flags: IomapFlags::EMPTY,
        };
        let fs = ScriptedFs::new(BS as u32, BS, vec![map]);
        let err = dio_write(&fs, &dev, &(), 0, &[1; 512], IomapOpFlags::OVERWRITE_ONLY);
        assert!(matches!(err, Err(IomapError::WouldBlock)));
        assert!(dev.requests().is_empty());
        assert_eq!(*fs.ends.lock(), 1);
        assert!(fs.end_ios.lock().is_empty());
    }

    /// `DIRTY` on a written mapping is safe under the shared lock (it only
    /// asks completion for metadata work), so OVERWRITE_ONLY lets it through;
    /// the outcome still says the write was not pure.
    #[test]
    fn dirty_overwrite_passes_overwrite_only_but_is_not_pure() {
        let dev = TestDev::new(MIB as usize, 512);
        let map = Iomap {
            offset: 0,
            length: BS,
            kind: IomapKind::Mapped,
            addr: 0,
            flags: IomapFlags::DIRTY,
        };
        let fs = ScriptedFs::new(BS as u32, BS, vec![map]);
        let out = dio_write(&fs, &dev, &(), 0, &[1; 512], IomapOpFlags::OVERWRITE_ONLY).unwrap();
        assert_eq!(out.written, 512);
        assert!(out.end_flags.is_pure());
        assert!(!out.pure_overwrite);
        assert_eq!(dev.writes(), vec![(0, 512)]);
    }

    #[test]
    fn pure_overwrite_completes_once_with_no_work() {
        let (dev, fs) = setup(512, 8);
        for b in 0..4 {
            fs.set(b, Block::Mapped(MIB + b as u64 * BS));
        }
        fs.set_size(4 * BS);
        let data = pattern(4 * BS as usize, 9);
        let out = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::DSYNC).unwrap();
        assert_eq!(
            out,
            DioWriteOutcome {
                written: 4 * BS,
                end_flags: DioEndFlags::default(),
                pure_overwrite: true,
                // The test device has a volatile cache and no FUA.
                fua: false,
            }
        );
        assert_eq!(fs.end_ios(), vec![(0, 4 * BS, DioEndFlags::default())]);
        assert_eq!(dev.writes(), vec![(MIB, 4 * BS)]);
        assert_eq!(dev.bytes(MIB, 4 * BS as usize), data);
    }

    #[test]
    fn overwrite_extending_size_is_not_pure() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Mapped(MIB));
        fs.set_size(512);
        let out = dio_write(&fs, &dev, &(), 0, &[3; 1024], IomapOpFlags::default()).unwrap();
        assert_eq!(
            out.end_flags,
            DioEndFlags {
                unwritten: false,
                size_change: true
            }
        );
        assert!(!out.pure_overwrite);
        assert_eq!(fs.state.lock().size, 1024);
    }

    #[test]
    fn device_error_mid_write_reports_offset_and_completes_written_part() {
        let (dev, fs) = setup(512, 8);
        fs.set(0, Block::Mapped(MIB));
        fs.set(1, Block::Mapped(MIB + BS));
        fs.set_size(2 * BS);
        // Blocks 2..4 are holes: allocated at 8 MiB, and that write fails.
        dev.fail_nth_write_from_now(2);
        let data = pattern(4 * BS as usize, 10);
        let err = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::default()).unwrap_err();
        match err {
            IomapError::Device {
                file_offset,
                ref source,
            } => {
                assert_eq!(file_offset, 2 * BS);
                assert!(
                    matches!(source, blockdev::DeviceError::Io { offset, .. } if *offset == 8 * MIB),
                    "{source}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            fs.end_ios(),
            vec![(0, 2 * BS, DioEndFlags::default())],
            "completion covers exactly the written mapping"
        );
        // The failed blocks stay unwritten: they still read as zeros.
        assert_eq!(fs.block(2), Block::Unwritten(8 * MIB));
        assert_eq!(fs.ends.lock().last(), Some(&(2 * BS, 2 * BS, 0)));
        fs.assert_begin_end_paired();
        assert!(read(&fs, &dev, 2 * BS, 2 * BS as usize)
            .iter()
            .all(|&b| b == 0));
    }

    /// A failure inside a new mapping only completes whole blocks: the block
    /// the failed request started in was never fully written.
    #[test]
    fn failure_inside_new_mapping_completes_whole_blocks_only() {
        let (dev, fs) = setup(512, 1024);
        let pos = 512;
        let data = pattern(3 * MIB as usize, 11);
        // Requests: head zeroing, data [512, 1 MiB), data [1 MiB, 2 MiB) <- fails.
        dev.fail_nth_write_from_now(3);
        let err = dio_write(&fs, &dev, &(), pos, &data, IomapOpFlags::default()).unwrap_err();
        assert!(matches!(err, IomapError::Device { file_offset, .. } if file_offset == MIB));
        let writes = dev.writes();
        assert_eq!(writes[0], (8 * MIB, 512));
        assert_eq!(writes[1], (8 * MIB + 512, MIB - 512));
        assert_eq!(writes[2], (8 * MIB + MIB, MIB));
        let (epos, elen, eflags) = fs.end_ios()[0];
        assert_eq!((epos, elen), (pos, MIB - pos));
        assert_eq!((epos + elen) % BS, 0);
        assert!(eflags.unwritten && eflags.size_change);
        assert_eq!(fs.end_ios().len(), 1);
        // The completed part reads back; the rest reads as zeros.
        let buf = read(&fs, &dev, 0, 2 * MIB as usize);
        assert!(buf[..512].iter().all(|&b| b == 0));
        assert_eq!(&buf[512..MIB as usize], &data[..(MIB - 512) as usize]);
        assert!(buf[MIB as usize..].iter().all(|&b| b == 0));
    }

    /// A fragmented file: mapped runs at scattered addresses, an unwritten
    /// block, a hole, and a short maximum mapping length. Each mapping gets
    /// its own request at its own address; one completion covers all.
    #[test]
    fn multi_mapping_write_splits_at_mapping_boundaries() {
        let (dev, mut fs) = setup(512, 8);
        fs.max_blocks = 2;
        fs.set(0, Block::Mapped(MIB));
        fs.set(1, Block::Mapped(MIB + BS));
        fs.set(2, Block::Mapped(MIB + 2 * BS)); // contiguous, cut by max_blocks
        fs.set(3, Block::Mapped(3 * MIB));
        fs.set(4, Block::Unwritten(4 * MIB));
        fs.set(5, Block::Hole);
        fs.set(6, Block::Mapped(5 * MIB));
        fs.set_size(7 * BS);
        let data = pattern(7 * BS as usize, 12);
        let out = dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::default()).unwrap();
        assert_eq!(out.written, 7 * BS);
        assert_eq!(
            out.end_flags,
            DioEndFlags {
                unwritten: true,
                size_change: false
            }
        );
        assert!(!out.pure_overwrite);
        assert_eq!(
            dev.writes(),
            vec![
                (MIB, 2 * BS),
                (MIB + 2 * BS, BS),
                (3 * MIB, BS),
                (4 * MIB, BS),
                (8 * MIB, BS),
                (5 * MIB, BS),
            ]
        );
        let at = |b: usize| &data[b * BS as usize..(b + 1) * BS as usize];
        assert_eq!(dev.bytes(3 * MIB, BS as usize), at(3));
        assert_eq!(dev.bytes(4 * MIB, BS as usize), at(4));
        assert_eq!(dev.bytes(8 * MIB, BS as usize), at(5));
        assert_eq!(fs.end_ios(), vec![(0, 7 * BS, out.end_flags)]);
        assert_eq!(read(&fs, &dev, 0, 7 * BS as usize), data);
        fs.assert_begin_end_paired();
    }

    /// A sub-block write spanning two new blocks zeroes the head of the
    /// first and the tail of the second, nothing in between.
    #[test]
    fn unaligned_write_across_new_blocks_zeroes_both_edges() {
        for clip in [false, true] {
            let (dev, mut fs) = setup(512, 8);
            fs.clip = clip;
            let pos = 3 * KIB;
            let data = pattern(2 * KIB as usize, 13);
            dio_write(&fs, &dev, &(), pos, &data, IomapOpFlags::default()).unwrap();
            let base = 8 * MIB;
            assert_eq!(
                dev.writes(),
                vec![
                    (base, 3 * KIB),
                    (base + 3 * KIB, 2 * KIB),
                    (base + 5 * KIB, 3 * KIB)
                ]
            );
            let both = dev.bytes(base, 2 * BS as usize);
            assert!(both[..3 * KIB as usize].iter().all(|&b| b == 0));
            assert_eq!(&both[3 * KIB as usize..5 * KIB as usize], &data[..]);
            assert!(both[5 * KIB as usize..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn large_mappings_are_issued_in_bounded_requests() {
        let (dev, fs) = setup(512, 1024);
        for b in 0..1024 {
            fs.set(b, Block::Mapped(MIB + b as u64 * BS));
        }
        fs.set_size(1024 * BS);
        let len = 3 * MIB + 8 * KIB;
        let data = pattern(len as usize, 14);
        dio_write(&fs, &dev, &(), 0, &data, IomapOpFlags::default()).unwrap();
        assert_eq!(
            dev.writes(),
            vec![
                (MIB, MIB),
                (2 * MIB, MIB),
                (3 * MIB, MIB),
                (4 * MIB, 8 * KIB)
            ]
        );
        assert_eq!(fs.begins.lock().len(), 1, "one mapping, several requests");
        dev.clear_log();
        assert_eq!(read(&fs, &dev, 0, len as usize), data);
        assert_eq!(dev.requests().len(), 4);
        assert!(dev.requests().iter().all(|r| matches!(r,
            Req::Read { len, .. } if *len <= DIO_MAX_REQUEST_BYTES)));
    }

    #[test]
    fn unallocated_mapping_for_a_write_is_a_bad_mapping() {
        for kind in [IomapKind::Hole, IomapKind::Delalloc, IomapKind::Inline] {
            let dev = TestDev::new(MIB as usize, 512);
            let map = Iomap {
                offset: 0,
                length: BS,
                kind,
                addr: 0,
                flags: IomapFlags::EMPTY,
            };
            let fs = ScriptedFs::new(BS as u32, 0, vec![map]);
            let err = dio_write(&fs, &dev, &(), 0, &[1; 4096], IomapOpFlags::default());
            assert!(
                matches!(err, Err(IomapError::BadMapping { pos: 0, .. })),
                "{err:?}"
            );
            assert!(dev.requests().is_empty());
            assert!(fs.end_ios.lock().is_empty());
            assert_eq!(*fs.ends.lock(), 1);
        }
    }

    #[test]
    fn inconsistent_mappings_are_bad_mappings() {
        let m = |offset, length, kind, addr, flags| Iomap {
            offset,
            length,
            kind,
            addr,
            flags,
        };
        let none = IomapFlags::EMPTY;
        let cases = [
            // Copy-on-write is not implemented: writing in place is wrong.
            m(0, BS, IomapKind::Mapped, 0, IomapFlags::SHARED),
            // Does not contain the offset.
            m(BS, BS, IomapKind::Mapped, 0, none),
            // Empty.
            m(0, 0, IomapKind::Mapped, 0, none),
            // Device address not aligned to the logical block.
            m(0, BS, IomapKind::Mapped, 100, none),
            // Device address overflows.
            m(0, BS, IomapKind::Mapped, u64::MAX - 10, none),
            // A new mapping starting inside the block of the write's head.
            m(1024, BS, IomapKind::Unwritten, 0, IomapFlags::NEW),
        ];
        for map in cases {
            let dev = TestDev::new(MIB as usize, 512);
            let fs = ScriptedFs::new(BS as u32, 0, vec![map]);
            let pos = if map.offset == 1024 { 2048 } else { 0 };
            let err = dio_write(&fs, &dev, &(), pos, &[1; 512], IomapOpFlags::default());
            assert!(
                matches!(err, Err(IomapError::BadMapping { .. })),
                "{map:?}: {err:?}"
            );
            let mut buf = [0u8; 512];
            let fs = ScriptedFs::new(BS as u32, 0, vec![map]);
            if map.offset != 1024 && !map.flags.contains(IomapFlags::SHARED) {
                let err = dio_read(&fs, &dev, &(), 0, &mut buf, IomapOpFlags::READ);
                assert!(
                    matches!(err, Err(IomapError::BadMapping { .. })),
                    "{map:?}: {err:?}"
                );
            }
            assert!(dev.requests().is_empty(), "{map:?}");
        }
    }

    /// Zeroing may not reach into a block that another mapping covers
    /// partly: a new mapping whose span starts inside a block, away from the
    /// write's start, is rejected (the data before it in that block was just
    /// written by this very write).
    #[test]
    fn zeroing_mapping_starting_mid_block_inside_the_write_is_rejected() {
        let dev = TestDev::new(MIB as usize, 512);
        let none = IomapFlags::EMPTY;
        let maps = vec![
            Iomap {
                offset: 0,
                length: 512,
                kind: IomapKind::Mapped,
                addr: 0,
                flags: none,
            },
            Iomap {
                offset: 512,
                length: BS - 512,
                kind: IomapKind::Unwritten,
                addr: 512,
                flags: IomapFlags::NEW,
            },
        ];
        let fs = ScriptedFs::new(BS as u32, BS, maps);
        let err = dio_write(&fs, &dev, &(), 0, &[1; 1024], IomapOpFlags::default());
        assert!(
            matches!(err, Err(IomapError::BadMapping { pos: 512, .. })),
            "{err:?}"
        );
        // The first mapping's 512 bytes were written and completed.
        assert_eq!(dev.writes(), vec![(0, 512)]);
        assert_eq!(*fs.end_ios.lock(), vec![(0, 512, DioEndFlags::default())]);
    }

    #[test]
    fn empty_write_asks_nothing_and_completes_nothing() {
        let (dev, fs) = setup(512, 8);
        let out = dio_write(&fs, &dev, &(), 4096, &[], IomapOpFlags::default()).unwrap();
        assert_eq!(out.written, 0);
        assert!(out.pure_overwrite);
        assert!(fs.begins.lock().is_empty() && fs.end_ios().is_empty());
        let n = dio_read(&fs, &dev, &(), 4096, &mut [], IomapOpFlags::READ).unwrap();
        assert_eq!(n, 0);
        assert!(dev.requests().is_empty());
    }

    #[test]
    fn device_error_on_read_reports_file_offset() {
        let (dev, fs) = setup(512, 8);
        dev.fail_reads();
        fs.set(1, Block::Mapped(MIB));
        let mut buf = vec![0u8; 2 * BS as usize];
        let err = dio_read(&fs, &dev, &(), 0, &mut buf, IomapOpFlags::READ);
        assert!(
            matches!(err, Err(IomapError::Device { file_offset, .. }) if file_offset == BS),
            "{err:?}"
        );
        fs.assert_begin_end_paired();
        assert_eq!(fs.ends.lock().last(), Some(&(BS, BS, 0)));
    }

    #[test]
    fn simple_read_asks_no_mapping_and_sends_one_request() {
        let dev = TestDev::new(MIB as usize * 4, 512);
        let fs = FakeFs::new(BS as u32, 8, MIB);
        fs.set(1, Block::Mapped(2 * MIB));
        fs.set(2, Block::Unwritten(3 * MIB));
        fs.set_size(4 * BS);
        dev.poke(2 * MIB + 512, &[7u8; 1024]);
        dev.clear_log();
        let mut buf = vec![0u8; 1024];
        let n = dio_read_simple(&fs, &dev, &(), BS + 512, &mut buf)
            .expect("one mapped block inside EOF qualifies")
            .unwrap();
        assert_eq!(n, 1024);
        assert_eq!(buf, vec![7u8; 1024]);
        assert!(
            fs.begins.lock().is_empty(),
            "the fast path iterated mappings"
        );
        assert_eq!(dev.requests().len(), 1);
        // Anything else falls back untouched: unwritten, a hole, crossing a
        // block, past EOF, unaligned, longer than a block.
        let mut two = vec![0u8; 2 * BS as usize];
        let mut small = vec![0u8; 512];
        let mut odd = vec![0u8; 100];
        assert!(dio_read_simple(&fs, &dev, &(), 2 * BS, &mut small).is_none());
        assert!(dio_read_simple(&fs, &dev, &(), 0, &mut small).is_none());
        assert!(dio_read_simple(&fs, &dev, &(), 2 * BS - 512, &mut buf).is_none());
        assert!(dio_read_simple(&fs, &dev, &(), 4 * BS, &mut small).is_none());
        assert!(dio_read_simple(&fs, &dev, &(), BS, &mut odd).is_none());
        assert!(dio_read_simple(&fs, &dev, &(), BS, &mut two).is_none());
        assert_eq!(dev.requests().len(), 1, "a refused simple read sent I/O");
    }
}
