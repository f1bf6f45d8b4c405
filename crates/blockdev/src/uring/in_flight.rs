//! One request's life in a ring: the submission entries that carry it, what
//! each completion entry means for it, and how its buffer goes back to the
//! caller.
//!
//! # Pieces
//!
//! A read or write larger than the device's largest request
//! ([`RequestLimits`]) goes to the kernel as several pieces, each its own
//! submission entry cut to fit ([`Split`]): the kernel does not split a
//! non-blocking request itself, and would hand the whole of it to a worker
//! thread instead. The caller still sees one request: it completes once,
//! after the kernel has finished with every piece it was given, so the
//! buffer is never handed back (or freed) while a piece may still touch it.
//! A piece that fails fails the whole request, with the error of the failed
//! piece at the lowest device offset, naming that piece's range. No piece
//! starts after a failure, but those started run to their end: pieces start
//! in offset order, so every piece below the reported one was tried whole,
//! and the error does not depend on the order of completions. A flush is
//! one piece without a buffer.
//!
//! The kernel may transfer less than asked, or fail with `EINTR`/`EAGAIN`;
//! neither is an error of the piece, so it is continued from where it
//! stopped, a bounded number of times. This is the only place that reads a
//! completion entry's result.
//!
//! An entry's `user_data` names its request's slot in the queue's table
//! (low 32 bits) and the piece's place in [`InFlight`]'s piece table (high
//! 32 bits).

use std::io;

use io_uring::{opcode, squeue, types};

use super::setup::{DEVICE_FILE, MAX_RETRIES};
use crate::error::IoOp;
use crate::queue::{DeviceCompletion, Token};
use crate::{AlignedBuf, DeviceError, RequestLimits};

/// Most bytes one submission entry transfers. Its length field is 32 bits
/// and the kernel caps one transfer at `MAX_RW_COUNT` (2 GiB less a page)
/// anyway; longer requests go in pieces. A multiple of every logical block
/// size, so each piece stays aligned.
const MAX_BYTES_PER_ENTRY: usize = 1 << 30;

/// Most pieces of one request the kernel has at once; a request of more
/// pieces starts the next as one finishes. Eight 256 KiB pieces carry a
/// 2 MiB folio at once on a device with the smallest common limits.
pub(super) const PIECES_IN_FLIGHT: usize = 8;

/// How a queue cuts requests into pieces the device takes whole.
#[derive(Clone, Copy, Debug)]
pub(super) struct Split {
    limits: RequestLimits,
    page: usize,
    /// Logical block size: every piece is a multiple of it.
    block: usize,
    /// Pieces of one request the kernel may have at once
    /// (`1..=PIECES_IN_FLIGHT`): the ring has room for that many entries
    /// for every request the queue holds.
    budget: usize,
}

impl Split {
    pub(super) fn new(limits: RequestLimits, page: usize, block: usize, budget: usize) -> Split {
        Split {
            limits,
            page: page.max(1),
            block: block.max(1),
            budget: budget.clamp(1, PIECES_IN_FLIGHT),
        }
    }

    /// Length of the piece that starts at memory address `addr` and device
    /// byte `at`, with `rest` bytes of the request left (a multiple of the
    /// block size); `contiguous` if the memory is most likely physically
    /// contiguous (huge pages), so that its pages merge into segments.
    fn piece_len(&self, addr: usize, at: u64, rest: usize, contiguous: bool) -> usize {
        let mut len = rest.min(MAX_BYTES_PER_ENTRY);
        if let Some(max) = self.limits.max_bytes {
            len = len.min(max);
        }
        match (contiguous, self.limits.max_contiguous_bytes) {
            // Where the kernel gave small pages after all, it splits the
            // request itself: slower, still correct.
            (true, Some(max)) => len = len.min(max),
            (true, None) => {}
            (false, _) => {
                if let Some(pages) = self.limits.max_pages {
                    // The first page may be entered part way.
                    len = len.min(pages.saturating_mul(self.page) - addr % self.page);
                }
            }
        }
        if let Some(boundary) = self.limits.boundary_bytes.filter(|&b| b > 0) {
            let on_disk = at.wrapping_add(self.limits.boundary_offset);
            let to_boundary = boundary - on_disk % boundary;
            len = len.min(usize::try_from(to_boundary).unwrap_or(usize::MAX));
        }
        if len < rest {
            len -= len % self.block;
        }
        // A limit below one block: send a block, which the kernel splits
        // (slower, still correct).
        if len == 0 {
            len = self.block.min(rest);
        }
        len
    }
}

