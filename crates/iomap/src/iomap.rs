//! One extent mapping: the answer to "what is at file offset X?".

/// What backs a range of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IomapKind {
    /// No space: reads return zeros.
    Hole,
    /// Space reserved but not placed (buffered writes only).
    Delalloc,
    /// Written data at `addr`.
    Mapped,
    /// Space placed at `addr` but reading as zeros until converted at I/O
    /// completion.
    Unwritten,
    /// Data held in metadata.
    Inline,
}

/// Promises attached to a mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IomapFlags(u8);

impl IomapFlags {
    pub const EMPTY: IomapFlags = IomapFlags(0);
    /// Allocated by this `begin` call: partial blocks must be zeroed.
    pub const NEW: IomapFlags = IomapFlags(1 << 0);
    /// Completing I/O here needs metadata to become durable (size change,
    /// conversion, or a dirty inode).
    pub const DIRTY: IomapFlags = IomapFlags(1 << 1);
    /// Copy-on-write needed (reserved for reflink).
    pub const SHARED: IomapFlags = IomapFlags(1 << 2);

    pub const fn contains(self, other: IomapFlags) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn intersects(self, other: IomapFlags) -> bool {
        self.0 & other.0 != 0
    }
    pub const fn union(self, other: IomapFlags) -> IomapFlags {
        IomapFlags(self.0 | other.0)
    }
}

impl std::ops::BitOr for IomapFlags {
    type Output = IomapFlags;
    fn bitor(self, rhs: IomapFlags) -> IomapFlags {
        self.union(rhs)
    }
}

/// A mapping of file bytes `[offset, offset + length)`.
///
/// For `Mapped` and `Unwritten`, file byte `offset` lives at device byte
/// `addr`, and the mapping is contiguous on the device. For `Hole`, `addr` is
/// meaningless (zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Iomap {
    pub offset: u64,
    pub length: u64,
    pub kind: IomapKind,
    pub addr: u64,
    pub flags: IomapFlags,
}

impl Iomap {
    pub fn end(&self) -> u64 {
        self.offset + self.length
    }

    /// Device byte address of file byte `pos`, which must lie in this mapping.
    pub fn device_addr(&self, pos: u64) -> u64 {
        debug_assert!(pos >= self.offset && pos < self.end());
        self.addr + (pos - self.offset)
    }

    /// Writing here needs no metadata at all: written space, not new, not
    /// dirty, not shared.
    pub fn is_pure_overwrite(&self) -> bool {
        self.kind == IomapKind::Mapped
            && !self
                .flags
                .intersects(IomapFlags::NEW | IomapFlags::DIRTY | IomapFlags::SHARED)
    }
}
