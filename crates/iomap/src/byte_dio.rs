//! Direct I/O at any byte offset, length and buffer address.
//!
//! Aligned requests go straight to [`dio_read`] / [`dio_write`] and keep
//! every fast path; buffer addresses the device cannot take are bounced by
//! the device layer. An unaligned request goes through a bounce buffer of
//! whole device blocks: a read reads the covering blocks and copies out the
//! bytes asked for; a write reads the partial device blocks at its two
//! edges, merges the caller's bytes in and writes whole blocks
//! ([`dio_write_padded`], so completion covers the caller's bytes only).
//! The bounce buffer is at most [`BOUNCE_CHUNK_BYTES`]: longer requests go
//! in chunks, cut at file-system block boundaries.
//!
//! # Locking (the caller's part)
//!
//! A write's edge blocks must not change between their read and the write
//! back. Either the caller holds the inode's I/O lock exclusive with direct
//! I/O drained, or it holds it shared, passes `OVERWRITE_ONLY`, and holds
//! [`write_lock_range`] exclusive in the inode's
//! [`RangeLock`](crate::RangeLock) (see [`crate::io_lock`]). Under the
//! shared lock the caller's bytes must lie inside EOF; the padding of the
//! last device block may reach past it (`PADDED_TAIL`).
//!
//! # End of file
//!
//! Bytes at or past the size are never handed out and are written back as
//! zeros: the device may hold bytes there from a write whose size change
//! was lost in a crash.

use blockdev::{AlignedBuf, BlockDevice};

use crate::align::{align_down, align_up, is_aligned};
use crate::dio::{
    dio_read, dio_write, dio_write_padded, logical_block_size, DIO_MAX_REQUEST_BYTES,
};
use crate::ioend::DioWriteOutcome;
use crate::write_protocol::WriteRange;
use crate::{IomapError, IomapOpFlags, IomapOps};

/// Largest bounce buffer one unaligned request uses.
pub const BOUNCE_CHUNK_BYTES: u64 = DIO_MAX_REQUEST_BYTES;

fn logical_block(dev: &dyn BlockDevice) -> u64 {
    u64::from(logical_block_size(dev))
}

/// `[pos, pos + len)` covers whole device blocks: no bounce, no
/// read-modify-write.
pub fn is_block_aligned(dev: &dyn BlockDevice, pos: u64, len: u64) -> bool {
    let lbs = logical_block(dev);
    is_aligned(pos, lbs) && is_aligned(len, lbs)
}

/// The file range a write of `len` bytes at `pos` must hold in the inode's
/// range lock: its device blocks, rounded out. `None` if it overflows.
pub fn write_lock_range(dev: &dyn BlockDevice, pos: u64, len: u64) -> Option<(u64, u64)> {
    let lbs = logical_block(dev);
    let end = align_up(pos.checked_add(len)?, lbs)?;
    Some((align_down(pos, lbs), end))
}

/// What the write protocol needs to know of a write of `len` bytes at
/// `pos`: its device blocks and whether it covers them whole.
pub fn write_range(dev: &dyn BlockDevice, pos: u64, len: u64) -> Result<WriteRange, IomapError> {
    let (start, end) =
        write_lock_range(dev, pos, len).ok_or(IomapError::RangeOverflow { pos, len })?;
    Ok(WriteRange {
        start,
        end,
        aligned: is_block_aligned(dev, pos, len),
    })
}

fn bounce_buffer(dev: &dyn BlockDevice, pos: u64, len: u64) -> Result<AlignedBuf, IomapError> {
    let caps = dev.caps();
    let align = caps.memory_alignment.max(caps.logical_block_size).max(1) as usize;
    AlignedBuf::new(len as usize, align).map_err(|source| IomapError::Bounce { pos, source })
}

/// The chunk of `[from, stop)` a bounced request handles next: at most
/// [`BOUNCE_CHUNK_BYTES`], cut at a file-system block boundary when one
/// lies inside. (Any device-block cut would be correct; a cut inside a new
/// block would have the first chunk zero the block's rest only for the next
/// chunk to overwrite it.)
fn chunk_end(from: u64, stop: u64, fs_block: u64) -> u64 {
    let limit = from.saturating_add(BOUNCE_CHUNK_BYTES);
    if limit >= stop {
        return stop;
    }
    let cut = align_down(limit, fs_block);
    if cut > from {
        cut
    } else {
        limit
    }
}

