//! RAM-backed device for tests: counts requests, injects faults and simulates
//! power cuts.
//!
//! # Fault model
//!
//! This is the device the crash tests assume, so it is written down here,
//! next to the code that implements it:
//!
//! - A completed write is visible to every later read, but it is *durable*
//!   (survives power loss) only once a flush that started after it has
//!   completed, or at once if it was a FUA write or the device has no volatile
//!   write cache.
//! - At a power cut, each write that is not yet durable independently
//!   survives whole, is lost whole, or is *torn*: any subset of its logical
//!   blocks survives. A logical block is never torn internally (the device's
//!   atomic unit is one logical block).
//! - Surviving writes land in the order they were issued, so where two
//!   surviving writes overlap, the later one wins. A durable write is
//!   therefore never undone by an earlier, non-durable write being replayed
//!   over it.
//! - A failed request (injected with [`FaultRule`]) has no effect at all: a
//!   failed write changes no byte, a failed flush makes nothing durable.
//!
//! # Cost
//!
//! Power-cut tests make 10,000+ devices per run, so the image is stored as
//! copy-on-write chunks shared between the durable image, the current
//! contents and every device a cut produces. A flush costs O(writes since the
//! last flush), a cut O(chunks + writes since the last flush), and a write
//! copies at most the chunks it touches that are still shared.

use std::fmt;
use std::io;
use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::IoOp;
use crate::rng::SplitMix64;
use crate::WriteMode;
use crate::{check_request, BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceKind};

/// Granularity of copy-on-write sharing. Small enough that a 4 KiB write
/// after a flush copies little, large enough that a 16 MiB device is 1024
/// chunks, so cloning an image stays in the microseconds.
const CHUNK_BYTES: usize = 16 * 1024;

/// Whether a request kind is subject to a [`FaultRule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    /// Reads, writes and flushes alike.
    Any,
}

/// Makes matching requests fail with `EIO`.
///
/// Every active rule sees every request, and counts the ones that match it,
/// independently of other rules; a request fails if any rule fails it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    pub op: FaultOp,
    /// Let this many matching requests succeed before failing any.
    pub skip: u64,
    /// Fail this many matching requests after the skipped ones, then let
    /// everything through again; `None` fails them forever.
    pub count: Option<u64>,
    /// Only requests overlapping these device bytes match. A flush has no
    /// bytes, so a rule with a range never fails a flush.
    pub range: Option<Range<u64>>,
}

impl FaultRule {
    /// Fails every request of kind `op`, forever; narrow it with the
    /// builder methods.
    pub fn new(op: FaultOp) -> FaultRule {
        FaultRule {
            op,
            skip: 0,
            count: None,
            range: None,
        }
    }

    pub fn skip(self, skip: u64) -> FaultRule {
        FaultRule { skip, ..self }
    }

    pub fn count(self, count: u64) -> FaultRule {
        FaultRule {
            count: Some(count),
            ..self
        }
    }

    pub fn range(self, range: Range<u64>) -> FaultRule {
        FaultRule {
            range: Some(range),
            ..self
        }
    }

    fn matches(&self, op: IoOp, offset: u64, len: u64) -> bool {
        let op_matches = matches!(
            (self.op, op),
            (FaultOp::Any, _)
                | (FaultOp::Read, IoOp::Read)
                | (FaultOp::Write, IoOp::Write)
                | (FaultOp::Flush, IoOp::Flush)
        );
        let range_matches = match &self.range {
            None => true,
            Some(r) => op != IoOp::Flush && offset < r.end && r.start < offset.saturating_add(len),
        };
        op_matches && range_matches
    }
}

/// What a power cut does to one write that was not yet durable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Survival {
    Lost,
    Kept,
    /// One entry per logical block of the write, in order: `true` keeps that
    /// block. Missing entries count as `false`; extra entries are ignored.
    Torn(Vec<bool>),
}

/// A write issued since the last flush, as shown to a power-cut chooser.
#[derive(Clone)]
pub struct PendingWrite {
    index: usize,
    offset: u64,
    data: Arc<[u8]>,
    durable: bool,
    logical_block_size: u32,
}

impl PendingWrite {
    /// Position among the writes a power cut replays, 0 being the oldest:
    /// lets a test name "the k-th write since the flush".
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> u64 {
        self.data.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Number of logical blocks: the length a [`Survival::Torn`] mask needs.
    pub fn blocks(&self) -> usize {
        self.data.len() / self.logical_block_size as usize
    }

    /// Durable at completion (FUA, or no volatile write cache): a power cut
    /// keeps it whatever the chooser answers.
    pub fn durable(&self) -> bool {
        self.durable
    }

    /// The bytes written, so a chooser can target a kind of block (say, a
    /// journal commit record).
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

impl fmt::Debug for PendingWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingWrite")
            .field("index", &self.index)
            .field("offset", &self.offset)
            .field("len", &self.data.len())
            .field("durable", &self.durable)
            .finish()
    }
}

/// A RAM-backed [`BlockDevice`] with a crash model (see the module docs).
pub struct MemDevice {
    caps: DeviceCaps,
    counters: DeviceCounters,
    state: Mutex<State>,
}

struct State {
    /// What survives a power cut if every pending write is lost.
    durable: Image,
    /// What reads see: `durable` plus every pending write.
    current: Image,
    /// Writes since the last flush, oldest first. Invariant: empty, or its
    /// first entry is not durable (a durable write issued with nothing
    /// pending goes straight into `durable`). So when it is empty, `durable`
    /// and `current` have the same contents.
    pending: Vec<PendingWrite>,
    faults: Vec<ActiveFault>,
    /// Requests to hold before they return ([`MemDevice::pause_after`]).
    pauses: Vec<ArmedPause>,
}

