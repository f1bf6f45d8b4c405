//! Planning a direct I/O: one mapping's span turned into [`DioSegment`]s —
//! device requests of at most [`DIO_MAX_REQUEST_BYTES`], edge zeroing, zero
//! fills — without doing any I/O, so the synchronous and asynchronous
//! engines issue the same requests.

use crate::align::{align_down, align_up, is_aligned};
use crate::iter::IomapSpan;
use crate::{Iomap, IomapError, IomapFlags, IomapKind};

/// Largest device request a direct I/O issues; larger mappings are split.
/// Bounds the latency of one request and the size backends must bounce.
pub const DIO_MAX_REQUEST_BYTES: u64 = 1 << 20;

/// One unit of work a direct I/O needs for part of one mapping.
///
/// `file_offset` locates the bytes in the file (and, for `Read` and `Write`,
/// in the caller's buffer, which starts at the request's position).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DioSegment {
    /// File bytes that read as zeros (hole, unwritten, delalloc): fill the
    /// caller's buffer, no device I/O.
    FillZeroes { file_offset: u64, len: u64 },
    /// Read device bytes into the caller's buffer.
    Read {
        file_offset: u64,
        dev_addr: u64,
        len: u64,
    },
    /// Write the caller's bytes to the device.
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

impl DioSegment {
    pub fn file_offset(&self) -> u64 {
        match *self {
            DioSegment::FillZeroes { file_offset, .. }
            | DioSegment::Read { file_offset, .. }
            | DioSegment::Write { file_offset, .. }
            | DioSegment::WriteZeroes { file_offset, .. } => file_offset,
        }
    }

    pub fn len(&self) -> u64 {
        match *self {
            DioSegment::FillZeroes { len, .. }
            | DioSegment::Read { len, .. }
            | DioSegment::Write { len, .. }
            | DioSegment::WriteZeroes { len, .. } => len,
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

/// The segments of one span, in submission order: head zeroing, data
/// requests, tail zeroing.
#[derive(Clone, Debug)]
pub struct SpanSegments {
    head: Option<DioSegment>,
    body: Body,
    tail: Option<DioSegment>,
}

#[derive(Clone, Debug)]
struct Body {
    op: BodyOp,
    pos: u64,
    end: u64,
    /// Device address of `pos` (unused for `FillZeroes`).
    dev_addr: u64,
    /// Largest request, a multiple of the device logical block size.
    max_request: u64,
    /// Preferred cut points between requests (file-system block size for
    /// writes, so a failed request leaves whole blocks before it).
    cut_align: u64,
}

#[derive(Clone, Copy, Debug)]
enum BodyOp {
    FillZeroes,
    Read,
    Write,
}

impl Iterator for SpanSegments {
    type Item = DioSegment;

    fn next(&mut self) -> Option<DioSegment> {
        if let Some(head) = self.head.take() {
            return Some(head);
        }
        if let Some(seg) = self.body.next() {
            return Some(seg);
        }
        self.tail.take()
    }
}

impl Body {
    fn next(&mut self) -> Option<DioSegment> {
        if self.pos >= self.end {
            return None;
        }
        let file_offset = self.pos;
        let cut = match self.op {
            // Memory fills have no size limit.
            BodyOp::FillZeroes => self.end,
            BodyOp::Read | BodyOp::Write => {
                if self.end - self.pos <= self.max_request {
                    self.end
                } else {
                    let limit = self.pos + self.max_request;
                    let aligned = align_down(limit, self.cut_align);
                    if aligned > self.pos {
                        aligned
                    } else {
                        limit
                    }
                }
            }
        };
        let len = cut - self.pos;
        let dev_addr = self.dev_addr;
        self.pos = cut;
        self.dev_addr += len;
        Some(match self.op {
            BodyOp::FillZeroes => DioSegment::FillZeroes { file_offset, len },
            BodyOp::Read => DioSegment::Read {
                file_offset,
                dev_addr,
                len,
            },
            BodyOp::Write => DioSegment::Write {
                file_offset,
                dev_addr,
                len,
            },
        })
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
pub fn read_segments(span: &IomapSpan, lbs: u32) -> Result<SpanSegments, IomapError> {
    let lbs = u64::from(lbs.max(1));
    let op = match span.iomap.kind {
        IomapKind::Hole | IomapKind::Unwritten | IomapKind::Delalloc => BodyOp::FillZeroes,
        IomapKind::Mapped => BodyOp::Read,
        IomapKind::Inline => {
            return Err(bad(
                span.pos,
                "inline data is not supported by direct I/O".into(),
            ))
        }
    };
    Ok(SpanSegments {
        head: None,
        body: Body {
            op,
            pos: span.pos,
            end: span.end(),
            dev_addr: device_addr(span, span.pos)?,
            max_request: max_request(lbs),
            cut_align: lbs,
        },
        tail: None,
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
) -> Result<SpanSegments, IomapError> {
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
            head = Some(DioSegment::WriteZeroes {
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
            tail = Some(DioSegment::WriteZeroes {
                file_offset: end,
                dev_addr: device_addr(span, end)?,
                len: block_end - end,
            });
        }
    }
    Ok(SpanSegments {
        head,
        body: Body {
            op: BodyOp::Write,
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
                DioSegment::WriteZeroes {
                    file_offset: 0,
                    dev_addr: 8 * MIB,
                    len: 512
                },
                DioSegment::Write {
                    file_offset: 512,
                    dev_addr: 8 * MIB + 512,
                    len: MIB - 512
                },
                DioSegment::Write {
                    file_offset: MIB,
                    dev_addr: 9 * MIB,
                    len: MIB
                },
                DioSegment::Write {
                    file_offset: 2 * MIB,
                    dev_addr: 10 * MIB,
                    len: 512
                },
                DioSegment::WriteZeroes {
                    file_offset: 2 * MIB + 512,
                    dev_addr: 10 * MIB + 512,
                    len: BS - 512
                },
            ]
        );
    }
}