/// Reads up to `buf.len()` bytes at `pos` at any alignment; returns the
/// bytes read, short at EOF. `flags` as for [`dio_read`]. The caller holds
/// the inode's I/O lock (either mode).
pub fn dio_read_bytes<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &mut [u8],
    flags: IomapOpFlags,
) -> Result<usize, O::Error> {
    let size = ops.size(inode)?;
    if buf.is_empty() || pos >= size {
        return Ok(0);
    }
    let len = (buf.len() as u64).min(size - pos);
    let end = pos + len;
    let lbs = logical_block(dev);
    if is_block_aligned(dev, pos, buf.len() as u64) {
        // Straight into the caller's buffer, whole blocks.
        let aligned_len = align_up(len, lbs).unwrap_or(len) as usize;
        dio_read(ops, dev, inode, pos, &mut buf[..aligned_len], flags)?;
        buf[len as usize..aligned_len].fill(0);
        return Ok(len as usize);
    }
    let start = align_down(pos, lbs);
    let stop = align_up(end, lbs).ok_or(IomapError::RangeOverflow { pos, len })?;
    let fs_block = u64::from(ops.block_size()).max(lbs);
    let mut bounce = bounce_buffer(dev, pos, (stop - start).min(BOUNCE_CHUNK_BYTES))?;
    let mut from = start;
    while from < stop {
        let to = chunk_end(from, stop, fs_block);
        let chunk = &mut bounce[..(to - from) as usize];
        dio_read(ops, dev, inode, from, chunk, flags)?;
        let (copy_from, copy_to) = (pos.max(from), end.min(to));
        buf[(copy_from - pos) as usize..(copy_to - pos) as usize]
            .copy_from_slice(&chunk[(copy_from - from) as usize..(copy_to - from) as usize]);
        from = to;
    }
    Ok(len as usize)
}

/// Reads the device block at `block_pos` into `out` as the file shows it:
/// bytes at or past EOF are zeros.
fn read_edge_block<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    block_pos: u64,
    out: &mut [u8],
    flags: IomapOpFlags,
) -> Result<(), O::Error> {
    let inside = dio_read_bytes(ops, dev, inode, block_pos, out, flags)?;
    out[inside..].fill(0);
    Ok(())
}

