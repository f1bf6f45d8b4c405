//! Power cuts: which writes a device that loses power now comes back with.
//!
//! Every write that is not yet durable is replayed onto the durable image,
//! in issue order, and each is kept, lost or torn as a chooser says (the
//! fault model in the parent module). A cut returns a new device and leaves
//! the old one alone, so one history can be cut every way a test likes, and
//! a seeded chooser makes a failing cut a reproducer.

use std::fmt;
use std::sync::Arc;

use super::MemDevice;
use crate::rng::SplitMix64;

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
    pub(super) index: usize,
    pub(super) offset: u64,
    pub(super) data: Arc<[u8]>,
    pub(super) durable: bool,
    pub(super) logical_block_size: u32,
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

impl MemDevice {
    /// Simulates losing power now, and returns the device as it would come
    /// back: the durable image with the pending writes replayed in issue
    /// order, each kept, lost or torn as `choose` says (durable writes are
    /// always kept; `choose` is still called for them, and its answer
    /// ignored, so that indices and call counts do not depend on
    /// durability). The new device has the same capabilities and kind of
    /// queue (its queues numbered from 0 again), fresh counters and no
    /// faults; `self` is unchanged, so one history can be cut many ways.
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
        let cut = MemDevice::from_image(self.caps.clone(), image);
        match &self.out_of_order {
            Some(out_of_order) => cut.with_out_of_order_queue(out_of_order.seed),
            None => cut,
        }
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
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{block, blocks_of, read, write, LBS};
    use super::*;
    use crate::{BlockDevice, FaultOp, FaultRule, WriteMode};

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
}