/// One request the kernel may be working on.
pub(super) struct InFlight {
    pub(super) token: Token,
    pub(super) op: Op,
    /// Buffer bytes already given to pieces: the next piece starts here.
    next: usize,
    /// Pieces started (a flush is one).
    started: u32,
    /// Pieces not finished, by their number in `user_data`.
    pieces: [Option<Piece>; PIECES_IN_FLIGHT],
    /// Device offset of the failed piece reported, and its error.
    failure: Option<(u64, DeviceError)>,
}

/// A part of a request sent as one submission entry (and continued by more
/// after short transfers).
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Range of the buffer: `start..start + len`.
    start: usize,
    len: usize,
    /// Bytes transferred so far.
    done: usize,
    /// Resubmissions after `EINTR`/`EAGAIN` without progress.
    retries: u32,
    /// An entry for the rest of this piece is in the ring or the kernel.
    /// When false, the piece waits for `next_entry` to send its rest.
    queued: bool,
}

pub(super) enum Op {
    Read {
        offset: u64,
        buf: AlignedBuf,
        /// Aligned stand-in for a `buf` whose memory is misaligned for
        /// direct I/O; copied into `buf` at completion.
        bounce: Option<AlignedBuf>,
        /// Registered-buffer index of `buf` in this ring's table, checked by
        /// `UringQueue::fixed_index` (never set with a bounce).
        fixed: Option<u16>,
    },
    Write {
        offset: u64,
        buf: AlignedBuf,
        /// Aligned copy of a misaligned `buf`.
        bounce: Option<AlignedBuf>,
        fua: bool,
        /// As for reads.
        fixed: Option<u16>,
    },
    Flush,
}

/// The `user_data` of piece `piece` of the request in slot `slot`.
fn user_data(slot: usize, piece: usize) -> u64 {
    ((piece as u64) << 32) | slot as u64
}

/// The slot and piece a completion entry's `user_data` names.
pub(super) fn slot_and_piece(user_data: u64) -> (usize, usize) {
    (
        (user_data & 0xffff_ffff) as usize,
        (user_data >> 32) as usize,
    )
}

impl InFlight {
    pub(super) fn new(token: Token, op: Op) -> InFlight {
        InFlight {
            token,
            op,
            next: 0,
            started: 0,
            pieces: [None; PIECES_IN_FLIGHT],
            failure: None,
        }
    }

    /// The next entry to push for this request, in slot `slot`: the rest of
    /// a piece that stopped short, else a new piece if `split` allows one
    /// more in the kernel. `None` when there is nothing to send now. The
    /// piece counts as queued from here: push the entry, or give it back
    /// with [`refused`](InFlight::refused).
    pub(super) fn next_entry(&mut self, slot: usize, split: &Split) -> Option<squeue::Entry> {
        for number in 0..PIECES_IN_FLIGHT {
            if let Some(piece) = &mut self.pieces[number] {
                if !piece.queued {
                    piece.queued = true;
                    return Some(self.entry(slot, number));
                }
            }
        }
        let in_kernel = self.pieces.iter().flatten().count();
        if self.failure.is_some() || !self.has_unsent() || in_kernel >= split.budget {
            return None;
        }
        let number = self.pieces.iter().position(Option::is_none)?;
        let start = self.next;
        let len = match &self.op {
            Op::Read {
                offset,
                buf,
                bounce,
                ..
            }
            | Op::Write {
                offset,
                buf,
                bounce,
                ..
            } => {
                let memory = bounce.as_ref().unwrap_or(buf);
                let addr = memory.as_ptr() as usize + start;
                let contiguous = memory.is_huge_page_mapping();
                split.piece_len(addr, offset + start as u64, buf.len() - start, contiguous)
            }
            Op::Flush => 0,
        };
        self.next += len;
        self.started += 1;
        self.pieces[number] = Some(Piece {
            start,
            len,
            done: 0,
            retries: 0,
            queued: true,
        });
        Some(self.entry(slot, number))
    }

