//! The checkpoint's metadata image: every inode with its extents and
//! directory entries, sorted, checked on the way in and out.

use super::primitive::{
    check_attrs, check_name, check_symlink_target, check_xattr_name, kind_code, state_code,
    Decoder, Encoder, ATTRS_ENCODED_LEN, BYTES_LEN_BYTES, STRING_LEN_BYTES, U16_BYTES, U32_BYTES,
    U64_BYTES, U8_BYTES,
};
use crate::error::{Error, Result};
use crate::limits::{MAX_XATTR_BYTES_PER_INODE, XATTR_USER_PREFIX};
use crate::types::{DirEntryImage, Extent, FileKind, Ino, InodeImage, MetaImage, XattrImage};

/// Encoded size of one extent: file_off, len, addr, state.
pub const EXTENT_ENCODED_LEN: usize = 3 * U64_BYTES + U8_BYTES;
/// Encoded size of an inode without its extents, entries, xattrs and
/// target bytes: ino, kind, nlink, size, attrs length and attrs, extent,
/// entry and xattr counts, target length.
pub const INODE_FIXED_ENCODED_LEN: usize = U64_BYTES
    + U8_BYTES
    + U32_BYTES
    + U64_BYTES
    + U16_BYTES
    + ATTRS_ENCODED_LEN
    + 3 * U32_BYTES
    + BYTES_LEN_BYTES;
/// Smallest encoded directory entry: ino and a one-byte name.
pub const ENTRY_MIN_ENCODED_LEN: usize = U64_BYTES + STRING_LEN_BYTES + 1;
/// An extended attribute's encoding without its name and value bytes.
pub const XATTR_OVERHEAD_ENCODED_LEN: usize = STRING_LEN_BYTES + BYTES_LEN_BYTES;
/// Smallest encoded extended attribute: a one-byte name after `user.`, an
/// empty value.
pub const XATTR_MIN_ENCODED_LEN: usize = XATTR_OVERHEAD_ENCODED_LEN + XATTR_USER_PREFIX.len() + 1;
/// Encoded size of the image header: next_ino, inode count.
pub const IMAGE_HEADER_ENCODED_LEN: usize = 2 * U64_BYTES;

/// Encodes a whole metadata image. Fails if the image breaks an invariant
/// the decoder checks (see [`decode_image`]), so that whatever is written
/// can be read back.
pub fn encode_image(image: &MetaImage) -> Result<Vec<u8>> {
    encode_image_after(0, image)
}

/// [`encode_image`] after `room` zero bytes, which a caller fills with a
/// header: a record of hundreds of megabytes is then built once, not
/// encoded and copied behind its header.
pub fn encode_image_after(room: usize, image: &MetaImage) -> Result<Vec<u8>> {
    let inodes: Vec<(&InodeImage, &dyn ExtentSource)> = image
        .inodes
        .iter()
        .map(|i| (i, &i.extents as &dyn ExtentSource))
        .collect();
    encode_image_from(room, image.next_ino, &inodes)
}

/// A file's extents in file order, wherever they are kept: an image's
/// vector, or the live extent map, which a whole checkpoint then encodes
/// without first copying every extent into an image.
pub trait ExtentSource {
    fn extent_count(&self) -> usize;
    /// Calls `f` with each extent in order, stopping at its first error.
    fn try_each(&self, f: &mut dyn FnMut(&Extent) -> Result<()>) -> Result<()>;
}

impl ExtentSource for Vec<Extent> {
    fn extent_count(&self) -> usize {
        self.len()
    }

    fn try_each(&self, f: &mut dyn FnMut(&Extent) -> Result<()>) -> Result<()> {
        self.iter().try_for_each(f)
    }
}

