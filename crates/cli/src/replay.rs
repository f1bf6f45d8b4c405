//! `iomapfs replay`: rebuild a device from a log-writes recording
//! (`iomapfs io --record LOG`), at any point, and check the volume at every
//! flush point (as fstests' generic/482 does with dm-log-writes).
//!
//! The durability checks rest on marks the recording session writes into
//! the log (this module defines them): `synced` after every fsync,
//! fdatasync, sync or DSYNC write that returned, with the file's size and
//! crc32c at that moment, and `changing` before every command that may
//! change a file. Between a file's `synced` mark and its next `changing`
//! mark, every flush point must show exactly that content.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use blockdev::memory::MemDevice;
use blockdev::{BlockDevice, LogEntry, LogReader, Survival};
use clap::Args;
use iomapfs_fs::{fsck, OpenFlags, Volume};

use crate::target::open_device;
use crate::{Failure, Target};

const LONG_ABOUT: &str = "\
Replay a log-writes recording onto TARGET, up to any point.

A recording (iomapfs io --record LOG) holds every write, with its data, every
flush and every mark, in the order they completed. Replaying its first N
entries onto a copy of the device as it was when the recording began
rebuilds the device as it was after entry N, and in particular what a power
cut right after any flush may leave. TARGET must hold that starting content:
a copy of the image taken before the recording (or a zeroed device, when the
recording began with an empty one); it must be at least as large as the
recorded device.

With --check-every-flush, replay stops at every flush entry up to the end
point and, on a copy in memory, mounts the volume, runs fsck, and checks
that every file synced before that point (fsync, fdatasync, sync or an
O_DSYNC write that returned, according to the recording's marks) still
holds exactly what it held then. Flush points before block 0 first holds
an iomapfs superblock (a recording that begins with the format, such as
`iomapfs bench --record`) are skipped and counted: there is no volume yet.
TARGET is written as without the option.";

const AFTER_HELP: &str = "\
Exit status: 0 replayed (and, with --check-every-flush, every flush point
passed); 1 a flush point failed a check (each failure is printed), or the
log or TARGET could not be read or written; 2 bad command-line usage.

Examples:
  cp disk.img base.img
  iomapfs io disk.img --record run.log -c 'open -c /a' -c 'pwrite 0 1m' -c fsync
  iomapfs replay run.log --list
  iomapfs replay run.log base.img --check-every-flush
  iomapfs replay run.log base.img --to 12        # the first 12 entries only
  iomapfs replay run.log base.img --mark before-rm";

/// Replay a log-writes recording onto a device, checking every flush point.
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct ReplayArgs {
    /// The log written by `iomapfs io --record LOG`.
    pub log: PathBuf,

    /// Image file or block device holding the device's content as it was
    /// when the recording began; replayed entries are written to it.
    #[arg(required_unless_present = "list")]
    pub target: Option<Target>,

    /// Replay only the first N entries (see --list for their numbers).
    #[arg(long, value_name = "N", conflicts_with = "mark")]
    pub to: Option<u64>,

    /// Replay up to and including the first mark named NAME.
    #[arg(long, value_name = "NAME")]
    pub mark: Option<String>,

    /// At every flush entry replayed: mount, fsck and check that synced
    /// files are intact (on a copy in memory).
    #[arg(long)]
    pub check_every_flush: bool,

    /// List the log's entries, numbered, and exit.
    #[arg(long)]
    pub list: bool,
}

/// Prefix of the marks the recording session writes (user marks may not
/// use it).
pub const MARK_PREFIX: &str = "iomapfs:";

/// The mark written after `path` was made durable holding `data`.
pub fn synced_mark(path: &str, data: &[u8]) -> String {
    format!(
        "{MARK_PREFIX}synced {} {:08x} {path}",
        data.len(),
        crc32c::crc32c(data)
    )
}

/// The mark written before a command that may change `path`.
pub fn changing_mark(path: &str) -> String {
    format!("{MARK_PREFIX}changing {path}")
}

/// A recording session's mark, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum SessionMark {
    Synced { path: String, size: u64, crc: u32 },
    Changing { path: String },
}

fn parse_mark(name: &str) -> Option<SessionMark> {
    let rest = name.strip_prefix(MARK_PREFIX)?;
    if let Some(path) = rest.strip_prefix("changing ") {
        return Some(SessionMark::Changing {
            path: path.to_string(),
        });
    }
    let mut words = rest.strip_prefix("synced ")?.splitn(3, ' ');
    let size = words.next()?.parse().ok()?;
    let crc = u32::from_str_radix(words.next()?, 16).ok()?;
    let path = words.next()?.to_string();
    Some(SessionMark::Synced { path, size, crc })
}

fn log_failure(log: &Path, e: impl std::fmt::Display) -> Failure {
    Failure::new(1, format!("replay: {}: {e}", log.display()))
}

