//! Plain data shared by the in-memory state, the journal and the checkpoint.
//!
//! All offsets, lengths and addresses are in bytes. Extent offsets, lengths
//! and addresses are multiples of the file-system block size.

/// Inode number. [`ROOT_INO`] is the root directory; 0 is never used.
pub type Ino = u64;

pub const ROOT_INO: Ino = 1;

/// What an inode is. Only regular files have data extents, only
/// directories have entries, only symlinks have a target; the special files
/// (FIFOs, sockets, device nodes) have neither: they are names with
/// attributes, whose behaviour the kernel provides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    /// The `S_IFMT` bits of `st_mode` for this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::Regular => libc::S_IFREG,
            FileKind::Directory => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::Socket => libc::S_IFSOCK,
            FileKind::CharDevice => libc::S_IFCHR,
            FileKind::BlockDevice => libc::S_IFBLK,
        }
    }

    /// The kind whose `S_IFMT` bits `mode` carries, if any.
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        [
            FileKind::Regular,
            FileKind::Directory,
            FileKind::Symlink,
            FileKind::Fifo,
            FileKind::Socket,
            FileKind::CharDevice,
            FileKind::BlockDevice,
        ]
        .into_iter()
        .find(|k| k.mode_bits() == mode & libc::S_IFMT)
    }

    /// Whether a directory entry may name an inode of this kind more than
    /// once (hard links): everything but directories.
    pub fn may_have_hard_links(self) -> bool {
        self != FileKind::Directory
    }
}

/// A point in time: seconds since the Unix epoch (negative before it) and
/// nanoseconds within the second (`< 1_000_000_000`). Wide enough for any
/// `struct timespec` a user can set with `utimensat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

impl Timestamp {
    pub const NSEC_PER_SEC: u32 = 1_000_000_000;

    /// From nanoseconds since the epoch (what the data records carry).
    pub fn from_ns(ns: u64) -> Timestamp {
        Timestamp {
            sec: (ns / u64::from(Self::NSEC_PER_SEC)) as i64,
            nsec: (ns % u64::from(Self::NSEC_PER_SEC)) as u32,
        }
    }

    /// Nanoseconds since the epoch, clamped to `[0, u64::MAX]`.
    pub fn as_ns(self) -> u64 {
        if self.sec < 0 {
            return 0;
        }
        (self.sec as u64)
            .saturating_mul(u64::from(Self::NSEC_PER_SEC))
            .saturating_add(u64::from(self.nsec))
    }

    pub fn is_valid(self) -> bool {
        self.nsec < Self::NSEC_PER_SEC
    }
}

/// Permission bits `st_mode` may carry besides the kind: rwx for user,
/// group and other, set-user-id, set-group-id and sticky.
pub const MODE_PERMISSION_BITS: u32 = 0o7777;

/// An inode's attributes (what `stat` shows besides size, link count and
/// allocation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InodeAttrs {
    /// Permission bits only ([`MODE_PERMISSION_BITS`]); the kind is kept
    /// apart.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Inode flags. None are defined in format version 2 and the decoder
    /// refuses any set: room for later per-inode choices (such as where an
    /// extent map lives) without a new inode layout.
    pub flags: u32,
    /// Device number of a character or block device node; 0 otherwise.
    pub rdev: u64,
    /// Last access. Reads do not update it (as `noatime`): only a create
    /// and an explicit set do.
    pub atime: Timestamp,
    /// Last data change (write, truncate, punch, fallocate past EOF), or
    /// for directories last entry change.
    pub mtime: Timestamp,
    /// Last change of anything: data, attributes, links, xattrs.
    pub ctime: Timestamp,
    /// Creation time; never changes.
    pub btime: Timestamp,
}

impl InodeAttrs {
    /// Attributes of an inode created at `now` with `mode`, `uid`, `gid`.
    pub fn new(mode: u32, uid: u32, gid: u32, now: Timestamp) -> InodeAttrs {
        InodeAttrs {
            mode: mode & MODE_PERMISSION_BITS,
            uid,
            gid,
            flags: 0,
            rdev: 0,
            atime: now,
            mtime: now,
            ctime: now,
            btime: now,
        }
    }

    /// The data changed at `t` (a write, truncate, punch): mtime becomes
    /// `t`, and ctime too unless a later change already moved it further
    /// (a write's time can be logged after an xattr change that followed
    /// it; see `write_times`).
    pub fn data_changed_at(&mut self, t: Timestamp) {
        self.mtime = t;
        self.ctime = self.ctime.max(t);
    }
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

/// One extended attribute: a `user.` name and its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XattrImage {
    pub name: String,
    pub value: Vec<u8>,
}

/// One inode as stored in a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeImage {
    pub ino: Ino,
    pub kind: FileKind,
    /// Number of directory entries naming this inode (directories: 0 or 1;
    /// others any number up to [`crate::limits::MAX_LINKS`]); 0 means
    /// unlinked but possibly still open: freed at mount.
    pub nlink: u32,
    /// On-disk size in bytes (regular files; 0 for every other kind).
    pub size: u64,
    pub attrs: InodeAttrs,
    /// Sorted by `file_off`, non-overlapping. Empty unless regular.
    pub extents: Vec<Extent>,
    /// Sorted by name. Empty unless a directory.
    pub entries: Vec<DirEntryImage>,
    /// Sorted by name, names unique. Any kind.
    pub xattrs: Vec<XattrImage>,
    /// A symlink's target (never empty); empty for every other kind.
    pub target: Vec<u8>,
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

/// A key span `[start, end)` of an extent map: file offsets at which
/// extents start. `end` `u64::MAX` means no end.
pub type KeySpan = (u64, u64);

