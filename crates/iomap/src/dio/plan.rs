//! Planning a direct I/O: one mapping's span turned into [`ReadSegment`]s or
//! [`WriteSegment`]s —
//! device requests of at most [`DIO_MAX_REQUEST_BYTES`], edge zeroing, zero
//! fills — without doing any I/O, so the synchronous and asynchronous
//! engines issue the same requests.

use crate::align::{align_down, align_up, is_aligned};
use crate::iter::IomapSpan;
use crate::{Iomap, IomapError, IomapFlags, IomapKind};

/// Largest device request a direct I/O issues; larger mappings are split.
/// Bounds the latency of one request and the size backends must bounce.
pub const DIO_MAX_REQUEST_BYTES: u64 = 1 << 20;

/// One unit of work a direct read needs for part of one mapping.
///
/// `file_offset` locates the bytes in the file and in the caller's buffer,
/// which starts at the request's position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadSegment {
    /// File bytes that read as zeros (hole, unwritten, delalloc): fill the
    /// caller's buffer, no device I/O.
    FillZeroes { file_offset: u64, len: u64 },
    /// Read device bytes into the caller's buffer.
    Read {
        file_offset: u64,
        dev_addr: u64,
        len: u64,
    },
}

/// One unit of work a direct write needs for part of one mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteSegment {
    /// Write the caller's bytes (from `file_offset`, located in the
    /// caller's buffer as for [`ReadSegment`]) to the device.
    Write {
        file_offset: u64,
        dev_addr: u64,
        len: u64,
    },
    /// Write zeros to the part of a new or unwritten block that the write
    /// does not cover. `file_offset` lies outside the request.
    WriteZeroes {
        file_offset: u64,
        dev_addr: u64,
        len: u64,
    },
}

impl ReadSegment {
    pub fn file_offset(&self) -> u64 {
        match *self {
            ReadSegment::FillZeroes { file_offset, .. } | ReadSegment::Read { file_offset, .. } => {
                file_offset
            }
        }
    }

