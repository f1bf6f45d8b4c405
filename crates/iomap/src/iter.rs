//! Walking a file range one mapping at a time.
//!
//! [`IomapIter`] is the only place that calls [`IomapOps::begin`] and
//! [`IomapOps::end`] for the engines. It asks for the mapping at the current
//! position, checks that the answer is usable (a file system bug must become
//! an error, never out-of-bounds I/O), hands the engine the part of the
//! mapping the request covers, and advances by what the engine reports done.
//! It does no I/O itself, so synchronous and asynchronous submission share
//! it.

use crate::align::is_aligned;
use crate::{Iomap, IomapError, IomapKind, IomapOpFlags, IomapOps};

/// The part of one mapping that a request covers: file bytes
/// `[pos, pos + len)`, all inside `iomap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IomapSpan {
    pub iomap: Iomap,
    pub pos: u64,
    pub len: u64,
}

impl IomapSpan {
    pub fn end(&self) -> u64 {
        self.pos + self.len
    }

    /// Device byte address of file byte `pos`. Unlike
    /// [`Iomap::device_addr`], `pos` may lie outside the mapping, as long as
    /// it is in a file-system block the mapping touches: a block is
    /// contiguous on the device, so edge zeroing can reach the parts of a
    /// block that a clipped mapping leaves out. Only meaningful for `Mapped`
    /// and `Unwritten`. `None` on address overflow (checked by the caller's
    /// bounds).
    pub fn device_addr_of(&self, pos: u64) -> Option<u64> {
        if pos >= self.iomap.offset {
            self.iomap.addr.checked_add(pos - self.iomap.offset)
        } else {
            self.iomap.addr.checked_sub(self.iomap.offset - pos)
        }
    }
}

/// Iterates the mappings of file bytes `[pos, pos + len)`.
///
/// Use: `while let Some(span) = iter.begin()? { ...I/O...; iter.end(&span, done)?; }`.
/// Every `begin` that returns a span must be followed by exactly one `end`
/// for it, also when the I/O failed (with the bytes that were done), so the
/// file system can release what it reserved.
pub struct IomapIter<'a, O: IomapOps> {
    ops: &'a O,
    inode: &'a O::Inode,
    start: u64,
    pos: u64,
    end: u64,
    flags: IomapOpFlags,
    /// Device I/O unit: device addresses of mapped bytes must be aligned to it.
    alignment: u64,
    /// A span returned by `begin` and not yet ended.
    open: bool,
}

impl<'a, O: IomapOps> IomapIter<'a, O> {
    /// `alignment` is the device's logical block size: every mapping that
    /// the request crosses must keep device addresses aligned to it.
    pub fn new(
        ops: &'a O,
        inode: &'a O::Inode,
        pos: u64,
        len: u64,
        flags: IomapOpFlags,
        alignment: u32,
    ) -> Result<Self, IomapError> {
        let end = pos.checked_add(len).ok_or_else(|| IomapError::BadMapping {
            pos,
            reason: format!("range of {len} bytes overflows the file offset space"),
        })?;
        Ok(IomapIter {
            ops,
            inode,
            start: pos,
            pos,
            end,
            flags,
            alignment: u64::from(alignment.max(1)),
            open: false,
        })
    }

    /// Next file byte to map.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// Bytes done so far (the sum of `done` passed to [`Self::end`]).
    pub fn processed(&self) -> u64 {
        self.pos - self.start
    }

    /// The op flags passed to every `begin`.
    pub fn flags(&self) -> IomapOpFlags {
        self.flags
    }

    /// Asks the file system for the mapping at the current position; `None`
    /// when the whole range has been processed. Errors from `begin` (such as
    /// `WouldBlock`) are returned unchanged.
    pub fn begin(&mut self) -> Result<Option<IomapSpan>, O::Error> {
        debug_assert!(!self.open, "IomapIter::begin without end");
        if self.pos >= self.end {
            return Ok(None);
        }
        let iomap = self
            .ops
            .begin(self.inode, self.pos, self.end - self.pos, self.flags)?;
        let span = self.check(iomap)?;
        self.open = true;
        Ok(Some(span))
    }

    /// The I/O for `span` is finished after `done` bytes (`done <
    /// span.len` on failure: the iteration then stops). Calls
    /// [`IomapOps::end`] and advances.
    pub fn end(&mut self, span: &IomapSpan, done: u64) -> Result<(), O::Error> {
        debug_assert!(self.open, "IomapIter::end without begin");
        debug_assert_eq!(span.pos, self.pos);
        debug_assert!(done <= span.len);
        let done = done.min(span.len);
        self.open = false;
        self.pos += done;
        if done < span.len {
            // Nothing after a short span may be done: the processed bytes
            // must stay one contiguous run from the start.
            self.end = self.pos;
        }
        self.ops.end(
            self.inode,
            span.pos,
            span.len,
            done,
            self.flags,
            &span.iomap,
        )
    }

    /// Validates a mapping from `begin` and clips it to the request.
    fn check(&self, iomap: Iomap) -> Result<IomapSpan, IomapError> {
        let pos = self.pos;
        let bad = |reason: String| IomapError::BadMapping { pos, reason };
        if iomap.length == 0 {
            return Err(bad(format!("empty mapping {iomap:?}")));
        }
        let Some(map_end) = iomap.offset.checked_add(iomap.length) else {
            return Err(bad(format!("mapping {iomap:?} overflows")));
        };
        if iomap.offset > pos || map_end <= pos {
            return Err(bad(format!(
                "mapping {iomap:?} does not contain the offset"
            )));
        }
        let span_end = map_end.min(self.end);
        let span = IomapSpan {
            iomap,
            pos,
            len: span_end - pos,
        };
        if span_end < self.end && !is_aligned(span_end, self.alignment) {
            return Err(bad(format!(
                "mapping {iomap:?} ends inside a {}-byte device block",
                self.alignment
            )));
        }
        if matches!(iomap.kind, IomapKind::Mapped | IomapKind::Unwritten) {
            let addr = span.device_addr_of(pos);
            if iomap.addr.checked_add(iomap.length).is_none() || addr.is_none() {
                return Err(bad(format!("device address of {iomap:?} overflows")));
            }
            if addr
                .is_some_and(|a| a.checked_rem(self.alignment) != pos.checked_rem(self.alignment))
            {
                return Err(bad(format!(
                    "mapping {iomap:?} is not aligned to the {}-byte device block",
                    self.alignment
                )));
            }
        }
        Ok(span)
    }
}
