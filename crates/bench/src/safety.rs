//! Deciding whether an explicit `--device` may be overwritten.
//!
//! Bench formats the device several times over, so it refuses anything that
//! looks like someone's data: a recognisable file system or partition table
//! (unless `force`), partitions, and anything in use — mounted, swap,
//! held by device-mapper/md, or (for an image file) attached to a loop
//! device. "In use" is refused even with `force`: the kernel would refuse
//! the exclusive open anyway, and the remedy is to stop the user, not to
//! insist.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::BenchError;

/// Smallest device bench runs on: room for iomapfs metadata and the
/// workload files (which shrink to half the device when it is small).
pub const MIN_DEVICE_BYTES: u64 = 64 << 20;

pub use iomapfs_fs::signature::{recognise, SIGNATURE_PROBE_BYTES as PROBE_BYTES};

fn refuse(path: &Path, reason: impl Into<String>) -> BenchError {
    BenchError::DeviceRefused {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// `major:minor` of a device number.
fn dev_pair(rdev: u64) -> (u32, u32) {
    (libc::major(rdev), libc::minor(rdev))
}

fn parse_pair(text: &str) -> Option<(u32, u32)> {
    let (a, b) = text.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Where a device number is mounted, from /proc/self/mountinfo (field 3 is
/// the mounted device's major:minor, field 5 the mount point).
fn mount_points_of(dev: (u32, u32)) -> Vec<String> {
    iomapfs_mount::mountinfo::mounts()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.device == dev)
        .map(|m| m.mount_point.display().to_string())
        .collect()
}

/// Whether the device number is an active swap area.
fn is_swap(dev: (u32, u32)) -> bool {
    let Ok(swaps) = fs::read_to_string("/proc/swaps") else {
        return false;
    };
    swaps.lines().skip(1).any(|line| {
        line.split_whitespace()
            .next()
            .and_then(|p| fs::metadata(p).ok())
            .is_some_and(|m| m.file_type().is_block_device() && dev_pair(m.rdev()) == dev)
    })
}

/// Partitions of a whole disk: (name, major:minor).
fn partitions_of(sys: &Path) -> Vec<(String, (u32, u32))> {
    let Ok(entries) = fs::read_dir(sys) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.path().join("partition").exists())
        .filter_map(|e| {
            let pair = parse_pair(&fs::read_to_string(e.path().join("dev")).ok()?)?;
            Some((e.file_name().to_string_lossy().into_owned(), pair))
        })
        .collect()
}

/// Loop devices whose backing file is `file`.
pub fn loops_backed_by(file: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .filter(|e| {
            fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|b| Path::new(b.trim()) == file)
        })
        .map(|e| Path::new("/dev").join(e.file_name()))
        .collect()
}

/// Checks that bench may overwrite `path`; `force` allows destroying a
/// recognised file system or partition table, never a device in use.
pub fn check_explicit(path: &Path, force: bool) -> Result<(), BenchError> {
    let meta = fs::metadata(path).map_err(|e| refuse(path, format!("cannot stat it: {e}")))?;
    let ft = meta.file_type();
    let size;
    if ft.is_block_device() {
        let dev = dev_pair(meta.rdev());
        let sys = PathBuf::from(format!("/sys/dev/block/{}:{}", dev.0, dev.1));
        let points = mount_points_of(dev);
        if !points.is_empty() {
            return Err(refuse(
                path,
                format!("it is mounted on {}; unmount it first", points.join(", ")),
            ));
        }
        if is_swap(dev) {
            return Err(refuse(path, "it is an active swap area; swapoff it first"));
        }
        let holders: Vec<String> = fs::read_dir(sys.join("holders"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if !holders.is_empty() {
            return Err(refuse(
                path,
                format!(
                    "it is in use by {} (device-mapper, md or similar)",
                    holders.join(", ")
                ),
            ));
        }
        let parts = partitions_of(&sys);
        for (name, pair) in &parts {
            let points = mount_points_of(*pair);
            if !points.is_empty() || is_swap(*pair) {
                return Err(refuse(
                    path,
                    format!("its partition {name} is in use (mounted or swap)"),
                ));
            }
        }
        if !parts.is_empty() && !force {
            let names: Vec<_> = parts.iter().map(|(n, _)| n.as_str()).collect();
            return Err(refuse(
                path,
                format!(
                    "it has partitions ({}); bench would destroy them. \
                     Pass --force to overwrite the whole device",
                    names.join(", ")
                ),
            ));
        }
        size = fs::read_to_string(sys.join("size"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(|sectors| sectors * 512)
            .unwrap_or(0);
    } else if ft.is_file() {
        let canonical = fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        let loops = loops_backed_by(&canonical);
        if !loops.is_empty() {
            let names: Vec<_> = loops.iter().map(|p| p.display().to_string()).collect();
            return Err(refuse(
                path,
                format!(
                    "it is attached to {}; detach it first (losetup -d)",
                    names.join(", ")
                ),
            ));
        }
        size = meta.len();
    } else {
        return Err(refuse(path, "not a block device or regular file"));
    }
    if size < MIN_DEVICE_BYTES {
        return Err(refuse(
            path,
            format!(
                "it holds {size} bytes; bench needs at least {} MiB",
                MIN_DEVICE_BYTES >> 20
            ),
        ));
    }
    let mut head = Vec::with_capacity(PROBE_BYTES);
    fs::File::open(path)
        .and_then(|f| f.take(PROBE_BYTES as u64).read_to_end(&mut head))
        .map_err(|e| refuse(path, format!("cannot read its first bytes: {e}")))?;
    if let Some(what) = recognise(&head) {
        if !force {
            return Err(refuse(
                path,
                format!(
                    "it holds {what}; bench formats the device and would destroy it. \
                     Pass --force to overwrite it"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    fn image_with(offset: u64, magic: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(MIN_DEVICE_BYTES).unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        f.write_all(magic).unwrap();
        f
    }

    #[test]
    fn refuses_recognised_contents_unless_forced() {
        let cases: [(u64, &[u8], &str); 5] = [
            (0, b"IOMAPFS1", "iomapfs"),
            (0, b"XFSB", "XFS"),
            (1080, &[0x53, 0xEF], "ext4"),
            (510, &[0x55, 0xAA], "MBR"),
            (512, b"EFI PART", "GPT"),
        ];
        for (offset, magic, word) in cases {
            let f = image_with(offset, magic);
            let err = check_explicit(f.path(), false).unwrap_err().to_string();
            assert!(err.contains(word) && err.contains("--force"), "{err}");
            check_explicit(f.path(), true).unwrap();
        }
        check_explicit(image_with(4000, b"x").path(), false).unwrap();
    }

    #[test]
    fn refuses_small_missing_and_odd_paths() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let err = check_explicit(f.path(), true).unwrap_err().to_string();
        assert!(err.contains("at least"), "{err}");
        let err = check_explicit(Path::new("/nonexistent/dev"), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot stat"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = check_explicit(dir.path(), true).unwrap_err().to_string();
        assert!(err.contains("not a block device"), "{err}");
    }

    #[test]
    fn a_mounted_block_device_is_refused_even_with_force() {
        // The root file system's device, when it is a block device we can
        // see (it is in most containers and VMs).
        let Ok(root) = fs::metadata("/") else { return };
        let dev = dev_pair(root.dev());
        let Some(node) = fs::read_dir("/dev").ok().and_then(|d| {
            d.flatten().map(|e| e.path()).find(|p| {
                fs::metadata(p)
                    .is_ok_and(|m| m.file_type().is_block_device() && dev_pair(m.rdev()) == dev)
            })
        }) else {
            eprintln!("skipped: no /dev node for the root file system's device");
            return;
        };
        let err = check_explicit(&node, true).unwrap_err().to_string();
        assert!(err.contains("mounted"), "{err}");
    }
}
