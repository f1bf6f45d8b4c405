//! `iomapfs mkfs`: write a new, empty volume to an image file or device.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use clap::Args;
use iomapfs_fs::superblock::read_superblock;
use iomapfs_fs::{FormatOptions, Volume};

use crate::size::human_bytes;
use crate::target::{lock_target, open_device, read_head, recognise, TargetLock};
use crate::{size_arg, Failure, Target};

const LONG_ABOUT: &str = "\
Write a new, empty iomapfs volume to TARGET.

TARGET is an image file or a block device. An image file that does not exist
is created when --size is given. mkfs refuses to overwrite a TARGET that
already holds an iomapfs volume, an XFS or ext2/3/4 file system, or an MBR or
GPT partition table, unless --force is given.

Sizes accept binary suffixes: k (KiB), m (MiB), g (GiB), t (TiB), or a
plain byte count (4096, 0x1000).";

const AFTER_HELP: &str = "\
Examples:
  iomapfs mkfs disk.img --size 64m            create a 64 MiB image and format it
  iomapfs mkfs disk.img --force               reformat an existing image
  iomapfs mkfs disk.img --size 1g --force     grow/shrink the image to 1 GiB, reformat
  iomapfs mkfs /dev/zram0 --block-size 4k     format a block device

Exit status: 0 formatted; 1 refused or failed (the message says why);
2 bad command-line usage.";

/// Make a new iomapfs volume (image file or block device).
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct MkfsArgs {
    #[arg(help = crate::TARGET_HELP)]
    pub target: Target,

    /// Size of the image file in bytes (suffixes k/m/g/t). Creates TARGET
    /// if missing; resizing an existing image also needs --force. Not
    /// allowed for block devices, which are used whole.
    #[arg(long, value_name = "BYTES", value_parser = size_arg)]
    pub size: Option<u64>,

    /// File-system block size in bytes: a power of two from 512 to 64k, at
    /// least the device's logical block size.
    #[arg(long, value_name = "BYTES", value_parser = size_arg, default_value = "4096")]
    pub block_size: u64,

    /// Journal size in bytes (suffixes k/m/g). Default: chosen from the
    /// device size.
    #[arg(long, value_name = "BYTES", value_parser = size_arg)]
    pub journal_size: Option<u64>,

    /// Format even if TARGET already holds a volume, file system or
    /// partition table, and allow --size to resize an existing image.
    #[arg(long, short = 'f')]
    pub force: bool,

    /// Keep each base checkpoint's extents in one image instead of extent
    /// pages (the default: a base then writes only the extent chunks
    /// changed since the last one, and the volume keeps free the room its
    /// next base's pages need). The volume is then readable by iomapfs
    /// builds that predate extent pages (incompat bit 2).
    #[arg(long)]
    pub no_extent_pages: bool,

    /// Keep extents in extent pages: the default; kept for scripts that
    /// name it.
    #[arg(long, conflicts_with = "no_extent_pages")]
    pub extent_pages: bool,

    /// List every extent page in each checkpoint root instead of in index
    /// pages. By default (with extent pages) a root lists index pages
    /// (incompat bit 3), each a block listing a run of up to 127 pages at
    /// 4 KiB blocks, written twice: a root and a base's writes then stop
    /// growing with every page. Without them the volume is readable by
    /// iomapfs builds that predate index pages.
    #[arg(long)]
    pub no_page_index: bool,

    /// List extent pages in index pages: the default with extent pages;
    /// kept for scripts that name it.
    #[arg(long, conflicts_with_all = ["no_extent_pages", "no_page_index"])]
    pub page_index: bool,
}

pub fn run(args: &MkfsArgs) -> Result<u8, Failure> {
    let path = args.target.as_path();
    let block_size = check_block_size(args.block_size)?;
    let created = prepare_target(path, args)?;
    let result = format(path, args, block_size);
    if result.is_err() && created {
        // Do not leave a half-made image behind that we created ourselves.
        let _ = fs::remove_file(path);
    }
    result
}

fn check_block_size(bs: u64) -> Result<u32, Failure> {
    if !(512..=65536).contains(&bs) || !bs.is_power_of_two() {
        return Err(Failure::new(
            1,
            format!("mkfs: --block-size {bs}: must be a power of two from 512 to 65536 bytes"),
        ));
    }
    Ok(bs as u32)
}

