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
//! - Queued requests complete in push order ([`crate::InlineQueue`]), or,
//!   on a device built [`with_out_of_order_queue`](MemDevice::with_out_of_order_queue),
//!   in a seeded-random order, each reaching the device as it completes
//!   (the fault model of that queue is in [`crate::queue::out_of_order`]).
//!
//! # Where each part lives
//!
//! - `image`: the contents, as copy-on-write chunks, so that the 10,000+
//!   devices a power-cut test makes share memory.
//! - `fault`: injected request failures ([`FaultRule`]).
//! - `power_cut`: what survives losing power ([`MemDevice::power_cut`]).
//! - `pause`: holding a request open before it reaches the device or
//!   between done and returned ([`MemDevice::pause_before`],
//!   [`MemDevice::pause_after`]).

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::IoOp;
use crate::request::Admission;
use crate::rng::mix64;
use crate::WriteMode;
use crate::{
    BlockDevice, DeviceCaps, DeviceCounters, DeviceError, DeviceKind, DeviceQueue, OutOfOrderQueue,
};

mod fault;
mod image;
mod pause;
mod power_cut;

pub use fault::{FaultOp, FaultRule};
pub use pause::PausedRequest;
pub use power_cut::{PendingWrite, Survival};

use fault::Faults;
use image::Image;
use pause::{PausePoint, Pauses};

/// A RAM-backed [`BlockDevice`] with a crash model (see the module docs).
pub struct MemDevice {
    caps: DeviceCaps,
    /// Shared by every handle on the device (see [`MemDevice::handle`]).
    counters: Arc<DeviceCounters>,
    state: Arc<Mutex<State>>,
    /// `Some`: [`BlockDevice::native_queue`] makes an [`OutOfOrderQueue`].
    out_of_order: Option<OutOfOrder>,
    /// What [`BlockDevice::request_slots`] says.
    request_slots: Option<usize>,
}

/// How [`MemDevice::with_out_of_order_queue`] seeds its queues.
struct OutOfOrder {
    seed: u64,
    /// Queues made so far: each gets its own seed, derived from `seed` and
    /// its number, so two queues do not reorder in lockstep.
    queues_made: AtomicU64,
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
    faults: Faults,
    /// Requests to hold before they return ([`MemDevice::pause_after`]).
    pauses: Pauses,
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

    /// Makes [`new_queue`](crate::new_queue) on this device build an
    /// [`OutOfOrderQueue`], which completes requests in a seeded-random
    /// order instead of push order: the reorderings a real NVMe or io_uring
    /// queue may produce, reproducibly. The `n`-th queue made from the
    /// device (counting from 0) is seeded with [`mix64`]`(seed + n)`, so
    /// the same seed and the same calls give the same completions.
    ///
    /// Without it (the default), queues are [`crate::InlineQueue`]s,
    /// which complete in push order.
    pub fn with_out_of_order_queue(mut self, seed: u64) -> MemDevice {
        self.out_of_order = Some(OutOfOrder {
            seed,
            queues_made: AtomicU64::new(0),
        });
        self
    }

