//! One request's life in a ring: the submission entry that carries the rest
//! of it, what each completion entry means for it, and how its buffer goes
//! back to the caller.
//!
//! The kernel may transfer less than asked, or fail with `EINTR`/`EAGAIN`;
//! neither is an error of the request, so it is continued from where it
//! stopped, a bounded number of times. This is the only place that reads a
//! completion entry's result.

use std::io;

use io_uring::{opcode, squeue, types};

use super::setup::{DEVICE_FILE, MAX_RETRIES};
use crate::error::IoOp;
use crate::queue::{DeviceCompletion, Token};
use crate::{AlignedBuf, DeviceError};

/// Most bytes one submission entry transfers. Its length field is 32 bits
/// and the kernel caps one transfer at `MAX_RW_COUNT` (2 GiB less a page)
/// anyway; longer requests continue like short transfers. A multiple of
/// every logical block size, so each piece stays aligned.
const MAX_BYTES_PER_ENTRY: usize = 1 << 30;

/// One request the kernel may be working on.
pub(super) struct InFlight {
    pub(super) token: Token,
    pub(super) op: Op,
    /// Bytes transferred so far (short transfers are continued).
    pub(super) done: usize,
    /// Resubmissions after `EINTR`/`EAGAIN` without progress.
    pub(super) retries: u32,
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

impl InFlight {
    /// The submission entry for the rest of this request, tagged with its
    /// slot `index`.
    pub(super) fn entry(&mut self, index: usize) -> squeue::Entry {
        let done = self.done;
        let entry = match &mut self.op {
            Op::Read {
                offset,
                buf,
                bounce,
                fixed,
            } => {
                let target = bounce.as_mut().unwrap_or(buf);
                let rest = &mut target[done..];
                let len = rest.len().min(MAX_BYTES_PER_ENTRY) as u32;
                let at = *offset + done as u64;
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
                let rest = &source[done..];
                let len = rest.len().min(MAX_BYTES_PER_ENTRY) as u32;
                let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                let at = *offset + done as u64;
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
        entry.user_data(index as u64)
    }

    /// Kind and device offset of a read or write; `None` for a flush.
    pub(super) fn target(&self) -> Option<(IoOp, u64)> {
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
}

/// What one completion entry means for its request.
pub(super) enum Outcome {
    Done(Result<usize, DeviceError>),
    /// Not finished: send the rest again.
    Resubmit,
}

/// Interprets the result of the entry just completed for `request`.
pub(super) fn outcome(request: &mut InFlight, res: i32) -> Outcome {
    let Some((op, offset)) = request.target() else {
        return Outcome::Done(if res < 0 {
            Err(DeviceError::Flush {
                source: io::Error::from_raw_os_error(-res),
            })
        } else {
            Ok(0)
        });
    };
    let len = request.io_len();
    if res < 0 {
        let errno = -res;
        if matches!(errno, libc::EINTR | libc::EAGAIN) && request.retries < MAX_RETRIES {
            request.retries += 1;
            return Outcome::Resubmit;
        }
        let source = io::Error::from_raw_os_error(errno);
        return Outcome::Done(Err(io_error(op, offset, len, source)));
    }
    if res == 0 {
        // End of file: the image shrank under us. Reported, not looped on.
        return Outcome::Done(Err(DeviceError::Short {
            op,
            offset,
            len: len as u64,
            done: request.done as u64,
        }));
    }
    request.done += res as usize;
    request.retries = 0;
    if request.done < len {
        Outcome::Resubmit
    } else {
        Outcome::Done(Ok(len))
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

/// Hands a finished request's buffer back, copying a bounced read into it.
pub(super) fn into_completion(
    request: InFlight,
    result: Result<usize, DeviceError>,
) -> DeviceCompletion {
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
