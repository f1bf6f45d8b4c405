//! Writing zeros: to a device range, or to the written parts of a file range.
//!
//! Zeroing is how the engine keeps invariant 1 (no stale data) when only part
//! of a file-system block receives data: a new or unwritten block is converted
//! whole at completion, so every byte of it that the write does not cover must
//! be zero on the device first. The file system uses the same helpers when
//! truncate or hole punching leaves a partial block.

use blockdev::{BlockDevice, DeviceError, WriteMode};

use crate::align::{align_down, is_aligned};
use crate::iter::IomapIter;
use crate::{IomapError, IomapKind, IomapOpFlags, IomapOps};

/// Largest zero-filled write request, in bytes. Zeros come from one static
/// buffer of this size, so zeroing allocates nothing.
pub const ZERO_REQUEST_BYTES: usize = 64 << 10;

/// Alignment of the zero buffer: a page, so backends that need aligned memory
/// for `O_DIRECT` do not bounce it.
#[repr(C, align(4096))]
struct ZeroBuf([u8; ZERO_REQUEST_BYTES]);

static ZEROES: ZeroBuf = ZeroBuf([0; ZERO_REQUEST_BYTES]);

/// Writes zeros to device bytes `[dev_addr, dev_addr + len)`, in requests of
/// at most [`ZERO_REQUEST_BYTES`]. The range must be aligned to the device's
/// logical block size (the device rejects it otherwise).
///
/// On error, some leading part of the range may already be zero.
pub fn zero_range(dev: &dyn BlockDevice, dev_addr: u64, len: u64) -> Result<(), DeviceError> {
    let lbs = dev.caps().logical_block_size.max(1) as usize;
    // Each request must stay a multiple of the logical block size.
    let chunk = align_down(ZERO_REQUEST_BYTES as u64, lbs as u64) as usize;
    if chunk == 0 {
        // A logical block larger than the static buffer: no such devices
        // exist today, but a hostile image or a bad probe must not panic.
        let zeros = vec![0u8; lbs];
        return zero_range_with(dev, dev_addr, len, &zeros);
    }
    zero_range_with(dev, dev_addr, len, &ZEROES.0[..chunk])
}

fn zero_range_with(
    dev: &dyn BlockDevice,
    dev_addr: u64,
    len: u64,
    zeros: &[u8],
) -> Result<(), DeviceError> {
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(zeros.len() as u64) as usize;
        dev.write_at(&zeros[..n], dev_addr + done, WriteMode::Normal)?;
        done += n as u64;
    }
    Ok(())
}

/// Makes file bytes `[pos, pos + len)` read as zeros, at any byte offset and
/// length: the parts backed by written (`Mapped`) space are overwritten with
/// zeros on the device; holes, unwritten and delalloc space already read as
/// zeros and are left alone. Partial device blocks at the edges are
/// read-modify-written.
///
/// For truncate and hole punching of partial blocks. `begin` is called with
/// `ZERO | DIRECT` and without `WRITE`, so nothing is allocated. The caller
/// holds the inode's I/O lock exclusive and has drained direct I/O (the
/// read-modify-write would otherwise race a concurrent write to the same
/// device block).
pub fn zero_file_range<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    len: u64,
) -> Result<(), O::Error> {
    let lbs = dev.caps().logical_block_size.max(1);
    let flags = IomapOpFlags::ZERO | IomapOpFlags::DIRECT;
    let mut iter = IomapIter::new(ops, inode, pos, len, flags, lbs)?;
    while let Some(span) = iter.begin()? {
        let result = match span.iomap.kind {
            IomapKind::Hole | IomapKind::Unwritten | IomapKind::Delalloc => Ok(()),
            IomapKind::Mapped => match span.device_addr_of(span.pos) {
                Some(dev_addr) => zero_unaligned(dev, span.pos, dev_addr, span.len),
                None => Err(IomapError::BadMapping {
                    pos: span.pos,
                    reason: format!("device address of {:?} overflows", span.iomap),
                }),
            },
            IomapKind::Inline => Err(IomapError::BadMapping {
                pos: span.pos,
                reason: "inline data cannot be zeroed on the device".into(),
            }),
        };
        match result {
            Ok(()) => iter.end(&span, span.len)?,
            Err(e) => {
                // Report nothing done: which prefix is zero is unknown.
                let _ = iter.end(&span, 0);
                return Err(e.into());
            }
        }
    }
    Ok(())
}

