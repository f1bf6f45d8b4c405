//! Test doubles for the engine: a recording in-memory device and a small
//! file system with a per-block map.
//!
//! The device is the real memory backend behind a request log, so the
//! engine's tests pin down exactly which requests it issues.

use std::collections::VecDeque;

use blockdev::memory::{FaultOp, FaultRule, MemDevice};
use blockdev::{BlockDevice, DeviceCaps, DeviceCounters, DeviceError, WriteMode};
use parking_lot::Mutex;

use crate::{DioEndFlags, EndIo, Iomap, IomapError, IomapFlags, IomapKind, IomapOpFlags, IomapOps};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
/// File-system block size of the engine tests.
pub const BS: u64 = 4096;
/// What the device holds where nothing was written: must never leak.
pub const STALE: u8 = 0xAA;

/// Recognisable test data: `len` bytes that differ from their neighbours
/// and, with another `seed`, from other data.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// One request the device received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Req {
    Read { off: u64, len: u64 },
    Write { off: u64, len: u64 },
}

/// The real in-memory device (`blockdev::memory::MemDevice`) behind a log of
/// every request the engine sends, so tests can pin down the exact requests.
pub struct TestDev {
    inner: MemDevice,
    log: Mutex<Vec<Req>>,
}

impl TestDev {
    pub fn new(size: usize, lbs: u32) -> TestDev {
        TestDev {
            inner: MemDevice::new(size as u64, lbs),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Fills the whole device with `byte` (stale data that must never leak).
    pub fn fill(&self, byte: u8) {
        self.inner.fill(&[byte]);
    }

    pub fn bytes(&self, off: u64, len: usize) -> Vec<u8> {
        let off = off as usize;
        self.inner.snapshot()[off..off + len].to_vec()
    }

    /// Puts `bytes` on the device without logging a request.
    pub fn poke(&self, off: u64, bytes: &[u8]) {
        self.inner.write_at(bytes, off, WriteMode::Normal).unwrap();
    }

    pub fn requests(&self) -> Vec<Req> {
        self.log.lock().clone()
    }

    pub fn writes(&self) -> Vec<(u64, u64)> {
        self.requests()
            .into_iter()
            .filter_map(|r| match r {
                Req::Write { off, len } => Some((off, len)),
                Req::Read { .. } => None,
            })
            .collect()
    }

    pub fn clear_log(&self) {
        self.log.lock().clear();
    }

    /// Fails the `n`-th write request from now on (1-based), once.
    pub fn fail_nth_write_from_now(&self, n: u64) {
        self.inner
            .inject(FaultRule::new(FaultOp::Write).skip(n - 1).count(1));
    }

    /// Fails every read from now on.
    pub fn fail_reads(&self) {
        self.inner.inject(FaultRule::new(FaultOp::Read));
    }
}

impl BlockDevice for TestDev {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.log.lock().push(Req::Read {
            off: offset,
            len: buf.len() as u64,
        });
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.log.lock().push(Req::Write {
            off: offset,
            len: buf.len() as u64,
        });
        self.inner.write_at(buf, offset, mode)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }

    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }
}

/// State of one file-system block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Hole,
    Unwritten(u64),
    Mapped(u64),
}

#[derive(Debug)]
pub struct FsState {
    pub blocks: Vec<Block>,
    pub size: u64,
    /// Next device address handed out for allocation.
    pub next_free: u64,
}

/// A file system of one file with a per-block map. Allocates holes as
/// `Unwritten | NEW` on direct writes, converts at `end_io`.
pub struct FakeFs {
    pub bs: u32,
    /// Return mappings clipped to the requested range (true) or whole blocks.
    pub clip: bool,
    /// Longest mapping returned, in blocks.
    pub max_blocks: u64,
    pub state: Mutex<FsState>,
    pub begins: Mutex<Vec<(u64, u64, IomapOpFlags, Iomap)>>,
    pub ends: Mutex<Vec<(u64, u64, u64)>>,
    pub end_ios: Mutex<Vec<(u64, u64, DioEndFlags)>>,
    /// Journal commits asked for.
    pub commits: std::sync::atomic::AtomicU64,
}

