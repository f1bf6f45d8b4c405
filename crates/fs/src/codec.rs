//! Byte encoding of journal records and metadata images.
//!
//! Everything is little-endian. [`Encoder`] appends to a `Vec<u8>`;
//! [`Decoder`] reads from a borrowed slice and never panics: every read is
//! bounds-checked, every count is checked against the bytes that remain
//! before anything is allocated for it, and every failure is an
//! [`Error::Corrupt`] that names the device byte where decoding failed.
//!
//! The encoder refuses (with [`Error::InvalidArgument`]) to write anything the
//! decoder would reject, so a value that encodes always decodes back.
//!
//! The exact byte layouts are documented in `docs/FORMAT.md`.

use crate::error::{Error, Result};
use crate::limits::MAX_NAME_LEN;
use crate::types::{
    DirEntryImage, Extent, ExtentState, FileKind, Ino, InodeImage, MetaImage, Record,
};

/// Bytes of the length prefix of a string.
const STRING_LEN_BYTES: usize = 2;
/// Longest string the encoding can carry.
const MAX_STRING_LEN: usize = u16::MAX as usize;

// Every valid name has an encoding, and [`check_name`]'s message names the
// limit as a number.
const _: () = assert!(MAX_NAME_LEN <= MAX_STRING_LEN);
const _: () = assert!(MAX_NAME_LEN == 255);

const U8_BYTES: usize = 1;
const U32_BYTES: usize = 4;
const U64_BYTES: usize = 8;

// Record tags. 0 is never used, so zeroed bytes never decode as a record.
const TAG_CREATE: u8 = 1;
const TAG_UNLINK: u8 = 2;
const TAG_RENAME: u8 = 3;
const TAG_FREE_INODE: u8 = 4;
const TAG_MAP_UNWRITTEN: u8 = 5;
const TAG_COMPLETE_WRITE: u8 = 6;
const TAG_SET_SIZE: u8 = 7;
const TAG_PUNCH: u8 = 8;

// Enum codes. 0 is never used.
const KIND_REGULAR: u8 = 1;
const KIND_DIRECTORY: u8 = 2;
const STATE_WRITTEN: u8 = 1;
const STATE_UNWRITTEN: u8 = 2;

/// Encoded size of one extent: file_off, len, addr, state.
pub const EXTENT_ENCODED_LEN: usize = 3 * U64_BYTES + U8_BYTES;
/// Encoded size of an inode without its extents and entries: ino, kind,
/// nlink, size, mtime_ns, extent count, entry count.
pub const INODE_FIXED_ENCODED_LEN: usize =
    U64_BYTES + U8_BYTES + U32_BYTES + 2 * U64_BYTES + 2 * U32_BYTES;
/// Smallest encoded directory entry: ino and a one-byte name.
pub const ENTRY_MIN_ENCODED_LEN: usize = U64_BYTES + STRING_LEN_BYTES + 1;
/// Encoded size of the image header: next_ino, inode count.
pub const IMAGE_HEADER_ENCODED_LEN: usize = 2 * U64_BYTES;
/// Smallest encoded record (a tag and one u64: `FreeInode`).
pub const RECORD_MIN_ENCODED_LEN: usize = U8_BYTES + U64_BYTES;

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

