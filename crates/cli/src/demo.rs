//! `iomapfs demo`: the end-to-end tour that needs no setup.
//!
//! Makes an image, formats it, writes files through every kind of handle
//! (O_DIRECT, buffered, O_DSYNC) and every space operation (fallocate,
//! punch, truncate, rename), unmounts, mounts again from the device, checks
//! every byte against an in-memory model, runs fsck, and reports.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use blockdev::rng::mix64;
use blockdev::{AlignedBuf, RequestCounts};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use iomapfs_fs::{fsck, FiemapKind, File, FormatOptions, OpenFlags, Volume};

use crate::size::{cvtstr, human_bytes, per_second, short_bytes};
use crate::target::{describe_device, open_device};
use crate::{size_arg, Failure};

const LONG_ABOUT: &str = "\
Run an end-to-end demonstration on a scratch image; needs no setup.

The demo creates an image file (in a temporary directory unless --image is
given), formats it, and writes files through O_DIRECT, buffered and O_DSYNC
handles, with fallocate, hole punching, truncation and an atomic rename. It
fsyncs, unmounts, mounts the volume again from the image, reads every file
back and compares every byte with what was written, runs fsck, and prints a
report with throughput figures and the device requests (writes, flushes,
FUA) that durability cost. The temporary image is removed at the end (kept
if something fails, so it can be inspected).";

const AFTER_HELP: &str = "\
Examples:
  iomapfs demo                          64 MiB temporary image, removed after
  iomapfs demo --size 256m              a bigger run
  iomapfs demo --image demo.img         keep the image; then try
                                        iomapfs io demo.img -c 'ls /demo'

Exit status: 0 every byte verified and fsck clean; 1 a mismatch, an fsck
problem or an error (the message says which); 2 bad command-line usage.";

/// Write, remount and verify a scratch volume end to end.
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct DemoArgs {
    /// Image file to create and keep (must not exist yet). Default: a
    /// temporary image, removed afterwards.
    #[arg(long, value_name = "PATH")]
    pub image: Option<PathBuf>,

    /// Image size in bytes (suffixes k/m/g). At least 16m.
    #[arg(long, value_name = "BYTES", value_parser = size_arg, default_value = "64m")]
    pub size: u64,
}

const MIN_SIZE: u64 = 16 << 20;
const MIB: u64 = 1 << 20;
/// O_DIRECT writes are issued in calls of this size.
const DIRECT_CHUNK: u64 = MIB;
/// Memory alignment of O_DIRECT buffers (enough for any logical block
/// size up to 4 KiB).
const DIRECT_ALIGN: usize = 4096;
/// Buffered writes use an odd size so calls straddle blocks and pages.
const BUFFERED_CHUNK: u64 = 100_000;
/// O_DSYNC appends: a write-ahead-log-like record size and count.
const DSYNC_RECORD: u64 = 4096;
const DSYNC_RECORDS: u64 = 64;

fn fail(step: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new(1, format!("demo: {step}: {e}"))
}

pub fn run(args: &DemoArgs) -> Result<u8, Failure> {
    if args.size < MIN_SIZE || !args.size.is_multiple_of(4096) {
        return Err(Failure::new(
            1,
            format!(
                "demo: --size {}: must be a multiple of 4 KiB and at least {}",
                args.size,
                short_bytes(MIN_SIZE)
            ),
        ));
    }
    let (tmpdir, image) = match &args.image {
        Some(p) => {
            if p.exists() {
                return Err(Failure::new(
                    1,
                    format!(
                        "demo: {} already exists; the demo formats its image, so give a \
                         new path (or remove the file)",
                        p.display()
                    ),
                ));
            }
            (None, p.clone())
        }
        None => {
            let dir = tempfile::Builder::new()
                .prefix("iomapfs-demo.")
                .tempdir()
                .map_err(|e| fail("creating a temporary directory", e))?;
            let image = dir.path().join("demo.img");
            (Some(dir), image)
        }
    };

    let result = create_image(&image, args.size).and_then(|()| demo(&image));
    match (result, tmpdir) {
        (Ok(()), Some(dir)) => {
            drop(dir);
            println!("removed the temporary image");
            Ok(0)
        }
        (Ok(()), None) => {
            println!(
                "image kept at {}: try  iomapfs io {} -c 'ls /demo'",
                image.display(),
                image.display()
            );
            Ok(0)
        }
        (Err(e), Some(dir)) => {
            let kept = dir.keep();
            eprintln!(
                "iomapfs: demo: image kept for inspection at {}",
                kept.join("demo.img").display()
            );
            Err(e)
        }
        (Err(e), None) => Err(e),
    }
}

