//! The probe's file system: a root directory holding one read-only file,
//! `pattern`, whose bytes are a function of their offset (see
//! [`pattern_word`]), served from memory. It answers the same way over
//! either transport, so the two differ only in how requests travel.

use crate::fuse_wire::{self as wire, opcode, put_u32, put_u64};

pub const ROOT_INO: u64 = 1;
pub const FILE_INO: u64 = 2;
pub const FILE_NAME: &[u8] = b"pattern";

/// How long the kernel may cache names and attributes: the tree never
/// changes, so only the first open of the file costs a LOOKUP.
const VALID_SECS: u64 = 3600;

/// The little-endian u64 at offset `8 * index` of `pattern`.
pub fn pattern_word(index: u64) -> u64 {
    index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x696f_6d61_7066_7321
}

/// Fills `out` with the bytes of `pattern` from `offset` on.
pub fn fill_pattern(offset: u64, out: &mut [u8]) {
    if offset.is_multiple_of(8) && out.len().is_multiple_of(8) {
        let first = offset / 8;
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&pattern_word(first + i as u64).to_le_bytes());
        }
        return;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        let at = offset + i as u64;
        *byte = pattern_word(at / 8).to_le_bytes()[(at % 8) as usize];
    }
}

/// What the handler does with a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// Reply with this many bytes of the reply buffer.
    Reply(usize),
    /// Reply with this errno.
    Error(i32),
    /// The opcode takes no reply (FORGET, INTERRUPT).
    NoReply,
}

/// One request as the handler sees it: the fixed argument struct and the
/// variable part (names), whichever transport carried them.
pub struct Request<'a> {
    pub header: wire::InHeader,
    pub op: &'a [u8],
    pub payload: &'a [u8],
}

/// The synthetic file system.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticFs {
    pub file_size: u64,
    /// `open_flags` of every file open: 0 (the kernel may cache data;
    /// O_DIRECT opens still take its direct path) or FOPEN_DIRECT_IO.
    pub open_flags: u32,
}

impl SyntheticFs {
    /// Answers `req` into `out` (large enough for any reply the kernel may
    /// ask for: the transport's read size). INIT is the session's, not
    /// handled here.
    pub fn answer(&self, req: &Request<'_>, out: &mut [u8]) -> Answer {
        let ino = req.header.nodeid;
        match req.header.opcode {
            opcode::LOOKUP => {
                let name = nul_terminated(req.payload).or_else(|| nul_terminated(req.op));
                if ino == ROOT_INO && name == Some(FILE_NAME) {
                    Answer::Reply(self.entry_out(FILE_INO, out))
                } else {
                    Answer::Error(libc::ENOENT)
                }
            }
            opcode::GETATTR => match self.attr_at(ino, &mut out[16..]) {
                Some(()) => {
                    put_u64(out, 0, VALID_SECS);
                    put_u32(out, 8, 0);
                    put_u32(out, 12, 0);
                    Answer::Reply(wire::ATTR_OUT_LEN)
                }
                None => Answer::Error(libc::ENOENT),
            },
            opcode::OPEN | opcode::OPENDIR => {
                out[..wire::OPEN_OUT_LEN].fill(0);
                if req.header.opcode == opcode::OPEN {
                    put_u32(out, 8, self.open_flags);
                }
                Answer::Reply(wire::OPEN_OUT_LEN)
            }
            opcode::READ => {
                if ino != FILE_INO || req.op.len() < 24 {
                    return Answer::Error(libc::EINVAL);
                }
                let offset = wire::get_u64(req.op, 8);
                let size = wire::get_u32(req.op, 16) as u64;
                let end = (offset.saturating_add(size)).min(self.file_size);
                let len = end.saturating_sub(offset) as usize;
                if len > out.len() {
                    return Answer::Error(libc::EINVAL);
                }
                fill_pattern(offset, &mut out[..len]);
                Answer::Reply(len)
            }
            opcode::READDIR => self.readdir(req, out),
            opcode::RELEASE | opcode::RELEASEDIR | opcode::FLUSH | opcode::ACCESS => {
                Answer::Reply(0)
            }
            opcode::DESTROY => Answer::Reply(0),
            opcode::STATFS => {
                out[..wire::STATFS_OUT_LEN].fill(0);
                put_u64(out, 0, self.file_size / 4096);
                put_u64(out, 24, 2);
                put_u32(out, 40, 4096);
                put_u32(out, 44, 255);
                put_u32(out, 48, 4096);
                Answer::Reply(wire::STATFS_OUT_LEN)
            }
            // A missing attribute (not ENOSYS, after which the kernel stops
            // asking): every getxattr is a full round trip that does no
            // work, the probe's no-op request.
            opcode::GETXATTR | opcode::LISTXATTR => Answer::Error(libc::ENODATA),
            opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT => Answer::NoReply,
            _ => Answer::Error(libc::ENOSYS),
        }
    }