pub fn run(args: &ReplayArgs) -> Result<u8, Failure> {
    let mut reader = LogReader::open(&args.log).map_err(|e| log_failure(&args.log, e))?;
    if args.list {
        return list(&mut reader, &args.log);
    }
    let target_path = args
        .target
        .as_ref()
        .expect("clap requires TARGET without --list");
    let target = open_device(target_path, false)
        .map_err(|f| Failure::new(1, format!("replay: {}", f.message)))?;
    let header = reader.header;
    let caps = target.caps();
    if caps.size_bytes < header.device_size
        || header.logical_block_size % caps.logical_block_size != 0
    {
        return Err(Failure::new(
            1,
            format!(
                "replay: {}: {} bytes with {}-byte logical blocks cannot hold the recorded device ({} bytes, {}-byte blocks)",
                target_path.display(),
                caps.size_bytes,
                caps.logical_block_size,
                header.device_size,
                header.logical_block_size
            ),
        ));
    }
    let mut checker = if args.check_every_flush {
        Some(Checker::new(
            &*target,
            header.device_size,
            header.logical_block_size,
        )?)
    } else {
        None
    };
    let mut counts = Counts::default();
    let mut reached_mark = false;
    loop {
        if args.to.is_some_and(|n| counts.entries >= n) || reached_mark {
            break;
        }
        let Some(entry) = reader.next_entry().map_err(|e| log_failure(&args.log, e))? else {
            break;
        };
        let index = counts.entries;
        counts.entries += 1;
        entry.apply(&*target).map_err(|e| {
            Failure::new(
                1,
                format!(
                    "replay: entry {index} ({entry}) on {}: {e}",
                    target_path.display()
                ),
            )
        })?;
        match &entry {
            LogEntry::Write { .. } => counts.writes += 1,
            LogEntry::Flush => counts.flushes += 1,
            LogEntry::Mark(name) => {
                counts.marks += 1;
                reached_mark = args.mark.as_deref() == Some(name.as_str());
            }
        }
        if let Some(c) = checker.as_mut() {
            c.entry(index, &entry)?;
        }
    }
    if let Some(tail) = &reader.tail {
        eprintln!(
            "iomapfs: replay: note: the log ends early at byte {} ({}); replayed what precedes it",
            tail.at, tail.reason
        );
    }
    if let Some(name) = &args.mark {
        if !reached_mark {
            return Err(Failure::new(
                1,
                format!("replay: no mark named {name:?} in {}", args.log.display()),
            ));
        }
    }
    target.flush().map_err(|e| {
        Failure::new(
            1,
            format!("replay: flushing {}: {e}", target_path.display()),
        )
    })?;
    println!(
        "replayed {} entries ({} writes, {} flushes, {} marks) onto {}",
        counts.entries,
        counts.writes,
        counts.flushes,
        counts.marks,
        target_path.display()
    );
    let Some(c) = checker else {
        return Ok(0);
    };
    println!(
        "checked {} flush points: {} synced-file checks, {} failed",
        c.points, c.file_checks, c.failures
    );
    if c.before_format > 0 {
        println!(
            "skipped {} flush points before the volume was formatted",
            c.before_format
        );
    }
    Ok(u8::from(c.failures > 0))
}

#[derive(Default)]
struct Counts {
    entries: u64,
    writes: u64,
    flushes: u64,
    marks: u64,
}

fn list(reader: &mut LogReader, log: &Path) -> Result<u8, Failure> {
    println!(
        "log {}: device of {} bytes, {}-byte logical blocks",
        log.display(),
        reader.header.device_size,
        reader.header.logical_block_size
    );
    let mut i = 0u64;
    while let Some(entry) = reader.next_entry().map_err(|e| log_failure(log, e))? {
        println!("{i:>8}  {entry}");
        i += 1;
    }
    if let Some(tail) = &reader.tail {
        println!("log ends early at byte {}: {}", tail.at, tail.reason);
    }
    Ok(0)
}

/// The replayed device in memory, checked at every flush.
struct Checker {
    mem: MemDevice,
    /// path -> (size, crc, log entry of the `synced` mark), while valid.
    synced: BTreeMap<String, (u64, u32, u64)>,
    points: u64,
    file_checks: u64,
    failures: u64,
    /// Block 0 has held an iomapfs superblock at a flush point: the
    /// volume exists, and every later point must mount.
    formatted: bool,
    before_format: u64,
}