fn create_image(image: &Path, size: u64) -> Result<(), Failure> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(image)
        .map_err(|e| fail(&format!("creating {}", image.display()), e))?;
    file.set_len(size)
        .map_err(|e| fail(&format!("sizing {}", image.display()), e))
}

/// Deterministic, position-dependent content: byte `i` of file `seed` at
/// file offset `offset + i`. A misplaced block never matches.
fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        let pos = offset + i as u64;
        let word = mix64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pos / 8));
        *b = word.to_le_bytes()[(pos % 8) as usize];
    }
}

/// What one file must contain after the remount.
struct Expected {
    path: &'static str,
    data: Vec<u8>,
}

impl Expected {
    fn write(&mut self, offset: u64, bytes: &[u8]) {
        let end = offset as usize + bytes.len();
        if self.data.len() < end {
            self.data.resize(end, 0);
        }
        self.data[offset as usize..end].copy_from_slice(bytes);
    }
    fn zero(&mut self, offset: u64, len: u64) {
        let start = (offset as usize).min(self.data.len());
        let end = ((offset + len) as usize).min(self.data.len());
        self.data[start..end].fill(0);
    }
}

struct Timing {
    bytes: u64,
    ops: u64,
    elapsed: Duration,
}

impl Timing {
    fn rate(&self) -> String {
        format!(
            "{}/sec",
            cvtstr(per_second(self.bytes as f64, self.elapsed))
        )
    }
}

fn progress(total: u64, msg: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>8} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(msg);
    bar
}

/// A zeroed buffer aligned for O_DIRECT.
fn aligned(len: usize) -> Result<AlignedBuf, Failure> {
    AlignedBuf::new(len, DIRECT_ALIGN).map_err(|e| fail("allocating a buffer", e))
}

fn open(vol: &Volume, path: &str, flags: OpenFlags) -> Result<File, Failure> {
    vol.open_file(path, flags)
        .map_err(|e| fail(&format!("open {path}"), e))
}

fn write_all(file: &File, path: &str, buf: &[u8], offset: u64) -> Result<(), Failure> {
    let mut done = 0usize;
    while done < buf.len() {
        let pos = offset + done as u64;
        let n = file
            .pwrite(&buf[done..], pos)
            .map_err(|e| fail(&format!("pwrite {path} at offset {pos}"), e))?;
        if n == 0 {
            return Err(fail(
                &format!("pwrite {path} at offset {pos}"),
                "write made no progress",
            ));
        }
        done += n;
    }
    Ok(())
}