    /// Makes [`BlockDevice::request_slots`] say `slots`, as a block
    /// device whose kernel queue holds that many requests would.
    pub fn with_request_slots(mut self, slots: usize) -> MemDevice {
        self.request_slots = Some(slots);
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
            counters: Arc::default(),
            state: Arc::new(Mutex::new(State {
                durable: image.clone(),
                current: image,
                pending: Vec::new(),
                faults: Faults::default(),
                pauses: Pauses::default(),
            })),
            out_of_order: None,
            request_slots: None,
        }
    }

    /// Another handle on the same device (contents, counters, faults,
    /// pauses), with the default queue: what an [`OutOfOrderQueue`] runs
    /// its requests on, since it outlives the borrow `native_queue` gets.
    fn handle(&self) -> MemDevice {
        MemDevice {
            caps: self.caps.clone(),
            counters: Arc::clone(&self.counters),
            state: Arc::clone(&self.state),
            out_of_order: None,
            request_slots: self.request_slots,
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
}

impl BlockDevice for MemDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        let len = buf.len() as u64;
        self.hold_if_paused(PausePoint::Before, IoOp::Read, offset, len);
        let result = self.read_now(buf, offset);
        self.hold_if_paused(PausePoint::After, IoOp::Read, offset, len);
        result
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        let len = buf.len() as u64;
        self.hold_if_paused(PausePoint::Before, IoOp::Write, offset, len);
        let result = self.write_now(buf, offset, mode);
        self.hold_if_paused(PausePoint::After, IoOp::Write, offset, len);
        result
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.hold_if_paused(PausePoint::Before, IoOp::Flush, 0, 0);
        let result = self.flush_now();
        self.hold_if_paused(PausePoint::After, IoOp::Flush, 0, 0);
        result
    }

    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    fn request_slots(&self) -> Option<usize> {
        self.request_slots
    }

    fn native_queue(&self, depth: usize) -> Result<Option<Box<dyn DeviceQueue>>, DeviceError> {
        let Some(out_of_order) = &self.out_of_order else {
            return Ok(None);
        };
        let n = out_of_order.queues_made.fetch_add(1, Ordering::Relaxed);
        let seed = mix64(out_of_order.seed.wrapping_add(n));
        let dev: Arc<dyn BlockDevice> = Arc::new(self.handle());
        Ok(Some(Box::new(OutOfOrderQueue::new(dev, depth, seed))))
    }

    fn backend_name(&self) -> &'static str {
        "memory"
    }
}

impl MemDevice {
    fn admission(&self) -> Admission<'_> {
        Admission::new(&self.caps, &self.counters)
    }

    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.admission().read(offset, buf.len())?;
        let mut state = self.state.lock();
        if state
            .faults
            .should_fail(IoOp::Read, offset, buf.len() as u64)
        {
            return Err(eio(IoOp::Read, offset, buf.len()));
        }
        state.current.read(offset as usize, buf);
        Ok(())
    }

    fn write_now(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.admission().write(offset, buf.len(), mode)?;
        let mut state = self.state.lock();
        if state
            .faults
            .should_fail(IoOp::Write, offset, buf.len() as u64)
        {
            return Err(eio(IoOp::Write, offset, buf.len()));
        }
        if buf.is_empty() {
            return Ok(());
        }
        let offset_usize = offset as usize;
        let durable = mode == WriteMode::Fua || !self.caps.volatile_write_cache;
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
        self.admission().flush();
        let mut state = self.state.lock();
        if state.faults.should_fail(IoOp::Flush, 0, 0) {
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
            .field(
                "out_of_order_seed",
                &self.out_of_order.as_ref().map(|o| o.seed),
            )
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

/// What the tests of every part of this device use to drive it.
#[cfg(test)]
mod test_support {
    use super::*;

    pub(super) const LBS: usize = 512;

    pub(super) fn block(byte: u8, blocks: usize) -> Vec<u8> {
        vec![byte; blocks * LBS]
    }

    pub(super) fn read(dev: &MemDevice, offset: usize, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        dev.read_at(&mut buf, offset as u64).unwrap();
        buf
    }

    pub(super) fn write(
        dev: &MemDevice,
        byte: u8,
        block_no: usize,
        blocks: usize,
        mode: WriteMode,
    ) {
        dev.write_at(&block(byte, blocks), (block_no * LBS) as u64, mode)
            .unwrap();
    }

    /// The byte each block of `dev` holds, checking blocks are uniform.
    pub(super) fn blocks_of(dev: &MemDevice) -> Vec<u8> {
        dev.snapshot()
            .chunks(LBS)
            .map(|b| {
                assert!(b.iter().all(|&x| x == b[0]), "block torn inside");
                b[0]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::image::CHUNK_BYTES;
    use super::test_support::{block, blocks_of, read, write, LBS};
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

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