struct ArmedPause {
    rule: FaultRule,
    matched: u64,
    reached: std::sync::mpsc::Sender<()>,
    resume: std::sync::mpsc::Receiver<()>,
}

/// A request held by [`MemDevice::pause_after`]: done on the device, not yet
/// returned to its caller. Tests use it to slip other work in between.
pub struct PausedRequest {
    reached: std::sync::mpsc::Receiver<()>,
    resume: std::sync::mpsc::Sender<()>,
}

impl PausedRequest {
    /// Waits until the request is held.
    pub fn wait_reached(&self) {
        self.reached
            .recv()
            .expect("the device was dropped before the paused request came");
    }

    /// Lets the held request return (or, if it has not come yet, lets it
    /// pass without stopping).
    pub fn resume(&self) {
        // The request may already have passed a dropped pause: nothing to do.
        let _ = self.resume.send(());
    }
}

struct ActiveFault {
    rule: FaultRule,
    matched: u64,
    failed: u64,
}

impl MemDevice {
    /// A zero-filled device with a volatile write cache and no native FUA,
    /// the configuration that exercises flush ordering hardest.
    ///
    /// `size_bytes` is rounded down to whole logical blocks, as for an image
    /// file.
    ///
    /// # Panics
    /// If `logical_block_size` is not a power of two. It is a constant in the
    /// calling test, not runtime input; [`MemDevice::try_with_caps`] returns
    /// an error instead.
    pub fn new(size_bytes: u64, logical_block_size: u32) -> MemDevice {
        MemDevice::with_caps(size_bytes, logical_block_size, true, false)
    }

    /// Behaves like a kernel device without native FUA: advertises
    /// [`DeviceCaps::kernel_durable_writes`], so the file system sends DSYNC
    /// overwrites as durable writes and no flush. (This device always keeps
    /// a [`WriteMode::Fua`] write across a power cut, as the kernel's write +
    /// flush would.)
    pub fn with_kernel_durable_writes(mut self) -> MemDevice {
        self.caps.kernel_durable_writes = true;
        self
    }

