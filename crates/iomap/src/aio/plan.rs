//! Planning asynchronous direct I/O: a file read or pure overwrite turned
//! into device requests with owned buffers, for the queue to push. Anything
//! else (allocation, conversion, zeroing) is not planned here: the queue
//! hands it to its completion worker, which takes the synchronous path.

use blockdev::{AlignedBuf, BlockDevice, DeviceRequest};

use crate::dio::read_segments;
use crate::ioend::Durability;
use crate::{IomapError, IomapIter, IomapKind, IomapOpFlags, IomapOps};

/// One device request of a split file request, and where its bytes sit in
/// the caller's buffer.
#[derive(Debug)]
pub struct Part {
    pub buf_offset: usize,
    pub request: DeviceRequest,
}

/// How a read reaches the device.
#[derive(Debug)]
pub enum ReadPlan {
    /// Nothing to read: every byte is a hole, unwritten or past EOF (the
    /// buffer is zeroed there).
    Done(AlignedBuf),
    /// One request straight into the caller's buffer.
    Whole(DeviceRequest),
    /// Parts into buffers of their own, each copied back at its offset into
    /// the caller's buffer (kept here) when it completes.
    Split(AlignedBuf, Vec<Part>),
}

/// How a write reaches the device, when it is a pure overwrite.
#[derive(Debug)]
pub enum WritePlan {
    /// Allocation, conversion, zeroing, an EOF crossing — or, for DSYNC, a
    /// dirty inode: not for the fast path. The buffer comes back untouched.
    NotPure(AlignedBuf),
    /// One request from the caller's buffer.
    Whole(DeviceRequest),
    /// Parts copied out of the caller's buffer (kept here).
    Split(AlignedBuf, Vec<Part>),
}

fn part_buffer(len: usize, align: usize, pos: u64) -> Result<AlignedBuf, IomapError> {
    AlignedBuf::new(len, align).map_err(|e| IomapError::BadMapping {
        pos,
        reason: format!("buffer for a {len}-byte part: {e}"),
    })
}

/// Plans a read of `buf.len()` bytes at `pos` (both aligned to the device's
/// logical block size). Returns the plan and the bytes inside EOF; bytes of
/// the buffer past EOF are zeroed. On error the buffer comes back.
pub fn plan_read<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    mut buf: AlignedBuf,
) -> Result<(ReadPlan, usize), (AlignedBuf, O::Error)> {
    if buf.is_empty() {
        return Ok((ReadPlan::Done(buf), 0));
    }
    // Simple read: one lookup, which also vouches that the buffer lies
    // inside EOF.
    if let Some(addr) = ops.simple_read_addr(inode, pos, buf.len() as u64) {
        let len = buf.len();
        return Ok((
            ReadPlan::Whole(DeviceRequest::Read { offset: addr, buf }),
            len,
        ));
    }
    let size = match ops.size(inode) {
        Ok(size) => size,
        Err(e) => return Err((buf, e)),
    };
    if pos >= size {
        buf.fill(0);
        return Ok((ReadPlan::Done(buf), 0));
    }
    let len = (buf.len() as u64).min(size - pos) as usize;
    let lbs = dev.caps().logical_block_size;
    let align = dev.caps().memory_alignment as usize;
    let aligned_len = (len as u64).next_multiple_of(u64::from(lbs));
    buf[len..].fill(0);
    let mut parts = Vec::new();
    let planned = (|| -> Result<(), O::Error> {
        let mut iter = IomapIter::new(ops, inode, pos, aligned_len, IomapOpFlags::DIRECT, lbs)?;
        while let Some(span) = iter.begin()? {
            for seg in read_segments(&span, lbs)? {
                if let Some((file_offset, dev_addr, len)) = seg.zero_fill(&mut buf, pos) {
                    parts.push(Part {
                        buf_offset: (file_offset - pos) as usize,
                        request: DeviceRequest::Read {
                            offset: dev_addr,
                            buf: part_buffer(len as usize, align, file_offset)?,
                        },
                    });
                }
            }
            iter.end(&span, span.len)?;
        }
        Ok(())
    })();
    // The zero fill may have reached past EOF into the last device block.
    buf[len..].fill(0);
    match planned {
        Err(e) => Err((buf, e)),
        Ok(()) if parts.is_empty() => Ok((ReadPlan::Done(buf), len)),
        Ok(()) => Ok((ReadPlan::Split(buf, parts), len)),
    }
}

/// Plans `buf` at `pos` as a pure overwrite inside EOF: every mapping
/// `Mapped`, and when durability is asked for, none dirty (a dirty inode
/// needs a journal commit). Data goes out as [`Durability::write_mode`]
/// says. The caller holds the inode's shared I/O lock.
pub fn plan_pure_overwrite<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: AlignedBuf,
    durability: Durability,
) -> Result<WritePlan, (AlignedBuf, O::Error)> {
    let dsync = durability != Durability::NotRequired;
    let mut flags = IomapOpFlags::WRITE | IomapOpFlags::DIRECT | IomapOpFlags::OVERWRITE_ONLY;
    if dsync {
        flags |= IomapOpFlags::DSYNC;
    }
    let mode = durability.write_mode();
    let end = pos + buf.len() as u64;
    let mut ranges: Vec<(u64, usize, usize)> = Vec::new();
    let mut cur = pos;
    while cur < end {
        let map = match ops.begin(inode, cur, end - cur, flags) {
            Ok(map) => map,
            Err(e) => return Err((buf, e)),
        };
        if map.kind != IomapKind::Mapped || (dsync && !map.is_pure_overwrite()) {
            return Ok(WritePlan::NotPure(buf));
        }
        if cur == pos && map.end() >= end {
            // One mapping: the caller's buffer goes out as is.
            let request = DeviceRequest::Write {
                offset: map.addr,
                buf,
                mode,
            };
            return Ok(WritePlan::Whole(request));
        }
        ranges.push((map.addr, (cur - pos) as usize, map.length as usize));
        cur = map.end();
    }
    let align = dev.caps().memory_alignment as usize;
    let mut parts = Vec::with_capacity(ranges.len());
    for (dev_addr, at, len) in ranges {
        let mut part = match part_buffer(len, align, pos + at as u64) {
            Ok(part) => part,
            Err(e) => return Err((buf, e.into())),
        };
        part.copy_from_slice(&buf[at..at + len]);
        parts.push(Part {
            buf_offset: at,
            request: DeviceRequest::Write {
                offset: dev_addr,
                buf: part,
                mode,
            },
        });
    }
    Ok(WritePlan::Split(buf, parts))
}
