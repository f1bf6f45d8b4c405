//! The few FUSE wire-format pieces the transport probe and the mount's
//! io_uring transport speak themselves (Linux UAPI `<linux/fuse.h>`,
//! little-endian x86-64 layouts), written and read at byte offsets so no
//! struct layout is assumed.

/// Opcodes the synthetic file system answers or must recognise.
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
}

/// `fuse_in_header`: len, opcode, unique, nodeid, uid, gid, pid, ...
pub const IN_HEADER_LEN: usize = 40;
/// `fuse_out_header`: len, error, unique.
pub const OUT_HEADER_LEN: usize = 16;
pub const INIT_OUT_LEN: usize = 64;
pub const ATTR_LEN: usize = 88;
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;
pub const ATTR_OUT_LEN: usize = 16 + ATTR_LEN;
pub const OPEN_OUT_LEN: usize = 16;
pub const STATFS_OUT_LEN: usize = 80;

/// INIT flags (the `flags` word; bits 32.. go in `flags2`).
pub mod init_flag {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `fuse_open_out.open_flags`.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;

/// io_uring transport (`FUSE_IO_URING_CMD_*`, `struct fuse_uring_*`).
pub mod uring {
    pub const CMD_REGISTER: u32 = 1;
    pub const CMD_COMMIT_AND_FETCH: u32 = 2;
    /// `fuse_uring_req_header`: `in_out[128]`, `op_in[128]`, ring_ent_in_out.
    pub const REQ_HEADER_LEN: usize = 288;
    pub const IN_OUT_OFFSET: usize = 0;
    pub const OP_IN_OFFSET: usize = 128;
    pub const OP_IN_LEN: usize = 128;
    /// `fuse_uring_ent_in_out`: flags u64, commit_id u64, payload_sz u32.
    pub const COMMIT_ID_OFFSET: usize = 256 + 8;
    pub const PAYLOAD_SZ_OFFSET: usize = 256 + 16;
    /// The payload buffer must hold the largest request or reply:
    /// `max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE)`.
    pub const MIN_READ_BUFFER: usize = 8192;
}

pub fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

pub fn get_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

pub fn put_u16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The request header fields the probe uses.
#[derive(Clone, Copy, Debug)]
pub struct InHeader {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
}

impl InHeader {
    /// Parses a `fuse_in_header`; None if `buf` is too short.
    pub fn parse(buf: &[u8]) -> Option<InHeader> {
        if buf.len() < IN_HEADER_LEN {
            return None;
        }
        Some(InHeader {
            opcode: get_u32(buf, 4),
            unique: get_u64(buf, 8),
            nodeid: get_u64(buf, 16),
        })
    }
}

/// Writes a `fuse_out_header` for a reply of `body_len` bytes.
pub fn put_out_header(buf: &mut [u8], unique: u64, error: i32, body_len: usize) {
    put_u32(buf, 0, (OUT_HEADER_LEN + body_len) as u32);
    put_u32(buf, 4, error as u32);
    put_u64(buf, 8, unique);
}

/// Length of the opcode's fixed argument struct (the classic transport's
/// split point between it and the variable part; the io_uring transport
/// gets the two in separate buffers). 0 for opcodes without one.
pub fn op_header_len(opcode: u32) -> usize {
    use opcode::*;
    match opcode {
        GETATTR => 16,
        OPEN | OPENDIR | GETXATTR | LISTXATTR | ACCESS | FORGET | INTERRUPT => 8,
        BATCH_FORGET => 8,
        READ | READDIR => 40,
        RELEASE | RELEASEDIR | FLUSH => 24,
        INIT => 64,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_header_counts_itself_and_round_trips_through_in_header_offsets() {
        let mut b = [0u8; OUT_HEADER_LEN];
        put_out_header(&mut b, 0x1122_3344_5566_7788, -2, 100);
        assert_eq!(get_u32(&b, 0), 116);
        assert_eq!(get_u32(&b, 4) as i32, -2);
        assert_eq!(get_u64(&b, 8), 0x1122_3344_5566_7788);
    }
}
