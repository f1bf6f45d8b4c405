//! The values every layout is built of: little-endian integers, strings,
//! directory entry names, counts, and the codes of the format's enums.

use crate::error::{Error, Result};
use crate::limits::{
    MAX_NAME_LEN, MAX_SYMLINK_LEN, MAX_XATTR_NAME_LEN, MAX_XATTR_VALUE_LEN, XATTR_USER_PREFIX,
};
use crate::types::{ExtentState, FileKind, InodeAttrs, Timestamp, MODE_PERMISSION_BITS};

/// Bytes of the length prefix of a string.
pub(super) const STRING_LEN_BYTES: usize = 2;
/// Longest string the encoding can carry.
const MAX_STRING_LEN: usize = u16::MAX as usize;

// Every valid name has an encoding, and [`check_name`]'s message names the
// limit as a number.
const _: () = assert!(MAX_NAME_LEN <= MAX_STRING_LEN);
const _: () = assert!(MAX_NAME_LEN == 255);

pub(super) const U8_BYTES: usize = 1;
pub(super) const U16_BYTES: usize = 2;
pub(super) const U32_BYTES: usize = 4;
pub(super) const U64_BYTES: usize = 8;
/// A timestamp: seconds (i64) and nanoseconds (u32).
pub(super) const TIMESTAMP_BYTES: usize = U64_BYTES + U32_BYTES;
/// Bytes of the length prefix of a byte string (xattr values, symlink
/// targets): u32, since a value may be 65536 bytes.
pub(super) const BYTES_LEN_BYTES: usize = U32_BYTES;
/// Encoded inode attributes as format version 2 defines them: mode, uid,
/// gid, flags (u32 each), rdev (u64), atime, mtime, ctime, btime.
pub const ATTRS_ENCODED_LEN: usize = 4 * U32_BYTES + U64_BYTES + 4 * TIMESTAMP_BYTES;

// Enum codes. 0 is never used.
pub(super) const KIND_REGULAR: u8 = 1;
const KIND_DIRECTORY: u8 = 2;
const KIND_SYMLINK: u8 = 3;
const KIND_FIFO: u8 = 4;
const KIND_SOCKET: u8 = 5;
const KIND_CHAR_DEVICE: u8 = 6;
const KIND_BLOCK_DEVICE: u8 = 7;
const STATE_WRITTEN: u8 = 1;
const STATE_UNWRITTEN: u8 = 2;

/// Checks a directory entry name: 1..=[`MAX_NAME_LEN`] bytes, no `/` or NUL,
/// and not `.` or `..`. Returns why it is invalid.
pub fn check_name(name: &str) -> std::result::Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty name");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("name longer than 255 bytes");
    }
    if name.bytes().any(|b| b == b'/' || b == 0) {
        return Err("name contains '/' or NUL");
    }
    if name == "." || name == ".." {
        return Err("name is '.' or '..'");
    }
    Ok(())
}

/// Checks an extended attribute name: in the `user.` namespace, with a
/// non-empty rest, at most [`MAX_XATTR_NAME_LEN`] bytes, no NUL.
pub fn check_xattr_name(name: &str) -> std::result::Result<(), &'static str> {
    if !name.starts_with(XATTR_USER_PREFIX) {
        return Err("only user.* extended attributes are supported");
    }
    if name.len() == XATTR_USER_PREFIX.len() {
        return Err("empty name after user.");
    }
    if name.len() > MAX_XATTR_NAME_LEN {
        return Err("extended attribute name longer than 255 bytes");
    }
    if name.bytes().any(|b| b == 0) {
        return Err("extended attribute name contains NUL");
    }
    Ok(())
}

/// Checks a symlink target: 1..=[`MAX_SYMLINK_LEN`] bytes, no NUL.
pub fn check_symlink_target(target: &[u8]) -> std::result::Result<(), &'static str> {
    if target.is_empty() {
        return Err("empty symlink target");
    }
    if target.len() > MAX_SYMLINK_LEN {
        return Err("symlink target longer than 4095 bytes");
    }
    if target.contains(&0) {
        return Err("symlink target contains NUL");
    }
    Ok(())
}

