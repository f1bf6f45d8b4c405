//! The values every layout is built of: little-endian integers, strings,
//! directory entry names, counts, and the codes of the format's enums.

use crate::error::{Error, Result};
use crate::limits::MAX_NAME_LEN;
use crate::types::{ExtentState, FileKind};

/// Bytes of the length prefix of a string.
pub(super) const STRING_LEN_BYTES: usize = 2;
/// Longest string the encoding can carry.
const MAX_STRING_LEN: usize = u16::MAX as usize;

// Every valid name has an encoding, and [`check_name`]'s message names the
// limit as a number.
const _: () = assert!(MAX_NAME_LEN <= MAX_STRING_LEN);
const _: () = assert!(MAX_NAME_LEN == 255);

pub(super) const U8_BYTES: usize = 1;
pub(super) const U32_BYTES: usize = 4;
pub(super) const U64_BYTES: usize = 8;

// Enum codes. 0 is never used.
pub(super) const KIND_REGULAR: u8 = 1;
const KIND_DIRECTORY: u8 = 2;
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
            other => Err(self.error_at(at, format!("unknown file kind {other}"))),
        }
    }

    pub(super) fn extent_state(&mut self) -> Result<ExtentState> {
        let at = self.pos;
        match self.u8()? {
            STATE_WRITTEN => Ok(ExtentState::Written),
            STATE_UNWRITTEN => Ok(ExtentState::Unwritten),
            other => Err(self.error_at(at, format!("unknown extent state {other}"))),
        }
    }
}

pub(super) fn kind_code(kind: FileKind) -> u8 {
    match kind {
        FileKind::Regular => KIND_REGULAR,
        FileKind::Directory => KIND_DIRECTORY,
    }
}

pub(super) fn state_code(state: ExtentState) -> u8 {
    match state {
        ExtentState::Written => STATE_WRITTEN,
        ExtentState::Unwritten => STATE_UNWRITTEN,
    }
}