fn demo(image: &Path) -> Result<(), Failure> {
    let shown = image.display();
    let dev = open_device(image, false).map_err(|f| fail("opening the image", f.message))?;
    println!("iomapfs demo on {}", describe_device(dev.as_ref()));
    Volume::format(dev.clone(), &FormatOptions::default()).map_err(|e| fail("format", e))?;
    let opts = crate::target::mount_options()?;
    let vol = Volume::open_with(dev.clone(), &opts).map_err(|e| fail("mount", e))?;
    let sfs = vol.statfs();
    println!(
        "formatted: block size {} bytes, data area {}, free {}",
        sfs.block_size,
        human_bytes(sfs.data_bytes),
        human_bytes(sfs.free_bytes)
    );

    // Size the workload to the volume: the direct file takes a quarter of
    // the free space, everything together about half.
    let direct_bytes = (sfs.free_bytes / 4 / DIRECT_CHUNK * DIRECT_CHUNK).clamp(MIB, 16 * MIB);
    let buffered_bytes = direct_bytes / 2 + 12_345;
    let sparse_bytes = 4 * MIB;
    let dsync_bytes = DSYNC_RECORD * DSYNC_RECORDS;
    let total = direct_bytes + buffered_bytes + dsync_bytes + MIB;

    vol.mkdir("/demo").map_err(|e| fail("mkdir /demo", e))?;
    let bar = progress(total, "write");
    let mut files = Vec::new();

    // 1. O_DIRECT, sequential, 1 MiB calls, from a buffer aligned for
    //    direct I/O (so no bounce copies). The content is generated before
    //    the clock starts.
    let mut direct_data = aligned(direct_bytes as usize)?;
    fill(1, 0, &mut direct_data);
    let t = Instant::now();
    {
        let path = "/demo/direct.dat";
        let f = open(
            &vol,
            path,
            OpenFlags {
                create: true,
                direct: true,
                ..OpenFlags::default()
            },
        )?;
        for (i, chunk) in direct_data.chunks(DIRECT_CHUNK as usize).enumerate() {
            write_all(&f, path, chunk, i as u64 * DIRECT_CHUNK)?;
            bar.inc(chunk.len() as u64);
        }
        f.fdatasync()
            .map_err(|e| fail(&format!("fdatasync {path}"), e))?;
    }
    let direct_t = Timing {
        bytes: direct_bytes,
        ops: direct_bytes.div_ceil(DIRECT_CHUNK),
        elapsed: t.elapsed(),
    };
    let direct = Expected {
        path: "/demo/direct.dat",
        data: direct_data.to_vec(),
    };
    drop(direct_data);

    // 2. Buffered, odd-sized calls, an overwrite, fsync, then the
    //    write-to-temporary-and-rename pattern for an atomic replace.
    let mut buffered = Expected {
        path: "/demo/buffered.dat",
        data: Vec::new(),
    };
    let tmp_path = "/demo/buffered.tmp";
    let mut data = vec![0u8; buffered_bytes as usize];
    fill(2, 0, &mut data);
    let mut patch = vec![0u8; 5000];
    fill(3, 12_345, &mut patch);
    let t = Instant::now();
    let mut buffered_ops = 0;
    {
        let f = open(
            &vol,
            tmp_path,
            OpenFlags {
                create: true,
                ..OpenFlags::default()
            },
        )?;
        for (i, chunk) in data.chunks(BUFFERED_CHUNK as usize).enumerate() {
            write_all(&f, tmp_path, chunk, i as u64 * BUFFERED_CHUNK)?;
            buffered_ops += 1;
            bar.inc(chunk.len() as u64);
        }
        write_all(&f, tmp_path, &patch, 12_345)?;
        buffered_ops += 1;
        f.fsync()
            .map_err(|e| fail(&format!("fsync {tmp_path}"), e))?;
    }
    buffered.write(0, &data);
    buffered.write(12_345, &patch);
    drop(data);
    vol.rename(tmp_path, buffered.path)
        .map_err(|e| fail(&format!("rename {tmp_path} -> {}", buffered.path), e))?;
    let buffered_t = Timing {
        bytes: buffered_bytes + 5000,
        ops: buffered_ops,
        elapsed: t.elapsed(),
    };

    // 3. O_DSYNC appends, like a write-ahead log: each is durable on return.
    let mut wal = Expected {
        path: "/demo/wal.log",
        data: Vec::new(),
    };
    let before = dev.counters().snapshot();
    let t = Instant::now();
    {
        let f = open(
            &vol,
            wal.path,
            OpenFlags {
                create: true,
                dsync: true,
                ..OpenFlags::default()
            },
        )?;
        let mut buf = vec![0u8; DSYNC_RECORD as usize];
        for i in 0..DSYNC_RECORDS {
            let off = i * DSYNC_RECORD;
            fill(4, off, &mut buf);
            write_all(&f, wal.path, &buf, off)?;
            wal.write(off, &buf);
            bar.inc(DSYNC_RECORD);
        }
    }
    let dsync_t = Timing {
        bytes: dsync_bytes,
        ops: DSYNC_RECORDS,
        elapsed: t.elapsed(),
    };
    let dsync_reqs = dev.counters().snapshot().since(&before);

    // 4. Space management: fallocate, write into it, punch, truncate down
    //    and up again.
    let mut sparse = Expected {
        path: "/demo/sparse.dat",
        data: Vec::new(),
    };
    let sparse_map;
    {
        let f = open(
            &vol,
            sparse.path,
            OpenFlags {
                create: true,
                ..OpenFlags::default()
            },
        )?;
        let p = sparse.path;
        f.fallocate(0, sparse_bytes, false)
            .map_err(|e| fail(&format!("fallocate {p} 0..{sparse_bytes}"), e))?;
        sparse.data.resize(sparse_bytes as usize, 0);
        let mut buf = vec![0u8; MIB as usize];
        fill(5, MIB, &mut buf);
        write_all(&f, p, &buf, MIB)?;
        sparse.write(MIB, &buf);
        bar.inc(MIB);
        let (punch_off, punch_len) = (MIB + MIB / 2, MIB / 4);
        f.punch_hole(punch_off, punch_len)
            .map_err(|e| fail(&format!("punch {p} at offset {punch_off}"), e))?;
        sparse.zero(punch_off, punch_len);
        f.truncate(3 * MIB)
            .map_err(|e| fail(&format!("truncate {p} to 3 MiB"), e))?;
        sparse.data.truncate(3 * MIB as usize);
        f.truncate(3 * MIB + MIB / 2)
            .map_err(|e| fail(&format!("truncate {p} to 3.5 MiB"), e))?;
        sparse.data.resize((3 * MIB + MIB / 2) as usize, 0);
        f.fsync().map_err(|e| fail(&format!("fsync {p}"), e))?;
        sparse_map = f.fiemap().map_err(|e| fail(&format!("fiemap {p}"), e))?;
    }
    bar.finish_and_clear();
    files.extend([direct, buffered, wal, sparse]);

    vol.sync().map_err(|e| fail("sync", e))?;
    let written = dev.counters().snapshot();
    vol.unmount().map_err(|e| fail("unmount", e))?;
    drop(dev);

    // 5. Mount again from the image and verify every byte.
    let dev = open_device(image, false).map_err(|f| fail("reopening the image", f.message))?;
    let opts = crate::target::mount_options()?;
    let vol = Volume::open_with(dev.clone(), &opts).map_err(|e| fail("remount", e))?;
    let verify_total: u64 = files.iter().map(|f| f.data.len() as u64).sum();
    let bar = progress(verify_total, "verify");
    let t = Instant::now();
    for exp in &files {
        verify(&vol, exp, &bar)?;
    }
    bar.finish_and_clear();
    let read_t = Timing {
        bytes: verify_total,
        ops: 0,
        elapsed: t.elapsed(),
    };
    match vol.stat(tmp_path) {
        Err(iomapfs_fs::Error::NotFound { .. }) => {}
        Ok(_) => {
            return Err(fail(
                "verify",
                format!("{tmp_path} still exists after it was renamed"),
            ))
        }
        Err(e) => return Err(fail(&format!("stat {tmp_path}"), e)),
    }
    let mut names: Vec<String> = vol
        .readdir("/demo")
        .map_err(|e| fail("readdir /demo", e))?
        .into_iter()
        .map(|e| e.name)
        .collect();
    names.sort();
    let mut want: Vec<String> = files
        .iter()
        .map(|f| f.path.trim_start_matches("/demo/").to_string())
        .collect();
    want.sort();
    if names != want {
        return Err(fail(
            "verify",
            format!("/demo lists {names:?}, expected {want:?}"),
        ));
    }
    vol.unmount().map_err(|e| fail("unmount after verify", e))?;

    // 6. fsck.
    let report = fsck::check(dev.clone()).map_err(|e| fail("fsck", e))?;
    if !report.is_clean() {
        return Err(fail(
            "fsck",
            format!(
                "{} problem(s) on {shown}:\n  {}",
                report.problems.len(),
                report.problems.join("\n  ")
            ),
        ));
    }

    print_report(&Report {
        direct: &direct_t,
        buffered: &buffered_t,
        dsync: &dsync_t,
        dsync_reqs,
        read: &read_t,
        written,
        sparse_map: &sparse_map,
        files: files.len(),
        fsck: &report,
    });
    Ok(())
}