/// [`encode_image_after`] for an image given as inodes (their own
/// `extents` ignored) each with its extents, sorted by inode number.
/// Checks what [`decode_image`] checks, the extents as they are encoded.
pub fn encode_image_from(
    room: usize,
    next_ino: Ino,
    inodes: &[(&InodeImage, &dyn ExtentSource)],
) -> Result<Vec<u8>> {
    let invalid = |reason: String| Error::invalid("encoding the metadata image", reason);
    let mut len = IMAGE_HEADER_ENCODED_LEN as u64;
    let mut prev_ino: Option<Ino> = None;
    for &(inode, extents) in inodes {
        // Refuse to write an image we would refuse to read.
        check_inode_order(inode.ino, prev_ino, next_ino).map_err(invalid)?;
        prev_ino = Some(inode.ino);
        check_inode_fields(inode, extents.extent_count() > 0).map_err(invalid)?;
        len +=
            inode_fields_encoded_len(inode) + (extents.extent_count() * EXTENT_ENCODED_LEN) as u64;
    }
    let len = usize::try_from(len).map_err(|_| invalid("image larger than memory".to_string()))?;
    let mut enc = Encoder::with_capacity(room + len);
    enc.bytes(&vec![0; room]);
    enc.u64(next_ino);
    enc.u64(inodes.len() as u64);
    for &(inode, extents) in inodes {
        let count = extents.extent_count();
        encode_inode_head(&mut enc, inode, count)?;
        let mut prev: Option<Extent> = None;
        let mut encoded = 0usize;
        extents.try_each(&mut |e| {
            check_extent(e, prev.as_ref())
                .map_err(|r| invalid(format!("inode {}: {r}", inode.ino)))?;
            prev = Some(*e);
            encode_extent(&mut enc, e);
            encoded += 1;
            Ok(())
        })?;
        // The count went out before the extents: a source whose count and
        // extents disagree would leave a record whose crc verifies and which
        // does not decode (a lost checkpoint at the next mount).
        if encoded != count {
            return Err(invalid(format!(
                "inode {}: {encoded} extents encoded under a count of {count}",
                inode.ino
            )));
        }
        encode_inode_tail(&mut enc, inode)?;
    }
    debug_assert_eq!(enc.len(), room + len);
    Ok(enc.into_bytes())
}

/// Appends one inode as the image stores it ([`inode_encoded_len`] bytes).
/// The caller has checked it ([`check_inode`]).
pub(super) fn encode_inode(enc: &mut Encoder, inode: &InodeImage) -> Result<()> {
    encode_inode_head(enc, inode, inode.extents.len())?;
    for e in &inode.extents {
        encode_extent(enc, e);
    }
    encode_inode_tail(enc, inode)
}

/// An inode's fixed fields and counts, before its extents.
fn encode_inode_head(enc: &mut Encoder, inode: &InodeImage, extents: usize) -> Result<()> {
    enc.u64(inode.ino);
    enc.u8(kind_code(inode.kind));
    enc.u32(inode.nlink);
    enc.u64(inode.size);
    enc.u16(ATTRS_ENCODED_LEN as u16);
    enc.attrs(&inode.attrs)?;
    enc.count_u32(extents, "extents")?;
    enc.count_u32(inode.entries.len(), "directory entries")?;
    enc.count_u32(inode.xattrs.len(), "extended attributes")
}

pub(super) fn encode_extent(enc: &mut Encoder, e: &Extent) {
    enc.u64(e.file_off);
    enc.u64(e.len);
    enc.u64(e.addr);
    enc.u8(state_code(e.state));
}

