//! The classic transport: one thread reads requests from `/dev/fuse` and
//! writes each reply back with one `write`. Under the io_uring transport
//! the same loop still runs, for what the kernel keeps sending this way:
//! INIT, FORGET and INTERRUPT.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;

use super::synthetic::{init_reply, Answer, Request, MAX_WRITE};
use super::Shared;
use crate::fuse_wire::{self as wire, opcode};

/// Serves requests read from `fd` until the connection goes away: ENODEV
/// (unmounted or aborted), or ECONNABORTED, which a read returns when the
/// unmount or abort lands while it is taking a request off the queue (an
/// unmount right after a close, with readahead or RELEASE still queued). `on_init` runs once the INIT reply is
/// written, when the kernel accepts io_uring registrations.
pub fn serve(fd: RawFd, shared: &Shared, mut on_init: impl FnMut()) -> io::Result<()> {
    // The kernel refuses reads smaller than a whole request of max_write.
    let mut request = vec![0u8; MAX_WRITE + 4096];
    let mut reply = vec![0u8; wire::OUT_HEADER_LEN + MAX_WRITE];
    loop {
        // SAFETY: `request` is a live, writable buffer of the given length.
        let n = unsafe { libc::read(fd, request.as_mut_ptr().cast(), request.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENODEV) | Some(libc::ECONNABORTED) => return Ok(()),
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                _ => return Err(err),
            }
        }
        let request = &request[..n as usize];
        let Some(header) = wire::InHeader::parse(request) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/dev/fuse gave a {n}-byte request, shorter than its header"),
            ));
        };
        let body = &request[wire::IN_HEADER_LEN..];
        let (body_out, out_of_body) = reply.split_at_mut(wire::OUT_HEADER_LEN);
        let answer = if header.opcode == opcode::INIT {
            Answer::Reply(init_reply(body, shared.init_flags, out_of_body))
        } else {
            if !matches!(
                header.opcode,
                opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT
            ) {
                shared.counters.dev_requests.fetch_add(1, Ordering::Relaxed);
            }
            let split = wire::op_header_len(header.opcode).min(body.len());
            let req = Request {
                header,
                op: &body[..split],
                payload: &body[split..],
            };
            shared.count_request(&req);
            shared.fs.answer(&req, out_of_body)
        };
        let body_len = match answer {
            Answer::NoReply => continue,
            Answer::Reply(len) => {
                wire::put_out_header(body_out, header.unique, 0, len);
                len
            }
            Answer::Error(errno) => {
                wire::put_out_header(body_out, header.unique, -errno, 0);
                0
            }
        };
        let len = wire::OUT_HEADER_LEN + body_len;
        // SAFETY: `reply` holds `len` initialised bytes.
        let written = unsafe { libc::write(fd, reply.as_ptr().cast(), len) };
        if written < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                // The request was interrupted or the connection aborted.
                Some(libc::ENOENT) => {}
                Some(libc::ENODEV) => return Ok(()),
                _ => return Err(err),
            }
        }
        if header.opcode == opcode::INIT {
            on_init();
        }
    }
}