/// One inode as a delta checkpoint stores it: everything but the extents
/// whole, and the extents only inside `spans`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeDelta {
    /// Sorted, disjoint, each non-empty (none: the extents did not
    /// change). Applying the delta removes every
    /// extent stored under a key in a span and adds `inode.extents`, each
    /// of which starts inside a span. An inode the base does not hold comes
    /// with the one span `(0, u64::MAX)`.
    pub spans: Vec<KeySpan>,
    /// Its extents are those of the new state that start inside `spans`.
    pub inode: InodeImage,
}

/// What changed between two metadata images (a delta checkpoint's
/// contents): applied to the older one, it gives the newer one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaDelta {
    pub next_ino: Ino,
    /// Inodes deleted since the base. Sorted.
    pub removed: Vec<Ino>,
    /// Inodes created or changed since the base. Sorted by ino, none also
    /// in `removed`.
    pub changed: Vec<InodeDelta>,
}

/// One journal record: a metadata change that is atomic across crashes.
///
/// Replay applies records in sequence order to the state loaded from the
/// checkpoint; the live path applies the very same record to the in-memory
/// state when it makes the change, so both paths share one implementation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A new inode `ino` of `kind` with `attrs`, linked as `parent/name`
    /// (the parent's mtime and ctime become `attrs.ctime`); `target` is a
    /// symlink's target, empty for other kinds.
    Create {
        ino: Ino,
        parent: Ino,
        name: String,
        kind: FileKind,
        attrs: InodeAttrs,
        target: Vec<u8>,
    },
    /// Remove entry `parent/name`; the inode it named loses one link (at 0
    /// its space is released by [`Record::FreeInode`] once no handle holds
    /// it). The parent's mtime and ctime and the inode's ctime become `time`.
    Unlink {
        parent: Ino,
        name: String,
        time: Timestamp,
    },
    /// Move `src_parent/src_name` to `dst_parent/dst_name`, replacing (and
    /// unlinking) any inode named there; with `exchange`, swap the two
    /// names instead (both must exist). Both parents' mtime and ctime and
    /// the moved inodes' ctime become `time`.
    Rename {
        src_parent: Ino,
        src_name: String,
        dst_parent: Ino,
        dst_name: String,
        exchange: bool,
        time: Timestamp,
    },
    /// A new name `parent/name` for the existing non-directory `ino` (a
    /// hard link): its link count grows by one.
    Link {
        ino: Ino,
        parent: Ino,
        name: String,
        time: Timestamp,
    },
    /// Set mode, owner and times (chmod, chown, utimens): the live path
    /// computes every new value, replay only stores them.
    SetAttr {
        ino: Ino,
        mode: u32,
        uid: u32,
        gid: u32,
        atime: Timestamp,
        mtime: Timestamp,
        ctime: Timestamp,
    },
    /// Create or replace extended attribute `name` of `ino`.
    SetXattr {
        ino: Ino,
        name: String,
        value: Vec<u8>,
        ctime: Timestamp,
    },
    /// Remove extended attribute `name` of `ino`.
    RemoveXattr {
        ino: Ino,
        name: String,
        ctime: Timestamp,
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
    /// `min_size`. Here and in `SetSize` and `Punch`, `mtime_ns`
    /// (nanoseconds since the epoch) is when the data changed
    /// ([`InodeAttrs::data_changed_at`]); in `CompleteWrite` that is the
    /// time of the write, not of its completion, and 0 leaves the times
    /// alone (the write's time was logged already, or replaced by an
    /// explicit one).
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

impl Record {
    /// The device range `(addr, len)` this record newly maps, if it maps
    /// one: what mount's free-space hint must not hand out once replay
    /// has applied it (`free_space::Reserve`). Only
    /// [`Record::MapUnwritten`] places space: a completion converts
    /// space some earlier record or the checkpoint placed, and every other
    /// record maps nothing or releases space. Extent pages and spill
    /// extents are written by checkpoints, never journaled. No wildcard
    /// arm: a new record kind must say whether it places space.
    pub fn placed(&self) -> Option<(u64, u64)> {
        match self {
            Record::MapUnwritten { len, addr, .. } => Some((*addr, *len)),
            Record::Create { .. }
            | Record::Unlink { .. }
            | Record::Rename { .. }
            | Record::Link { .. }
            | Record::SetAttr { .. }
            | Record::SetXattr { .. }
            | Record::RemoveXattr { .. }
            | Record::FreeInode { .. }
            | Record::CompleteWrite { .. }
            | Record::SetSize { .. }
            | Record::Punch { .. } => None,
        }
    }
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

/// Inodes changed since some point, each with what a delta from that
/// point needs to know of it.
pub type ChangedInodes = InoMap<InodeChanges>;

/// How one inode changed since some point (see [`ChangedInodes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeChanges {
    /// Whether the inode existed at that point: found before the first
    /// record that changed it applied. With inode numbers never reused,
    /// this and whether it exists now tell a delta whether the inode is
    /// new, changed, removed or neither, without the state of that point.
    pub existed: bool,
    /// The extent-map key spans the changes touched (none: its extents did
    /// not change).
    pub spans: Vec<KeySpan>,
}

/// The inode table: a persistent (copy-on-write) hash map keyed by inode
/// number. Cloning it is O(1), which is what lets a checkpoint take its
/// snapshot under the metadata lock in a time that does not grow with the
/// metadata; a change after the clone copies only the path to the inode it
/// changes. Lookups allocate nothing.
pub type InodeTable<V> = imbl::GenericHashMap<
    Ino,
    V,
    std::hash::BuildHasherDefault<InoHasher>,
    imbl::shared_ptr::DefaultSharedPtr,
>;