    pub fn len(&self) -> u64 {
        match *self {
            ReadSegment::FillZeroes { len, .. } | ReadSegment::Read { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Carries out a `FillZeroes` segment in `buf`, which holds the file
    /// bytes from `pos`; a `Read` is the caller's to issue, and comes back
    /// as `(file_offset, dev_addr, len)`.
    pub fn zero_fill(self, buf: &mut [u8], pos: u64) -> Option<(u64, u64, u64)> {
        match self {
            ReadSegment::FillZeroes { file_offset, len } => {
                let at = (file_offset - pos) as usize;
                buf[at..at + len as usize].fill(0);
                None
            }
            ReadSegment::Read {
                file_offset,
                dev_addr,
                len,
            } => Some((file_offset, dev_addr, len)),
        }
    }
}

impl WriteSegment {
    pub fn file_offset(&self) -> u64 {
        match *self {
            WriteSegment::Write { file_offset, .. }
            | WriteSegment::WriteZeroes { file_offset, .. } => file_offset,
        }
    }

    pub fn len(&self) -> u64 {
        match *self {
            WriteSegment::Write { len, .. } | WriteSegment::WriteZeroes { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A write to this mapping must zero the uncovered parts of its edge blocks:
/// the blocks read as zeros now (unwritten) or hold garbage (new), and
/// completion makes the whole block readable.
pub fn needs_zeroing(iomap: &Iomap) -> bool {
    iomap.kind == IomapKind::Unwritten || iomap.flags.contains(IomapFlags::NEW)
}

/// The segments of one span's direct read, in file order.
///
/// A read has no edge work, so unlike [`WriteSegments`] this holds no
/// optional head or tail. An absent one (`None`) leaves its payload bytes
/// uninitialised, and with `read_segments` not inlined (it has three
/// callers) LLVM hoisted the `buf[at..at + len]` check of the tail's
/// payload out of `read_span`'s loop and chose between two copies of the
/// loop by it: harmless, as both copies look at the tail's discriminant
/// before the result matters, but memcheck reports that jump as depending
/// on uninitialised values (the C API valgrind test).
#[derive(Clone, Debug)]
pub struct ReadSegments {
    /// The span reads as zeros: one fill, no device address.
    zeros: bool,
    body: Body,
}

/// The segments of one span's direct write, in submission order: head
/// zeroing, data requests, tail zeroing.
#[derive(Clone, Debug)]
pub struct WriteSegments {
    head: Option<WriteSegment>,
    body: Body,
    tail: Option<WriteSegment>,
}

/// The requests a span's bytes are cut into: `(file_offset, dev_addr, len)`.
#[derive(Clone, Debug)]
struct Body {
    pos: u64,
    end: u64,
    /// Device address of `pos` (unused for zero fills).
    dev_addr: u64,
    /// Largest request, a multiple of the device logical block size
    /// (`u64::MAX` for memory fills, which have no size limit).
    max_request: u64,
    /// Preferred cut points between requests (file-system block size for
    /// writes, so a failed request leaves whole blocks before it).
    cut_align: u64,
}

impl Iterator for ReadSegments {
    type Item = ReadSegment;

    fn next(&mut self) -> Option<ReadSegment> {
        let (file_offset, dev_addr, len) = self.body.next()?;
        Some(if self.zeros {
            ReadSegment::FillZeroes { file_offset, len }
        } else {
            ReadSegment::Read {
                file_offset,
                dev_addr,
                len,
            }
        })
    }
}

impl Iterator for WriteSegments {
    type Item = WriteSegment;

    fn next(&mut self) -> Option<WriteSegment> {
        if let Some(head) = self.head.take() {
            return Some(head);
        }
        if let Some((file_offset, dev_addr, len)) = self.body.next() {
            return Some(WriteSegment::Write {
                file_offset,
                dev_addr,
                len,
            });
        }
        self.tail.take()
    }
}

impl Body {
    fn next(&mut self) -> Option<(u64, u64, u64)> {
        if self.pos >= self.end {
            return None;
        }
        let file_offset = self.pos;
        let cut = if self.end - self.pos <= self.max_request {
            self.end
        } else {
            let limit = self.pos + self.max_request;
            let aligned = align_down(limit, self.cut_align);
            if aligned > self.pos {
                aligned
            } else {
                limit
            }
        };
        let len = cut - self.pos;
        let dev_addr = self.dev_addr;
        self.pos = cut;
        self.dev_addr += len;
        Some((file_offset, dev_addr, len))
    }
}

/// Largest request that is a multiple of the device logical block size.
fn max_request(lbs: u64) -> u64 {
    align_down(DIO_MAX_REQUEST_BYTES, lbs).max(lbs)
}

fn bad(pos: u64, reason: String) -> IomapError {
    IomapError::BadMapping { pos, reason }
}

/// Plans the direct read of `span`. `lbs` is the device logical block size.
pub fn read_segments(span: &IomapSpan, lbs: u32) -> Result<ReadSegments, IomapError> {
    let lbs = u64::from(lbs.max(1));
    let zeros = match span.iomap.kind {
        IomapKind::Hole | IomapKind::Unwritten | IomapKind::Delalloc => true,
        IomapKind::Mapped => false,
        IomapKind::Inline => {
            return Err(bad(
                span.pos,
                "inline data is not supported by direct I/O".into(),
            ))
        }
    };
    Ok(ReadSegments {
        zeros,
        body: Body {
            pos: span.pos,
            end: span.end(),
            dev_addr: device_addr(span, span.pos)?,
            max_request: if zeros { u64::MAX } else { max_request(lbs) },
            cut_align: lbs,
        },
    })
}

/// Plans the direct write of `span`, part of a write of file bytes
/// `[req_pos, req_end)`. `block_size` is the file-system block size, a
/// multiple of the device logical block size `lbs`.
///
/// If the mapping is new or unwritten and the span starts or ends inside a
/// file-system block, the rest of that block is zeroed. A block is contiguous
/// on the device, so its uncovered part is reached from the span's address
/// even when the file system clipped the mapping to the request. That is only
/// safe at the request's own edges, and only if no other mapping starts or
/// ends inside the block; anything else is a bad mapping.
pub fn write_segments(
    span: &IomapSpan,
    req_pos: u64,
    req_end: u64,
    block_size: u32,
    lbs: u32,
) -> Result<WriteSegments, IomapError> {
    let iomap = &span.iomap;
    let lbs = u64::from(lbs.max(1));
    let bs = u64::from(block_size);
    match iomap.kind {
        IomapKind::Mapped | IomapKind::Unwritten => {}
        kind => {
            return Err(bad(
                span.pos,
                format!("{kind:?} mapping for a direct write (must be allocated)"),
            ))
        }
    }
    if iomap.flags.contains(IomapFlags::SHARED) {
        // Writing in place would change the other owners' data too.
        return Err(bad(
            span.pos,
            format!("shared mapping {iomap:?}: copy-on-write is not supported"),
        ));
    }
    let mut head = None;
    let mut tail = None;
    if needs_zeroing(iomap) && bs > 0 {
        let start = span.pos;
        if !is_aligned(start, bs) {
            let block = align_down(start, bs);
            if start != req_pos || (iomap.offset > block && iomap.offset != start) {
                return Err(bad(
                    start,
                    format!("mapping {iomap:?} starts inside a {bs}-byte block"),
                ));
            }
            head = Some(WriteSegment::WriteZeroes {
                file_offset: block,
                dev_addr: device_addr(span, block)?,
                len: start - block,
            });
        }
        let end = span.end();
        if !is_aligned(end, bs) {
            let Some(block_end) = align_up(end, bs) else {
                return Err(bad(end, "block end overflows".into()));
            };
            let map_end = iomap.end();
            if end != req_end || (map_end < block_end && map_end != end) {
                return Err(bad(
                    end,
                    format!("mapping {iomap:?} ends inside a {bs}-byte block"),
                ));
            }
            device_addr(span, block_end)?;
            tail = Some(WriteSegment::WriteZeroes {
                file_offset: end,
                dev_addr: device_addr(span, end)?,
                len: block_end - end,
            });
        }
    }
    Ok(WriteSegments {
        head,
        body: Body {
            pos: span.pos,
            end: span.end(),
            dev_addr: device_addr(span, span.pos)?,
            max_request: max_request(lbs),
            cut_align: bs.max(lbs),
        },
        tail,
    })
}

fn device_addr(span: &IomapSpan, pos: u64) -> Result<u64, IomapError> {
    match span.iomap.kind {
        IomapKind::Mapped | IomapKind::Unwritten => span
            .device_addr_of(pos)
            .ok_or_else(|| bad(pos, format!("device address of {:?} overflows", span.iomap))),
        _ => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{BS, MIB};

    #[test]
    fn write_plan_orders_head_data_tail() {
        let span = IomapSpan {
            iomap: Iomap {
                offset: 0,
                length: 4 * MIB,
                kind: IomapKind::Unwritten,
                addr: 8 * MIB,
                flags: IomapFlags::NEW,
            },
            pos: 512,
            len: 2 * MIB,
        };
        let segs: Vec<_> = write_segments(&span, 512, 512 + 2 * MIB, 4096, 512)
            .unwrap()
            .collect();
        assert_eq!(
            segs,
            vec![
                WriteSegment::WriteZeroes {
                    file_offset: 0,
                    dev_addr: 8 * MIB,
                    len: 512
                },
                WriteSegment::Write {
                    file_offset: 512,
                    dev_addr: 8 * MIB + 512,
                    len: MIB - 512
                },
                WriteSegment::Write {
                    file_offset: MIB,
                    dev_addr: 9 * MIB,
                    len: MIB
                },
                WriteSegment::Write {
                    file_offset: 2 * MIB,
                    dev_addr: 10 * MIB,
                    len: 512
                },
                WriteSegment::WriteZeroes {
                    file_offset: 2 * MIB + 512,
                    dev_addr: 10 * MIB + 512,
                    len: BS - 512
                },
            ]
        );
    }
}