impl FakeFs {
    pub fn new(bs: u32, nblocks: usize, alloc_base: u64) -> FakeFs {
        FakeFs {
            bs,
            clip: false,
            max_blocks: u64::MAX,
            state: Mutex::new(FsState {
                blocks: vec![Block::Hole; nblocks],
                size: 0,
                next_free: alloc_base,
            }),
            begins: Mutex::new(Vec::new()),
            ends: Mutex::new(Vec::new()),
            end_ios: Mutex::new(Vec::new()),
            commits: Default::default(),
        }
    }

    pub fn set(&self, block: usize, state: Block) {
        self.state.lock().blocks[block] = state;
    }

    pub fn block(&self, block: usize) -> Block {
        self.state.lock().blocks[block]
    }

    pub fn set_size(&self, size: u64) {
        self.state.lock().size = size;
    }

    pub fn end_ios(&self) -> Vec<(u64, u64, DioEndFlags)> {
        self.end_ios.lock().clone()
    }

    /// Every `begin` was matched by one `end`, for the same range.
    pub fn assert_begin_end_paired(&self) {
        let begins = self.begins.lock();
        let ends = self.ends.lock();
        assert_eq!(begins.len(), ends.len(), "begin/end calls do not pair up");
        for ((bpos, blen, _, map), (epos, elen, _)) in begins.iter().zip(ends.iter()) {
            assert_eq!(*bpos, *epos);
            assert!(*elen <= *blen && *epos + *elen <= map.end());
        }
    }
}

impl IomapOps for FakeFs {
    type Inode = ();
    type Error = IomapError;

    fn begin(
        &self,
        _inode: &(),
        pos: u64,
        len: u64,
        flags: IomapOpFlags,
    ) -> Result<Iomap, IomapError> {
        let bs = u64::from(self.bs);
        let mut st = self.state.lock();
        let first = pos / bs;
        let last = (pos + len - 1) / bs;
        let limit = last.min(first.saturating_add(self.max_blocks - 1));
        let write = flags.contains(IomapOpFlags::WRITE);
        let overwrite_only = flags.contains(IomapOpFlags::OVERWRITE_ONLY);
        let state = st.blocks[first as usize];
        // Declared padding may reach past EOF (to the end of its block).
        let eof_limit = if flags.contains(IomapOpFlags::PADDED_TAIL) {
            st.size.next_multiple_of(bs)
        } else {
            st.size
        };
        if overwrite_only && (!matches!(state, Block::Mapped(_)) || pos + len > eof_limit) {
            return Err(IomapError::WouldBlock);
        }
        let (kind, addr, flags_out, nblocks) = if write && state == Block::Hole {
            let mut n = 1;
            while first + n <= limit && st.blocks[(first + n) as usize] == Block::Hole {
                n += 1;
            }
            let addr = st.next_free;
            st.next_free += n * bs;
            for i in 0..n {
                st.blocks[(first + i) as usize] = Block::Unwritten(addr + i * bs);
            }
            (IomapKind::Unwritten, addr, IomapFlags::NEW, n)
        } else {
            let mut n = 1;
            let next = |b: Block, i: u64| match (state, b) {
                (Block::Hole, Block::Hole) => true,
                (Block::Unwritten(a), Block::Unwritten(x))
                | (Block::Mapped(a), Block::Mapped(x)) => x == a + i * bs,
                _ => false,
            };
            while first + n <= limit && next(st.blocks[(first + n) as usize], n) {
                n += 1;
            }
            match state {
                Block::Hole => (IomapKind::Hole, 0, IomapFlags::EMPTY, n),
                Block::Unwritten(a) => (IomapKind::Unwritten, a, IomapFlags::EMPTY, n),
                Block::Mapped(a) => (IomapKind::Mapped, a, IomapFlags::EMPTY, n),
            }
        };
        let mut map = Iomap {
            offset: first * bs,
            length: nblocks * bs,
            kind,
            addr,
            flags: flags_out,
        };
        if self.clip {
            let start = map.offset.max(pos);
            let end = map.end().min(pos + len);
            if kind != IomapKind::Hole {
                map.addr += start - map.offset;
            }
            map.offset = start;
            map.length = end - start;
        }
        self.begins.lock().push((pos, len, flags, map));
        Ok(map)
    }