fn verify(vol: &Volume, exp: &Expected, bar: &ProgressBar) -> Result<(), Failure> {
    let p = exp.path;
    let st = vol.stat(p).map_err(|e| fail(&format!("stat {p}"), e))?;
    if st.size != exp.data.len() as u64 {
        return Err(fail(
            "verify",
            format!(
                "MISMATCH: {p} has size {} after remount, expected {}",
                st.size,
                exp.data.len()
            ),
        ));
    }
    let f = open(
        vol,
        p,
        OpenFlags {
            read_only: true,
            ..OpenFlags::default()
        },
    )?;
    let mut buf = vec![0u8; MIB as usize];
    let mut off = 0usize;
    while off < exp.data.len() {
        let want = &exp.data[off..(off + buf.len()).min(exp.data.len())];
        let mut got = 0;
        while got < want.len() {
            let pos = (off + got) as u64;
            let n = f
                .pread(&mut buf[got..want.len()], pos)
                .map_err(|e| fail(&format!("pread {p} at offset {pos}"), e))?;
            if n == 0 {
                return Err(fail(
                    "verify",
                    format!("MISMATCH: {p}: unexpected end of file at offset {pos}"),
                ));
            }
            got += n;
        }
        if let Some(i) = (0..want.len()).find(|&i| buf[i] != want[i]) {
            let bad = off + i;
            return Err(fail(
                "verify",
                format!(
                    "MISMATCH: {p} at offset {bad}: expected 0x{:02x}, read 0x{:02x}",
                    want[i], buf[i]
                ),
            ));
        }
        off += want.len();
        bar.inc(want.len() as u64);
    }
    Ok(())
}

