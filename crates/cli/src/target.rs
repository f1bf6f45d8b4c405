//! Opening the TARGET of a command (an image file or a block device) and
//! recognising what it already holds.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use std::sync::{Mutex, OnceLock};

use blockdev::{Backend, BlockDevice, DeviceKind};

use crate::Failure;

/// The backend the command line asked for (`--backend`), set once at start.
static BACKEND: OnceLock<Backend> = OnceLock::new();

/// Why the last device was opened with the backend it got, for reports.
static LAST_CHOICE: Mutex<Option<String>> = Mutex::new(None);

/// The page cache options of the command line (bytes), set once at start.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheOptions {
    /// `--cache-size`
    pub size: Option<u64>,
    /// `--dirty-background`
    pub dirty_background: Option<u64>,
    /// `--dirty-limit`
    pub dirty_limit: Option<u64>,
    /// `--write-behind`
    pub write_behind: Option<u64>,
}

static CACHE_OPTIONS: OnceLock<CacheOptions> = OnceLock::new();

/// Records the cache options for every later [`mount_options`].
pub fn set_cache_options(options: CacheOptions) {
    let _ = CACHE_OPTIONS.set(options);
}

/// How commands mount a volume: the cache from the command line's options,
/// defaults for the rest (an eighth of memory, 64 MiB to 2 GiB; dirty
/// limits at 10% and 20% of it; write-behind off).
pub fn mount_options() -> Result<iomapfs_fs::MountOptions, Failure> {
    let options = CACHE_OPTIONS.get().copied().unwrap_or_default();
    let mut cache = match options.size {
        None => iomap::CacheConfig::default(),
        Some(bytes) => {
            let config = iomap::CacheConfig::with_size(bytes);
            if config.size_bytes != bytes {
                return Err(Failure::new(
                    2,
                    format!(
                        "--cache-size {bytes}: the cache must hold at least {} bytes (four of the largest folios)",
                        config.size_bytes
                    ),
                ));
            }
            config
        }
    };
    if let Some(bytes) = options.dirty_background {
        cache.dirty_background_bytes = bytes;
    }
    if let Some(bytes) = options.dirty_limit {
        cache.dirty_limit_bytes = bytes;
    }
    if let Some(bytes) = options.write_behind {
        cache.write_behind_bytes = bytes;
    }
    cache
        .validate()
        .map_err(|why| Failure::new(2, format!("page cache options: {why}")))?;
    Ok(iomapfs_fs::MountOptions {
        cache,
        ..iomapfs_fs::MountOptions::default()
    })
}

/// Mounts the volume on `dev` with the command line's mount options.
pub fn mount(dev: Arc<dyn BlockDevice>, shown: &str) -> Result<iomapfs_fs::Volume, Failure> {
    let opts = mount_options()?;
    let vol = iomapfs_fs::Volume::open_with(dev, &opts)
        .map_err(|e| Failure::new(1, format!("cannot mount {shown}: {e}")))?;
    for warning in vol.mount_warnings() {
        eprintln!("iomapfs: warning: {shown}: {warning}");
    }
    Ok(vol)
}

/// Records the `--backend` choice for every later [`open_device`].
pub fn set_backend(backend: Backend) {
    let _ = BACKEND.set(backend);
}

/// Opens `path` with the backend chosen on the command line (default:
/// probed, see `blockdev::open_device`).
pub fn open_device(path: &Path, read_only: bool) -> Result<Arc<dyn BlockDevice>, Failure> {
    let backend = BACKEND.get().copied().unwrap_or(Backend::Auto);
    match blockdev::open_device(path, read_only, backend) {
        Ok((dev, choice)) => {
            if let Ok(mut last) = LAST_CHOICE.lock() {
                *last = Some(choice.reason);
            }
            Ok(dev)
        }
        // The device error names the path and the cause already.
        Err(e) => Err(Failure::new(1, e.to_string())),
    }
}

/// How [`lock_target`] holds a TARGET.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetLock {
    /// Commands that write the volume (`mount`, `io`, `mkfs`): alone.
    Exclusive,
    /// Commands that only read it (`fsck`): beside other readers, never
    /// beside a writer.
    Shared,
}