/// Writes `buf` at `pos` at any alignment. Aligned writes are
/// [`dio_write`]; others read-modify-write their edge device blocks (see
/// the module docs for the locking the caller must hold). With
/// `OVERWRITE_ONLY`, a write whose blocks reach past EOF fails with
/// `WouldBlock` before any I/O, as do holes and unwritten space.
pub fn dio_write_bytes<O: IomapOps>(
    ops: &O,
    dev: &dyn BlockDevice,
    inode: &O::Inode,
    pos: u64,
    buf: &[u8],
    flags: IomapOpFlags,
) -> Result<DioWriteOutcome, O::Error> {
    let len = buf.len() as u64;
    if len == 0 || is_block_aligned(dev, pos, len) {
        return dio_write(ops, dev, inode, pos, buf, flags);
    }
    let lbs = logical_block(dev);
    let (start, stop) =
        write_lock_range(dev, pos, len).ok_or(IomapError::RangeOverflow { pos, len })?;
    let end = pos + len;
    let mut flags = flags;
    if flags.contains(IomapOpFlags::OVERWRITE_ONLY) {
        let size = ops.size(inode)?;
        if end > size {
            // Decided before any I/O.
            return Err(IomapError::WouldBlock.into());
        }
        if stop > size {
            // Rewriting the file's last partial device block: the bytes
            // past EOF are padding (written back as zeros).
            flags |= IomapOpFlags::PADDED_TAIL;
        }
    }
    // Edge reads must not block either when the caller may not.
    let read_flags = if flags.contains(IomapOpFlags::NOWAIT) {
        IomapOpFlags::NOWAIT
    } else {
        IomapOpFlags::READ
    };
    let fs_block = u64::from(ops.block_size()).max(lbs);
    let mut bounce = bounce_buffer(dev, pos, (stop - start).min(BOUNCE_CHUNK_BYTES))?;
    let mut total = DioWriteOutcome::NOTHING;
    let mut from = start;
    while from < stop {
        let to = chunk_end(from, stop, fs_block);
        let chunk = &mut bounce[..(to - from) as usize];
        let head_partial = from < pos;
        if head_partial {
            read_edge_block(
                ops,
                dev,
                inode,
                from,
                &mut chunk[..lbs as usize],
                read_flags,
            )?;
        }
        let tail_block = to - lbs;
        if to > end && !(head_partial && tail_block == from) {
            let at = (tail_block - from) as usize;
            read_edge_block(ops, dev, inode, tail_block, &mut chunk[at..], read_flags)?;
        }
        let (copy_from, copy_to) = (pos.max(from), end.min(to));
        chunk[(copy_from - from) as usize..(copy_to - from) as usize]
            .copy_from_slice(&buf[(copy_from - pos) as usize..(copy_to - pos) as usize]);
        let done = dio_write_padded(ops, dev, inode, from, chunk, copy_to, flags)?;
        total.merge(&DioWriteOutcome {
            written: copy_to - copy_from,
            ..done
        });
        from = to;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{pattern, Block, FakeFs, Req, TestDev, BS, MIB, STALE};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// A file of `nblocks` written blocks at device offset 1 MiB, holding
    /// `pattern(.., 7)`, size `size`.
    fn mapped_file(lbs: u32, nblocks: usize, size: u64) -> (TestDev, FakeFs, Vec<u8>) {
        let dev = TestDev::new(16 * MIB as usize, lbs);
        dev.fill(STALE);
        let fs = FakeFs::new(BS as u32, nblocks, 8 * MIB);
        let content = pattern(nblocks * BS as usize, 7);
        dev.poke(MIB, &content);
        for b in 0..nblocks {
            fs.set(b, Block::Mapped(MIB + b as u64 * BS));
        }
        fs.set_size(size);
        (dev, fs, content)
    }

    #[test]
    fn sub_sector_overwrite_reads_one_block_and_writes_it_back() {
        let (dev, fs, mut want) = mapped_file(512, 4, 4 * BS);
        let data = pattern(100, 3);
        let out =
            dio_write_bytes(&fs, &dev, &(), 700, &data, IomapOpFlags::OVERWRITE_ONLY).unwrap();
        assert_eq!(out.written, 100);
        assert!(out.pure_overwrite);
        // Bytes 700..800 live in device block [512, 1024).
        assert_eq!(
            dev.requests(),
            vec![
                Req::Read {
                    off: MIB + 512,
                    len: 512
                },
                Req::Write {
                    off: MIB + 512,
                    len: 512
                },
            ]
        );
        want[700..800].copy_from_slice(&data);
        assert_eq!(dev.bytes(MIB, 4 * BS as usize), want);
    }

    #[test]
    fn write_spanning_blocks_reads_only_its_two_edges() {
        let (dev, fs, mut want) = mapped_file(512, 4, 4 * BS);
        let data = pattern(3000, 4);
        dio_write_bytes(&fs, &dev, &(), 1000, &data, IomapOpFlags::default()).unwrap();
        let reads: Vec<Req> = dev
            .requests()
            .into_iter()
            .filter(|r| matches!(r, Req::Read { .. }))
            .collect();
        assert_eq!(
            reads,
            vec![
                Req::Read {
                    off: MIB + 512,
                    len: 512
                },
                Req::Read {
                    off: MIB + 3584,
                    len: 512
                },
            ]
        );
        want[1000..4000].copy_from_slice(&data);
        assert_eq!(dev.bytes(MIB, 4 * BS as usize), want);
    }

    #[test]
    fn overwrite_only_refuses_data_past_eof_before_any_io() {
        let (dev, fs, _) = mapped_file(512, 2, 1000);
        let err = dio_write_bytes(&fs, &dev, &(), 990, &[1; 20], IomapOpFlags::OVERWRITE_ONLY)
            .unwrap_err();
        assert!(matches!(err, IomapError::WouldBlock), "{err:?}");
        assert!(dev.requests().is_empty());
    }

    /// Rewriting bytes of the file's last partial sector is an overwrite:
    /// the rest of the sector past EOF is padding, written back as zeros,
    /// and the size does not change.
    #[test]
    fn overwrite_only_rewrites_the_last_partial_sector() {
        let (dev, fs, content) = mapped_file(512, 2, 1000);
        let out =
            dio_write_bytes(&fs, &dev, &(), 900, &[1; 50], IomapOpFlags::OVERWRITE_ONLY).unwrap();
        assert!(out.pure_overwrite && !out.end_flags.size_change, "{out:?}");
        assert_eq!(fs.state.lock().size, 1000);
        assert_eq!(
            dev.requests(),
            vec![
                Req::Read {
                    off: MIB + 512,
                    len: 512
                },
                Req::Write {
                    off: MIB + 512,
                    len: 512
                },
            ]
        );
        let block = dev.bytes(MIB + 512, 512);
        assert_eq!(&block[..388], &content[512..900]);
        assert_eq!(&block[388..438], &[1; 50]);
        assert_eq!(&block[438..488], &content[950..1000]);
        assert!(block[488..].iter().all(|&b| b == 0));
        // Without the declaration the engine does not let padding cross EOF.
        let err = dio_write_padded(
            &fs,
            &dev,
            &(),
            512,
            &block,
            950,
            IomapOpFlags::OVERWRITE_ONLY,
        )
        .unwrap_err();
        assert!(matches!(err, IomapError::WouldBlock), "{err:?}");
    }

    #[test]
    fn edge_bytes_past_eof_are_written_back_as_zeros() {
        // The device holds stale bytes past EOF (a lost size change).
        let (dev, fs, _) = mapped_file(512, 2, 1000);
        dio_write_bytes(&fs, &dev, &(), 1030, &[9; 10], IomapOpFlags::default()).unwrap();
        assert_eq!(fs.state.lock().size, 1040);
        let block = dev.bytes(MIB + 1024, 512);
        assert!(block[..6].iter().all(|&b| b == 0), "head padding past EOF");
        assert_eq!(&block[6..16], &[9; 10]);
        assert!(block[16..].iter().all(|&b| b == 0), "tail padding past EOF");
    }

    #[test]
    fn edge_block_straddling_eof_keeps_bytes_before_it_and_zeros_after() {
        // Size 1000: device block [512, 1024) holds file bytes up to 1000
        // and stale device bytes after.
        let (dev, fs, content) = mapped_file(512, 2, 1000);
        assert!(content[1000..1024].iter().any(|&b| b != 0));
        dio_write_bytes(&fs, &dev, &(), 900, &[9; 50], IomapOpFlags::default()).unwrap();
        let block = dev.bytes(MIB + 512, 512);
        assert_eq!(&block[..388], &content[512..900]);
        assert_eq!(&block[388..438], &[9; 50]);
        assert_eq!(&block[438..488], &content[950..1000]);
        assert!(block[488..].iter().all(|&b| b == 0), "stale bytes past EOF");
    }

    #[test]
    fn reads_stop_at_eof_at_any_alignment() {
        let (dev, fs, content) = mapped_file(512, 2, 5000);
        let mut buf = vec![0x55; 300];
        assert_eq!(
            dio_read_bytes(&fs, &dev, &(), 4900, &mut buf, IomapOpFlags::READ).unwrap(),
            100
        );
        assert_eq!(&buf[..100], &content[4900..5000]);
        assert!(buf[100..].iter().all(|&b| b == 0x55), "untouched past EOF");
        // Aligned read across EOF: zeros after it, never device bytes.
        let mut buf = vec![0x55; 1024];
        assert_eq!(
            dio_read_bytes(&fs, &dev, &(), 4608, &mut buf, IomapOpFlags::READ).unwrap(),
            392
        );
        assert_eq!(&buf[..392], &content[4608..5000]);
        assert!(buf[392..512].iter().all(|&b| b == 0));
    }

    #[test]
    fn long_unaligned_requests_bounce_in_bounded_chunks() {
        let nblocks = (3 * MIB / BS) as usize + 2;
        let (dev, fs, mut want) = mapped_file(512, nblocks, nblocks as u64 * BS);
        let data = pattern((3 * MIB) as usize + 100, 5);
        dio_write_bytes(&fs, &dev, &(), 300, &data, IomapOpFlags::default()).unwrap();
        want[300..300 + data.len()].copy_from_slice(&data);
        assert_eq!(dev.bytes(MIB, want.len()), want);
        assert!(dev
            .writes()
            .iter()
            .all(|&(_, len)| len <= BOUNCE_CHUNK_BYTES));
        // Four chunks, each reading at most its own edges: 2 edge reads.
        let reads = dev
            .requests()
            .iter()
            .filter(|r| matches!(r, Req::Read { .. }))
            .count();
        assert_eq!(reads, 2);
        let mut back = vec![0; data.len()];
        dio_read_bytes(&fs, &dev, &(), 300, &mut back, IomapOpFlags::READ).unwrap();
        assert_eq!(back, data);
    }

    /// The same random byte-granular writes go to two files: one through
    /// [`dio_write_bytes`], one as the aligned writes of the whole blocks
    /// they cover (merged by the test from a model). Every read at any
    /// alignment, and both files' whole contents, must agree with the model.
    #[test]
    fn random_byte_writes_match_the_aligned_path_and_a_model() {
        for lbs in [512u32, 4096] {
            for seed in 0..40u64 {
                let mut rng = StdRng::seed_from_u64(seed);
                let nblocks = 16;
                let file_len = nblocks as u64 * BS;
                let (dev_a, fs_a, _) = mapped_file(lbs, nblocks, file_len);
                let (dev_b, fs_b, _) = mapped_file(lbs, nblocks, file_len);
                for fs in [&fs_a, &fs_b] {
                    for b in 0..nblocks {
                        match (seed as usize + b) % 5 {
                            0 => fs.set(b, Block::Hole),
                            1 => fs.set(b, Block::Unwritten(2 * MIB + b as u64 * BS)),
                            _ => {}
                        }
                    }
                }
                let mut model = vec![0u8; file_len as usize];
                let mut check = vec![0u8; file_len as usize];
                dio_read(&fs_a, &dev_a, &(), 0, &mut model, IomapOpFlags::READ).unwrap();
                for step in 0..60 {
                    let pos = rng.gen_range(0..file_len - 1);
                    let len = rng.gen_range(1..=(file_len - pos).min(3 * BS));
                    let data = pattern(len as usize, (seed as u8) ^ step);
                    dio_write_bytes(&fs_a, &dev_a, &(), pos, &data, IomapOpFlags::default())
                        .unwrap();
                    model[pos as usize..(pos + len) as usize].copy_from_slice(&data);
                    let (start, stop) = write_lock_range(&dev_b, pos, len).unwrap();
                    dio_write(
                        &fs_b,
                        &dev_b,
                        &(),
                        start,
                        &model[start as usize..stop as usize],
                        IomapOpFlags::default(),
                    )
                    .unwrap();
                    let rpos = rng.gen_range(0..file_len);
                    let mut got = vec![0u8; rng.gen_range(0..=(file_len - rpos) as usize)];
                    dio_read_bytes(&fs_a, &dev_a, &(), rpos, &mut got, IomapOpFlags::READ).unwrap();
                    assert_eq!(
                        got,
                        model[rpos as usize..rpos as usize + got.len()],
                        "lbs {lbs} seed {seed} step {step}: read {rpos}+{}",
                        got.len()
                    );
                }
                for (fs, dev) in [(&fs_a, &dev_a), (&fs_b, &dev_b)] {
                    dio_read(fs, dev, &(), 0, &mut check, IomapOpFlags::READ).unwrap();
                    assert!(check == model, "lbs {lbs} seed {seed}: file differs");
                }
            }
        }
    }
}