/// Checks a mode as stored: permission bits only (the kind is kept apart).
pub fn check_mode(mode: u32) -> std::result::Result<(), String> {
    if mode & !MODE_PERMISSION_BITS != 0 {
        return Err(format!("mode {mode:#o} has bits beyond 0o7777"));
    }
    Ok(())
}

/// Checks attributes as stored: permission bits only, no inode flags
/// (format version 2 defines none), valid nanoseconds.
pub fn check_attrs(attrs: &InodeAttrs) -> std::result::Result<(), String> {
    check_mode(attrs.mode)?;
    if attrs.flags != 0 {
        return Err(format!("unknown inode flags {:#x}", attrs.flags));
    }
    for (what, t) in [
        ("atime", attrs.atime),
        ("mtime", attrs.mtime),
        ("ctime", attrs.ctime),
        ("btime", attrs.btime),
    ] {
        if !t.is_valid() {
            return Err(format!("{what} nanoseconds {} out of range", t.nsec));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Encoder

/// Where an [`Encoder`] puts its bytes.
pub trait Sink {
    fn put(&mut self, bytes: &[u8]);
    /// Bytes put so far.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// Counts the bytes an encoding takes without keeping them, so that an
/// encoded length comes from the very code that writes the bytes and cannot
/// disagree with it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Measure {
    len: usize,
}

impl Sink for Measure {
    fn put(&mut self, bytes: &[u8]) {
        self.len += bytes.len();
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Appends little-endian values to a byte vector, or with [`Measure`] only
/// counts them.
#[derive(Clone, Debug, Default)]
pub struct Encoder<S = Vec<u8>> {
    out: S,
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder::default()
    }

    pub fn with_capacity(capacity: usize) -> Encoder {
        Encoder {
            out: Vec::with_capacity(capacity),
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.out
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.out
    }
}

impl Encoder<Measure> {
    /// An encoder that only counts what it is given.
    pub fn measure() -> Encoder<Measure> {
        Encoder::default()
    }
}

impl<S: Sink> Encoder<S> {
    pub fn len(&self) -> usize {
        self.out.len()
    }

    pub fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    pub fn u8(&mut self, v: u8) {
        self.out.put(&[v]);
    }

    pub fn u16(&mut self, v: u16) {
        self.out.put(&v.to_le_bytes());
    }

    pub fn u32(&mut self, v: u32) {
        self.out.put(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.out.put(&v.to_le_bytes());
    }

    /// Raw bytes, no length prefix.
    pub fn bytes(&mut self, v: &[u8]) {
        self.out.put(v);
    }

    /// A string with a u16 length prefix. Fails if longer than 65535 bytes.
    pub fn string(&mut self, s: &str) -> Result<()> {
        let len = u16::try_from(s.len()).map_err(|_| {
            Error::invalid(
                "encoding a string",
                format!("{} bytes is longer than {MAX_STRING_LEN}", s.len()),
            )
        })?;
        self.u16(len);
        self.bytes(s.as_bytes());
        Ok(())
    }

    /// A directory entry name: checked with [`check_name`], then as
    /// [`Encoder::string`].
    pub fn name(&mut self, name: &str) -> Result<()> {
        check_name(name).map_err(|reason| Error::invalid(format!("name {name:?}"), reason))?;
        self.string(name)
    }

    /// A byte string with a u32 length prefix.
    pub fn byte_string(&mut self, v: &[u8]) -> Result<()> {
        let len = u32::try_from(v.len()).map_err(|_| {
            Error::invalid(
                "encoding a byte string",
                format!("{} bytes is longer than {}", v.len(), u32::MAX),
            )
        })?;
        self.u32(len);
        self.bytes(v);
        Ok(())
    }

    pub fn timestamp(&mut self, t: Timestamp) {
        self.u64(t.sec as u64);
        self.u32(t.nsec);
    }

    /// Inode attributes ([`ATTRS_ENCODED_LEN`] bytes), checked with
    /// [`check_attrs`].
    pub fn attrs(&mut self, a: &InodeAttrs) -> Result<()> {
        check_attrs(a).map_err(|reason| Error::invalid("encoding inode attributes", reason))?;
        self.u32(a.mode);
        self.u32(a.uid);
        self.u32(a.gid);
        self.u32(a.flags);
        self.u64(a.rdev);
        for t in [a.atime, a.mtime, a.ctime, a.btime] {
            self.timestamp(t);
        }
        Ok(())
    }

    /// An extended attribute name (see [`check_xattr_name`]).
    pub fn xattr_name(&mut self, name: &str) -> Result<()> {
        check_xattr_name(name)
            .map_err(|reason| Error::invalid(format!("xattr {name:?}"), reason))?;
        self.string(name)
    }

    /// An extended attribute value: at most [`MAX_XATTR_VALUE_LEN`] bytes.
    pub fn xattr_value(&mut self, value: &[u8]) -> Result<()> {
        if value.len() > MAX_XATTR_VALUE_LEN {
            return Err(Error::invalid(
                "encoding an extended attribute value",
                format!("{} bytes exceed {MAX_XATTR_VALUE_LEN}", value.len()),
            ));
        }
        self.byte_string(value)
    }

    /// A symlink target (see [`check_symlink_target`]).
    pub fn symlink_target(&mut self, target: &[u8]) -> Result<()> {
        check_symlink_target(target)
            .map_err(|reason| Error::invalid("encoding a symlink target", reason))?;
        self.byte_string(target)
    }

    /// A count that the decoder reads as u32.
    pub(super) fn count_u32(&mut self, n: usize, what: &str) -> Result<()> {
        let n = u32::try_from(n).map_err(|_| {
            Error::invalid(
                format!("encoding {what}"),
                format!("{n} items exceed the format's limit of {}", u32::MAX),
            )
        })?;
        self.u32(n);
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Decoder

/// Reads little-endian values from a slice. Every failure is an
/// [`Error::Corrupt`] naming `what` and the device byte of the failing field
/// (`base` is the device byte of the slice's first byte).
#[derive(Clone, Debug)]
pub struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
    base: u64,
    what: &'static str,
}

impl<'a> Decoder<'a> {
    pub fn new(buf: &'a [u8], base: u64, what: &'static str) -> Decoder<'a> {
        Decoder {
            buf,
            pos: 0,
            base,
            what,
        }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Device byte of the next byte to read.
    pub fn offset(&self) -> u64 {
        self.offset_of(self.pos)
    }

    fn offset_of(&self, pos: usize) -> u64 {
        self.base.saturating_add(pos as u64)
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    /// A corruption error at the current offset.
    pub fn error(&self, reason: impl Into<String>) -> Error {
        Error::corrupt(self.what, self.offset(), reason)
    }

    pub(super) fn error_at(&self, pos: usize, reason: impl Into<String>) -> Error {
        Error::corrupt(self.what, self.offset_of(pos), reason)
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.error(format!(
                "truncated: need {n} bytes, {} remain",
                self.remaining()
            )));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A string with a u16 length prefix; must be UTF-8.
    pub fn string(&mut self) -> Result<String> {
        let at = self.pos;
        let len = usize::from(self.u16()?);
        let bytes = self.bytes(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(self.error_at(at, "string is not UTF-8")),
        }
    }

    /// A directory entry name (see [`check_name`]).
    pub fn name(&mut self) -> Result<String> {
        let at = self.pos;
        let name = self.string()?;
        check_name(&name).map_err(|reason| self.error_at(at, format!("bad name: {reason}")))?;
        Ok(name)
    }

    /// A byte string with a u32 length prefix, at most `max` bytes.
    pub fn byte_string(&mut self, max: usize, what: &str) -> Result<Vec<u8>> {
        let at = self.pos;
        let len = self.u32()? as usize;
        if len > max {
            return Err(self.error_at(at, format!("{what} of {len} bytes exceeds {max}")));
        }
        Ok(self.bytes(len)?.to_vec())
    }

    pub fn timestamp(&mut self) -> Result<Timestamp> {
        let at = self.pos;
        let sec = self.u64()? as i64;
        let nsec = self.u32()?;
        let t = Timestamp { sec, nsec };
        if !t.is_valid() {
            return Err(self.error_at(at, format!("timestamp nanoseconds {nsec} out of range")));
        }
        Ok(t)
    }

    /// Inode attributes, checked with [`check_attrs`].
    pub fn attrs(&mut self) -> Result<InodeAttrs> {
        let at = self.pos;
        let a = InodeAttrs {
            mode: self.u32()?,
            uid: self.u32()?,
            gid: self.u32()?,
            flags: self.u32()?,
            rdev: self.u64()?,
            atime: self.timestamp()?,
            mtime: self.timestamp()?,
            ctime: self.timestamp()?,
            btime: self.timestamp()?,
        };
        check_attrs(&a).map_err(|reason| self.error_at(at, reason))?;
        Ok(a)
    }

    pub fn xattr_name(&mut self) -> Result<String> {
        let at = self.pos;
        let name = self.string()?;
        check_xattr_name(&name)
            .map_err(|reason| self.error_at(at, format!("bad xattr name: {reason}")))?;
        Ok(name)
    }

    pub fn xattr_value(&mut self) -> Result<Vec<u8>> {
        self.byte_string(MAX_XATTR_VALUE_LEN, "extended attribute value")
    }

    pub fn symlink_target(&mut self) -> Result<Vec<u8>> {
        let at = self.pos;
        let target = self.byte_string(MAX_SYMLINK_LEN, "symlink target")?;
        check_symlink_target(&target)
            .map_err(|reason| self.error_at(at, format!("bad symlink target: {reason}")))?;
        Ok(target)
    }

    /// A u32 count of items each at least `min_item_len` bytes long; fails
    /// unless that many items can fit in the remaining bytes, so the caller
    /// may allocate for `count` items.
    pub fn count_u32(&mut self, min_item_len: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u32()?;
        self.check_count(at, u64::from(n), min_item_len, what)
    }

    /// As [`Decoder::count_u32`] for a u64 count.
    pub fn count_u64(&mut self, min_item_len: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64()?;
        self.check_count(at, n, min_item_len, what)
    }

    fn check_count(&self, at: usize, n: u64, min_item_len: usize, what: &str) -> Result<usize> {
        let fits = (self.remaining() / min_item_len.max(1)) as u64;
        if n > fits {
            return Err(self.error_at(
                at,
                format!(
                    "{what} count {n} cannot fit in the {} bytes that remain",
                    self.remaining()
                ),
            ));
        }
        // n <= remaining bytes, which is a usize.
        Ok(n as usize)
    }

    /// Fails if any bytes remain.
    pub fn finish(&self) -> Result<()> {
        if self.is_empty() {
            Ok(())
        } else {
            Err(self.error(format!("{} unexpected trailing bytes", self.remaining())))
        }
    }

    pub(super) fn kind(&mut self) -> Result<FileKind> {
        let at = self.pos;
        match self.u8()? {
            KIND_REGULAR => Ok(FileKind::Regular),
            KIND_DIRECTORY => Ok(FileKind::Directory),
            KIND_SYMLINK => Ok(FileKind::Symlink),
            KIND_FIFO => Ok(FileKind::Fifo),
            KIND_SOCKET => Ok(FileKind::Socket),
            KIND_CHAR_DEVICE => Ok(FileKind::CharDevice),
            KIND_BLOCK_DEVICE => Ok(FileKind::BlockDevice),
            other => Err(self.error_at(at, format!("unknown file kind {other}"))),
        }
    }

    pub(super) fn extent_state(&mut self) -> Result<ExtentState> {
        let at = self.pos;
        let code = self.u8()?;
        extent_state_of(code)
            .ok_or_else(|| self.error_at(at, format!("unknown extent state {code}")))
    }
}

/// The extent state a byte encodes, if any.
pub(super) fn extent_state_of(code: u8) -> Option<ExtentState> {
    match code {
        STATE_WRITTEN => Some(ExtentState::Written),
        STATE_UNWRITTEN => Some(ExtentState::Unwritten),
        _ => None,
    }
}

pub(super) fn kind_code(kind: FileKind) -> u8 {
    match kind {
        FileKind::Regular => KIND_REGULAR,
        FileKind::Directory => KIND_DIRECTORY,
        FileKind::Symlink => KIND_SYMLINK,
        FileKind::Fifo => KIND_FIFO,
        FileKind::Socket => KIND_SOCKET,
        FileKind::CharDevice => KIND_CHAR_DEVICE,
        FileKind::BlockDevice => KIND_BLOCK_DEVICE,
    }
}

pub(super) fn state_code(state: ExtentState) -> u8 {
    match state {
        ExtentState::Written => STATE_WRITTEN,
        ExtentState::Unwritten => STATE_UNWRITTEN,
    }
}
