//! `iomapfs mount`: serve a volume as a POSIX file system through FUSE.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::Args;
use iomapfs_mount::MountConfig;

use crate::target::{lock_target, mount, open_device, TargetLock};
use crate::{Failure, Target};

const LONG_ABOUT: &str = "\
Mount the iomapfs volume on TARGET at MOUNTPOINT through FUSE, so that every
program can use its files: cp, rsync, fio, databases, object stores.

By default the command returns once the mount is live and a daemon serves it
in the background; with --foreground it serves in this process. Unmount with
`umount MOUNTPOINT` (root), `fusermount3 -u MOUNTPOINT`, or SIGINT/SIGTERM to
the serving process: the volume is then written back and checkpointed. If the
daemon is killed outright, `umount -l MOUNTPOINT` clears the dead mount and
the next mount recovers from the journal, as after a power cut.

O_DIRECT opens reach iomapfs direct I/O (any offset and length); other opens
use iomapfs's own page cache, and by default the kernel page cache in front of
it (see kernel_cache below); the kernel keeps the two kinds of open coherent.
The kernel checks permissions (default_permissions). TARGET is refused while
mounted or in use.";

const AFTER_HELP: &str = "\
Options (-o, comma-separated):
  allow_other          let other users reach the files (a non-root user needs
                       user_allow_other in /etc/fuse.conf)
  threads=N            request threads, each with its own /dev/fuse (default 4)
  uring                requests travel over FUSE over io_uring (root; Linux
                       6.14+ with CONFIG_FUSE_IO_URING): one queue per CPU,
                       served by a thread pinned to that CPU, so a request is
                       answered on the CPU that made it; reads and writes are
                       answered there, other requests by the threads=N
                       threads. The command turns on
                       /sys/module/fuse/parameters/enable_uring while its
                       queues register, then puts it back. Faster where
                       waking another CPU is dear (VMs): measure with
                       `iomapfs fuse-transport-probe` and the bench's mount
                       rows
  uring_idle           uring, with the queue threads at SCHED_IDLE: a waiting
                       caller is woken on its own CPU (lowest latency at
                       queue depth 1), but on a CPU kept busy by other
                       programs requests made there wait for idle time
  kernel_cache         (default) non-direct opens read through the kernel page
                       cache in front of iomapfs's own; writes update it and reach
                       iomapfs before returning; O_DIRECT opens take the
                       kernel's direct I/O path, which writes cached pages
                       back before and drops them after
  writeback_cache      kernel_cache, and writes stay in the kernel page cache
                       until the kernel writes them back
  direct_io            every open bypasses the kernel page cache; iomapfs
                       keeps direct and buffered opens coherent itself
  ro                   read-only: every change fails with EROFS, TARGET is
                       opened read-only and left unwritten (no checkpoint at
                       unmount; a journal left by a crash is replayed in
                       memory only); fsck may run beside it
  rw                   (default) read-write
  fsname=NAME          the source shown in /proc/mounts (default: TARGET)
  noexec, exec         whether programs on the mount may be executed
                       (default exec); the mount is always nosuid, nodev and
                       noatime (those words are accepted; suid, dev, atime,
                       strictatime and sync are refused)
  default_permissions  always on; accepted for compatibility

mount(8): the mount's type is fuse.iomapfs. Link this binary as its helper,
  ln -s \"$(command -v iomapfs)\" /sbin/mount.fuse.iomapfs
and `mount -t fuse.iomapfs TARGET MOUNTPOINT -o OPTIONS`, fstab lines and
`mount -o remount,ro MOUNTPOINT` (and back with remount,rw) work.

Exit status: 0 mounted (daemon) or unmounted cleanly (--foreground);
1 the mount or the clean unmount failed; 2 bad usage.

Example:
  iomapfs mkfs disk.img --size 1g && mkdir -p /mnt/x
  iomapfs mount disk.img /mnt/x && cp -r /etc /mnt/x/ && umount /mnt/x";