    /// Like [`MemDevice::new`], choosing the cache and FUA capabilities.
    ///
    /// # Panics
    /// As [`MemDevice::new`].
    pub fn with_caps(
        size_bytes: u64,
        logical_block_size: u32,
        volatile_write_cache: bool,
        fua: bool,
    ) -> MemDevice {
        match MemDevice::try_with_caps(size_bytes, logical_block_size, volatile_write_cache, fua) {
            Ok(dev) => dev,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn try_with_caps(
        size_bytes: u64,
        logical_block_size: u32,
        volatile_write_cache: bool,
        fua: bool,
    ) -> Result<MemDevice, DeviceError> {
        let caps = mem_caps(size_bytes, logical_block_size, volatile_write_cache, fua)?;
        let image = Image::zeroed(caps.size_bytes as usize);
        Ok(MemDevice::from_image(caps, image))
    }

    /// A device whose contents (durable and current) are `bytes`, rounded
    /// down to whole logical blocks like an image file: for loading a saved
    /// or deliberately corrupted image, whatever its length.
    ///
    /// # Panics
    /// As [`MemDevice::new`].
    pub fn from_bytes(
        bytes: Vec<u8>,
        logical_block_size: u32,
        volatile_write_cache: bool,
        fua: bool,
    ) -> MemDevice {
        match MemDevice::try_from_bytes(bytes, logical_block_size, volatile_write_cache, fua) {
            Ok(dev) => dev,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn try_from_bytes(
        bytes: Vec<u8>,
        logical_block_size: u32,
        volatile_write_cache: bool,
        fua: bool,
    ) -> Result<MemDevice, DeviceError> {
        let caps = mem_caps(
            bytes.len() as u64,
            logical_block_size,
            volatile_write_cache,
            fua,
        )?;
        let image = Image::from_bytes(&bytes[..caps.size_bytes as usize]);
        Ok(MemDevice::from_image(caps, image))
    }

    fn from_image(caps: DeviceCaps, image: Image) -> MemDevice {
        MemDevice {
            caps,
            counters: DeviceCounters::default(),
            state: Mutex::new(State {
                durable: image.clone(),
                current: image,
                pending: Vec::new(),
                faults: Vec::new(),
                pauses: Vec::new(),
            }),
        }
    }

    /// Overwrites the whole device, durable image included, with `pattern`
    /// repeated (an empty pattern means zeros), and forgets pending writes.
    /// Tests fill with a marker first so that any stale byte a read returns
    /// is recognisable. Not a request: counters and faults are untouched.
    pub fn fill(&self, pattern: &[u8]) {
        let image = Image::filled(self.caps.size_bytes as usize, pattern);
        let mut state = self.state.lock();
        state.durable = image.clone();
        state.current = image;
        state.pending.clear();
    }

    /// The current contents: what reads return now.
    pub fn snapshot(&self) -> Vec<u8> {
        self.state
            .lock()
            .current
            .to_vec(self.caps.size_bytes as usize)
    }

    /// How many writes a power cut would replay (and ask a chooser about):
    /// every write since the last flush, except durable writes issued while
    /// nothing was pending, which are already part of the durable image.
    pub fn pending_writes(&self) -> usize {
        self.state.lock().pending.len()
    }

    pub fn inject(&self, rule: FaultRule) {
        self.state.lock().faults.push(ActiveFault {
            rule,
            matched: 0,
            failed: 0,
        });
    }

    pub fn clear_faults(&self) {
        self.state.lock().faults.clear();
    }

    /// Holds the first request that matches `rule` (its `skip` counts,
    /// `count` does not) after it is done on the device and before it
    /// returns, until the test calls [`PausedRequest::resume`]. A hold
    /// takes no lock, so other requests go on meanwhile.
    pub fn pause_after(&self, rule: FaultRule) -> PausedRequest {
        let (reached_tx, reached) = std::sync::mpsc::channel();
        let (resume, resume_rx) = std::sync::mpsc::channel();
        self.state.lock().pauses.push(ArmedPause {
            rule,
            matched: 0,
            reached: reached_tx,
            resume: resume_rx,
        });
        PausedRequest { reached, resume }
    }

    fn hold_if_paused(&self, op: IoOp, offset: u64, len: u64) {
        let hit = {
            let mut state = self.state.lock();
            let mut hit = None;
            for (i, p) in state.pauses.iter_mut().enumerate() {
                if p.rule.matches(op, offset, len) {
                    p.matched += 1;
                    if p.matched > p.rule.skip {
                        hit = Some(i);
                        break;
                    }
                }
            }
            hit.map(|i| state.pauses.remove(i))
        };
        if let Some(pause) = hit {
            // A test that dropped its handle lets everything through.
            if pause.reached.send(()).is_ok() {
                let _ = pause.resume.recv();
            }
        }
    }

    /// Simulates losing power now, and returns the device as it would come
    /// back: the durable image with the pending writes replayed in issue
    /// order, each kept, lost or torn as `choose` says (durable writes are
    /// always kept; `choose` is still called for them, and its answer
    /// ignored, so that indices and call counts do not depend on
    /// durability). The new device has the same capabilities, fresh
    /// counters and no faults; `self` is unchanged, so one history can be
    /// cut many ways.
    ///
    /// `choose` runs without the device lock held, so it may use `self`.
    pub fn power_cut(&self, choose: &mut dyn FnMut(&PendingWrite) -> Survival) -> MemDevice {
        let (mut image, pending) = {
            let state = self.state.lock();
            (state.durable.clone(), state.pending.clone())
        };
        let lbs = self.caps.logical_block_size as usize;
        for w in &pending {
            let survival = choose(w);
            let offset = w.offset as usize;
            match survival {
                _ if w.durable => image.write(offset, &w.data),
                Survival::Kept => image.write(offset, &w.data),
                Survival::Lost => {}
                Survival::Torn(keep) => {
                    for (i, block) in w.data.chunks_exact(lbs).enumerate() {
                        if keep.get(i).copied().unwrap_or(false) {
                            image.write(offset + i * lbs, block);
                        }
                    }
                }
            }
        }
        MemDevice::from_image(self.caps.clone(), image)
    }

    /// [`MemDevice::power_cut`] with pseudo-random choices from `seed`: each
    /// pending write is lost, kept or torn with roughly equal chance, a torn
    /// write keeping each block with probability 1/2. The same seed and
    /// history give the same device, so a failing seed is a reproducer.
    pub fn power_cut_seeded(&self, seed: u64) -> MemDevice {
        // `% 3` and `& 1` rather than `below`: saved seeds must keep
        // cutting the same way.
        let mut rng = SplitMix64::new(seed);
        self.power_cut(&mut |w| match rng.next_u64() % 3 {
            0 => Survival::Lost,
            1 => Survival::Kept,
            _ => Survival::Torn((0..w.blocks()).map(|_| rng.next_u64() & 1 == 1).collect()),
        })
    }

    /// Runs the fault rules against one request; `true` if it must fail.
    fn should_fail(state: &mut State, op: IoOp, offset: u64, len: u64) -> bool {
        let mut fail = false;
        for f in &mut state.faults {
            if !f.rule.matches(op, offset, len) {
                continue;
            }
            f.matched += 1;
            if f.matched <= f.rule.skip {
                continue;
            }
            let exhausted = match f.rule.count {
                Some(count) => f.failed >= count,
                None => false,
            };
            if !exhausted {
                f.failed += 1;
                fail = true;
            }
        }
        fail
    }
}

impl BlockDevice for MemDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        let result = self.read_now(buf, offset);
        self.hold_if_paused(IoOp::Read, offset, buf.len() as u64);
        result
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        let result = self.write_now(buf, offset, mode);
        self.hold_if_paused(IoOp::Write, offset, buf.len() as u64);
        result
    }

    fn flush(&self) -> Result<(), DeviceError> {
        let result = self.flush_now();
        self.hold_if_paused(IoOp::Flush, 0, 0);
        result
    }

    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    fn backend_name(&self) -> &'static str {
        "memory"
    }
}

impl MemDevice {
    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_request(&self.caps, offset, buf.len())?;
        self.counters.record_read(buf.len());
        let mut state = self.state.lock();
        if MemDevice::should_fail(&mut state, IoOp::Read, offset, buf.len() as u64) {
            return Err(eio(IoOp::Read, offset, buf.len()));
        }
        state.current.read(offset as usize, buf);
        Ok(())
    }

    fn write_now(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        check_request(&self.caps, offset, buf.len())?;
        let fua = mode == WriteMode::Fua;
        self.counters.record_write(buf.len(), fua);
        let mut state = self.state.lock();
        if MemDevice::should_fail(&mut state, IoOp::Write, offset, buf.len() as u64) {
            return Err(eio(IoOp::Write, offset, buf.len()));
        }
        if buf.is_empty() {
            return Ok(());
        }
        let offset_usize = offset as usize;
        let durable = fua || !self.caps.volatile_write_cache;
        let state = &mut *state;
        state.current.write(offset_usize, buf);
        if durable && state.pending.is_empty() {
            // Nothing earlier can be replayed over it, so it needs no place
            // in the replay list: this keeps write-through devices from
            // accumulating an unbounded list.
            state
                .durable
                .share_from(&state.current, offset_usize, buf.len());
        } else {
            state.pending.push(PendingWrite {
                index: state.pending.len(),
                offset,
                data: Arc::from(buf),
                durable,
                logical_block_size: self.caps.logical_block_size,
            });
        }
        Ok(())
    }

