//! iomapfs as a buffered target: the benchmark file on a fresh volume,
//! read and written through a non-direct handle, arranged for one
//! [`BufferedVariant`] (see there for what each measures).
//!
//! The handle is opened without `direct` and nothing else: whatever
//! iomapfs does for non-direct handles (today read-modify-write direct
//! I/O, then its folio cache) is what is measured, with the volume's
//! default mount options and so its default cache size.

use std::sync::Arc;

use blockdev::{BlockDevice, RequestCounts};
use iomapfs_fs::{File, OpenFlags, Volume};

use super::passes::PassTarget;
use crate::target::{format_and_mount, write_bench_file, IOMAPFS_FILE};
use crate::workload::{BufferedSpec, BufferedVariant, Op};
use crate::BenchError;

/// The flags of the measured handle.
fn buffered_flags(op: Op) -> OpenFlags {
    OpenFlags {
        direct: false,
        read_only: op == Op::Read,
        ..OpenFlags::default()
    }
}

pub struct BufferedFs {
    dev: Arc<dyn BlockDevice>,
    spec: BufferedSpec,
    variant: BufferedVariant,
    span: u64,
    // Field order is drop order: the file handle goes before the volume.
    file: Option<File>,
    vol: Option<Volume>,
    /// What the arrangement did: read by the tests, which check it against
    /// the passes of a window.
    done: Arranged,
}

/// Counts of what a [`BufferedFs`] did around and at the end of passes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
struct Arranged {
    /// Times the cache was made cold: the mount, then (cold) a cache drop
    /// before every pass.
    mounts: u64,
    /// Files created for alloc passes.
    files_created: u64,
    /// Passes ended with an fsync.
    fsyncs: u64,
}

impl BufferedFs {
    /// Formats `dev` and sets the volume up for `variant`: the file of
    /// `span` bytes written and committed (reads, overwrite; none for
    /// alloc, whose passes make their own), opened non-direct, and for
    /// warm reads read once from start to end.
    pub fn prepare(
        dev: Arc<dyn BlockDevice>,
        spec: &BufferedSpec,
        variant: BufferedVariant,
        span: u64,
    ) -> Result<BufferedFs, BenchError> {
        let vol = format_and_mount(dev.clone())?;
        let mut fs = BufferedFs {
            dev,
            spec: *spec,
            variant,
            span,
            file: None,
            vol: None,
            done: Arranged {
                mounts: 1,
                ..Arranged::default()
            },
        };
        if !matches!(variant, BufferedVariant::Alloc { .. }) {
            write_bench_file(&vol, span)?;
            fs.file = Some(open(&vol, buffered_flags(spec.op))?);
        }
        fs.vol = Some(vol);
        if variant == BufferedVariant::Warm {
            fs.read_whole_file()?;
        }
        Ok(fs)
    }

    /// Closes the file and unmounts cleanly (which writes back anything
    /// still dirty: outside every window).
    pub fn close(mut self) -> Result<(), BenchError> {
        drop(self.file.take());
        match self.vol.take() {
            Some(vol) => vol
                .unmount()
                .map_err(|e| BenchError::fs("iomapfs unmount", e)),
            None => Ok(()),
        }
    }

    fn file(&self) -> Result<&File, BenchError> {
        self.file
            .as_ref()
            .ok_or_else(|| BenchError::failed("iomapfs buffered", "no file open"))
    }

    fn vol(&self) -> Result<&Volume, BenchError> {
        self.vol
            .as_ref()
            .ok_or_else(|| BenchError::failed("iomapfs buffered", "no volume mounted"))
    }

    /// Reads the file once through the measured handle (warm: so the
    /// window starts with it cached).
    fn read_whole_file(&mut self) -> Result<(), BenchError> {
        let chunk = self.spec.io_size.max(1 << 20).min(self.span);
        let mut buf = vec![0u8; chunk as usize];
        let mut offset = 0;
        while offset < self.span {
            let len = chunk.min(self.span - offset) as usize;
            self.read_exact(&mut buf[..len], offset)?;
            offset += len as u64;
        }
        Ok(())
    }

    fn read_exact(&self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        match self.file()?.pread(buf, offset) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(n) => Err(BenchError::failed(
                "iomapfs buffered read",
                format!("short read: {n} of {} bytes at {offset}", buf.len()),
            )),
            Err(e) => Err(BenchError::fs("iomapfs buffered read", e)),
        }
    }

    /// Cold: drops the volume's cached folios (`Volume::drop_caches`, as
    /// the kernel rows drop the file's pages), so that nothing of the file
    /// is cached when the pass starts. The cache keeps the memory, as the
    /// kernel keeps freed pages: a pass measures reading the device, not
    /// the process's first touch of fresh memory.
    fn remount(&mut self) -> Result<(), BenchError> {
        self.vol()?
            .drop_caches()
            .map_err(|e| BenchError::fs("iomapfs drop_caches (cold pass)", e))?;
        self.done.mounts += 1;
        Ok(())
    }

    /// Alloc: unlinks the previous pass's file (its dirty data, if any, is
    /// dropped with it, as the kernel drops an unlinked file's) and
    /// creates a new, empty one.
    fn fresh_file(&mut self) -> Result<(), BenchError> {
        drop(self.file.take());
        if self.done.files_created > 0 {
            self.vol()?
                .unlink(IOMAPFS_FILE)
                .map_err(|e| BenchError::fs("iomapfs unlink (alloc pass)", e))?;
        }
        let flags = OpenFlags {
            create: true,
            exclusive: true,
            ..buffered_flags(self.spec.op)
        };
        let file = open(self.vol()?, flags)?;
        self.done.files_created += 1;
        self.file = Some(file);
        Ok(())
    }
}