/// Before the size grows to cover `new_start` or beyond: zeros the tail of
/// the current EOF block up to `new_start`. Those bytes read as zeros today
/// only because reads stop at EOF; on the device they may hold data of a
/// write whose size change was lost in a crash, or of a truncate. The
/// caller holds the inode's I/O lock exclusive with direct I/O drained.
pub fn zero_eof_gap<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    new_start: u64,
) -> Result<(), O::Error> {
    let size = ops.size(inode)?;
    let block = u64::from(ops.block_size().max(1));
    let end = new_start.min(size.next_multiple_of(block));
    if end <= size {
        return Ok(());
    }
    zero_file_range(ops, dev, inode, size, end - size)
}

/// Zeros device bytes `[dev_addr, dev_addr + len)` at any byte alignment,
/// reading and rewriting partial logical blocks at the edges. `file_offset`
/// (the file byte at `dev_addr`) is only for error reports.
fn zero_unaligned(
    dev: &dyn BlockDevice,
    file_offset: u64,
    dev_addr: u64,
    len: u64,
) -> Result<(), IomapError> {
    let lbs = u64::from(dev.caps().logical_block_size.max(1));
    let end = dev_addr
        .checked_add(len)
        .ok_or_else(|| IomapError::BadMapping {
            pos: file_offset,
            reason: "device range overflows".into(),
        })?;
    let file_of = |d: u64| file_offset + (d - dev_addr);
    let device_err = |d: u64| {
        let file_offset = file_of(d);
        move |source| IomapError::Device {
            file_offset,
            source,
        }
    };
    let mut d = dev_addr;
    // Leading partial block.
    if !is_aligned(d, lbs) {
        let block = align_down(d, lbs);
        let upto = end.min(block + lbs);
        zero_in_block(dev, block, (d - block) as usize, (upto - block) as usize)
            .map_err(device_err(d))?;
        d = upto;
    }
    // Whole blocks.
    let whole_end = align_down(end, lbs);
    if whole_end > d {
        zero_range(dev, d, whole_end - d).map_err(device_err(d))?;
        d = whole_end;
    }
    // Trailing partial block.
    if d < end {
        zero_in_block(dev, d, 0, (end - d) as usize).map_err(device_err(d))?;
    }
    Ok(())
}

