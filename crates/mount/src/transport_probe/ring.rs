//! The io_uring transport (FUSE over io_uring, kernel ≥ 6.14 with
//! `/sys/module/fuse/parameters/enable_uring` on): one queue per possible
//! CPU, each a thread pinned to its CPU with a ring of its own. Each ring
//! entry is a header buffer (`fuse_uring_req_header`) and a payload buffer
//! registered with FUSE_IO_URING_CMD_REGISTER; the kernel fills them with a
//! request taken on that CPU and completes the command; the thread writes
//! the reply into the same buffers and answers with
//! FUSE_IO_URING_CMD_COMMIT_AND_FETCH, which also waits for the next one.
//! No read or write syscall per request: one `io_uring_enter` answers and
//! waits.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;

use io_uring::{cqueue, squeue, IoUring};

use super::synthetic::{Answer, Request, MAX_WRITE};
use super::Shared;
use crate::fuse_uring::{command, connection_ended, pin_to_cpu, EntryBuffers};
use crate::fuse_wire::{self as wire, get_u32, get_u64, put_u32, uring};

/// How a queue thread sets up its ring.
#[derive(Clone, Copy, Debug)]
pub struct QueueSpec {
    pub qid: u16,
    /// The session's /dev/fuse descriptor.
    pub fd: RawFd,
    /// Ring entries (requests the queue can hold at once).
    pub entries: usize,
    /// IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN: the kernel runs the
    /// queue's task work (copying a request in) only when the thread waits
    /// in io_uring_enter, never interrupting it.
    pub defer_taskrun: bool,
}

/// Payload buffer size: the kernel refuses a smaller one
/// (`max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE)`).
pub const PAYLOAD_LEN: usize = if MAX_WRITE > uring::MIN_READ_BUFFER {
    MAX_WRITE
} else {
    uring::MIN_READ_BUFFER
};

/// Why a queue could not start.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("queue {qid}: setting up an io_uring with 128-byte SQEs and 32-byte CQEs: {source}")]
    Setup { qid: u16, source: io::Error },
    #[error("queue {qid}: FUSE_IO_URING_CMD_REGISTER refused: {source}")]
    Register { qid: u16, source: io::Error },
}

/// Runs queue `spec.qid` until the connection goes away. `ready` gets
/// Ok once every entry is registered (the kernel refused none at
/// submission), or the error.
pub fn serve(
    spec: QueueSpec,
    shared: &Shared,
    ready: Sender<Result<(), QueueError>>,
) -> io::Result<()> {
    let qid = spec.qid;
    pin_to_cpu(qid as usize);
    let mut builder = IoUring::<squeue::Entry128, cqueue::Entry32>::builder();
    if spec.defer_taskrun {
        builder.setup_single_issuer().setup_defer_taskrun();
    }
    // Declared before the ring, so dropped after it on every path.
    let entries = (0..spec.entries)
        .map(|_| EntryBuffers::new(PAYLOAD_LEN, 4096))
        .collect::<Result<Vec<_>, _>>();
    let mut entries = match entries {
        Ok(entries) => entries,
        Err(e) => {
            let source = io::Error::other(e.to_string());
            let _ = ready.send(Err(QueueError::Setup { qid, source }));
            return Ok(());
        }
    };
    let mut ring = match builder.build((2 * spec.entries).next_power_of_two() as u32) {
        Ok(ring) => ring,
        Err(source) => {
            let _ = ready.send(Err(QueueError::Setup { qid, source }));
            return Ok(());
        }
    };
    for (index, entry) in entries.iter().enumerate() {
        let sqe = command(
            spec.fd,
            uring::CMD_REGISTER,
            0,
            qid,
            Some(&entry.iov),
            index as u64,
        );
        // SAFETY: the iovecs and the buffers they point at live in
        // `entries`, which outlives the ring's use of them (the ring is
        // dropped first, at the end of this function, and every command
        // has completed by then).
        unsafe { ring.submission().push(&sqe) }.expect("ring sized for every entry");
    }
    if let Err(source) = ring.submit() {
        let _ = ready.send(Err(QueueError::Register { qid, source }));
        return Ok(());
    }
    // A refused REGISTER completes at once; an accepted one stays
    // in flight until the kernel has a request for it.
    let refused = ring.completion().find(|cqe| cqe.result() < 0);
    if let Some(cqe) = refused {
        let source = io::Error::from_raw_os_error(-cqe.result());
        let _ = ready.send(Err(QueueError::Register { qid, source }));
        return Ok(());
    }
    let _ = ready.send(Ok(()));

    let mut live = entries.len();
    let mut done: Vec<(usize, i32)> = Vec::with_capacity(entries.len());
    let mut scratch = [0u8; uring::OP_IN_LEN + 256];
    let mut failure = None;
    while live > 0 {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
            Err(err) => return Err(err),
        }
        done.clear();
        done.extend(
            ring.completion()
                .map(|cqe| (cqe.user_data() as usize, cqe.result())),
        );
        for &(index, result) in &done {
            if result < 0 {
                live -= 1;
                if !connection_ended(result) && failure.is_none() {
                    failure = Some(io::Error::from_raw_os_error(-result));
                }
                continue;
            }
            let entry = &mut entries[index];
            let commit_id = answer(entry, shared, &mut scratch);
            let sqe = command(
                spec.fd,
                uring::CMD_COMMIT_AND_FETCH,
                commit_id,
                qid,
                None,
                index as u64,
            );
            // SAFETY: as for REGISTER: the entry's buffers outlive the ring.
            unsafe { ring.submission().push(&sqe) }.expect("one slot per entry");
        }
    }
    drop(ring);
    match failure {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// Answers the request in `entry` in place; returns its commit id.
fn answer(entry: &mut EntryBuffers, shared: &Shared, scratch: &mut [u8]) -> u64 {
    let header_buf = &mut entry.header[..];
    let commit_id = get_u64(header_buf, uring::COMMIT_ID_OFFSET);
    let payload_len =
        (get_u32(header_buf, uring::PAYLOAD_SZ_OFFSET) as usize).min(entry.payload.len());
    let header = wire::InHeader::parse(&header_buf[uring::IN_OUT_OFFSET..])
        .expect("the in_out area holds a whole fuse_in_header");
    shared
        .counters
        .ring_requests
        .fetch_add(1, Ordering::Relaxed);
    let op_len = wire::op_header_len(header.opcode).min(uring::OP_IN_LEN);
    // The reply goes into the payload buffer the request came in: keep the
    // (small) request payload aside first. READ has none, so its reply
    // data is written once, straight into the buffer the kernel copies
    // from.
    let (op, payload) = scratch.split_at_mut(uring::OP_IN_LEN);
    op[..op_len].copy_from_slice(&header_buf[uring::OP_IN_OFFSET..uring::OP_IN_OFFSET + op_len]);
    let kept = payload_len.min(payload.len());
    payload[..kept].copy_from_slice(&entry.payload[..kept]);
    let req = Request {
        header,
        op: &op[..op_len],
        payload: &payload[..kept],
    };
    shared.count_request(&req);
    let (error, body_len) = match shared.fs.answer(&req, &mut entry.payload) {
        Answer::Reply(len) => (0, len),
        Answer::Error(errno) => (-errno, 0),
        // Nothing that needs no reply travels over the ring; answer
        // anyway so the entry is fetched again.
        Answer::NoReply => (0, 0),
    };
    wire::put_out_header(
        &mut header_buf[uring::IN_OUT_OFFSET..],
        header.unique,
        error,
        body_len,
    );
    put_u32(header_buf, uring::PAYLOAD_SZ_OFFSET, body_len as u32);
    commit_id
}