/// Creates, checks and (with --force) resizes the target. Returns whether
/// this call created the image file.
fn prepare_target(path: &Path, args: &MkfsArgs) -> Result<bool, Failure> {
    let shown = path.display();
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let Some(size) = args.size else {
                return Err(Failure::new(
                    1,
                    format!(
                        "mkfs: {shown} does not exist; give --size to create an image \
                         file (e.g. --size 64m)"
                    ),
                ));
            };
            check_image_size(path, size)?;
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| Failure::new(1, format!("mkfs: cannot create {shown}: {e}")))?;
            if let Err(e) = file.set_len(size) {
                let _ = fs::remove_file(path);
                return Err(Failure::new(
                    1,
                    format!("mkfs: cannot size {shown} to {size} bytes: {e}"),
                ));
            }
            return Ok(true);
        }
        Err(e) => return Err(Failure::new(1, format!("mkfs: cannot access {shown}: {e}"))),
    };

    let ft = meta.file_type();
    if ft.is_block_device() {
        if args.size.is_some() {
            return Err(Failure::new(
                1,
                format!(
                    "mkfs: {shown} is a block device: it is used whole, --size applies \
                     to image files only"
                ),
            ));
        }
    } else if !ft.is_file() {
        return Err(Failure::new(
            1,
            format!("mkfs: {shown} is neither an image file nor a block device"),
        ));
    }

    // Look at what is there before touching anything.
    if meta.len() > 0 || ft.is_block_device() {
        let dev = open_device(path, true).map_err(|f| prefix(f, "mkfs"))?;
        let head = read_head(dev.as_ref()).map_err(|f| prefix(f, "mkfs"))?;
        if let Some(what) = recognise(&head) {
            if !args.force {
                return Err(Failure::new(
                    1,
                    format!(
                        "mkfs: {shown} already holds {what}; refusing to overwrite it \
                         (use --force to format anyway)"
                    ),
                ));
            }
            eprintln!("iomapfs: mkfs: {shown} held {what}; overwriting it (--force)");
        }
    }

    if ft.is_file() {
        match args.size {
            Some(size) if size != meta.len() => {
                if !args.force {
                    return Err(Failure::new(
                        1,
                        format!(
                            "mkfs: {shown} exists with size {}; --size {size} would resize \
                             it: add --force to do so",
                            meta.len()
                        ),
                    ));
                }
                check_image_size(path, size)?;
                let file = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| Failure::new(1, format!("mkfs: cannot open {shown}: {e}")))?;
                file.set_len(size).map_err(|e| {
                    Failure::new(
                        1,
                        format!("mkfs: cannot resize {shown} to {size} bytes: {e}"),
                    )
                })?;
            }
            _ if meta.len() == 0 => {
                return Err(Failure::new(
                    1,
                    format!("mkfs: {shown} is empty; give --size (e.g. --size 64m)"),
                ));
            }
            _ => {}
        }
    }
    Ok(false)
}

fn check_image_size(path: &Path, size: u64) -> Result<(), Failure> {
    if size == 0 || !size.is_multiple_of(512) {
        return Err(Failure::new(
            1,
            format!(
                "mkfs: --size {size} for {}: must be a positive multiple of 512 bytes",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// `start..end  (size)` for the layout table.
fn region(start: u64, len: u64) -> String {
    format!("{start:>12}..{:<12} {}", start + len, human_bytes(len))
}

fn prefix(mut f: Failure, cmd: &str) -> Failure {
    f.message = format!("{cmd}: {}", f.message);
    f
}

fn format(path: &Path, args: &MkfsArgs, block_size: u32) -> Result<u8, Failure> {
    let shown = path.display();
    let _lock = lock_target(path, "mkfs", TargetLock::Exclusive)?;
    let dev = open_device(path, false).map_err(|f| prefix(f, "mkfs"))?;
    let opts = FormatOptions {
        block_size,
        journal_bytes: args.journal_size,
        extent_pages: !args.no_extent_pages,
        // Index pages list extent pages: none without them.
        page_index: !args.no_extent_pages && !args.no_page_index,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone(), &opts)
        .map_err(|e| Failure::new(1, format!("mkfs: cannot format {shown}: {e}")))?;
    let opts = crate::target::mount_options().map_err(|f| prefix(f, "mkfs"))?;
    let vol = Volume::open_with(dev.clone(), &opts).map_err(|e| {
        Failure::new(
            1,
            format!("mkfs: formatted {shown}, but cannot mount it: {e}"),
        )
    })?;
    let sfs = vol.statfs();
    vol.unmount()
        .map_err(|e| Failure::new(1, format!("mkfs: {shown}: unmount after format: {e}")))?;

    let caps = dev.caps();
    println!("formatted {shown}");
    println!(
        "  device        {}",
        crate::target::describe_device(dev.as_ref())
    );
    println!("  size          {}", human_bytes(caps.size_bytes));
    println!("  block size    {} bytes", sfs.block_size);
    // The layout as written: read back from the superblock.
    match read_superblock(dev.as_ref()) {
        Ok(sb) => {
            let l = &sb.layout;
            let uuid: String = sb.uuid.iter().map(|b| format!("{b:02x}")).collect();
            println!("  format        version {}, uuid {uuid}", sb.version);
            let incompat = sb.features_incompat;
            println!(
                "  extent pages  {}",
                if incompat & iomapfs_fs::superblock::INCOMPAT_EXTENT_PAGES == 0 {
                    "off"
                } else if incompat & iomapfs_fs::superblock::INCOMPAT_PAGE_INDEX != 0 {
                    "on, listed in index pages"
                } else {
                    "on"
                }
            );
            println!("  layout        (device byte ranges)");
            println!("    superblock  {}", region(0, u64::from(l.block_size)));
            for (i, slot) in l.checkpoint_slots.iter().enumerate() {
                println!("    checkpoint{i} {}", region(slot.start, slot.len));
            }
            println!("    journal     {}", region(l.journal.start, l.journal.len));
            println!("    data        {}", region(l.data.start, l.data.len));
        }
        Err(e) => println!("  layout        (cannot read the superblock back: {e})"),
    }
    println!(
        "  data area     {}, {} blocks",
        human_bytes(sfs.data_bytes),
        sfs.data_bytes / u64::from(sfs.block_size.max(1))
    );
    println!("  free          {}", human_bytes(sfs.free_bytes));
    println!("  inodes        {}", sfs.inodes);
    Ok(0)
}