    fn flush_now(&self) -> Result<(), DeviceError> {
        self.counters.record_flush();
        let mut state = self.state.lock();
        if MemDevice::should_fail(&mut state, IoOp::Flush, 0, 0) {
            return Err(DeviceError::Flush {
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        // Only chunks touched by pending writes differ between the two
        // images, so sharing those makes them equal.
        let state = &mut *state;
        for w in state.pending.drain(..) {
            state
                .durable
                .share_from(&state.current, w.offset as usize, w.data.len());
        }
        Ok(())
    }
}

impl fmt::Debug for MemDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        f.debug_struct("MemDevice")
            .field("caps", &self.caps)
            .field("pending_writes", &state.pending.len())
            .field("fault_rules", &state.faults.len())
            .finish()
    }
}

fn mem_caps(
    size_bytes: u64,
    logical_block_size: u32,
    volatile_write_cache: bool,
    fua: bool,
) -> Result<DeviceCaps, DeviceError> {
    let unusable = |reason: String| DeviceError::Unusable {
        path: "memory".into(),
        reason,
    };
    if !logical_block_size.is_power_of_two() {
        return Err(unusable(format!(
            "logical block size {logical_block_size} is not a power of two"
        )));
    }
    let size_bytes = size_bytes - size_bytes % u64::from(logical_block_size);
    if usize::try_from(size_bytes).is_err() {
        return Err(unusable(format!("{size_bytes} bytes do not fit in memory")));
    }
    Ok(DeviceCaps {
        kind: DeviceKind::Memory,
        name: format!("memory ({size_bytes} bytes)"),
        logical_block_size,
        // Plain memcpy: any address will do.
        memory_alignment: 1,
        size_bytes,
        volatile_write_cache,
        fua,
        kernel_durable_writes: false,
        direct_io: false,
    })
}

fn eio(op: IoOp, offset: u64, len: usize) -> DeviceError {
    DeviceError::Io {
        op,
        offset,
        len: len as u64,
        source: io::Error::from_raw_os_error(libc::EIO),
    }
}

/// Device contents as copy-on-write chunks of `CHUNK_BYTES` (the last one
/// padded; bytes past the device size are never read or written). Cloning
/// shares every chunk; writing copies only shared chunks it touches.
#[derive(Clone)]
struct Image {
    chunks: Vec<Arc<Vec<u8>>>,
}

impl Image {
    fn zeroed(size: usize) -> Image {
        // One zero chunk shared by all: a fresh 16 MiB device costs 1024
        // pointers, not 16 MiB.
        let zero = Arc::new(vec![0; CHUNK_BYTES]);
        Image {
            chunks: vec![zero; size.div_ceil(CHUNK_BYTES)],
        }
    }

    fn from_bytes(bytes: &[u8]) -> Image {
        let chunks = bytes
            .chunks(CHUNK_BYTES)
            .map(|c| {
                let mut chunk = vec![0; CHUNK_BYTES];
                chunk[..c.len()].copy_from_slice(c);
                Arc::new(chunk)
            })
            .collect();
        Image { chunks }
    }

    fn filled(size: usize, pattern: &[u8]) -> Image {
        if pattern.is_empty() {
            return Image::zeroed(size);
        }
        let chunk_at = |start: usize| {
            let chunk: Vec<u8> = (start..start + CHUNK_BYTES)
                .map(|pos| pattern[pos % pattern.len()])
                .collect();
            Arc::new(chunk)
        };
        let n = size.div_ceil(CHUNK_BYTES);
        let chunks = if CHUNK_BYTES.is_multiple_of(pattern.len()) {
            // Every chunk starts at a multiple of the period: all identical.
            let shared = chunk_at(0);
            vec![shared; n]
        } else {
            (0..n).map(|i| chunk_at(i * CHUNK_BYTES)).collect()
        };
        Image { chunks }
    }

    /// Calls `f(chunk index, offset in chunk, range in the request)` for
    /// each piece of `[offset, offset + len)`.
    fn for_each_piece(offset: usize, len: usize, mut f: impl FnMut(usize, usize, Range<usize>)) {
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let in_chunk = pos % CHUNK_BYTES;
            let n = (CHUNK_BYTES - in_chunk).min(len - done);
            f(pos / CHUNK_BYTES, in_chunk, done..done + n);
            done += n;
        }
    }

    fn read(&self, offset: usize, buf: &mut [u8]) {
        Image::for_each_piece(offset, buf.len(), |ci, at, r| {
            let n = r.len();
            buf[r].copy_from_slice(&self.chunks[ci][at..at + n]);
        });
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        Image::for_each_piece(offset, data.len(), |ci, at, r| {
            let n = r.len();
            Arc::make_mut(&mut self.chunks[ci])[at..at + n].copy_from_slice(&data[r]);
        });
    }

    /// Makes the chunks covering `[offset, offset + len)` the same chunks as
    /// `other`'s. Whole chunks are shared, so this is only right where the
    /// two images already agree outside that range within those chunks.
    fn share_from(&mut self, other: &Image, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset / CHUNK_BYTES;
        let last = (offset + len - 1) / CHUNK_BYTES;
        self.chunks[first..=last].clone_from_slice(&other.chunks[first..=last]);
    }

