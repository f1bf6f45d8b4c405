//! `iomapfs`: make, check, exercise and demonstrate iomapfs volumes.
//!
//! Every subcommand works on a TARGET: an image file or a block device.
//! Errors go to standard error prefixed with `iomapfs: `; exit codes are
//! documented in `iomapfs --help`.

mod allocator;
mod bench;
mod demo;
mod fsck;
mod fuse_probe;
mod io;
mod mkfs;
mod mount;
mod mount_helper;
mod replay;
mod shell;
mod size;
mod target;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A command's failure: what to print after `iomapfs: ` and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// Prints an error line: `iomapfs: MESSAGE` on standard error, after
/// flushing standard output so the two streams interleave in order.
pub fn report_error(message: &str) {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    eprintln!("iomapfs: {message}");
}

/// Parses a byte count for clap (`--size 64m`).
fn size_arg(text: &str) -> Result<u64, String> {
    size::parse_size(text, 4096)
}

const ABOUT: &str = "iomapfs: a userspace, extent-based, crash-safe file store";

const LONG_ABOUT: &str = "\
iomapfs: a userspace, extent-based, crash-safe file store.

iomapfs keeps files with pread/pwrite, O_DIRECT and O_DSYNC semantics, fsync,
fallocate and truncate on a raw block device or an image file, and survives
power loss at any point. This binary makes volumes, checks them, and runs
xfs_io-style commands against them.

Sizes and offsets everywhere accept binary suffixes like xfs_io:
k (KiB), m (MiB), g (GiB), t (TiB), e.g. 4k, 16m, 0x1000.

Quick start (no setup needed):
  iomapfs demo

Examples (by hand):
  iomapfs mkfs disk.img --size 64m
  iomapfs io disk.img -c 'open -c /log' -c 'pwrite 0 1m' -c 'fsync' -c 'fiemap'
  iomapfs fsck disk.img
  iomapfs mount disk.img /mnt/x   (then any program can use /mnt/x)";

const AFTER_HELP: &str = "\
Exit status: 0 success; 1 an operation failed or fsck found problems;
2 bad command-line usage, or (fsck) the volume cannot be read at all.";

#[derive(Parser)]
#[command(name = "iomapfs", version, about = ABOUT, long_about = LONG_ABOUT, after_help = AFTER_HELP)]
struct Cli {
    /// I/O backend for the target: `sync` (pread/pwritev2), `uring`
    /// (io_uring), `pool` (pread/pwritev2; queued requests run on one worker
    /// thread per CPU), or `auto` — io_uring when the device accepts NOWAIT
    /// submission; where it does not (zram: io_uring would punt every
    /// request to a kernel worker, and the device works in the submitting
    /// thread), the pool on more than one CPU, else sync. `stat` in
    /// `iomapfs io` shows the choice and why.
    #[arg(long, global = true, value_name = "BACKEND", default_value = "auto")]
    backend: blockdev::Backend,
    /// Page cache of non-direct (buffered) handles: its size in bytes (k, m,
    /// g suffixes). Default: an eighth of physical memory, between 64 MiB
    /// and 2 GiB; dirty data is written back from 10% of it and writers
    /// wait at 20%.
    #[arg(long, global = true, value_name = "SIZE", value_parser = parse_cache_size)]
    cache_size: Option<u64>,
    /// Dirty bytes of the page cache past which background writeback
    /// starts (k, m, g suffixes). Default: 10% of the cache.
    #[arg(long, global = true, value_name = "SIZE", value_parser = parse_cache_size)]
    dirty_background: Option<u64>,
    /// Dirty bytes past which writers write back before they return.
    /// Default: 20% of the cache.
    #[arg(long, global = true, value_name = "SIZE", value_parser = parse_cache_size)]
    dirty_limit: Option<u64>,
    /// A sequential buffered writer's bytes are written back behind it in
    /// chunks of this size while it goes on writing, so an fsync at the end
    /// finds little left: for logs and bulk loads that end with fsync (4m
    /// is a good chunk; a multiple of 2 MiB). Default: 0 (off: it costs
    /// device work that writers who never sync do not need).
    #[arg(long, global = true, value_name = "SIZE", value_parser = parse_cache_size)]
    write_behind: Option<u64>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Mkfs(mkfs::MkfsArgs),
    Fsck(fsck::FsckArgs),
    Io(io::IoArgs),
    Demo(demo::DemoArgs),
    Bench(bench::BenchArgs),
    Mount(mount::MountArgs),
    Replay(replay::ReplayArgs),
    FuseTransportProbe(fuse_probe::ProbeArgs),
}

/// Keeps panics (bugs, never user errors) from printing a bare backtrace:
/// they print one `iomapfs: internal error` line instead, unless
/// RUST_BACKTRACE asks for the full story.
fn install_panic_hook() {
    if std::env::var_os("RUST_BACKTRACE").is_some() {
        return;
    }
    std::panic::set_hook(Box::new(|info| {
        let what = if let Some(s) = info.payload().downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = info.payload().downcast_ref::<String>() {
            s.clone()
        } else {
            "panic".to_string()
        };
        let place = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        report_error(&format!(
            "internal error (a bug, please report it): {what}{place}; \
             set RUST_BACKTRACE=1 for details"
        ));
    }));
}

/// Like C tools (xfs_io among them), end quietly when the reader of our
/// output goes away (`iomapfs io ... | head`) instead of failing on every
/// later write. A volume left mounted that way is recovered from its journal
/// at the next mount, as after a crash.
fn default_sigpipe() {
    // SAFETY: setting a signal disposition to SIG_DFL at startup, before any
    // other thread exists, has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    allocator::set_up();
    default_sigpipe();
    install_panic_hook();
    if let Some(code) = mount_helper::run_if_invoked_as_helper() {
        return code;
    }
    let cli = Cli::parse();
    target::set_backend(cli.backend);
    target::set_cache_options(target::CacheOptions {
        size: cli.cache_size,
        dirty_background: cli.dirty_background,
        dirty_limit: cli.dirty_limit,
        write_behind: cli.write_behind,
    });
    let result = match cli.command {
        Command::Mkfs(args) => mkfs::run(&args),
        Command::Fsck(args) => fsck::run(&args),
        Command::Io(args) => io::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Bench(args) => bench::run(&args, cli.backend).map(|()| 0),
        Command::Mount(args) => mount::run(&args),
        Command::Replay(args) => replay::run(&args),
        Command::FuseTransportProbe(args) => fuse_probe::run(&args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            report_error(&failure.message);
            ExitCode::from(failure.code)
        }
    }
}

fn parse_cache_size(text: &str) -> Result<u64, String> {
    size::parse_size(text, 1)
}

/// Shared by subcommands: the TARGET argument's help.
pub const TARGET_HELP: &str =
    "Image file or block device holding the volume (e.g. disk.img, /dev/zram0)";

/// A TARGET path as given.
pub type Target = PathBuf;