/// Locks TARGET (`flock` on the image file or device node) for as long as
/// the returned file is open, or refuses at once if another iomapfs
/// process holds it in a conflicting way: a mounted image file is refused
/// by `io`, `fsck` and `mkfs` as a mounted block device already is (by
/// `O_EXCL`). `command` names the refusing command in the message.
pub fn lock_target(
    target: &Path,
    command: &str,
    how: TargetLock,
) -> Result<std::fs::File, Failure> {
    let file = std::fs::File::open(target)
        .map_err(|e| Failure::new(1, format!("{command}: {}: {e}", target.display())))?;
    let op = match how {
        TargetLock::Exclusive => libc::LOCK_EX,
        TargetLock::Shared => libc::LOCK_SH,
    };
    // SAFETY: flock on a descriptor we own; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        let why = if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            "in use: another iomapfs process holds it (mounted?)".to_string()
        } else {
            err.to_string()
        };
        return Err(Failure::new(
            1,
            format!("{command}: {}: {why}", target.display()),
        ));
    }
    Ok(file)
}

/// One line describing the device and backend, for `stat` and reports.
pub fn describe_device(dev: &dyn BlockDevice) -> String {
    let caps = dev.caps();
    let kind = match caps.kind {
        DeviceKind::BlockDevice => "block device",
        DeviceKind::ImageFile => "image file",
        DeviceKind::Memory => "memory",
    };
    let io = if caps.kind == DeviceKind::Memory || caps.direct_io {
        "O_DIRECT"
    } else {
        // The file system refused O_DIRECT: still durable (flush is
        // fdatasync), but timings measure the kernel page cache.
        "buffered: O_DIRECT refused by the host file system"
    };
    let why = LAST_CHOICE
        .lock()
        .ok()
        .and_then(|last| last.clone())
        .map(|reason| format!(" [{reason}]"))
        .unwrap_or_default();
    format!(
        "{} ({kind}), backend {} ({io}){why}, {} bytes, logical block {} bytes, \
         memory alignment {}, FUA {}, volatile write cache {}",
        caps.name,
        dev.backend_name(),
        caps.size_bytes,
        caps.logical_block_size,
        caps.memory_alignment,
        yes_no(caps.fua),
        yes_no(caps.volatile_write_cache),
    )
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

pub use iomapfs_fs::signature::{recognise, SIGNATURE_PROBE_BYTES as PROBE_BYTES};

/// Reads the start of the device for [`recognise`]: up to [`PROBE_BYTES`],
/// rounded down to the logical block size.
pub fn read_head(dev: &dyn BlockDevice) -> Result<Vec<u8>, Failure> {
    let caps = dev.caps();
    let lbs = u64::from(caps.logical_block_size.max(1));
    let len = (PROBE_BYTES as u64).min(caps.size_bytes) / lbs * lbs;
    let mut head = vec![0u8; len as usize];
    if len > 0 {
        dev.read_at(&mut head, 0).map_err(|e| {
            Failure::new(
                1,
                format!("{}: cannot read the first {len} bytes: {e}", caps.name),
            )
        })?;
    }
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(offset: usize, magic: &[u8]) -> Vec<u8> {
        let mut head = vec![0u8; PROBE_BYTES];
        head[offset..offset + magic.len()].copy_from_slice(magic);
        head
    }

    #[test]
    fn recognises_known_magics() {
        assert_eq!(recognise(&vec![0u8; PROBE_BYTES]), None);
        assert_eq!(recognise(&with(0, b"IOMAPFS1")), Some("an iomapfs volume"));
        assert_eq!(recognise(&with(0, b"XFSB")), Some("an XFS file system"));
        assert!(recognise(&with(1080, &[0x53, 0xEF]))
            .unwrap()
            .contains("ext4"));
        assert!(recognise(&with(510, &[0x55, 0xAA]))
            .unwrap()
            .contains("MBR"));
        let mut gpt = with(510, &[0x55, 0xAA]);
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert!(recognise(&gpt).unwrap().contains("GPT"));
        // Short heads (tiny devices) are fine.
        assert_eq!(recognise(&[0u8; 16]), None);
        assert_eq!(recognise(&[]), None);
    }
}