struct Report<'a> {
    direct: &'a Timing,
    buffered: &'a Timing,
    dsync: &'a Timing,
    dsync_reqs: RequestCounts,
    read: &'a Timing,
    written: RequestCounts,
    sparse_map: &'a [iomapfs_fs::FiemapExtent],
    files: usize,
    fsck: &'a fsck::FsckReport,
}

fn print_report(r: &Report) {
    println!(
        "O_DIRECT writes   {} in {} calls, {}",
        short_bytes(r.direct.bytes),
        r.direct.ops,
        r.direct.rate()
    );
    println!(
        "buffered writes   {} in {} calls + fsync + rename, {}",
        short_bytes(r.buffered.bytes),
        r.buffered.ops,
        r.buffered.rate()
    );
    let per = |n: u64| n as f64 / r.dsync.ops.max(1) as f64;
    println!(
        "O_DSYNC appends   {} x {} B, {:.1} us each; per write: {:.2} device writes, \
         {:.2} FUA, {:.2} flushes",
        r.dsync.ops,
        DSYNC_RECORD,
        r.dsync.elapsed.as_secs_f64() * 1e6 / r.dsync.ops.max(1) as f64,
        per(r.dsync_reqs.writes),
        per(r.dsync_reqs.fua_writes),
        per(r.dsync_reqs.flushes)
    );
    let count = |k: FiemapKind| r.sparse_map.iter().filter(|x| x.kind == k).count();
    println!(
        "space operations  fallocate 4 MiB, write 1 MiB, punch 256 KiB, truncate to 3 MiB \
         and 3.5 MiB: map {} data, {} unwritten, {} hole range(s)",
        count(FiemapKind::Data),
        count(FiemapKind::Unwritten),
        count(FiemapKind::Hole)
    );
    println!(
        "device requests   {} writes ({}), {} FUA, {} flushes until unmount",
        r.written.writes,
        short_bytes(r.written.bytes_written),
        r.written.fua_writes,
        r.written.flushes
    );
    println!(
        "verify            {} in {} files read back after remount: every byte matches, {}",
        short_bytes(r.read.bytes),
        r.files,
        r.read.rate()
    );
    println!(
        "fsck              clean: {} inodes, {} directories, {} extents, {} used",
        r.fsck.inodes,
        r.fsck.directories,
        r.fsck.extents,
        short_bytes(r.fsck.used_bytes)
    );
    println!("OK");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_position_dependent_and_chunking_independent() {
        let mut whole = vec![0u8; 100];
        fill(7, 3, &mut whole);
        let mut a = vec![0u8; 40];
        let mut b = vec![0u8; 60];
        fill(7, 3, &mut a);
        fill(7, 43, &mut b);
        assert_eq!(&whole[..40], &a[..]);
        assert_eq!(&whole[40..], &b[..]);
        let mut other = vec![0u8; 100];
        fill(8, 3, &mut other);
        assert_ne!(whole, other);
        let mut shifted = vec![0u8; 100];
        fill(7, 11, &mut shifted);
        assert_ne!(whole, shifted);
    }

    #[test]
    fn expected_model() {
        let mut e = Expected {
            path: "/x",
            data: Vec::new(),
        };
        e.write(4, &[1, 2, 3]);
        assert_eq!(e.data, [0, 0, 0, 0, 1, 2, 3]);
        e.zero(5, 100);
        assert_eq!(e.data, [0, 0, 0, 0, 1, 0, 0]);
    }
}