    fn entry_out(&self, ino: u64, out: &mut [u8]) -> usize {
        out[..40].fill(0);
        put_u64(out, 0, ino);
        put_u64(out, 16, VALID_SECS);
        put_u64(out, 24, VALID_SECS);
        self.attr_at(ino, &mut out[40..]).expect("known inode");
        wire::ENTRY_OUT_LEN
    }

    /// Writes the `fuse_attr` of `ino`; None for an unknown inode.
    fn attr_at(&self, ino: u64, out: &mut [u8]) -> Option<()> {
        let (mode, nlink, size) = match ino {
            ROOT_INO => (libc::S_IFDIR | 0o755, 2, 0),
            FILE_INO => (libc::S_IFREG | 0o444, 1, self.file_size),
            _ => return None,
        };
        out[..wire::ATTR_LEN].fill(0);
        put_u64(out, 0, ino);
        put_u64(out, 8, size);
        put_u64(out, 16, size.div_ceil(512));
        put_u32(out, 60, mode);
        put_u32(out, 64, nlink);
        put_u32(out, 80, 4096);
        Some(())
    }

    /// `.`, `..` and `pattern`, as `fuse_dirent`s from the asked offset.
    fn readdir(&self, req: &Request<'_>, out: &mut [u8]) -> Answer {
        if req.header.nodeid != ROOT_INO || req.op.len() < 24 {
            return Answer::Error(libc::ENOTDIR);
        }
        let start = wire::get_u64(req.op, 8);
        let size = (wire::get_u32(req.op, 16) as usize).min(out.len());
        let entries: [(u64, &[u8], u32); 3] = [
            (ROOT_INO, b".", libc::DT_DIR as u32),
            (ROOT_INO, b"..", libc::DT_DIR as u32),
            (FILE_INO, FILE_NAME, libc::DT_REG as u32),
        ];
        let mut used = 0;
        for (index, (ino, name, kind)) in entries.iter().enumerate().skip(start as usize) {
            let len = (24 + name.len()).next_multiple_of(8);
            if used + len > size {
                break;
            }
            let d = &mut out[used..used + len];
            d.fill(0);
            put_u64(d, 0, *ino);
            put_u64(d, 8, index as u64 + 1);
            put_u32(d, 16, name.len() as u32);
            put_u32(d, 20, *kind);
            d[24..24 + name.len()].copy_from_slice(name);
            used += len;
        }
        Answer::Reply(used)
    }
}

fn nul_terminated(bytes: &[u8]) -> Option<&[u8]> {
    let end = bytes.iter().position(|&b| b == 0)?;
    (end > 0).then_some(&bytes[..end])
}

/// The INIT reply (`fuse_init_out`) for a kernel that sent `init_in`:
/// the kernel's own minor version and readahead, `flags` asked for (only
/// those the kernel offered), 1 MiB requests.
pub fn init_reply(init_in: &[u8], wanted: u64, out: &mut [u8]) -> usize {
    let minor = wire::get_u32(init_in, 4);
    let max_readahead = wire::get_u32(init_in, 8);
    let mut offered = wire::get_u32(init_in, 12) as u64;
    if offered & wire::init_flag::INIT_EXT != 0 && init_in.len() >= 20 {
        offered |= (wire::get_u32(init_in, 16) as u64) << 32;
    }
    let flags = wanted & offered;
    out[..wire::INIT_OUT_LEN].fill(0);
    put_u32(out, 0, 7);
    put_u32(out, 4, minor);
    put_u32(out, 8, max_readahead);
    put_u32(out, 12, flags as u32);
    wire::put_u16(out, 16, 64);
    wire::put_u16(out, 18, 48);
    put_u32(out, 20, MAX_WRITE as u32);
    put_u32(out, 24, 1);
    wire::put_u16(out, 28, (MAX_WRITE / 4096) as u16);
    put_u32(out, 32, (flags >> 32) as u32);
    wire::INIT_OUT_LEN
}

/// The largest request payload (max_write and max_pages * 4 KiB).
pub const MAX_WRITE: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_pattern_bytes_match_the_aligned_words() {
        let mut aligned = vec![0u8; 64];
        fill_pattern(4096, &mut aligned);
        let mut unaligned = vec![0u8; 29];
        fill_pattern(4096 + 3, &mut unaligned);
        assert_eq!(unaligned[..], aligned[3..32]);
        assert_ne!(aligned[0..8], aligned[8..16]);
    }

    #[test]
    fn reads_stop_at_the_end_of_the_file() {
        let fs = SyntheticFs {
            file_size: 10_000,
            open_flags: 0,
        };
        let mut op = [0u8; 40];
        put_u64(&mut op, 8, 8192);
        put_u32(&mut op, 16, 4096);
        let req = Request {
            header: wire::InHeader {
                opcode: opcode::READ,
                unique: 2,
                nodeid: FILE_INO,
            },
            op: &op,
            payload: &[],
        };
        let mut out = vec![0u8; 4096];
        assert_eq!(fs.answer(&req, &mut out), Answer::Reply(10_000 - 8192));
    }
}