/// Read-modify-write of one logical block at `block`, zeroing bytes
/// `[from, to)` of it.
fn zero_in_block(
    dev: &dyn BlockDevice,
    block: u64,
    from: usize,
    to: usize,
) -> Result<(), DeviceError> {
    let mut buf = vec![0u8; dev.caps().logical_block_size.max(1) as usize];
    dev.read_at(&mut buf, block)?;
    buf[from..to].fill(0);
    dev.write_at(&buf, block, WriteMode::Normal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{Block, FakeFs, Req, TestDev, BS, STALE};

    #[test]
    fn zero_range_writes_bounded_chunks_and_nothing_else() {
        let dev = TestDev::new(1 << 20, 512);
        dev.fill(STALE);
        let len = 200 * 1024;
        zero_range(&dev, BS, len).unwrap();
        let chunk = ZERO_REQUEST_BYTES as u64;
        assert_eq!(
            dev.writes(),
            vec![
                (BS, chunk),
                (BS + chunk, chunk),
                (BS + 2 * chunk, chunk),
                (BS + 3 * chunk, len - 3 * chunk)
            ]
        );
        assert!(dev.bytes(BS, len as usize).iter().all(|&b| b == 0));
        assert_eq!(dev.bytes(BS - 1, 1), vec![STALE]);
        assert_eq!(dev.bytes(BS + len, 1), vec![STALE]);
    }

    #[test]
    fn zero_range_rejects_unaligned_device_ranges() {
        let dev = TestDev::new(1 << 20, 512);
        assert!(matches!(
            zero_range(&dev, 100, 512),
            Err(DeviceError::Unaligned { .. })
        ));
    }

    /// Truncate-style zeroing at byte granularity: written blocks are zeroed
    /// (partial device blocks read-modify-written), unwritten space and
    /// holes are left alone, and nothing is allocated.
    #[test]
    fn zero_file_range_zeroes_only_written_space() {
        let dev = TestDev::new(1 << 20, 512);
        dev.fill(STALE);
        let fs = FakeFs::new(BS as u32, 8, 1 << 19);
        let (a, b, c) = (16 * BS, 32 * BS, 48 * BS);
        fs.set(0, Block::Mapped(a));
        fs.set(1, Block::Unwritten(b));
        fs.set(2, Block::Hole);
        fs.set(3, Block::Mapped(c));
        // File bytes [1000, 3 * BS + 100).
        zero_file_range(&fs, &dev, &(), 1000, 3 * BS + 100 - 1000).unwrap();

        let block_a = dev.bytes(a, BS as usize);
        assert!(block_a[..1000].iter().all(|&x| x == STALE));
        assert!(block_a[1000..].iter().all(|&x| x == 0));
        assert!(dev.bytes(b, BS as usize).iter().all(|&x| x == STALE));
        let block_c = dev.bytes(c, BS as usize);
        assert!(block_c[..100].iter().all(|&x| x == 0));
        assert!(block_c[100..].iter().all(|&x| x == STALE));
        assert_eq!(
            dev.requests(),
            vec![
                Req::Read {
                    off: a + 512,
                    len: 512
                },
                Req::Write {
                    off: a + 512,
                    len: 512
                },
                Req::Write {
                    off: a + 1024,
                    len: BS - 1024
                },
                Req::Read { off: c, len: 512 },
                Req::Write { off: c, len: 512 },
            ]
        );
        assert_eq!(fs.block(2), Block::Hole, "zeroing allocates nothing");
        for (_, _, flags, _) in fs.begins.lock().iter() {
            assert_eq!(*flags, IomapOpFlags::ZERO | IomapOpFlags::DIRECT);
        }
        fs.assert_begin_end_paired();
    }

    #[test]
    fn zero_file_range_inside_one_device_block() {
        let dev = TestDev::new(1 << 20, 512);
        dev.fill(STALE);
        let fs = FakeFs::new(BS as u32, 8, 1 << 19);
        fs.set(0, Block::Mapped(BS));
        zero_file_range(&fs, &dev, &(), 100, 100).unwrap();
        let bytes = dev.bytes(BS, 512);
        assert!(bytes[..100].iter().all(|&x| x == STALE));
        assert!(bytes[100..200].iter().all(|&x| x == 0));
        assert!(bytes[200..].iter().all(|&x| x == STALE));
        assert_eq!(dev.requests().len(), 2);
    }

    #[test]
    fn zero_file_range_reports_device_errors_with_file_offset() {
        let dev = TestDev::new(1 << 20, 512);
        let fs = FakeFs::new(BS as u32, 8, 1 << 19);
        fs.set(0, Block::Mapped(BS));
        fs.set(1, Block::Mapped(4 * BS));
        dev.fail_nth_write_from_now(1);
        let err = zero_file_range(&fs, &dev, &(), BS, BS).unwrap_err();
        assert!(
            matches!(err, IomapError::Device { file_offset, .. } if file_offset == BS),
            "{err:?}"
        );
        fs.assert_begin_end_paired();
    }
}