impl Checker {
    /// Loads `target`'s first `size` bytes (blocks that are all zeros stay
    /// unallocated: memory follows what the device holds).
    fn new(target: &dyn BlockDevice, size: u64, lbs: u32) -> Result<Checker, Failure> {
        let mem = MemDevice::try_with_caps(size, lbs, true, false).map_err(|e| {
            Failure::new(1, format!("replay: an in-memory copy of {size} bytes: {e}"))
        })?;
        const CHUNK: u64 = 1 << 20;
        let mut buf = blockdev::AlignedBuf::new(CHUNK as usize, 4096)
            .map_err(|e| Failure::new(1, format!("replay: buffer: {e}")))?;
        let mut at = 0;
        while at < size {
            let n = CHUNK.min(size - at) as usize;
            target
                .read_at(&mut buf[..n], at)
                .map_err(|e| Failure::new(1, format!("replay: reading the target: {e}")))?;
            if buf[..n].iter().any(|&b| b != 0) {
                mem.write_at(&buf[..n], at, blockdev::WriteMode::Normal)
                    .map_err(|e| Failure::new(1, format!("replay: {e}")))?;
            }
            at += n as u64;
        }
        Ok(Checker {
            mem,
            synced: BTreeMap::new(),
            points: 0,
            file_checks: 0,
            failures: 0,
            formatted: false,
            before_format: 0,
        })
    }

    fn entry(&mut self, index: u64, entry: &LogEntry) -> Result<(), Failure> {
        entry
            .apply(&self.mem)
            .map_err(|e| Failure::new(1, format!("replay: entry {index} in memory: {e}")))?;
        match entry {
            LogEntry::Mark(name) => match parse_mark(name) {
                Some(SessionMark::Synced { path, size, crc }) => {
                    self.synced.insert(path, (size, crc, index));
                }
                Some(SessionMark::Changing { path }) => {
                    self.synced.remove(&path);
                }
                None => {}
            },
            LogEntry::Flush => {
                if !self.formatted {
                    match iomapfs_fs::superblock::read_superblock(&self.mem) {
                        Err(iomapfs_fs::Error::NotIomapfs { .. }) => {
                            self.before_format += 1;
                            return Ok(());
                        }
                        _ => self.formatted = true,
                    }
                }
                self.points += 1;
                if let Err(why) = self.check_point() {
                    self.failures += 1;
                    println!("flush point {} (entry {index}): {why}", self.points);
                }
            }
            LogEntry::Write { .. } => {}
        }
        Ok(())
    }

    /// Mount + fsck + synced files, on copies of the state now.
    fn check_point(&mut self) -> Result<(), String> {
        let copy = |mem: &MemDevice| -> Arc<dyn BlockDevice> {
            Arc::new(mem.power_cut(&mut |_| Survival::Kept))
        };
        let report = fsck::check(copy(&self.mem))
            .map_err(|e| format!("fsck cannot read the volume: {e}"))?;
        if !report.is_clean() {
            return Err(format!("fsck: {}", report.problems.join("; ")));
        }
        let vol = Volume::open(copy(&self.mem)).map_err(|e| format!("mount: {e}"))?;
        let mut bad = Vec::new();
        for (path, &(size, crc, at)) in &self.synced {
            self.file_checks += 1;
            let data = read_whole(&vol, path);
            match data {
                Ok(d) if d.len() as u64 == size && crc32c::crc32c(&d) == crc => {}
                Ok(d) => bad.push(format!(
                    "{path}, synced at entry {at} with {size} bytes (crc32c {crc:08x}), holds {} bytes (crc32c {:08x})",
                    d.len(),
                    crc32c::crc32c(&d)
                )),
                Err(e) => bad.push(format!("{path}, synced at entry {at}: {e}")),
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!("synced data lost: {}", bad.join("; ")))
        }
    }
}

/// The whole content of `path` on `vol`.
pub fn read_whole(vol: &Volume, path: &str) -> Result<Vec<u8>, String> {
    let f = vol
        .open_file(
            path,
            OpenFlags {
                read_only: true,
                ..OpenFlags::default()
            },
        )
        .map_err(|e| e.to_string())?;
    let size = f.stat().map_err(|e| e.to_string())?.size;
    let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit in memory"))?;
    let mut data = vec![0u8; len];
    let mut done = 0;
    while done < len {
        let n = f
            .pread(&mut data[done..], done as u64)
            .map_err(|e| e.to_string())?;
        if n == 0 {
            data.truncate(done);
            break;
        }
        done += n;
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_marks_round_trip() {
        let m = synced_mark("/a b/c", b"hello");
        assert_eq!(
            parse_mark(&m),
            Some(SessionMark::Synced {
                path: "/a b/c".into(),
                size: 5,
                crc: crc32c::crc32c(b"hello")
            })
        );
        assert_eq!(
            parse_mark(&changing_mark("/x")),
            Some(SessionMark::Changing { path: "/x".into() })
        );
        assert_eq!(parse_mark("before-rm"), None);
        assert_eq!(parse_mark("iomapfs:synced nonsense"), None);
    }
}