    fn to_vec(&self, size: usize) -> Vec<u8> {
        let mut out = vec![0; size];
        self.read(0, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const LBS: usize = 512;

    fn block(byte: u8, blocks: usize) -> Vec<u8> {
        vec![byte; blocks * LBS]
    }

    fn read(dev: &MemDevice, offset: usize, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        dev.read_at(&mut buf, offset as u64).unwrap();
        buf
    }

    fn write(dev: &MemDevice, byte: u8, block_no: usize, blocks: usize, mode: WriteMode) {
        dev.write_at(&block(byte, blocks), (block_no * LBS) as u64, mode)
            .unwrap();
    }

    /// The byte each block of `dev` holds, checking blocks are uniform.
    fn blocks_of(dev: &MemDevice) -> Vec<u8> {
        dev.snapshot()
            .chunks(LBS)
            .map(|b| {
                assert!(b.iter().all(|&x| x == b[0]), "block torn inside");
                b[0]
            })
            .collect()
    }

    #[test]
    fn reads_see_writes_and_fill_marks_everything() {
        let dev = MemDevice::new(64 * 1024, LBS as u32);
        assert_eq!(dev.snapshot(), vec![0; 64 * 1024]);
        dev.fill(b"STALE!");
        let snap = dev.snapshot();
        assert!(snap.chunks(6).all(|c| c == &b"STALE!"[..c.len()]));
        write(&dev, 1, 3, 2, WriteMode::Normal);
        assert_eq!(read(&dev, 3 * LBS, 2 * LBS), block(1, 2));
        assert_eq!(&read(&dev, 2 * LBS, LBS)[..], &snap[2 * LBS..3 * LBS]);
        // The fill is durable: a cut losing everything still shows it.
        let cut = dev.power_cut(&mut |_| Survival::Lost);
        assert_eq!(cut.snapshot(), snap);
        // A fill replaces writes pending before it: no cut resurrects them.
        dev.fill(b"again");
        assert_eq!(dev.pending_writes(), 0);
        let refilled = dev.snapshot();
        assert_eq!(dev.power_cut(&mut |_| Survival::Kept).snapshot(), refilled);
    }

    #[test]
    fn fill_pattern_is_continuous_across_chunks() {
        // 3 does not divide the chunk size, 16 does: both chunk layouts.
        for pattern in [&b"abc"[..], &b"0123456789abcdef"[..]] {
            let dev = MemDevice::new(3 * CHUNK_BYTES as u64 + 1024, LBS as u32);
            dev.fill(pattern);
            let snap = dev.snapshot();
            assert_eq!(snap.len(), 3 * CHUNK_BYTES + 1024);
            for (i, b) in snap.iter().enumerate() {
                assert_eq!(*b, pattern[i % pattern.len()], "byte {i}");
            }
        }
        let dev = MemDevice::new(4096, LBS as u32);
        dev.fill(&[]);
        assert_eq!(dev.snapshot(), vec![0; 4096]);
    }

    #[test]
    fn requests_are_validated() {
        let dev = MemDevice::new(8 * LBS as u64, LBS as u32);
        let mut buf = vec![0; LBS];
        assert!(matches!(
            dev.read_at(&mut buf, 1),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.write_at(&buf[..100], 0, WriteMode::Normal),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.read_at(&mut buf, 8 * LBS as u64),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            dev.write_at(&buf, u64::MAX - LBS as u64 + 1, WriteMode::Normal),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert_eq!(dev.counters().snapshot(), Default::default());
        assert_eq!(dev.pending_writes(), 0);
    }

    #[test]
    fn bad_geometry_is_an_error_from_the_fallible_constructors() {
        for lbs in [0, 3, 1000] {
            assert!(matches!(
                MemDevice::try_with_caps(4096, lbs, true, false),
                Err(DeviceError::Unusable { .. })
            ));
            assert!(MemDevice::try_from_bytes(vec![0; 4096], lbs, true, false).is_err());
        }
        // Sizes round down to whole blocks, as for image files.
        let dev = MemDevice::new(4096 + 100, 4096);
        assert_eq!(dev.caps().size_bytes, 4096);
        let dev = MemDevice::from_bytes(vec![7; 1500], LBS as u32, true, false);
        assert_eq!(dev.caps().size_bytes, 1024);
        assert_eq!(dev.snapshot(), vec![7; 1024]);
    }

    #[test]
    fn from_bytes_round_trips_across_chunks() {
        let bytes: Vec<u8> = (0..3 * CHUNK_BYTES + LBS)
            .map(|i| (i % 251) as u8)
            .collect();
        let dev = MemDevice::from_bytes(bytes.clone(), LBS as u32, true, false);
        assert_eq!(dev.snapshot(), bytes);
        // A read straddling a chunk boundary.
        let off = CHUNK_BYTES - LBS;
        assert_eq!(read(&dev, off, 2 * LBS), bytes[off..off + 2 * LBS]);
        // Both durable and current: a cut with nothing pending gives the same.
        assert_eq!(dev.power_cut_seeded(1).snapshot(), bytes);
    }

    /// The held request is done on the device but has not returned; other
    /// requests go on meanwhile; `skip` picks which match is held.
    #[test]
    fn paused_request_is_done_but_held_until_resumed() {
        let dev = Arc::new(MemDevice::new(64 * LBS as u64, LBS as u32));
        let lbs = LBS as u64;
        let paused = dev.pause_after(FaultRule::new(FaultOp::Write).range(lbs..2 * lbs).skip(1));
        write(&dev, 1, 1, 1, WriteMode::Normal); // first match: skipped
        write(&dev, 3, 5, 1, WriteMode::Normal); // outside the range
        let returned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (dev, returned) = (dev.clone(), returned.clone());
            std::thread::spawn(move || {
                write(&dev, 2, 1, 1, WriteMode::Normal);
                returned.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        paused.wait_reached();
        // Done on the device, not returned; others go on.
        assert_eq!(blocks_of(&dev)[1], 2);
        assert!(!returned.load(std::sync::atomic::Ordering::SeqCst));
        write(&dev, 4, 6, 1, WriteMode::Normal);
        dev.flush().unwrap();
        paused.resume();
        writer.join().unwrap();
        assert!(returned.load(std::sync::atomic::Ordering::SeqCst));
        // One-shot: later matches pass.
        write(&dev, 5, 1, 1, WriteMode::Normal);
        assert_eq!(blocks_of(&dev)[1], 5);
    }

    #[test]
    fn flushed_data_survives_every_cut() {
        let dev = MemDevice::new(64 * LBS as u64, LBS as u32);
        dev.fill(&[0xee]);
        write(&dev, 1, 0, 8, WriteMode::Normal);
        write(&dev, 2, 40, 4, WriteMode::Normal);
        dev.flush().unwrap();
        // Later writes avoid blocks 0..8 and 40..44.
        write(&dev, 3, 10, 6, WriteMode::Normal);
        write(&dev, 4, 20, 3, WriteMode::Normal);
        assert_eq!(dev.pending_writes(), 2);
        for seed in 0..200 {
            let b = blocks_of(&dev.power_cut_seeded(seed));
            assert_eq!(&b[0..8], &[1; 8], "seed {seed}");
            assert_eq!(&b[40..44], &[2; 4], "seed {seed}");
            assert_eq!(b[9], 0xee, "seed {seed}");
        }
        // Losing every pending write gives exactly the state at the flush.
        let b = blocks_of(&dev.power_cut(&mut |_| Survival::Lost));
        let mut want = vec![0xee; 64];
        want[0..8].fill(1);
        want[40..44].fill(2);
        assert_eq!(b, want);
    }

    #[test]
    fn unflushed_writes_can_be_lost_kept_or_torn() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        dev.fill(&[0xee]);
        write(&dev, 1, 0, 4, WriteMode::Normal); // index 0
        write(&dev, 2, 8, 4, WriteMode::Normal); // index 1
        let mut seen = Vec::new();
        let cut = dev.power_cut(&mut |w| {
            seen.push((w.index(), w.offset(), w.len(), w.blocks(), w.durable()));
            match w.index() {
                0 => Survival::Lost,
                // Block 3 gets no entry: missing entries are not kept.
                _ => Survival::Torn(vec![true, false, true]),
            }
        });
        assert_eq!(
            seen,
            vec![
                (0, 0, 4 * LBS as u64, 4, false),
                (1, 8 * LBS as u64, 4 * LBS as u64, 4, false)
            ]
        );
        let b = blocks_of(&cut);
        assert_eq!(&b[0..4], &[0xee; 4]);
        assert_eq!(&b[8..12], &[2, 0xee, 2, 0xee]);

        let b = blocks_of(&dev.power_cut(&mut |_| Survival::Kept));
        assert_eq!(&b[0..4], &[1; 4]);
        assert_eq!(&b[8..12], &[2; 4]);

        // The original device is untouched by cutting it.
        assert_eq!(dev.pending_writes(), 2);
        assert_eq!(read(&dev, 0, LBS), block(1, 1));
    }

    #[test]
    fn seeded_cuts_are_deterministic_and_cover_every_outcome() {
        let dev = MemDevice::new(32 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 8, WriteMode::Normal);
        let a = dev.power_cut_seeded(42).snapshot();
        assert_eq!(a, dev.power_cut_seeded(42).snapshot());
        let (mut lost, mut kept, mut torn) = (0, 0, 0);
        for seed in 0..300 {
            let b = blocks_of(&dev.power_cut_seeded(seed));
            match b[0..8].iter().filter(|&&x| x == 1).count() {
                0 => lost += 1,
                8 => kept += 1,
                _ => torn += 1,
            }
            assert!(b[0..8].iter().all(|&x| x == 0 || x == 1));
        }
        // ~1/3 each (torn-all and torn-none land in kept/lost rarely).
        for n in [lost, kept, torn] {
            assert!(
                (60..=140).contains(&n),
                "lost {lost} kept {kept} torn {torn}"
            );
        }
    }

    #[test]
    fn fua_and_write_through_writes_always_survive() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 2, WriteMode::Normal);
        write(&dev, 2, 4, 2, WriteMode::Fua);
        let mut durables = Vec::new();
        let cut = dev.power_cut(&mut |w| {
            durables.push(w.durable());
            Survival::Lost
        });
        assert_eq!(durables, vec![false, true]);
        let b = blocks_of(&cut);
        assert_eq!(&b[0..2], &[0, 0]);
        assert_eq!(&b[4..6], &[2, 2]);
        // A torn answer for a durable write is ignored too.
        let b = blocks_of(&dev.power_cut(&mut |_| Survival::Torn(vec![])));
        assert_eq!(&b[4..6], &[2, 2]);

        // No volatile cache: every write is durable at completion, and
        // nothing piles up waiting for a flush.
        let wt = MemDevice::with_caps(16 * LBS as u64, LBS as u32, false, false);
        for i in 0..16 {
            write(&wt, i as u8 + 1, i, 1, WriteMode::Normal);
        }
        assert_eq!(wt.pending_writes(), 0);
        let b = blocks_of(&wt.power_cut(&mut |_| Survival::Lost));
        assert_eq!(b, (1..=16).collect::<Vec<u8>>());
    }

    #[test]
    fn later_surviving_writes_win_in_issue_order() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 2, WriteMode::Normal); // index 0
        write(&dev, 2, 1, 2, WriteMode::Normal); // index 1, overlaps block 1
        let cut = |keep: [bool; 2]| {
            blocks_of(&dev.power_cut(&mut |w| {
                if keep[w.index()] {
                    Survival::Kept
                } else {
                    Survival::Lost
                }
            }))[0..3]
                .to_vec()
        };
        assert_eq!(cut([true, true]), [1, 2, 2]);
        assert_eq!(cut([true, false]), [1, 1, 0]);
        assert_eq!(cut([false, true]), [0, 2, 2]);
        assert_eq!(cut([false, false]), [0, 0, 0]);
    }

    #[test]
    fn a_durable_write_is_never_undone_by_replaying_an_older_one() {
        // Normal then FUA over the same block: whatever happens to the
        // normal write, the FUA data is what survives.
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Normal);
        write(&dev, 2, 0, 1, WriteMode::Fua);
        assert_eq!(dev.pending_writes(), 2);
        for s in [Survival::Kept, Survival::Lost, Survival::Torn(vec![true])] {
            let b = blocks_of(&dev.power_cut(&mut |_| s.clone()));
            assert_eq!(b[0], 2, "{s:?}");
        }
        // FUA with nothing pending, then a normal write over it: losing the
        // normal write must expose the FUA data, not the older contents.
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Fua);
        write(&dev, 2, 0, 1, WriteMode::Normal);
        assert_eq!(dev.pending_writes(), 1);
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Lost))[0], 1);
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Kept))[0], 2);
    }

    #[test]
    fn flush_makes_earlier_writes_durable_and_only_those() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Normal);
        dev.flush().unwrap();
        assert_eq!(dev.pending_writes(), 0);
        write(&dev, 2, 0, 1, WriteMode::Normal);
        write(&dev, 3, 1, 1, WriteMode::Normal);
        let b = blocks_of(&dev.power_cut(&mut |_| Survival::Lost));
        assert_eq!(&b[0..2], &[1, 0]);
        dev.flush().unwrap();
        let b = blocks_of(&dev.power_cut(&mut |_| Survival::Lost));
        assert_eq!(&b[0..2], &[2, 3]);
    }

    #[test]
    fn a_cut_device_is_fresh_and_independent() {
        let dev = MemDevice::with_caps(16 * LBS as u64, LBS as u32, true, true);
        dev.inject(FaultRule::new(FaultOp::Any));
        let cut = dev.power_cut(&mut |_| Survival::Kept);
        assert_eq!(cut.caps(), dev.caps());
        assert_eq!(cut.counters().snapshot(), Default::default());
        // No faults carried over; writes to the new device do not leak back.
        write(&cut, 9, 0, 1, WriteMode::Normal);
        assert_eq!(blocks_of(&cut)[0], 9);
        assert_eq!(dev.snapshot(), vec![0; 16 * LBS]);
    }

    #[test]
    fn chooser_may_use_the_device() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Normal);
        // Would deadlock if the device lock were held while choosing.
        let cut = dev.power_cut(&mut |_| {
            assert_eq!(dev.pending_writes(), 1);
            Survival::Kept
        });
        assert_eq!(blocks_of(&cut)[0], 1);
    }

    #[test]
    fn faults_respect_skip_count_and_op() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        dev.inject(FaultRule::new(FaultOp::Write).skip(2).count(2));
        let results: Vec<bool> = (0..6)
            .map(|i| {
                dev.write_at(&block(i as u8 + 1, 1), (i * LBS) as u64, WriteMode::Normal)
                    .is_ok()
            })
            .collect();
        assert_eq!(results, [true, true, false, false, true, true]);
        // Failed writes changed nothing and are not pending.
        assert_eq!(&blocks_of(&dev)[0..6], &[1, 2, 0, 0, 5, 6]);
        assert_eq!(dev.pending_writes(), 4);
        // Reads and flushes do not match a write rule.
        read(&dev, 0, LBS);
        dev.flush().unwrap();

        let err = {
            dev.inject(FaultRule::new(FaultOp::Read));
            let mut buf = vec![0x55; LBS];
            let err = dev.read_at(&mut buf, 0).unwrap_err();
            assert_eq!(
                buf,
                vec![0x55; LBS],
                "a failed read leaves the buffer alone"
            );
            err
        };
        match err {
            DeviceError::Io {
                op: IoOp::Read,
                offset: 0,
                len,
                ref source,
            } => {
                assert_eq!(len, LBS as u64);
                assert_eq!(source.raw_os_error(), Some(libc::EIO));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(err.errno(), libc::EIO);
        dev.clear_faults();
        read(&dev, 0, LBS);
    }

    #[test]
    fn fault_ranges_match_only_overlapping_requests() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        // Bytes 1000..1100 span blocks 1 and 2 (block 2 starts at 1024).
        dev.inject(FaultRule::new(FaultOp::Any).range(1000..1100));
        let w = |blk: usize, n: usize| {
            dev.write_at(&block(7, n), (blk * LBS) as u64, WriteMode::Normal)
                .is_ok()
        };
        assert!(w(0, 1));
        assert!(!w(1, 1));
        assert!(!w(0, 2), "overlaps the range partially");
        assert!(!w(2, 4), "block 2 starts at byte 1024, inside the range");
        assert!(w(3, 4));
        let mut buf = vec![0; LBS];
        assert!(dev.read_at(&mut buf, LBS as u64).is_err());
        assert!(dev.flush().is_ok(), "a flush has no bytes to overlap");
    }

    #[test]
    fn a_failed_flush_makes_nothing_durable() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 1, WriteMode::Normal);
        dev.inject(FaultRule::new(FaultOp::Flush).count(1));
        let err = dev.flush().unwrap_err();
        assert!(matches!(err, DeviceError::Flush { .. }), "{err}");
        assert_eq!(err.errno(), libc::EIO);
        assert_eq!(dev.pending_writes(), 1);
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Lost))[0], 0);
        dev.flush().unwrap();
        assert_eq!(blocks_of(&dev.power_cut(&mut |_| Survival::Lost))[0], 1);
    }

    #[test]
    fn counters_count_issued_requests_by_kind() {
        let dev = MemDevice::new(16 * LBS as u64, LBS as u32);
        write(&dev, 1, 0, 2, WriteMode::Normal);
        write(&dev, 1, 2, 1, WriteMode::Fua);
        read(&dev, 0, 3 * LBS);
        dev.flush().unwrap();
        // An injected failure still reached the device, so it counts.
        dev.inject(FaultRule::new(FaultOp::Write).count(1));
        assert!(dev.write_at(&block(1, 1), 0, WriteMode::Normal).is_err());
        // A rejected request never reached it.
        assert!(dev.write_at(&[0; 3], 0, WriteMode::Normal).is_err());
        let c = dev.counters().snapshot();
        assert_eq!(
            c,
            crate::RequestCounts {
                reads: 1,
                writes: 3,
                fua_writes: 1,
                flushes: 1,
                bytes_read: 3 * LBS as u64,
                bytes_written: 4 * LBS as u64,
            }
        );
    }

    #[test]
    fn concurrent_writers_to_disjoint_ranges() {
        let dev = Arc::new(MemDevice::new(64 * LBS as u64, LBS as u32));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let dev = Arc::clone(&dev);
                std::thread::spawn(move || {
                    for i in 0..8 {
                        write(&dev, t as u8 + 1, t * 8 + i, 1, WriteMode::Normal);
                        if i % 3 == 0 {
                            dev.flush().unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let b = blocks_of(&dev);
        for t in 0..8 {
            assert!(b[t * 8..t * 8 + 8].iter().all(|&x| x == t as u8 + 1));
        }
    }

    /// The chunked copy-on-write image against a flat model of the fault
    /// model: random writes (many straddling chunk boundaries), FUA writes,
    /// flushes and cuts must give byte-identical results.
    #[test]
    fn matches_a_flat_reference_model() {
        struct Model {
            durable: Vec<u8>,
            current: Vec<u8>,
            pending: Vec<(usize, Vec<u8>, bool)>,
        }
        // Decided by the write's identity, so the device and the model agree
        // without sharing indices.
        fn decide(offset: u64, data: &[u8]) -> Survival {
            let blocks = data.len() / LBS;
            match (offset / LBS as u64 + u64::from(data[0])) % 3 {
                0 => Survival::Lost,
                1 => Survival::Kept,
                _ => Survival::Torn(
                    (0..blocks)
                        .map(|i| (i + data[1] as usize).is_multiple_of(2))
                        .collect(),
                ),
            }
        }
        let size = 3 * CHUNK_BYTES + 8 * LBS;
        let blocks = size / LBS;
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..40 {
            let vwc = round % 4 != 3;
            let dev = MemDevice::with_caps(size as u64, LBS as u32, vwc, false);
            let mut m = Model {
                durable: vec![0; size],
                current: vec![0; size],
                pending: Vec::new(),
            };
            for _ in 0..rng.gen_range(1..60) {
                match rng.gen_range(0..10) {
                    0 => {
                        dev.flush().unwrap();
                        m.pending.clear();
                        m.durable.clone_from(&m.current);
                    }
                    1 => {
                        let n = rng.gen_range(1..=40.min(blocks));
                        let at = rng.gen_range(0..=blocks - n) * LBS;
                        assert_eq!(read(&dev, at, n * LBS), m.current[at..at + n * LBS]);
                    }
                    k => {
                        let n = rng.gen_range(1..=40.min(blocks));
                        let at = rng.gen_range(0..=blocks - n) * LBS;
                        let data: Vec<u8> = (0..n * LBS).map(|_| rng.gen()).collect();
                        let fua = k == 2;
                        let mode = if fua {
                            WriteMode::Fua
                        } else {
                            WriteMode::Normal
                        };
                        dev.write_at(&data, at as u64, mode).unwrap();
                        m.current[at..at + data.len()].copy_from_slice(&data);
                        m.pending.push((at, data, fua || !vwc));
                    }
                }
                assert_eq!(dev.snapshot(), m.current, "round {round}");
            }
            let cut = dev.power_cut(&mut |w| decide(w.offset(), w.data()));
            let mut want = m.durable.clone();
            for (at, data, durable) in &m.pending {
                let s = if *durable {
                    Survival::Kept
                } else {
                    decide(*at as u64, data)
                };
                for (i, blk) in data.chunks(LBS).enumerate() {
                    let keep = match &s {
                        Survival::Kept => true,
                        Survival::Lost => false,
                        Survival::Torn(mask) => mask[i],
                    };
                    if keep {
                        want[at + i * LBS..at + (i + 1) * LBS].copy_from_slice(blk);
                    }
                }
            }
            assert_eq!(cut.snapshot(), want, "round {round}");
            // The device keeps working after being cut, and so does the cut.
            assert_eq!(dev.snapshot(), m.current);
            write(&cut, 0xab, 0, 1, WriteMode::Normal);
            assert_eq!(read(&cut, 0, LBS), block(0xab, 1));
        }
    }
}
