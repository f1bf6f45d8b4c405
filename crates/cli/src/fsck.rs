//! `iomapfs fsck`: check a volume offline, without modifying it (unless
//! `--repair` is given).

use clap::Args;
use iomapfs_fs::fsck;

use crate::size::human_bytes;
use crate::target::{lock_target, open_device, TargetLock};
use crate::{Failure, Target};

const LONG_ABOUT: &str = "\
Check the iomapfs volume on TARGET without modifying it.

fsck opens TARGET read-only, loads the newest valid checkpoint, replays the
journal after it in memory, and cross-checks every inode, directory entry and
extent: extents inside the data area and not overlapping, sizes and link
counts consistent, directories forming a tree. It also checks that the backup
superblock (in the last block of the device) reads and matches the primary,
and reports a durable checkpoint that was damaged (the volume would otherwise
roll back silently). Without --repair it never writes to TARGET, so it is safe
on a volume that was not unmounted cleanly (journal records that a mount would
replay are counted, not applied). Do not run it while another process has the
volume open for writing.

--repair restores an unusable primary superblock (block 0) from the backup, or
rewrites a backup that does not match the primary, and rewrites a damaged copy
of an index page from its other copy, then checks as above.";

const AFTER_HELP: &str = "\
Output: counts of inodes, directories and extents, used/total data bytes, the
number of journal records replayed and the checkpoint generation used, then
one line per problem found.

Exit status: 0 clean (after --repair: clean once repaired); 1 problems found
(listed); 2 the volume cannot be read
at all (not iomapfs, no valid superblock or checkpoint, or an I/O error; the
message says which).

Example:
  iomapfs fsck disk.img && echo clean";

/// Check a volume for consistency (read-only).
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct FsckArgs {
    #[arg(help = crate::TARGET_HELP)]
    pub target: Target,
    /// Restore the primary superblock from the backup (or the backup from
    /// the primary) and damaged index page copies from their other copy
    /// first; writes to TARGET.
    #[arg(long)]
    pub repair: bool,
}

pub fn run(args: &FsckArgs) -> Result<u8, Failure> {
    let shown = args.target.display();
    let lock = if args.repair {
        TargetLock::Exclusive
    } else {
        TargetLock::Shared
    };
    let _lock = lock_target(&args.target, "fsck", lock).map_err(|f| Failure::new(2, f.message))?;
    let dev = open_device(&args.target, !args.repair)
        .map_err(|f| Failure::new(2, format!("fsck: {}", f.message)))?;
    if args.repair {
        let cannot = |e| Failure::new(2, format!("fsck --repair: {shown}: cannot repair: {e}"));
        for line in fsck::repair_superblocks(&*dev).map_err(cannot)? {
            println!("repaired: {line}");
        }
        let (done, failed) = fsck::repair_index_copies(&*dev).map_err(cannot)?;
        for line in done {
            println!("repaired: {line}");
        }
        for line in failed {
            println!("not repaired: {line}");
        }
    }
    let report = fsck::check(dev.clone())
        .map_err(|e| Failure::new(2, format!("fsck: {shown}: cannot read the volume: {e}")))?;

    println!("fsck {shown}");
    println!(
        "  checkpoint generation     {}",
        report.checkpoint_generation
    );
    println!("  journal records replayed  {}", report.journal_records);
    println!("  inodes                    {}", report.inodes);
    println!("  directories               {}", report.directories);
    println!("  extents                   {}", report.extents);
    let pct = if report.data_bytes > 0 {
        report.used_bytes as f64 * 100.0 / report.data_bytes as f64
    } else {
        0.0
    };
    println!(
        "  data used                 {} of {} ({pct:.1}%)",
        human_bytes(report.used_bytes),
        human_bytes(report.data_bytes)
    );
    if report.is_clean() {
        println!("clean: no problems found");
        Ok(0)
    } else {
        println!("{} problem(s) found:", report.problems.len());
        for p in &report.problems {
            println!("  - {p}");
        }
        Ok(1)
    }
}