/// Mount a volume as a POSIX file system (FUSE).
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct MountArgs {
    #[arg(help = crate::TARGET_HELP)]
    pub target: Target,
    /// Directory to mount at.
    pub mountpoint: PathBuf,
    /// Mount options (see below).
    #[arg(short = 'o', value_name = "OPTIONS", value_delimiter = ',')]
    pub options: Vec<String>,
    /// Serve in this process until unmounted, instead of as a daemon.
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// The daemon's own invocation: report readiness on stdout, then detach.
    #[arg(long, hide = true)]
    pub daemon_child: bool,
}

/// What the daemon prints on stdout once the mount is live.
const READY: &str = "ready";

fn parse_options(args: &MountArgs) -> Result<MountConfig, Failure> {
    let mut cfg = MountConfig {
        fs_name: args.target.display().to_string(),
        ..MountConfig::default()
    };
    for opt in &args.options {
        cfg.apply_option(opt)
            .map_err(|why| Failure::new(2, format!("mount: {why}")))?;
    }
    Ok(cfg)
}

pub fn run(args: &MountArgs) -> Result<u8, Failure> {
    let cfg = parse_options(args)?;
    if !args.foreground && !args.daemon_child {
        return spawn_daemon(args);
    }
    if args.daemon_child {
        // A session of its own: the terminal's signals and hang-up no
        // longer reach the daemon.
        // SAFETY: setsid has no memory-safety preconditions.
        unsafe { libc::setsid() };
    }
    iomapfs_mount::block_stop_signals().map_err(|e| Failure::new(1, format!("mount: {e}")))?;
    let shown = args.target.display().to_string();
    // Held for the life of the mount: a second mount, `io`, `fsck` or
    // `mkfs` of TARGET is refused meanwhile.
    // A read-only mount shares it with readers (`fsck`) and opens the
    // device read-only: nothing of it can write there.
    let lock = if cfg.read_only {
        TargetLock::Shared
    } else {
        TargetLock::Exclusive
    };
    let _lock = lock_target(&args.target, "mount", lock)?;
    let dev = open_device(&args.target, cfg.read_only)?;
    let vol = mount(dev, &shown)?;
    let daemon = args.daemon_child;
    let mountpoint = args.mountpoint.display().to_string();
    iomapfs_mount::serve(vol, &args.mountpoint, &cfg, move || {
        if daemon {
            println!("{READY}");
            let _ = std::io::stdout().flush();
            detach_stdio();
        } else {
            println!(
                "mounted {shown} at {mountpoint}; unmount with `umount {mountpoint}` or Ctrl-C"
            );
            let _ = std::io::stdout().flush();
        }
    })
    .map_err(|e| Failure::new(1, format!("mount: {e}")))?;
    Ok(0)
}

/// Points stdin, stdout and stderr at /dev/null: the daemon outlives the
/// terminal and the pipes of the command that started it.
fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..=2 {
            // SAFETY: dup2 onto the standard descriptors, from one we own.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

/// Starts this command again as the daemon and waits until it reports the
/// mount live (exit 0) or fails (its error, its exit status).
fn spawn_daemon(args: &MountArgs) -> Result<u8, Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::new(1, format!("mount: finding this program: {e}")))?;
    // Global options (--backend, --cache-size) and this command's, again.
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    // Before a `--` (after it, it would be taken for TARGET).
    let at = argv.iter().position(|a| a == "--").unwrap_or(argv.len());
    argv.insert(at, "--daemon-child".into());
    let mut child = Command::new(exe)
        .args(&argv)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Failure::new(1, format!("mount: starting the daemon: {e}")))?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    let _ = BufReader::new(stdout).read_line(&mut line);
    if line.trim() == READY {
        println!(
            "mounted {} at {} (daemon pid {})",
            args.target.display(),
            args.mountpoint.display(),
            child.id()
        );
        return Ok(0);
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let status = child
        .wait()
        .map_err(|e| Failure::new(1, format!("mount: waiting for the daemon: {e}")))?;
    // The daemon printed its own `iomapfs: ...` error line.
    eprint!("{err}");
    Ok(status.code().map_or(1, |c| c.clamp(1, 255) as u8))
}
