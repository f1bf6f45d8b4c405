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

bitflags::bitflags! {
    /// Promises attached to a mapping.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
    pub struct IomapFlags: u8 {
        /// Allocated by this `begin` call: partial blocks must be zeroed.
        const NEW = 1 << 0;
        /// Completing I/O here needs metadata to become durable (size
        /// change, conversion, or a dirty inode).
        const DIRTY = 1 << 1;
        /// Copy-on-write needed (reserved for reflink).
        const SHARED = 1 << 2;
    }
}

impl IomapFlags {
    /// No promise.
    pub const EMPTY: IomapFlags = IomapFlags::empty();
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