fn open(vol: &Volume, flags: OpenFlags) -> Result<File, BenchError> {
    vol.open_file(IOMAPFS_FILE, flags)
        .map_err(|e| BenchError::fs("iomapfs open (non-direct)", e))
}

impl PassTarget for BufferedFs {
    fn before_pass(&mut self) -> Result<(), BenchError> {
        match self.variant {
            BufferedVariant::Cold => self.remount(),
            BufferedVariant::Alloc { .. } => self.fresh_file(),
            BufferedVariant::Warm | BufferedVariant::Overwrite { .. } => Ok(()),
        }
    }

    fn io(&mut self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        match self.spec.op {
            Op::Read => self.read_exact(buf, offset),
            Op::Write => self
                .file()?
                .pwrite(buf, offset)
                .map(drop)
                .map_err(|e| BenchError::fs("iomapfs buffered write", e)),
        }
    }

    fn end_pass(&mut self) -> Result<(), BenchError> {
        if self.variant.includes_writeback() {
            self.file()?
                .fsync()
                .map_err(|e| BenchError::fs("iomapfs fsync", e))?;
            self.done.fsyncs += 1;
        }
        Ok(())
    }

    fn requests(&self) -> Option<RequestCounts> {
        Some(self.dev.counters().snapshot())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use blockdev::MemDevice;

    use super::super::passes::run;
    use super::*;

    const MIB: u64 = 1 << 20;

    fn spec(op: Op, io_size: u64) -> BufferedSpec {
        BufferedSpec {
            op,
            io_size,
            span: 4 * MIB,
        }
    }

    fn window(fs: &mut BufferedFs, ms: u64) -> super::super::passes::Window {
        let (io_size, span) = (fs.spec.io_size, fs.span);
        let mut buf = vec![0u8; io_size as usize];
        run(fs, io_size, span, Duration::from_millis(ms), &mut buf).unwrap()
    }

    fn device() -> Arc<dyn BlockDevice> {
        Arc::new(MemDevice::new(64 * MIB, 512))
    }

    #[test]
    fn cold_passes_each_start_on_a_freshly_mounted_volume() {
        let dev = device();
        let s = spec(Op::Read, 64 << 10);
        let mut fs = BufferedFs::prepare(dev, &s, BufferedVariant::Cold, s.span).unwrap();
        let w = window(&mut fs, 50);
        assert!(w.passes >= 1);
        assert_eq!(fs.done.mounts, 1 + w.passes);
        // Every byte the window read, the device read (the cache was empty).
        let req = w.measurement.requests.unwrap();
        assert!(
            req.bytes_read >= w.measurement.bytes,
            "{req:?} for {}",
            w.measurement.bytes
        );
        fs.close().unwrap();
    }

    #[test]
    fn warm_reads_find_the_file_written_and_never_remount() {
        let dev = device();
        let s = spec(Op::Read, 4096);
        let mut fs = BufferedFs::prepare(dev, &s, BufferedVariant::Warm, s.span).unwrap();
        let w = window(&mut fs, 20);
        assert!(w.measurement.ops > 0);
        assert_eq!(fs.done.mounts, 1);
        fs.close().unwrap();
    }

    #[test]
    fn alloc_passes_append_to_a_new_file_each_time() {
        let dev = device();
        let s = spec(Op::Write, 1 << 20);
        let variant = BufferedVariant::Alloc { fsync: true };
        let mut fs = BufferedFs::prepare(dev.clone(), &s, variant, s.span).unwrap();
        assert!(fs.file.is_none(), "alloc passes make their own file");
        let w = window(&mut fs, 30);
        assert_eq!(fs.done.files_created, w.passes);
        assert_eq!(fs.done.fsyncs, w.passes);
        // The file is the last pass's: no bigger than one pass wrote.
        let size = fs.file().unwrap().stat().unwrap().size;
        assert!(size > 0 && size <= s.span, "{size}");
        // Every pass ended with an fsync, which flushes the device.
        let req = w.measurement.requests.unwrap();
        assert!(req.flushes >= w.passes, "{req:?} for {} passes", w.passes);
        assert!(req.bytes_written >= w.measurement.bytes, "{req:?}");
        // Only one file is left on the volume.
        let names = fs.vol().unwrap().readdir("/").unwrap();
        assert_eq!(names.len(), 1, "{names:?}");
        fs.close().unwrap();
    }

    #[test]
    fn overwrite_syncs_every_pass_only_with_fsync() {
        for fsync in [false, true] {
            let dev = device();
            let s = spec(Op::Write, 64 << 10);
            let variant = BufferedVariant::Overwrite { fsync };
            let mut fs = BufferedFs::prepare(dev.clone(), &s, variant, s.span).unwrap();
            let w = window(&mut fs, 30);
            let req = w.measurement.requests.unwrap();
            if fsync {
                assert_eq!(fs.done.fsyncs, w.passes);
                assert!(req.flushes >= w.passes, "{req:?} for {} passes", w.passes);
            } else {
                assert_eq!(fs.done.fsyncs, 0);
            }
            assert_eq!(fs.done.mounts, 1);
            assert_eq!(fs.file().unwrap().stat().unwrap().size, s.span);
            fs.close().unwrap();
        }
    }
}