/// Appends little-endian values to a byte vector.
#[derive(Clone, Debug, Default)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder::default()
    }

    pub fn with_capacity(capacity: usize) -> Encoder {
        Encoder {
            buf: Vec::with_capacity(capacity),
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Raw bytes, no length prefix.
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
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
    fn count_u32(&mut self, n: usize, what: &str) -> Result<()> {
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

    fn error_at(&self, pos: usize, reason: impl Into<String>) -> Error {
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

    fn kind(&mut self) -> Result<FileKind> {
        let at = self.pos;
        match self.u8()? {
            KIND_REGULAR => Ok(FileKind::Regular),
            KIND_DIRECTORY => Ok(FileKind::Directory),
            other => Err(self.error_at(at, format!("unknown file kind {other}"))),
        }
    }

    fn extent_state(&mut self) -> Result<ExtentState> {
        let at = self.pos;
        match self.u8()? {
            STATE_WRITTEN => Ok(ExtentState::Written),
            STATE_UNWRITTEN => Ok(ExtentState::Unwritten),
            other => Err(self.error_at(at, format!("unknown extent state {other}"))),
        }
    }
}

fn kind_code(kind: FileKind) -> u8 {
    match kind {
        FileKind::Regular => KIND_REGULAR,
        FileKind::Directory => KIND_DIRECTORY,
    }
}

fn state_code(state: ExtentState) -> u8 {
    match state {
        ExtentState::Written => STATE_WRITTEN,
        ExtentState::Unwritten => STATE_UNWRITTEN,
    }
}

// ---------------------------------------------------------------------------
// Records

/// Appends one record. Fails (writing nothing useful; discard the encoder)
/// if a name is invalid.
pub fn encode_record(record: &Record, enc: &mut Encoder) -> Result<()> {
    match record {
        Record::Create {
            ino,
            parent,
            name,
            kind,
            mtime_ns,
        } => {
            enc.u8(TAG_CREATE);
            enc.u64(*ino);
            enc.u64(*parent);
            enc.name(name)?;
            enc.u8(kind_code(*kind));
            enc.u64(*mtime_ns);
        }
        Record::Unlink { parent, name } => {
            enc.u8(TAG_UNLINK);
            enc.u64(*parent);
            enc.name(name)?;
        }
        Record::Rename {
            src_parent,
            src_name,
            dst_parent,
            dst_name,
        } => {
            enc.u8(TAG_RENAME);
            enc.u64(*src_parent);
            enc.name(src_name)?;
            enc.u64(*dst_parent);
            enc.name(dst_name)?;
        }
        Record::FreeInode { ino } => {
            enc.u8(TAG_FREE_INODE);
            enc.u64(*ino);
        }
        Record::MapUnwritten {
            ino,
            file_off,
            len,
            addr,
        } => {
            enc.u8(TAG_MAP_UNWRITTEN);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*addr);
        }
        Record::CompleteWrite {
            ino,
            file_off,
            len,
            min_size,
            mtime_ns,
        } => {
            enc.u8(TAG_COMPLETE_WRITE);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*min_size);
            enc.u64(*mtime_ns);
        }
        Record::SetSize {
            ino,
            size,
            mtime_ns,
        } => {
            enc.u8(TAG_SET_SIZE);
            enc.u64(*ino);
            enc.u64(*size);
            enc.u64(*mtime_ns);
        }
        Record::Punch {
            ino,
            file_off,
            len,
            mtime_ns,
        } => {
            enc.u8(TAG_PUNCH);
            enc.u64(*ino);
            enc.u64(*file_off);
            enc.u64(*len);
            enc.u64(*mtime_ns);
        }
    }
    Ok(())
}

/// Bytes [`encode_record`] appends for `record`.
pub fn record_encoded_len(record: &Record) -> usize {
    let string = |s: &String| STRING_LEN_BYTES + s.len();
    U8_BYTES
        + match record {
            Record::Create { name, .. } => 3 * U64_BYTES + string(name) + U8_BYTES,
            Record::Unlink { name, .. } => U64_BYTES + string(name),
            Record::Rename {
                src_name, dst_name, ..
            } => 2 * U64_BYTES + string(src_name) + string(dst_name),
            Record::FreeInode { .. } => U64_BYTES,
            Record::MapUnwritten { .. } => 4 * U64_BYTES,
            Record::CompleteWrite { .. } => 5 * U64_BYTES,
            Record::SetSize { .. } => 3 * U64_BYTES,
            Record::Punch { .. } => 4 * U64_BYTES,
        }
}

/// Reads one record.
pub fn decode_record(dec: &mut Decoder<'_>) -> Result<Record> {
    let at = dec.position();
    let tag = dec.u8()?;
    let record = match tag {
        TAG_CREATE => Record::Create {
            ino: dec.u64()?,
            parent: dec.u64()?,
            name: dec.name()?,
            kind: dec.kind()?,
            mtime_ns: dec.u64()?,
        },
        TAG_UNLINK => Record::Unlink {
            parent: dec.u64()?,
            name: dec.name()?,
        },
        TAG_RENAME => Record::Rename {
            src_parent: dec.u64()?,
            src_name: dec.name()?,
            dst_parent: dec.u64()?,
            dst_name: dec.name()?,
        },
        TAG_FREE_INODE => Record::FreeInode { ino: dec.u64()? },
        TAG_MAP_UNWRITTEN => Record::MapUnwritten {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            addr: dec.u64()?,
        },
        TAG_COMPLETE_WRITE => Record::CompleteWrite {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            min_size: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        TAG_SET_SIZE => Record::SetSize {
            ino: dec.u64()?,
            size: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        TAG_PUNCH => Record::Punch {
            ino: dec.u64()?,
            file_off: dec.u64()?,
            len: dec.u64()?,
            mtime_ns: dec.u64()?,
        },
        other => return Err(dec.error_at(at, format!("unknown record tag {other}"))),
    };
    Ok(record)
}

// ---------------------------------------------------------------------------
// Images

/// Encodes a whole metadata image. Fails if the image breaks an invariant
/// the decoder checks (see [`decode_image`]), so that whatever is written
/// can be read back.
pub fn encode_image(image: &MetaImage) -> Result<Vec<u8>> {
    // Refuse to write an image we would refuse to read.
    check_image(image).map_err(|reason| Error::invalid("encoding the metadata image", reason))?;
    let len = usize::try_from(image_encoded_len(image))
        .map_err(|_| Error::invalid("encoding the metadata image", "image larger than memory"))?;
    let mut enc = Encoder::with_capacity(len);
    enc.u64(image.next_ino);
    enc.u64(image.inodes.len() as u64);
    for inode in &image.inodes {
        enc.u64(inode.ino);
        enc.u8(kind_code(inode.kind));
        enc.u32(inode.nlink);
        enc.u64(inode.size);
        enc.u64(inode.mtime_ns);
        enc.count_u32(inode.extents.len(), "extents")?;
        enc.count_u32(inode.entries.len(), "directory entries")?;
        for e in &inode.extents {
            enc.u64(e.file_off);
            enc.u64(e.len);
            enc.u64(e.addr);
            enc.u8(state_code(e.state));
        }
        for d in &inode.entries {
            enc.u64(d.ino);
            enc.name(&d.name)?;
        }
    }
    debug_assert_eq!(enc.len(), len);
    Ok(enc.into_bytes())
}

/// Bytes [`encode_image`] produces for `image`, computed without encoding.
pub fn image_encoded_len(image: &MetaImage) -> u64 {
    let mut len = IMAGE_HEADER_ENCODED_LEN as u64;
    for inode in &image.inodes {
        len += INODE_FIXED_ENCODED_LEN as u64;
        len += (inode.extents.len() * EXTENT_ENCODED_LEN) as u64;
        for d in &inode.entries {
            len += (U64_BYTES + STRING_LEN_BYTES + d.name.len()) as u64;
        }
    }
    len
}

/// Decodes a whole image from `bytes` (which must hold exactly one image);
/// errors name offsets relative to the start of `bytes`.
pub fn decode_image(bytes: &[u8]) -> Result<MetaImage> {
    decode_image_at(bytes, 0, "metadata image")
}

/// As [`decode_image`], for bytes read from device byte `base`; errors name
/// `what` and device offsets.
pub fn decode_image_at(bytes: &[u8], base: u64, what: &'static str) -> Result<MetaImage> {
    let mut dec = Decoder::new(bytes, base, what);
    let next_ino = dec.u64()?;
    let inode_count = dec.count_u64(INODE_FIXED_ENCODED_LEN, "inode")?;
    let mut inodes: Vec<InodeImage> = Vec::with_capacity(inode_count);
    for _ in 0..inode_count {
        let at = dec.position();
        let inode = decode_inode(&mut dec)?;
        if let Some(prev) = inodes.last() {
            if inode.ino <= prev.ino {
                return Err(dec.error_at(
                    at,
                    format!("inode {} follows inode {}: not sorted", inode.ino, prev.ino),
                ));
            }
        }
        if inode.ino >= next_ino {
            return Err(dec.error_at(
                at,
                format!("inode {} is not below next_ino {next_ino}", inode.ino),
            ));
        }
        inodes.push(inode);
    }
    dec.finish()?;
    Ok(MetaImage { next_ino, inodes })
}

fn decode_inode(dec: &mut Decoder<'_>) -> Result<InodeImage> {
    let at = dec.position();
    let ino: Ino = dec.u64()?;
    if ino == 0 {
        return Err(dec.error_at(at, "inode number 0"));
    }
    let kind = dec.kind()?;
    let nlink = dec.u32()?;
    let size = dec.u64()?;
    let mtime_ns = dec.u64()?;
    let counts_at = dec.position();
    let extent_count = dec.u32()?;
    let entry_count = dec.u32()?;
    // Both lists must fit in what remains; check before allocating.
    let needed = u64::from(extent_count) * EXTENT_ENCODED_LEN as u64
        + u64::from(entry_count) * ENTRY_MIN_ENCODED_LEN as u64;
    if needed > dec.remaining() as u64 {
        return Err(dec.error_at(
            counts_at,
            format!(
                "inode {ino}: {extent_count} extents and {entry_count} entries cannot fit in the {} bytes that remain",
                dec.remaining()
            ),
        ));
    }
    if kind == FileKind::Directory && extent_count != 0 {
        return Err(dec.error_at(counts_at, format!("directory {ino} has extents")));
    }
    if kind == FileKind::Regular && entry_count != 0 {
        return Err(dec.error_at(counts_at, format!("regular file {ino} has entries")));
    }
    let mut extents: Vec<Extent> = Vec::with_capacity(extent_count as usize);
    for _ in 0..extent_count {
        let at = dec.position();
        let e = Extent {
            file_off: dec.u64()?,
            len: dec.u64()?,
            addr: dec.u64()?,
            state: dec.extent_state()?,
        };
        check_extent(&e, extents.last())
            .map_err(|reason| dec.error_at(at, format!("inode {ino}: {reason}")))?;
        extents.push(e);
    }
    let mut entries: Vec<DirEntryImage> = Vec::with_capacity(entry_count as usize);
    for _ in 0..entry_count {
        let at = dec.position();
        let entry_ino = dec.u64()?;
        let name = dec.name()?;
        if entry_ino == 0 {
            return Err(dec.error_at(at, format!("directory {ino}: entry {name:?} names inode 0")));
        }
        if let Some(prev) = entries.last() {
            if name <= prev.name {
                return Err(dec.error_at(
                    at,
                    format!(
                        "directory {ino}: entry {name:?} follows {:?}: not sorted",
                        prev.name
                    ),
                ));
            }
        }
        entries.push(DirEntryImage {
            name,
            ino: entry_ino,
        });
    }
    Ok(InodeImage {
        ino,
        kind,
        nlink,
        size,
        mtime_ns,
        extents,
        entries,
    })
}

/// An extent must be non-empty, must not overflow, and must start at or
/// after the end of the previous one.
fn check_extent(e: &Extent, prev: Option<&Extent>) -> std::result::Result<(), String> {
    if e.len == 0 {
        return Err(format!("empty extent at file offset {}", e.file_off));
    }
    if e.file_off.checked_add(e.len).is_none() || e.addr.checked_add(e.len).is_none() {
        return Err(format!(
            "extent at file offset {} length {} address {} overflows",
            e.file_off, e.len, e.addr
        ));
    }
    if let Some(p) = prev {
        if e.file_off < p.file_end() {
            return Err(format!(
                "extent at file offset {} overlaps or precedes the one ending at {}",
                e.file_off,
                p.file_end()
            ));
        }
    }
    Ok(())
}

/// The invariants [`decode_image`] checks, on an in-memory image.
fn check_image(image: &MetaImage) -> std::result::Result<(), String> {
    let mut prev_ino: Option<Ino> = None;
    for inode in &image.inodes {
        let ino = inode.ino;
        if ino == 0 {
            return Err("inode number 0".into());
        }
        if prev_ino.is_some_and(|p| ino <= p) {
            return Err(format!("inode {ino} is not sorted"));
        }
        if ino >= image.next_ino {
            return Err(format!(
                "inode {ino} is not below next_ino {}",
                image.next_ino
            ));
        }
        prev_ino = Some(ino);
        match inode.kind {
            FileKind::Directory if !inode.extents.is_empty() => {
                return Err(format!("directory {ino} has extents"))
            }
            FileKind::Regular if !inode.entries.is_empty() => {
                return Err(format!("regular file {ino} has entries"))
            }
            _ => {}
        }
        let mut prev: Option<&Extent> = None;
        for e in &inode.extents {
            check_extent(e, prev).map_err(|r| format!("inode {ino}: {r}"))?;
            prev = Some(e);
        }
        let mut prev_name: Option<&str> = None;
        for d in &inode.entries {
            check_name(&d.name).map_err(|r| format!("directory {ino}: {r}"))?;
            if d.ino == 0 {
                return Err(format!("directory {ino}: entry {:?} names inode 0", d.name));
            }
            if prev_name.is_some_and(|p| d.name.as_str() <= p) {
                return Err(format!("directory {ino}: entry {:?} is not sorted", d.name));
            }
            prev_name = Some(&d.name);
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn all_records() -> Vec<Record> {
        vec![
            Record::Create {
                ino: 7,
                parent: 1,
                name: "hello.txt".into(),
                kind: FileKind::Regular,
                mtime_ns: 123,
            },
            Record::Create {
                ino: 8,
                parent: 7,
                name: "d".repeat(MAX_NAME_LEN),
                kind: FileKind::Directory,
                mtime_ns: u64::MAX,
            },
            Record::Unlink {
                parent: 1,
                name: "ünïcødé".into(),
            },
            Record::Rename {
                src_parent: 1,
                src_name: "a".into(),
                dst_parent: 2,
                dst_name: "b".into(),
            },
            Record::FreeInode { ino: 9 },
            Record::MapUnwritten {
                ino: 9,
                file_off: 4096,
                len: 8192,
                addr: 1 << 40,
            },
            Record::CompleteWrite {
                ino: 9,
                file_off: 0,
                len: 4096,
                min_size: 100,
                mtime_ns: 5,
            },
            Record::SetSize {
                ino: 9,
                size: 0,
                mtime_ns: 6,
            },
            Record::Punch {
                ino: 9,
                file_off: 4096,
                len: 4096,
                mtime_ns: 7,
            },
        ]
    }

    fn random_name(rng: &mut SmallRng) -> String {
        let len = rng.gen_range(1..=20);
        (0..len)
            .map(|_| char::from(rng.gen_range(b'a'..=b'z')))
            .collect()
    }

    pub(crate) fn random_image(rng: &mut SmallRng, inodes: usize) -> MetaImage {
        let mut out = Vec::new();
        let mut ino = 0;
        for _ in 0..inodes {
            ino += rng.gen_range(1..5u64);
            let dir = rng.gen_bool(0.3);
            let mut extents = Vec::new();
            let mut entries = Vec::new();
            if dir {
                let mut names: Vec<String> =
                    (0..rng.gen_range(0..6)).map(|_| random_name(rng)).collect();
                names.sort();
                names.dedup();
                entries = names
                    .into_iter()
                    .map(|name| DirEntryImage {
                        name,
                        ino: rng.gen_range(1..1000),
                    })
                    .collect();
            } else {
                let mut off = 0u64;
                for _ in 0..rng.gen_range(0..6) {
                    off += rng.gen_range(0..4u64) * 4096;
                    let len = rng.gen_range(1..8u64) * 4096;
                    extents.push(Extent {
                        file_off: off,
                        len,
                        addr: rng.gen_range(0..1u64 << 30) * 4096,
                        state: if rng.gen() {
                            ExtentState::Written
                        } else {
                            ExtentState::Unwritten
                        },
                    });
                    off += len;
                }
            }
            out.push(InodeImage {
                ino,
                kind: if dir {
                    FileKind::Directory
                } else {
                    FileKind::Regular
                },
                nlink: rng.gen_range(0..2),
                size: rng.gen(),
                mtime_ns: rng.gen(),
                extents,
                entries,
            });
        }
        MetaImage {
            next_ino: ino + 1,
            inodes: out,
        }
    }

    #[test]
    fn records_round_trip() {
        for r in all_records() {
            let mut enc = Encoder::new();
            encode_record(&r, &mut enc).unwrap();
            assert_eq!(enc.len(), record_encoded_len(&r), "{r:?}");
            let bytes = enc.into_bytes();
            let mut dec = Decoder::new(&bytes, 0, "test");
            assert_eq!(decode_record(&mut dec).unwrap(), r);
            dec.finish().unwrap();
        }
    }

    #[test]
    fn record_truncations_and_flips_never_panic() {
        let mut rng = SmallRng::seed_from_u64(1);
        for r in all_records() {
            let mut enc = Encoder::new();
            encode_record(&r, &mut enc).unwrap();
            let bytes = enc.into_bytes();
            for cut in 0..bytes.len() {
                let mut dec = Decoder::new(&bytes[..cut], 100, "test");
                assert!(decode_record(&mut dec).is_err(), "cut {cut} of {r:?}");
            }
            for _ in 0..2000 {
                let mut b = bytes.clone();
                let i = rng.gen_range(0..b.len());
                b[i] ^= 1 << rng.gen_range(0..8);
                let mut dec = Decoder::new(&b, 0, "test");
                let _ = decode_record(&mut dec);
            }
        }
    }

    #[test]
    fn invalid_names_are_refused_both_ways() {
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            let r = Record::Unlink {
                parent: 1,
                name: bad.to_string(),
            };
            let mut enc = Encoder::new();
            assert!(encode_record(&r, &mut enc).is_err(), "{bad:?}");
            // Hand-encode it anyway: the decoder refuses it.
            let mut enc = Encoder::new();
            enc.u8(TAG_UNLINK);
            enc.u64(1);
            enc.string(bad).unwrap();
            let bytes = enc.into_bytes();
            let err = decode_record(&mut Decoder::new(&bytes, 1000, "test")).unwrap_err();
            match err {
                Error::Corrupt { offset, .. } => assert_eq!(offset, 1009),
                other => panic!("{other}"),
            }
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert!(Encoder::new().name(&long).is_err());
        let mut enc = Encoder::new();
        enc.string(&long).unwrap();
        assert!(Decoder::new(enc.as_bytes(), 0, "t").name().is_err());
        // Bad UTF-8.
        let bytes = [2u8, 0, 0xff, 0xfe];
        assert!(Decoder::new(&bytes, 0, "t").string().is_err());
    }

    #[test]
    fn bad_tags_and_enums_are_rejected() {
        for tag in [0u8, 9, 255] {
            let bytes = [tag; 64];
            let err = decode_record(&mut Decoder::new(&bytes, 5, "test")).unwrap_err();
            assert!(err.to_string().contains("unknown record tag"), "{err}");
            assert!(err.to_string().contains("byte 5"), "{err}");
        }
        let mut enc = Encoder::new();
        encode_record(
            &Record::Create {
                ino: 2,
                parent: 1,
                name: "x".into(),
                kind: FileKind::Regular,
                mtime_ns: 0,
            },
            &mut enc,
        )
        .unwrap();
        let mut bytes = enc.into_bytes();
        let kind_at = 1 + 8 + 8 + 2 + 1;
        bytes[kind_at] = 3;
        let err = decode_record(&mut Decoder::new(&bytes, 0, "test")).unwrap_err();
        assert!(err.to_string().contains("unknown file kind 3"), "{err}");
    }

    #[test]
    fn image_round_trip() {
        let mut rng = SmallRng::seed_from_u64(2);
        for n in [0, 1, 10, 200] {
            let image = random_image(&mut rng, n);
            let bytes = encode_image(&image).unwrap();
            assert_eq!(bytes.len() as u64, image_encoded_len(&image));
            assert_eq!(decode_image(&bytes).unwrap(), image);
        }
    }

    #[test]
    fn image_truncations_and_flips_never_panic() {
        let mut rng = SmallRng::seed_from_u64(3);
        let image = random_image(&mut rng, 12);
        let bytes = encode_image(&image).unwrap();
        for cut in 0..bytes.len() {
            assert!(decode_image(&bytes[..cut]).is_err(), "cut {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(decode_image(&extra).is_err());
        for _ in 0..10_000 {
            let mut b = bytes.clone();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..b.len());
                b[i] = rng.gen();
            }
            let _ = decode_image(&b);
        }
        for _ in 0..2000 {
            let len = rng.gen_range(0..200);
            let b: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let _ = decode_image(&b);
        }
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut enc = Encoder::new();
        enc.u64(10);
        enc.u64(u64::MAX);
        let err = decode_image(enc.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");

        let mut enc = Encoder::new();
        enc.u64(10);
        enc.u64(1);
        enc.u64(2);
        enc.u8(KIND_REGULAR);
        enc.u32(1);
        enc.u64(0);
        enc.u64(0);
        enc.u32(u32::MAX);
        enc.u32(u32::MAX);
        let err = decode_image(enc.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");
    }

    #[test]
    fn image_invariants_are_checked() {
        let file = |ino, extents| InodeImage {
            ino,
            kind: FileKind::Regular,
            nlink: 1,
            size: 0,
            mtime_ns: 0,
            extents,
            entries: vec![],
        };
        let ext = |file_off, len| Extent {
            file_off,
            len,
            addr: 0,
            state: ExtentState::Written,
        };
        let bad = [
            MetaImage {
                next_ino: 5,
                inodes: vec![file(3, vec![]), file(2, vec![])],
            },
            MetaImage {
                next_ino: 3,
                inodes: vec![file(3, vec![])],
            },
            MetaImage {
                next_ino: 5,
                inodes: vec![file(0, vec![])],
            },
            MetaImage {
                next_ino: 5,
                inodes: vec![file(2, vec![ext(0, 8192), ext(4096, 4096)])],
            },
            MetaImage {
                next_ino: 5,
                inodes: vec![file(2, vec![ext(0, 0)])],
            },
            MetaImage {
                next_ino: 5,
                inodes: vec![file(2, vec![ext(u64::MAX - 10, 4096)])],
            },
        ];
        for image in bad {
            assert!(encode_image(&image).is_err(), "{image:?}");
        }
        // Hand-encode an unsorted image: the decoder refuses it.
        let mut enc = Encoder::new();
        enc.u64(10);
        enc.u64(2);
        for ino in [3u64, 2] {
            enc.u64(ino);
            enc.u8(KIND_REGULAR);
            enc.u32(1);
            enc.u64(0);
            enc.u64(0);
            enc.u32(0);
            enc.u32(0);
        }
        let err = decode_image(enc.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("not sorted"), "{err}");
    }
}