    /// Whether part of the request was never given to a piece.
    fn has_unsent(&self) -> bool {
        match self.op {
            Op::Flush => self.started == 0,
            _ => self.next < self.io_len(),
        }
    }

    /// The submission entry for the rest of piece `number`.
    fn entry(&mut self, slot: usize, number: usize) -> squeue::Entry {
        let Some(piece) = self.pieces[number] else {
            unreachable!("entry for an empty piece");
        };
        let (from, to) = (piece.start + piece.done, piece.start + piece.len);
        let entry = match &mut self.op {
            Op::Read {
                offset,
                buf,
                bounce,
                fixed,
            } => {
                let target = bounce.as_mut().unwrap_or(buf);
                let rest = &mut target[from..to];
                let len = rest.len() as u32;
                let at = *offset + from as u64;
                match fixed {
                    // The piece lies inside `buf`, which lies inside the
                    // region registered at `index`.
                    Some(index) => {
                        opcode::ReadFixed::new(DEVICE_FILE, rest.as_mut_ptr(), len, *index)
                            .offset(at)
                            .build()
                    }
                    None => opcode::Read::new(DEVICE_FILE, rest.as_mut_ptr(), len)
                        .offset(at)
                        .build(),
                }
            }
            Op::Write {
                offset,
                buf,
                bounce,
                fua,
                fixed,
            } => {
                let source = bounce.as_ref().unwrap_or(buf);
                let rest = &source[from..to];
                let len = rest.len() as u32;
                let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                let at = *offset + from as u64;
                match fixed {
                    Some(index) => opcode::WriteFixed::new(DEVICE_FILE, rest.as_ptr(), len, *index)
                        .offset(at)
                        .rw_flags(flags)
                        .build(),
                    None => opcode::Write::new(DEVICE_FILE, rest.as_ptr(), len)
                        .offset(at)
                        .rw_flags(flags)
                        .build(),
                }
            }
            Op::Flush => opcode::Fsync::new(DEVICE_FILE)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        entry.user_data(user_data(slot, number))
    }

    /// Kind and device offset of a read or write; `None` for a flush.
    fn target(&self) -> Option<(IoOp, u64)> {
        match &self.op {
            Op::Read { offset, .. } => Some((IoOp::Read, *offset)),
            Op::Write { offset, .. } => Some((IoOp::Write, *offset)),
            Op::Flush => None,
        }
    }

    pub(super) fn io_len(&self) -> usize {
        match &self.op {
            Op::Read { buf, .. } | Op::Write { buf, .. } => buf.len(),
            Op::Flush => 0,
        }
    }

    /// Entries of this request the ring or the kernel holds: each will be
    /// reaped before the buffer may go.
    pub(super) fn in_kernel(&self) -> usize {
        self.pieces.iter().flatten().filter(|p| p.queued).count()
    }

    /// Piece `number`'s entry completed with `res`: the piece is finished,
    /// failed, or waits for [`next_entry`](InFlight::next_entry) to send
    /// its rest.
    pub(super) fn complete(&mut self, number: usize, res: i32) {
        let Some(Some(entry)) = self.pieces.get_mut(number) else {
            // Not one of ours (cannot happen: every entry names a piece
            // that stays until its completion).
            return;
        };
        entry.queued = false;
        let piece = *entry;
        let Some((op, offset)) = self.target() else {
            self.pieces[number] = None;
            if res < 0 {
                let source = io::Error::from_raw_os_error(-res);
                self.fail(0, DeviceError::Flush { source });
            }
            return;
        };
        let at = offset + piece.start as u64;
        if res < 0 {
            let errno = -res;
            if matches!(errno, libc::EINTR | libc::EAGAIN) && piece.retries < MAX_RETRIES {
                self.update(number, piece.done, piece.retries + 1);
                return;
            }
            let source = io::Error::from_raw_os_error(errno);
            self.pieces[number] = None;
            // Name the part that failed: a short transfer before it moved
            // the piece's first `done` bytes.
            let failed_at = at + piece.done as u64;
            self.fail(at, io_error(op, failed_at, piece.len - piece.done, source));
            return;
        }
        if res == 0 {
            // End of file: the image shrank under us. Reported, not looped on.
            self.pieces[number] = None;
            let short = DeviceError::Short {
                op,
                offset: at,
                len: piece.len as u64,
                done: piece.done as u64,
            };
            self.fail(at, short);
            return;
        }
        let done = piece.done + res as usize;
        if done < piece.len {
            self.update(number, done, 0);
        } else {
            self.pieces[number] = None;
        }
    }

    /// Piece `number`'s entry could not be pushed: it fails with `source`.
    pub(super) fn refused(&mut self, number: usize, source: io::Error) {
        let Some(Some(piece)) = self.pieces.get(number).copied() else {
            return;
        };
        self.pieces[number] = None;
        match self.target() {
            Some((op, offset)) => {
                let at = offset + piece.start as u64;
                self.fail(at, io_error(op, at, piece.len, source));
            }
            None => self.fail(0, DeviceError::Flush { source }),
        }
    }

    /// Only for dropping the queue: piece `number`'s entry completed and is
    /// not continued.
    pub(super) fn retire(&mut self, number: usize) {
        if let Some(slot) = self.pieces.get_mut(number) {
            *slot = None;
        }
    }

    /// Piece `number` continues from `done`.
    fn update(&mut self, number: usize, done: usize, retries: u32) {
        if let Some(piece) = &mut self.pieces[number] {
            piece.done = done;
            piece.retries = retries;
        }
    }

    /// Keeps the failure at the lowest device offset, so that the error
    /// does not depend on the order pieces complete in.
    fn fail(&mut self, at: u64, error: DeviceError) {
        if self.failure.as_ref().is_none_or(|(first, _)| at < *first) {
            self.failure = Some((at, error));
        }
    }

    /// Whether the request is over: no piece is left in the ring or the
    /// kernel or waiting to be continued, and none is left to start (all
    /// sent, or one failed).
    pub(super) fn is_finished(&self) -> bool {
        self.pieces.iter().all(Option::is_none) && (self.failure.is_some() || !self.has_unsent())
    }

    /// Pieces started so far.
    #[cfg(test)]
    fn started(&self) -> u32 {
        self.started
    }
}

pub(super) fn io_error(op: IoOp, offset: u64, len: usize, source: io::Error) -> DeviceError {
    DeviceError::Io {
        op,
        offset,
        len: len as u64,
        source,
    }
}

/// Hands a finished request's buffer back with its result, copying a
/// bounced read into it. Only for a request that [`InFlight::is_finished`]
/// or whose pieces never reached the ring: the kernel has nothing of it.
pub(super) fn into_completion(request: InFlight) -> DeviceCompletion {
    let len = request.io_len();
    let result = match request.failure {
        Some((_, error)) => Err(error),
        None => Ok(len),
    };
    let buf = match request.op {
        Op::Read {
            mut buf, bounce, ..
        } => {
            if let (Some(bounce), Ok(_)) = (bounce, &result) {
                buf.copy_from_slice(&bounce);
            }
            Some(buf)
        }
        Op::Write { buf, .. } => Some(buf),
        Op::Flush => None,
    };
    DeviceCompletion {
        token: request.token,
        result,
        buf,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn limits(max_bytes: usize) -> RequestLimits {
        RequestLimits {
            max_bytes: Some(max_bytes),
            ..RequestLimits::NONE
        }
    }

    fn write(offset: u64, len: usize) -> InFlight {
        let buf = AlignedBuf::new(len, 4096).unwrap();
        InFlight::new(
            7,
            Op::Write {
                offset,
                buf,
                bounce: None,
                fua: false,
                fixed: None,
            },
        )
    }

    /// Every entry `next_entry` gives now, as (piece number, user_data).
    fn drain(request: &mut InFlight, slot: usize, split: &Split) -> Vec<usize> {
        let mut pieces = Vec::new();
        while let Some(entry) = request.next_entry(slot, split) {
            let (s, piece) = slot_and_piece(entry.get_user_data());
            assert_eq!(s, slot);
            pieces.push(piece);
        }
        pieces
    }

    fn piece(request: &InFlight, number: usize) -> Piece {
        request.pieces[number].expect("piece in flight")
    }

    #[test]
    fn pieces_respect_every_limit_and_stay_block_aligned() {
        let split = Split::new(limits(64 * KIB), 4096, 512, 8);
        assert_eq!(split.piece_len(0, 0, 200 * KIB, false), 64 * KIB);
        assert_eq!(
            split.piece_len(0, 0, 8 * KIB, false),
            8 * KIB,
            "short rest whole"
        );
        // 128 pages from a buffer 512 bytes into a page: the 129th page
        // would be touched by a full 512 KiB, so the piece ends a page
        // early, still on a block boundary.
        let pages = RequestLimits {
            max_pages: Some(128),
            ..RequestLimits::NONE
        };
        let split = Split::new(pages, 4096, 512, 8);
        assert_eq!(split.piece_len(4096, 0, 2 << 20, false), 512 * KIB);
        assert_eq!(
            split.piece_len(4096 + 512, 0, 2 << 20, false),
            512 * KIB - 512
        );
        // The loop device of the bench bed: 128 scattered pages, or from
        // huge pages 127 segments of 64 KiB, past the 1280 KiB limit.
        let bed = RequestLimits {
            max_bytes: Some(1280 * KIB),
            max_pages: Some(128),
            max_contiguous_bytes: Some(127 * 64 * KIB),
            boundary_bytes: None,
            boundary_offset: 0,
        };
        let split = Split::new(bed, 4096, 512, 8);
        assert_eq!(split.piece_len(0, 0, 2 << 20, false), 512 * KIB);
        assert_eq!(split.piece_len(0, 0, 2 << 20, true), 1280 * KIB);
        let few_segments = RequestLimits {
            max_contiguous_bytes: Some(256 * KIB),
            ..bed
        };
        let split = Split::new(few_segments, 4096, 512, 8);
        assert_eq!(split.piece_len(0, 0, 2 << 20, true), 256 * KIB);
        // A chunk boundary 4 KiB ahead of the device offset.
        let chunks = RequestLimits {
            boundary_bytes: Some(64 * KIB as u64),
            ..RequestLimits::NONE
        };
        let split = Split::new(chunks, 4096, 512, 8);
        assert_eq!(split.piece_len(0, 60 * KIB as u64, 1 << 20, false), 4 * KIB);
        // On a partition that starts 8 KiB into its disk, the same device
        // offset is 4 KiB past a boundary of the disk.
        let partition = RequestLimits {
            boundary_offset: 8 * KIB as u64,
            ..chunks
        };
        let split = Split::new(partition, 4096, 512, 8);
        assert_eq!(
            split.piece_len(0, 60 * KIB as u64, 1 << 20, false),
            60 * KIB
        );
        // A limit that is not a block multiple rounds down; one below a
        // block still moves a block.
        let split = Split::new(limits(3000), 4096, 1024, 8);
        assert_eq!(split.piece_len(0, 0, 8 * KIB, false), 2048);
        let split = Split::new(limits(100), 4096, 1024, 8);
        assert_eq!(split.piece_len(0, 0, 8 * KIB, false), 1024);
        // No limits: one entry carries up to a gibibyte.
        let split = Split::new(RequestLimits::NONE, 4096, 512, 8);
        assert_eq!(split.piece_len(0, 0, 3 << 30, false), 1 << 30);
    }

    /// 320 KiB in 64 KiB pieces, at most 4 in the kernel: the fifth starts
    /// when one finishes, a short transfer is continued, and the request is
    /// over only when the last piece is.
    #[test]
    fn a_request_finishes_with_its_last_piece() {
        let split = Split::new(limits(64 * KIB), 4096, 512, 4);
        let mut request = write(1 << 20, 320 * KIB);
        assert_eq!(drain(&mut request, 3, &split), [0, 1, 2, 3]);
        assert_eq!(request.in_kernel(), 4);
        assert_eq!(
            (piece(&request, 2).start, piece(&request, 2).len),
            (128 * KIB, 64 * KIB)
        );
        request.complete(2, (64 * KIB) as i32);
        assert!(!request.is_finished());
        assert_eq!(drain(&mut request, 3, &split), [2], "the fifth piece");
        assert_eq!(piece(&request, 2).start, 256 * KIB);
        // Short: the rest of piece 0 goes again, from where it stopped.
        request.complete(0, (16 * KIB) as i32);
        assert_eq!(drain(&mut request, 3, &split), [0]);
        assert_eq!(piece(&request, 0).done, 16 * KIB);
        for (number, res) in [(3, 64), (0, 48), (1, 64), (2, 64)] {
            assert!(!request.is_finished(), "before piece {number}");
            request.complete(number, (res * KIB) as i32);
        }
        assert!(drain(&mut request, 3, &split).is_empty());
        assert!(request.is_finished());
        assert_eq!(request.started(), 5);
        let done = into_completion(request);
        assert_eq!((done.token, done.result.unwrap()), (7, 320 * KIB));
        assert_eq!(done.buf.unwrap().len(), 320 * KIB);
    }

    /// A piece fails while others are in the kernel: nothing new starts,
    /// the request waits for every piece the kernel has (the buffer is
    /// theirs until then), and fails with the error of the lowest failed
    /// piece, whatever order they fail in.
    #[test]
    fn a_failed_piece_fails_the_request_after_the_others_finish() {
        let split = Split::new(limits(64 * KIB), 4096, 512, 4);
        let mut request = write(1 << 20, 320 * KIB);
        assert_eq!(drain(&mut request, 0, &split), [0, 1, 2, 3]);
        request.complete(2, -libc::EIO);
        assert!(!request.is_finished(), "three pieces still in the kernel");
        // A piece started before the failure runs to its end (so that
        // the lowest failure is found whatever the completion order)...
        request.complete(3, -libc::EAGAIN);
        assert_eq!(drain(&mut request, 0, &split), [3], "...but none starts");
        request.complete(3, (64 * KIB) as i32);
        assert_eq!(request.in_kernel(), 2);
        request.complete(1, 0); // short, lower offset
        assert!(!request.is_finished(), "piece 0 is in the kernel");
        request.complete(0, (64 * KIB) as i32);
        assert!(request.is_finished());
        assert_eq!(request.started(), 4, "the fifth never started");
        match into_completion(request).result {
            Err(DeviceError::Short {
                op: IoOp::Write,
                offset,
                len,
                done: 0,
            }) => assert_eq!((offset, len), ((1 << 20) + 64 * 1024, 64 * 1024)),
            other => panic!("{other:?}"),
        }

        let mut request = write(0, 128 * KIB);
        assert_eq!(drain(&mut request, 0, &split), [0, 1]);
        request.complete(1, -libc::EIO);
        request.complete(0, (64 * KIB) as i32);
        match into_completion(request).result {
            Err(DeviceError::Io { offset, len, .. }) => {
                assert_eq!((offset, len), (64 * 1024, 64 * 1024))
            }
            other => panic!("{other:?}"),
        }
    }

    /// A piece that moved part of its bytes and then failed names the part
    /// that failed, not the whole piece.
    #[test]
    fn an_error_after_a_short_transfer_names_the_rest_of_the_piece() {
        let split = Split::new(limits(64 * KIB), 4096, 512, 4);
        let mut request = write(1 << 20, 64 * KIB);
        assert_eq!(drain(&mut request, 0, &split), [0]);
        request.complete(0, (16 * KIB) as i32);
        assert_eq!(drain(&mut request, 0, &split), [0]);
        request.complete(0, -libc::EIO);
        assert!(request.is_finished());
        match into_completion(request).result {
            Err(DeviceError::Io { offset, len, .. }) => {
                assert_eq!((offset, len), ((1 << 20) + 16 * 1024, 48 * 1024))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refused_entry_fails_its_piece() {
        let split = Split::new(limits(64 * KIB), 4096, 512, 4);
        let mut request = write(0, 128 * KIB);
        assert_eq!(drain(&mut request, 0, &split), [0, 1]);
        request.refused(1, io::Error::other("ring full"));
        assert!(!request.is_finished());
        request.complete(0, (64 * KIB) as i32);
        assert!(request.is_finished());
        assert!(matches!(
            into_completion(request).result,
            Err(DeviceError::Io { offset: 65536, .. })
        ));

        let mut flush = InFlight::new(1, Op::Flush);
        assert_eq!(drain(&mut flush, 0, &split), [0]);
        assert!(!flush.is_finished());
        flush.complete(0, 0);
        assert!(flush.is_finished());
        assert!(into_completion(flush).result.is_ok());
    }
}