/// One extent as [`encode_extent`] writes it, unchecked.
/// An extent from its [`EXTENT_ENCODED_LEN`] bytes, `None` if its state
/// is unknown ([`decode_extent`] then says so): the loop over a page's
/// fixed-size records, whose length is checked once before it, without a
/// bounds check and an error path per field (a page read on demand
/// decodes 250 of them, and mount's free-space scan every one).
pub(super) fn extent_from_record(record: &[u8; EXTENT_ENCODED_LEN]) -> Option<Extent> {
    let word = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&record[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    Some(Extent {
        file_off: word(0),
        len: word(8),
        addr: word(16),
        state: super::primitive::extent_state_of(record[24])?,
    })
}

pub(super) fn decode_extent(dec: &mut Decoder<'_>) -> Result<Extent> {
    Ok(Extent {
        file_off: dec.u64()?,
        len: dec.u64()?,
        addr: dec.u64()?,
        state: dec.extent_state()?,
    })
}

/// An inode's entries, xattrs and target, after its extents.
fn encode_inode_tail(enc: &mut Encoder, inode: &InodeImage) -> Result<()> {
    for d in &inode.entries {
        enc.u64(d.ino);
        enc.name(&d.name)?;
    }
    for x in &inode.xattrs {
        enc.xattr_name(&x.name)?;
        enc.xattr_value(&x.value)?;
    }
    enc.byte_string(&inode.target)
}

/// Bytes [`encode_image`] produces for `image`, computed without encoding.
pub fn image_encoded_len(image: &MetaImage) -> u64 {
    let mut len = IMAGE_HEADER_ENCODED_LEN as u64;
    for inode in &image.inodes {
        len += inode_encoded_len(inode);
    }
    len
}

/// Bytes one inode takes in the image.
pub fn inode_encoded_len(inode: &InodeImage) -> u64 {
    inode_fields_encoded_len(inode) + (inode.extents.len() * EXTENT_ENCODED_LEN) as u64
}

/// Bytes one inode takes in the image, but for its extents.
fn inode_fields_encoded_len(inode: &InodeImage) -> u64 {
    let mut len = INODE_FIXED_ENCODED_LEN as u64;
    for d in &inode.entries {
        len += (U64_BYTES + STRING_LEN_BYTES + d.name.len()) as u64;
    }
    for x in &inode.xattrs {
        len += (XATTR_OVERHEAD_ENCODED_LEN + x.name.len() + x.value.len()) as u64;
    }
    len + inode.target.len() as u64
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

pub(super) fn decode_inode(dec: &mut Decoder<'_>) -> Result<InodeImage> {
    let at = dec.position();
    let ino: Ino = dec.u64()?;
    if ino == 0 {
        return Err(dec.error_at(at, "inode number 0"));
    }
    let kind = dec.kind()?;
    let nlink = dec.u32()?;
    let size = dec.u64()?;
    let attrs_at = dec.position();
    let attrs_len = usize::from(dec.u16()?);
    if attrs_len < ATTRS_ENCODED_LEN {
        return Err(dec.error_at(
            attrs_at,
            format!("inode {ino}: attributes of {attrs_len} bytes, fewer than {ATTRS_ENCODED_LEN}"),
        ));
    }
    let attrs = dec.attrs()?;
    // Attributes a later format appends are skipped, whatever the feature
    // bits say; this build writes them back without them. FORMAT.md leaves
    // it to such a format to set a ro_compat bit, which keeps this build
    // from writing the volume at all (the superblock's check, not this).
    dec.bytes(attrs_len - ATTRS_ENCODED_LEN)?;
    let counts_at = dec.position();
    let extent_count = dec.u32()?;
    let entry_count = dec.u32()?;
    let xattr_count = dec.u32()?;
    // Every list must fit in what remains; check before allocating.
    let needed = u64::from(extent_count) * EXTENT_ENCODED_LEN as u64
        + u64::from(entry_count) * ENTRY_MIN_ENCODED_LEN as u64
        + u64::from(xattr_count) * XATTR_MIN_ENCODED_LEN as u64;
    if needed > dec.remaining() as u64 {
        return Err(dec.error_at(
            counts_at,
            format!(
                "inode {ino}: {extent_count} extents, {entry_count} entries and {xattr_count} xattrs cannot fit in the {} bytes that remain",
                dec.remaining()
            ),
        ));
    }
    check_kind_shape(
        kind,
        ino,
        extent_count > 0,
        entry_count > 0,
        size,
        attrs.rdev,
    )
    .map_err(|reason| dec.error_at(counts_at, reason))?;
    let mut extents: Vec<Extent> = Vec::with_capacity(extent_count as usize);
    for _ in 0..extent_count {
        let at = dec.position();
        let e = decode_extent(dec)?;
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
    let mut xattrs: Vec<XattrImage> = Vec::with_capacity(xattr_count as usize);
    let mut xattr_bytes = 0usize;
    for _ in 0..xattr_count {
        let at = dec.position();
        let name = dec.xattr_name()?;
        let value = dec.xattr_value()?;
        if xattrs.last().is_some_and(|p: &XattrImage| name <= p.name) {
            return Err(dec.error_at(at, format!("inode {ino}: xattr {name:?} not sorted")));
        }
        xattr_bytes += name.len() + value.len();
        if xattr_bytes > MAX_XATTR_BYTES_PER_INODE {
            return Err(dec.error_at(
                at,
                format!("inode {ino}: xattrs exceed {MAX_XATTR_BYTES_PER_INODE} bytes"),
            ));
        }
        xattrs.push(XattrImage { name, value });
    }
    let target = if kind == FileKind::Symlink {
        dec.symlink_target()?
    } else {
        // Length 0 or an error: only symlinks have a target.
        dec.byte_string(0, "target of a non-symlink")?
    };
    Ok(InodeImage {
        ino,
        kind,
        nlink,
        size,
        attrs,
        extents,
        entries,
        xattrs,
        target,
    })
}

/// What each kind may hold: extents and a size only in regular files
/// (a symlink's size is its target's length, not stored), entries only in
/// directories, a device number only in device nodes.
fn check_kind_shape(
    kind: FileKind,
    ino: Ino,
    has_extents: bool,
    has_entries: bool,
    size: u64,
    rdev: u64,
) -> std::result::Result<(), String> {
    if kind != FileKind::Regular && has_extents {
        return Err(format!("{kind:?} {ino} has extents"));
    }
    if kind != FileKind::Directory && has_entries {
        return Err(format!("{kind:?} {ino} has entries"));
    }
    if kind != FileKind::Regular && size != 0 {
        return Err(format!("{kind:?} {ino} has size {size}"));
    }
    if !matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) && rdev != 0 {
        return Err(format!("{kind:?} {ino} has a device number"));
    }
    Ok(())
}

/// An extent must be non-empty, must not overflow, and must start at or
/// after the end of the previous one.
pub fn check_extent(e: &Extent, prev: Option<&Extent>) -> std::result::Result<(), String> {
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

/// An image's inode numbers: not 0, sorted, below `next_ino`.
fn check_inode_order(
    ino: Ino,
    prev: Option<Ino>,
    next_ino: Ino,
) -> std::result::Result<(), String> {
    if ino == 0 {
        return Err("inode number 0".into());
    }
    if prev.is_some_and(|p| ino <= p) {
        return Err(format!("inode {ino} is not sorted"));
    }
    if ino >= next_ino {
        return Err(format!("inode {ino} is not below next_ino {next_ino}"));
    }
    Ok(())
}

/// The invariants the decoder checks for one inode, on an in-memory one.
pub fn check_inode(inode: &InodeImage) -> std::result::Result<(), String> {
    check_inode_fields(inode, !inode.extents.is_empty())?;
    let mut prev: Option<&Extent> = None;
    for e in &inode.extents {
        check_extent(e, prev).map_err(|r| format!("inode {}: {r}", inode.ino))?;
        prev = Some(e);
    }
    Ok(())
}

/// [`check_inode`] but for its extents, of which it has some or none.
fn check_inode_fields(inode: &InodeImage, has_extents: bool) -> std::result::Result<(), String> {
    let ino = inode.ino;
    check_kind_shape(
        inode.kind,
        ino,
        has_extents,
        !inode.entries.is_empty(),
        inode.size,
        inode.attrs.rdev,
    )?;
    check_attrs(&inode.attrs).map_err(|r| format!("inode {ino}: {r}"))?;
    if inode.kind == FileKind::Symlink {
        check_symlink_target(&inode.target).map_err(|r| format!("inode {ino}: {r}"))?;
    } else if !inode.target.is_empty() {
        return Err(format!("inode {ino}: a {:?} with a target", inode.kind));
    }
    let mut xattr_bytes = 0;
    let mut prev_xattr: Option<&str> = None;
    for x in &inode.xattrs {
        check_xattr_name(&x.name).map_err(|r| format!("inode {ino}: {r}"))?;
        if prev_xattr.is_some_and(|p| x.name.as_str() <= p) {
            return Err(format!("inode {ino}: xattr {:?} is not sorted", x.name));
        }
        prev_xattr = Some(&x.name);
        xattr_bytes += x.name.len() + x.value.len();
    }
    if xattr_bytes > MAX_XATTR_BYTES_PER_INODE {
        return Err(format!(
            "inode {ino}: xattrs exceed {MAX_XATTR_BYTES_PER_INODE} bytes"
        ));
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
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::codec::primitive::KIND_REGULAR;
    use crate::types::{ExtentState, InodeAttrs, Timestamp};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

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
            // Some non-directories are symlinks or special files instead.
            let kind = if dir {
                FileKind::Directory
            } else {
                match rng.gen_range(0..8) {
                    0 => FileKind::Symlink,
                    1 => FileKind::Fifo,
                    2 => FileKind::BlockDevice,
                    _ => FileKind::Regular,
                }
            };
            if kind != FileKind::Regular {
                extents.clear();
            }
            let mut attrs = InodeAttrs::new(
                rng.gen_range(0..0o10000),
                rng.gen(),
                rng.gen(),
                Timestamp {
                    sec: rng.gen(),
                    nsec: rng.gen_range(0..1_000_000_000),
                },
            );
            attrs.atime.sec = rng.gen();
            if kind == FileKind::BlockDevice {
                attrs.rdev = rng.gen();
            }
            let mut names: Vec<String> = (0..rng.gen_range(0..3))
                .map(|_| format!("user.{}", random_name(rng)))
                .collect();
            names.sort();
            names.dedup();
            let xattrs = names
                .into_iter()
                .map(|name| XattrImage {
                    name,
                    value: (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect(),
                })
                .collect();
            out.push(InodeImage {
                ino,
                kind,
                nlink: rng.gen_range(0..3),
                size: if kind == FileKind::Regular {
                    rng.gen()
                } else {
                    0
                },
                attrs,
                extents,
                entries,
                xattrs,
                target: if kind == FileKind::Symlink {
                    random_name(rng).into_bytes()
                } else {
                    Vec::new()
                },
            });
        }
        MetaImage {
            next_ino: ino + 1,
            inodes: out,
        }
    }

    /// An extent source whose count disagrees with the extents it gives
    /// is refused: the count is encoded before the extents, so the image
    /// would not decode (in release builds no debug assertion stops it).
    #[test]
    fn a_source_that_miscounts_its_extents_is_refused() {
        struct Miscounted(Vec<Extent>);
        impl ExtentSource for Miscounted {
            fn extent_count(&self) -> usize {
                self.0.len() + 1
            }
            fn try_each(&self, f: &mut dyn FnMut(&Extent) -> Result<()>) -> Result<()> {
                self.0.iter().try_for_each(f)
            }
        }
        let mut rng = SmallRng::seed_from_u64(5);
        let image = random_image(&mut rng, 40);
        let file = image
            .inodes
            .iter()
            .find(|i| !i.extents.is_empty())
            .expect("a file with extents");
        let source = Miscounted(file.extents.clone());
        let inodes: Vec<(&InodeImage, &dyn ExtentSource)> = image
            .inodes
            .iter()
            .map(|i| {
                let extents: &dyn ExtentSource = if i.ino == file.ino {
                    &source
                } else {
                    &i.extents
                };
                (i, extents)
            })
            .collect();
        let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            encode_image_from(0, image.next_ino, &inodes)
        }));
        match encoded {
            Ok(Err(e)) => assert!(e.to_string().contains("under a count"), "{e}"),
            Ok(Ok(bytes)) => panic!(
                "encoded; decodes: {:?}",
                decode_image(&bytes).map(|_| ()).map_err(|e| e.to_string())
            ),
            Err(_) => panic!("panicked (a debug assertion)"),
        }
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

        for counts in [[u32::MAX, 0, 0], [0, u32::MAX, 0], [0, 0, u32::MAX]] {
            let mut enc = Encoder::new();
            enc.u64(10);
            enc.u64(1);
            inode_head(&mut enc, 2, KIND_REGULAR);
            for c in counts {
                enc.u32(c);
            }
            enc.u32(0);
            let err = decode_image(enc.as_bytes()).unwrap_err();
            assert!(err.to_string().contains("cannot fit"), "{counts:?}: {err}");
        }
    }

    /// An inode's fields up to its counts, as format version 2 lays them out.
    fn inode_head(enc: &mut Encoder, ino: u64, kind: u8) {
        enc.u64(ino);
        enc.u8(kind);
        enc.u32(1);
        enc.u64(0);
        enc.u16(ATTRS_ENCODED_LEN as u16);
        enc.attrs(&InodeAttrs::default()).unwrap();
    }

    /// A whole inode with nothing in its lists.
    fn bare_inode(enc: &mut Encoder, ino: u64, kind: u8) {
        inode_head(enc, ino, kind);
        enc.u32(0);
        enc.u32(0);
        enc.u32(0);
        enc.u32(0);
    }

    /// What the decoder refuses in the parts format version 2 added, each
    /// written by hand (the encoder would refuse to write them).
    #[test]
    fn version_2_fields_are_checked_by_the_decoder() {
        use crate::codec::primitive::KIND_REGULAR as REG;
        const SYMLINK: u8 = 3;
        const FIFO: u8 = 4;
        let decode = |build: &dyn Fn(&mut Encoder)| {
            let mut enc = Encoder::new();
            enc.u64(10);
            enc.u64(1);
            build(&mut enc);
            decode_image(enc.as_bytes())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        // The baseline decodes.
        decode(&|e| bare_inode(e, 2, REG)).unwrap();
        decode(&|e| {
            inode_head(e, 2, SYMLINK);
            e.u32(0);
            e.u32(0);
            e.u32(0);
            e.u32(1);
            e.bytes(b"t");
        })
        .unwrap();
        type Case = (&'static str, Box<dyn Fn(&mut Encoder)>);
        let cases: Vec<Case> = vec![
            (
                "fewer than",
                Box::new(|e| {
                    e.u64(2);
                    e.u8(REG);
                    e.u32(1);
                    e.u64(0);
                    e.u16(ATTRS_ENCODED_LEN as u16 - 1);
                    e.bytes(&[0; INODE_FIXED_ENCODED_LEN]);
                }),
            ),
            (
                "beyond 0o7777",
                Box::new(|e| {
                    e.u64(2);
                    e.u8(REG);
                    e.u32(1);
                    e.u64(0);
                    e.u16(ATTRS_ENCODED_LEN as u16);
                    e.u32(0o100644);
                    e.bytes(&[0; INODE_FIXED_ENCODED_LEN]);
                }),
            ),
            (
                "symlink target",
                Box::new(|e| {
                    inode_head(e, 2, SYMLINK);
                    for _ in 0..4 {
                        e.u32(0);
                    }
                }),
            ),
            (
                "target of a non-symlink",
                Box::new(|e| {
                    inode_head(e, 2, FIFO);
                    for _ in 0..3 {
                        e.u32(0);
                    }
                    e.u32(1);
                    e.bytes(b"t");
                }),
            ),
            (
                "has size",
                Box::new(|e| {
                    e.u64(2);
                    e.u8(FIFO);
                    e.u32(1);
                    e.u64(5);
                    e.u16(ATTRS_ENCODED_LEN as u16);
                    e.attrs(&InodeAttrs::default()).unwrap();
                    for _ in 0..4 {
                        e.u32(0);
                    }
                }),
            ),
            (
                "bad xattr name",
                Box::new(|e| {
                    inode_head(e, 2, REG);
                    e.u32(0);
                    e.u32(0);
                    e.u32(1);
                    e.string("trusted.x").unwrap();
                    e.u32(0);
                    e.u32(0);
                }),
            ),
            (
                "not sorted",
                Box::new(|e| {
                    inode_head(e, 2, REG);
                    e.u32(0);
                    e.u32(0);
                    e.u32(2);
                    for n in ["user.b", "user.a"] {
                        e.string(n).unwrap();
                        e.u32(0);
                    }
                    e.u32(0);
                }),
            ),
            (
                "exceeds 65536",
                Box::new(|e| {
                    inode_head(e, 2, REG);
                    e.u32(0);
                    e.u32(0);
                    e.u32(1);
                    e.string("user.a").unwrap();
                    e.u32(65_537);
                    e.bytes(&[0; 65_537]);
                    e.u32(0);
                }),
            ),
        ];
        for (want, build) in cases {
            let err = decode(&*build).unwrap_err();
            assert!(err.contains(want), "want {want:?}: {err}");
        }
        // Longer attributes (a later format's) are skipped, not misread.
        let mut enc = Encoder::new();
        enc.u64(10);
        enc.u64(1);
        enc.u64(2);
        enc.u8(REG);
        enc.u32(1);
        enc.u64(0);
        enc.u16(ATTRS_ENCODED_LEN as u16 + 3);
        let attrs = InodeAttrs {
            uid: 42,
            ..InodeAttrs::default()
        };
        enc.attrs(&attrs).unwrap();
        enc.bytes(&[9, 9, 9]);
        for _ in 0..4 {
            enc.u32(0);
        }
        let image = decode_image(enc.as_bytes()).unwrap();
        assert_eq!(image.inodes[0].attrs.uid, 42);
    }

    #[test]
    fn image_invariants_are_checked() {
        let file = |ino, extents| InodeImage {
            ino,
            kind: FileKind::Regular,
            nlink: 1,
            size: 0,
            attrs: InodeAttrs::default(),
            extents,
            entries: vec![],
            xattrs: vec![],
            target: vec![],
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
            bare_inode(&mut enc, ino, KIND_REGULAR);
        }
        let err = decode_image(enc.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("not sorted"), "{err}");
    }

    /// The fixed lengths the checkpoint-space checks use are what the
    /// encoder writes: each part added to an image grows it by its constant.
    #[test]
    fn fixed_lengths_are_the_written_lengths() {
        let encoded = |inodes: Vec<InodeImage>| {
            let image = MetaImage {
                next_ino: 10,
                inodes,
            };
            let bytes = encode_image(&image).unwrap();
            assert_eq!(bytes.len() as u64, image_encoded_len(&image));
            bytes.len()
        };
        let inode = |ino, kind, extents, entries| InodeImage {
            ino,
            kind,
            nlink: 1,
            size: 0,
            attrs: InodeAttrs::default(),
            extents,
            entries,
            xattrs: vec![],
            target: vec![],
        };
        let extent = Extent {
            file_off: 0,
            len: 4096,
            addr: 0,
            state: ExtentState::Written,
        };
        let entry = DirEntryImage {
            name: "a".into(),
            ino: 2,
        };
        let empty = encoded(vec![]);
        assert_eq!(empty, IMAGE_HEADER_ENCODED_LEN);
        let file = encoded(vec![inode(2, FileKind::Regular, vec![], vec![])]);
        assert_eq!(file - empty, INODE_FIXED_ENCODED_LEN);
        let file_extent = encoded(vec![inode(2, FileKind::Regular, vec![extent], vec![])]);
        assert_eq!(file_extent - file, EXTENT_ENCODED_LEN);
        let dir_entry = encoded(vec![inode(1, FileKind::Directory, vec![], vec![entry])]);
        assert_eq!(dir_entry - file, ENTRY_MIN_ENCODED_LEN);
        let mut with_xattr = inode(2, FileKind::Regular, vec![], vec![]);
        with_xattr.xattrs.push(XattrImage {
            name: "user.a".into(),
            value: vec![],
        });
        assert_eq!(encoded(vec![with_xattr]) - file, XATTR_MIN_ENCODED_LEN);
        let mut link = inode(2, FileKind::Symlink, vec![], vec![]);
        link.target = b"abc".to_vec();
        assert_eq!(encoded(vec![link]) - file, 3);
    }

    /// docs/FORMAT.md gives these sizes in its grammar and text; they
    /// drifted once (68 and 107 for 72 and 111).
    #[test]
    fn the_format_document_states_the_encoded_sizes() {
        let doc = include_str!("../../../../docs/FORMAT.md");
        let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        for stated in [
            format!("(attrs_len - {ATTRS_ENCODED_LEN} bytes skipped)"),
            format!("btime ts ({ATTRS_ENCODED_LEN} bytes)"),
            format!("state u8 ({EXTENT_ENCODED_LEN} bytes;"),
            format!("name str (at least {ENTRY_MIN_ENCODED_LEN} bytes)"),
            format!("xattrs or target takes {INODE_FIXED_ENCODED_LEN} bytes."),
        ] {
            assert!(doc.contains(&stated), "FORMAT.md does not say {stated:?}");
        }
    }
}