    fn end(
        &self,
        _inode: &(),
        pos: u64,
        len: u64,
        written: u64,
        _flags: IomapOpFlags,
        _iomap: &Iomap,
    ) -> Result<(), IomapError> {
        self.ends.lock().push((pos, len, written));
        Ok(())
    }

    fn simple_read_addr(&self, _inode: &(), pos: u64, len: u64) -> Option<u64> {
        let bs = u64::from(self.bs);
        let st = self.state.lock();
        if pos + len > st.size || pos / bs != (pos + len - 1) / bs {
            return None;
        }
        match st.blocks.get((pos / bs) as usize) {
            Some(Block::Mapped(addr)) => Some(addr + pos % bs),
            _ => None,
        }
    }

    fn size(&self, _inode: &()) -> Result<u64, IomapError> {
        Ok(self.state.lock().size)
    }

    fn block_size(&self) -> u32 {
        self.bs
    }

    fn end_io(&self, _inode: &(), end: &EndIo) -> Result<(), IomapError> {
        let (pos, len, flags) = logged(end);
        self.end_ios.lock().push((pos, len, flags));
        let bs = u64::from(self.bs);
        let mut st = self.state.lock();
        if flags.unwritten {
            for b in pos / bs..(pos + len).div_ceil(bs) {
                if let Block::Unwritten(a) = st.blocks[b as usize] {
                    st.blocks[b as usize] = Block::Mapped(a);
                }
            }
        }
        if let Some(size) = end.new_size {
            st.size = st.size.max(size);
        }
        Ok(())
    }

    fn extend_size_in_core(&self, _: &(), size: u64) -> Result<(), IomapError> {
        let mut st = self.state.lock();
        st.size = st.size.max(size);
        Ok(())
    }

    fn commit(&self) -> Result<(), IomapError> {
        self.commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// How the fakes log a completion: (pos, len, what it asked for).
fn logged(end: &EndIo) -> (u64, u64, DioEndFlags) {
    let flags = DioEndFlags {
        unwritten: end.convert,
        size_change: end.new_size.is_some(),
    };
    (end.pos, end.len, flags)
}

/// A buggy or scripted file system: answers `begin` from a fixed list of
/// mappings (the first one containing `pos`, or the next in a queue).
pub struct ScriptedFs {
    pub bs: u32,
    pub size: u64,
    pub maps: Mutex<VecDeque<Iomap>>,
    pub ends: Mutex<u64>,
    pub end_ios: Mutex<Vec<(u64, u64, DioEndFlags)>>,
}

impl ScriptedFs {
    pub fn new(bs: u32, size: u64, maps: Vec<Iomap>) -> ScriptedFs {
        ScriptedFs {
            bs,
            size,
            maps: Mutex::new(maps.into()),
            ends: Mutex::new(0),
            end_ios: Mutex::new(Vec::new()),
        }
    }
}

impl IomapOps for ScriptedFs {
    type Inode = ();
    type Error = IomapError;

    fn begin(&self, _: &(), pos: u64, _: u64, _: IomapOpFlags) -> Result<Iomap, IomapError> {
        self.maps
            .lock()
            .pop_front()
            .ok_or_else(|| IomapError::BadMapping {
                pos,
                reason: "script exhausted".into(),
            })
    }

    fn end(
        &self,
        _: &(),
        _: u64,
        _: u64,
        _: u64,
        _: IomapOpFlags,
        _: &Iomap,
    ) -> Result<(), IomapError> {
        *self.ends.lock() += 1;
        Ok(())
    }

    fn size(&self, _: &()) -> Result<u64, IomapError> {
        Ok(self.size)
    }

    fn block_size(&self) -> u32 {
        self.bs
    }

    fn end_io(&self, _: &(), end: &EndIo) -> Result<(), IomapError> {
        self.end_ios.lock().push(logged(end));
        Ok(())
    }

    fn extend_size_in_core(&self, _: &(), _: u64) -> Result<(), IomapError> {
        Ok(())
    }

    fn commit(&self) -> Result<(), IomapError> {
        Ok(())
    }
}
