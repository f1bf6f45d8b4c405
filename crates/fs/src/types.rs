//! Plain data shared by the in-memory state, the journal and the checkpoint.
//!
//! All offsets, lengths and addresses are in bytes. Extent offsets, lengths
//! and addresses are multiples of the file-system block size.

/// Inode number. [`ROOT_INO`] is the root directory; 0 is never used.
pub type Ino = u64;

pub const ROOT_INO: Ino = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    Regular,
    Directory,
}

/// Whether an extent's space holds file data yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExtentState {
    /// Holds file data.
    Written,
    /// Placed but reads as zeros until converted at I/O completion.
    Unwritten,
}

/// File bytes `[file_off, file_off + len)` live at device bytes
/// `[addr, addr + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    pub file_off: u64,
    pub len: u64,
    pub addr: u64,
    pub state: ExtentState,
}

impl Extent {
    pub fn file_end(&self) -> u64 {
        self.file_off + self.len
    }
    pub fn addr_end(&self) -> u64 {
        self.addr + self.len
    }
}

/// One name in a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntryImage {
    pub name: String,
    pub ino: Ino,
}

/// One inode as stored in a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeImage {
    pub ino: Ino,
    pub kind: FileKind,
    /// Number of directory entries naming this inode (0 or 1: no hard links
    /// yet; 0 means unlinked but possibly still open: freed at mount).
    pub nlink: u32,
    /// On-disk size in bytes.
    pub size: u64,
    /// Last data or size modification, nanoseconds since the Unix epoch.
    pub mtime_ns: u64,
    /// Sorted by `file_off`, non-overlapping. Empty for directories.
    pub extents: Vec<Extent>,
    /// Sorted by name. Empty for regular files.
    pub entries: Vec<DirEntryImage>,
}

/// The whole metadata of a volume, as a checkpoint stores it. Free space is
/// not stored: it is the data area minus every extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaImage {
    /// Next inode number to hand out.
    pub next_ino: Ino,
    /// Sorted by `ino`.
    pub inodes: Vec<InodeImage>,
}

/// One journal record: a metadata change that is atomic across crashes.
///
/// Replay applies records in sequence order to the state loaded from the
/// checkpoint; the live path applies the very same record to the in-memory
/// state when it makes the change, so both paths share one implementation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A new inode `ino` of `kind`, linked as `parent/name`.
    Create {
        ino: Ino,
        parent: Ino,
        name: String,
        kind: FileKind,
        mtime_ns: u64,
    },
    /// Remove entry `parent/name`; the inode it named gets nlink 0 (its space
    /// is released by [`Record::FreeInode`] once no handle holds it).
    Unlink { parent: Ino, name: String },
    /// Move `src_parent/src_name` to `dst_parent/dst_name`, replacing (and
    /// unlinking) any inode named there.
    Rename {
        src_parent: Ino,
        src_name: String,
        dst_parent: Ino,
        dst_name: String,
    },
    /// Delete an inode with nlink 0 and release all its space.
    FreeInode { ino: Ino },
    /// Place unwritten space: file bytes `[file_off, file_off+len)` at device
    /// byte `addr`. The range was a hole.
    MapUnwritten {
        ino: Ino,
        file_off: u64,
        len: u64,
        addr: u64,
    },
    /// Completion of a write: unwritten space in `[file_off, file_off+len)`
    /// (block-aligned) becomes written, and the size becomes at least
    /// `min_size`.
    CompleteWrite {
        ino: Ino,
        file_off: u64,
        len: u64,
        min_size: u64,
        mtime_ns: u64,
    },
    /// Set the size. Space wholly past the new size (rounded up to a block)
    /// is released.
    SetSize { ino: Ino, size: u64, mtime_ns: u64 },
    /// Release space in `[file_off, file_off+len)` (block-aligned).
    Punch {
        ino: Ino,
        file_off: u64,
        len: u64,
        mtime_ns: u64,
    },
}

/// Hashes inode numbers for the in-memory maps keyed by them: they are
/// looked up on every I/O (sizes, mappings), and a multiply-shift of a
/// number the file system hands out is enough spread — no SipHash, whose
/// flooding resistance protects nothing here (users do not choose inode
/// numbers).
#[derive(Clone, Copy, Debug, Default)]
pub struct InoHasher(u64);

impl std::hash::Hasher for InoHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 ^= self.0 >> 29;
    }
}

/// A map keyed by inode number.
pub type InoMap<V> = std::collections::HashMap<Ino, V, std::hash::BuildHasherDefault<InoHasher>>;
