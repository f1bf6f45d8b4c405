//! `iomapfs io`: run xfs_io-style commands against a volume in one process.
//!
//! Syntax and output follow xfs_io(8) where the command exists there
//! (`pwrite`, `pread -v`, `falloc`, `fpunch`, `fiemap`, `stat`, ...), so
//! scripts and habits carry over. Namespace commands (`mkdir`, `ls`, `rm`,
//! `mv`) are additions: the volume is not mounted in the kernel, so there is
//! no shell to create files with.
//!
//! A failed command prints `iomapfs: CMD: FILE at offset N: cause` on
//! standard error and processing continues with the next command, like
//! xfs_io; the exit status is 1 if any command failed.

use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, Instant};

use std::sync::Arc;

use blockdev::{AlignedBuf, BlockDevice, LogWritesDevice};
use clap::Args;
use iomapfs_fs::{Error, FiemapExtent, FiemapKind, File, FileKind, OpenFlags, Volume};

use crate::size::{cvtstr, parse_size, per_second, timestr};
use crate::target::{describe_device, lock_target, open_device, TargetLock};
use crate::{report_error, shell, Failure, Target};

const LONG_ABOUT: &str = "\
Run xfs_io-style commands against the iomapfs volume on TARGET.

The volume is mounted once, every -c command runs in order in this process,
then the volume is unmounted cleanly (a checkpoint is written). With no -c,
commands are read from standard input, one per line.

Commands act on the *current open file*: 'open' a file first (it becomes
current), then read, write, sync, allocate or map it. Each command string is
split into words like a shell would (quotes work). Offsets, lengths and sizes
accept xfs_io's suffixes: k, m, g, t (binary), s (512-byte sectors), b
(file-system blocks), and 0x hex.

File commands (xfs_io syntax and output):
  open [-cfdsDtrx] [PATH]     open PATH, make it current (-c/-f create, -d O_DIRECT,
                              -s O_SYNC, -D O_DSYNC, -t truncate, -r read-only,
                              -x with -c: fail if it exists); no PATH: stat
  close                       close the current file
  file [N]                    list open files / make file N current
  pwrite [-b bs] [-S pattern] [-DwWq] OFF LEN
                              write LEN bytes of a byte pattern (default 0xcd)
                              at OFF in -b sized calls (default 4096); -D: each
                              call is O_DSYNC; -w fdatasync / -W fsync after
  pread [-b bs] [-vq] OFF LEN read LEN bytes at OFF; -v hex dump like xfs_io
  fsync | fdatasync           make the file's data (and metadata) durable
  falloc [-k] OFF LEN         allocate unwritten space; -k keep the size
  fpunch OFF LEN              deallocate; the range reads as zeros
  truncate LEN                set the file size
  stat [PATH]                 inode, size, blocks, extents, device/backend
  fiemap                      extent map: [start..end] in 512-byte units,
                              device block range, length, data/unwritten/hole
Volume commands:
  mkdir PATH | ls [PATH] | rm PATH | mv FROM TO | sync | statfs | help [CMD] | quit
With --record LOG:
  mark NAME                   a named point 'iomapfs replay --mark NAME' stops at";

const AFTER_HELP: &str = "\
Examples:
  iomapfs io disk.img -c 'open -c /a' -c 'pwrite 0 64k' -c 'pread -v 0 32'
  iomapfs io disk.img -c 'open -cd /db' -c 'pwrite -S 0xab -b 1m 0 16m' -c fsync
  iomapfs io disk.img -c 'open -c /f' -c 'pwrite 0 4k' -c 'falloc 4k 8k' \\
                      -c 'fpunch 0 4k' -c fiemap
  iomapfs io disk.img -c 'mkdir /logs' -c 'mv /a /logs/a' -c 'ls /logs'
  printf 'open /a\\nstat\\n' | iomapfs io disk.img

Exit status: 0 every command succeeded; 1 a command failed (each failure is
reported on standard error as it happens) or the volume could not be
mounted; 2 bad command-line usage.";

/// Run xfs_io-style commands (open, pwrite, pread, fsync, falloc, fiemap, ...).
#[derive(Args, Debug)]
#[command(long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct IoArgs {
    #[arg(help = crate::TARGET_HELP)]
    pub target: Target,

    /// A command to run, e.g. -c 'pwrite 0 4k'; repeat for several (they
    /// run in order). Without -c, commands are read from standard input.
    #[arg(short = 'c', long = "command", value_name = "CMD")]
    pub commands: Vec<String>,

    /// Record every device write (with its data), flush and mark of this
    /// session to LOG, for `iomapfs replay` (like dm-log-writes). Marks
    /// say when each file was made durable and with what content, so that
    /// replay can check durability at every flush; `mark NAME` adds one.
    #[arg(long, value_name = "LOG")]
    pub record: Option<std::path::PathBuf>,
}

fn prefix_io(f: Failure) -> Failure {
    Failure::new(f.code, format!("io: {}", f.message))
}

pub fn run(args: &IoArgs) -> Result<u8, Failure> {
    let shown = args.target.display();
    let _lock = lock_target(&args.target, "io", TargetLock::Exclusive)?;
    let dev = open_device(&args.target, false)
        .map_err(|f| Failure::new(1, format!("io: {}", f.message)))?;
    let recorder = match &args.record {
        Some(log) => Some(Arc::new(
            LogWritesDevice::create(dev.clone(), log)
                .map_err(|e| Failure::new(1, format!("io: --record {}: {e}", log.display())))?,
        )),
        None => None,
    };
    let dev: Arc<dyn BlockDevice> = match &recorder {
        Some(r) => r.clone(),
        None => dev,
    };
    let vol = crate::target::mount(dev, &shown.to_string()).map_err(prefix_io)?;
    let mut session = Session::new(vol, recorder);

    if args.commands.is_empty() {
        let stdin = std::io::stdin();
        let interactive = stdin.is_terminal();
        let mut line = String::new();
        let mut input = stdin.lock();
        loop {
            if interactive {
                print!("iomapfs> ");
                let _ = std::io::stdout().flush();
            }
            line.clear();
            match input.read_line(&mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    report_error(&format!("io: reading commands from standard input: {e}"));
                    session.failed = true;
                    break;
                }
            }
            if session.execute(&line) == Flow::Quit {
                break;
            }
        }
    } else {
        for cmd in &args.commands {
            if session.execute(cmd) == Flow::Quit {
                break;
            }
        }
    }

    let failed = session.finish();
    Ok(u8::from(failed))
}

/// Largest buffer a single pread/pwrite call may use (`-b`).
const MAX_IO_BUFFER: u64 = 1 << 30;
/// Memory alignment of I/O buffers (at least the device's requirement).
const IO_BUFFER_ALIGN: usize = 4096;
/// xfs_io's default `-b`.
const DEFAULT_IO_BUFFER: u64 = 4096;
/// xfs_io's default fill pattern (0xcdcdcdcd, one byte of it).
const DEFAULT_PATTERN: u8 = 0xcd;
/// Units of fiemap's and stat's block counts, like xfs_io.
const SECTOR: u64 = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    Quit,
}

struct OpenFile {
    path: String,
    file: File,
    flags: OpenFlags,
}

struct Session {
    vol: Volume,
    files: Vec<OpenFile>,
    current: Option<usize>,
    failed: bool,
    /// File-system block size, for the `b` number suffix.
    block_size: u64,
    /// `--record`: the device wrapper writing the log, for marks.
    recorder: Option<Arc<LogWritesDevice>>,
}

/// A parsed command line: options (in order) and positional arguments.
#[derive(Debug)]
struct Parsed {
    opts: Vec<(char, Option<String>)>,
    args: Vec<String>,
}

impl Parsed {
    fn has(&self, c: char) -> bool {
        self.opts.iter().any(|(o, _)| *o == c)
    }
    fn value(&self, c: char) -> Option<&str> {
        self.opts
            .iter()
            .rev()
            .find(|(o, _)| *o == c)
            .and_then(|(_, v)| v.as_deref())
    }
}

/// getopt(3) with GNU argument permutation: options may come before or after
/// positional arguments, can be grouped (`-vq`), and take values attached
/// (`-b4k`) or separate (`-b 4k`). `--` ends options. `spec` is getopt's
/// option string (`"b:S:Dq"`).
fn getopt(argv: &[String], spec: &str) -> Result<Parsed, String> {
    let mut parsed = Parsed {
        opts: Vec::new(),
        args: Vec::new(),
    };
    let mut only_args = false;
    let mut i = 0;
    while i < argv.len() {
        let arg = &argv[i];
        i += 1;
        if only_args || arg == "-" || !arg.starts_with('-') {
            parsed.args.push(arg.clone());
            continue;
        }
        if arg == "--" {
            only_args = true;
            continue;
        }
        let body: Vec<char> = arg[1..].chars().collect();
        let mut j = 0;
        while j < body.len() {
            let c = body[j];
            let pos = spec
                .char_indices()
                .find(|&(_, s)| s == c && c != ':')
                .map(|(p, _)| p)
                .ok_or_else(|| format!("unknown option -{c}"))?;
            let takes_value = spec[pos + c.len_utf8()..].starts_with(':');
            if takes_value {
                let rest: String = body[j + 1..].iter().collect();
                let value = if !rest.is_empty() {
                    rest
                } else if i < argv.len() {
                    i += 1;
                    argv[i - 1].clone()
                } else {
                    return Err(format!("option -{c} needs a value"));
                };
                parsed.opts.push((c, Some(value)));
                break;
            }
            parsed.opts.push((c, None));
            j += 1;
        }
    }
    Ok(parsed)
}

type Handler = fn(&mut Session, &Spec, &Parsed) -> Result<(), String>;

/// One command: its names, getopt spec, arity, help.
struct Spec {
    name: &'static str,
    alias: Option<&'static str>,
    opts: &'static str,
    min_args: usize,
    max_args: usize,
    usage: &'static str,
    oneline: &'static str,
    help: &'static str,
    run: Handler,
}

static COMMANDS: &[Spec] = &[
    Spec {
        name: "open",
        alias: Some("o"),
        opts: "cfdsDtrx",
        min_args: 0,
        max_args: 1,
        usage: "[-cfdsDtrx] [PATH]",
        oneline: "open a file and make it the current file",
        help: "\
 Opens PATH on the volume; it becomes the current file. Several files can be
 open at once ('file' lists them). Without PATH, shows 'stat' of the current
 file.
 -c, -f  create the file if it does not exist (O_CREAT)
 -x      with -c: fail if it already exists (O_EXCL)
 -d      direct I/O (O_DIRECT): no page cache; any offset and length works,
         whole device blocks at aligned offsets are fastest
 -s      synchronous I/O (O_SYNC): each write is durable when it returns
 -D      data-synchronous I/O (O_DSYNC): each write's data, and the metadata
         needed to read it back, are durable when it returns
 -t      truncate to zero length (O_TRUNC)
 -r      read-only (O_RDONLY)
 Example: open -cd /db",
        run: cmd_open,
    },
    Spec {
        name: "close",
        alias: Some("c"),
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "close the current file",
        help: " Closes the current file; the most recently opened remaining file becomes\n current.",
        run: cmd_close,
    },
    Spec {
        name: "file",
        alias: Some("f"),
        opts: "",
        min_args: 0,
        max_args: 1,
        usage: "[N]",
        oneline: "list open files, or make file N current",
        help: " Lists open files with their number and flags; the current one is in\n brackets. With N, file N becomes current.",
        run: cmd_file,
    },
    Spec {
        name: "pwrite",
        alias: Some("w"),
        opts: "b:S:DqwW",
        min_args: 2,
        max_args: 2,
        usage: "[-b bs] [-S pattern] [-DqwW] off len",
        oneline: "writes a number of bytes at a specified offset",
        help: "\
 Writes LEN bytes at offset OFF of the current file, in calls of at most BS
 bytes, and reports bytes written, calls made and throughput like xfs_io:
   wrote 4096/4096 bytes at offset 0
   4 KiB, 1 ops; 0.0001 sec (30.5 MiB/sec and 7812.5 ops/sec)
 -b bs       bytes per call (default 4096)
 -S pattern  fill byte (default 0xcd; like xfs_io, only the low byte is used)
 -D          O_DSYNC for these writes only: each call is durable when it
             returns. Done by writing through a second handle to the same
             file opened with O_DSYNC (the library has no per-call flag).
 -w          fdatasync once all writes are done (included in the timing)
 -W          fsync once all writes are done (included in the timing)
 -q          quiet: print nothing on success
 Example: pwrite -S 0xab -b 1m 0 16m",
        run: cmd_pwrite,
    },
    Spec {
        name: "pread",
        alias: Some("r"),
        opts: "b:qv",
        min_args: 2,
        max_args: 2,
        usage: "[-b bs] [-qv] off len",
        oneline: "reads a number of bytes at a specified offset",
        help: "\
 Reads LEN bytes at offset OFF of the current file, in calls of at most BS
 bytes; stops early at end of file.
 -b bs  bytes per call (default 4096)
 -v     dump the data read, 16 bytes a line, like xfs_io:
        00000000:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................
 -q     quiet: print nothing on success
 Example: pread -v 0 64",
        run: cmd_pread,
    },
    Spec {
        name: "fsync",
        alias: Some("s"),
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "make the current file's data and metadata durable",
        help: " Returns once every completed write to the file, and all its metadata,\n survive power loss.",
        run: cmd_fsync,
    },
    Spec {
        name: "fdatasync",
        alias: None,
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "make the current file's data durable",
        help: " Like fsync, but metadata is made durable only if needed to read the data\n back (size, allocation).",
        run: cmd_fdatasync,
    },
    Spec {
        name: "falloc",
        alias: None,
        opts: "k",
        min_args: 2,
        max_args: 2,
        usage: "[-k] off len",
        oneline: "allocates space associated with part of a file via fallocate",
        help: "\
 Allocates unwritten space for [OFF, OFF+LEN): it reads as zeros until
 written, and later writes there need no allocation. Raises the file size to
 OFF+LEN unless -k.
 -k  keep the file size (FALLOC_FL_KEEP_SIZE)",
        run: cmd_falloc,
    },
    Spec {
        name: "fpunch",
        alias: None,
        opts: "",
        min_args: 2,
        max_args: 2,
        usage: "off len",
        oneline: "de-allocates space associated with part of a file via fallocate",
        help: " Releases the space of [OFF, OFF+LEN); the range reads as zeros. The size\n does not change.",
        run: cmd_fpunch,
    },
    Spec {
        name: "truncate",
        alias: Some("t"),
        opts: "",
        min_args: 1,
        max_args: 1,
        usage: "len",
        oneline: "truncates the current file at the given offset",
        help: " Sets the file size to LEN bytes, releasing space past it or extending\n with a hole.",
        run: cmd_truncate,
    },
    Spec {
        name: "stat",
        alias: None,
        opts: "v",
        min_args: 0,
        max_args: 1,
        usage: "[PATH]",
        oneline: "statistics on the current file (or PATH)",
        help: "\
 Prints, like xfs_io: fd.path, fd.flags, stat.ino, stat.type, stat.size,
 stat.blocks (512-byte units allocated, written or unwritten), stat.nlink,
 stat.mtime, fsxattr.nextents, then the device and I/O backend. With PATH,
 stats that path without opening it (files or directories).",
        run: cmd_stat,
    },
    Spec {
        name: "fiemap",
        alias: None,
        opts: "v",
        min_args: 0,
        max_args: 0,
        usage: "[-v]",
        oneline: "print block mapping for the current file",
        help: "\
 Prints the current file's map from offset 0 to end of file (and unwritten
 space past it), one range per line, like 'xfs_io -c \"fiemap -v\"':
   EXT  index of the range
   FILE-OFFSET  [start..end] in 512-byte units of the file
   BLOCK-RANGE  start..end in 512-byte units of the device, or 'hole'
   TOTAL  length in 512-byte units
   TYPE  data, unwritten (allocated, reads as zeros) or hole",
        run: cmd_fiemap,
    },
    Spec {
        name: "mkdir",
        alias: None,
        opts: "",
        min_args: 1,
        max_args: 1,
        usage: "PATH",
        oneline: "create a directory",
        help: " Creates directory PATH; its parent must exist.",
        run: cmd_mkdir,
    },
    Spec {
        name: "ls",
        alias: None,
        opts: "",
        min_args: 0,
        max_args: 1,
        usage: "[PATH]",
        oneline: "list a directory (default /)",
        help: " Lists PATH (default /): inode number, type, size in bytes, name\n (directories end in /).",
        run: cmd_ls,
    },
    Spec {
        name: "rm",
        alias: None,
        opts: "",
        min_args: 1,
        max_args: 1,
        usage: "PATH",
        oneline: "remove a file or an empty directory",
        help: " Removes the file or empty directory PATH. An open file's data stays\n readable through open handles until they are closed.",
        run: cmd_rm,
    },
    Spec {
        name: "mv",
        alias: None,
        opts: "",
        min_args: 2,
        max_args: 2,
        usage: "FROM TO",
        oneline: "rename atomically, replacing TO",
        help: " Renames FROM to TO atomically (also across a crash), replacing TO if it\n exists.",
        run: cmd_mv,
    },
    Spec {
        name: "sync",
        alias: None,
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "make every completed change on the volume durable",
        help: " Commits the journal: every completed change on the volume survives power\n loss.",
        run: cmd_sync,
    },
    Spec {
        name: "statfs",
        alias: None,
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "statistics on the volume",
        help: " Prints block size, data area size, free bytes and inode count (bytes),\n then the device and I/O backend.",
        run: cmd_statfs,
    },
    Spec {
        name: "mark",
        alias: None,
        opts: "",
        min_args: 1,
        max_args: 1,
        usage: "NAME",
        oneline: "add a named mark to the --record log",
        help: "\
 With --record LOG, adds a mark named NAME to the log: 'iomapfs replay LOG
 TARGET --mark NAME' rebuilds the device as it was at this point. Names
 starting with 'iomapfs:' are reserved for the marks the session writes
 itself (when each file was made durable, and with what).",
        run: cmd_mark,
    },
    Spec {
        name: "help",
        alias: Some("?"),
        opts: "",
        min_args: 0,
        max_args: 1,
        usage: "[command]",
        oneline: "help for one or all commands",
        help: " Without an argument lists all commands; with one, explains it.",
        run: cmd_help,
    },
    Spec {
        name: "quit",
        alias: Some("q"),
        opts: "",
        min_args: 0,
        max_args: 0,
        usage: "",
        oneline: "exit (the volume is unmounted cleanly)",
        help: " Stops processing commands; the volume is unmounted cleanly.",
        run: cmd_quit,
    },
];

fn find_command(name: &str) -> Option<&'static Spec> {
    COMMANDS
        .iter()
        .find(|s| s.name == name || s.alias == Some(name))
}

impl Session {
    fn new(vol: Volume, recorder: Option<Arc<LogWritesDevice>>) -> Session {
        let block_size = u64::from(vol.statfs().block_size.max(1));
        Session {
            block_size,
            vol,
            files: Vec::new(),
            current: None,
            failed: false,
            recorder,
        }
    }

    /// Writes mark `name` to the recording, if any.
    fn record_mark(&mut self, name: &str) {
        let Some(r) = &self.recorder else {
            return;
        };
        if let Err(e) = r.mark(name) {
            self.fail(&format!("record: {e}"));
        }
    }

    /// Paths a command may change (recorded as `changing` before it runs).
    fn paths_changed_by(&self, spec: &Spec, p: &Parsed) -> Vec<String> {
        let current = || {
            self.current
                .and_then(|i| self.files.get(i))
                .map(|f| f.path.clone())
        };
        match spec.name {
            "pwrite" | "truncate" | "falloc" | "fpunch" => current().into_iter().collect(),
            "open" if p.has('t') || p.has('c') || p.has('f') => {
                p.args.iter().map(|a| volume_path(a)).collect()
            }
            "rm" | "mv" => p.args.iter().map(|a| volume_path(a)).collect(),
            _ => Vec::new(),
        }
    }

    /// Paths a command that returned made durable (recorded as `synced`).
    fn paths_synced_by(&self, spec: &Spec, p: &Parsed) -> Vec<String> {
        let current = self.current.and_then(|i| self.files.get(i));
        match spec.name {
            "fsync" | "fdatasync" => current.map(|f| f.path.clone()).into_iter().collect(),
            "pwrite"
                if p.has('D')
                    || p.has('w')
                    || p.has('W')
                    || current.is_some_and(|f| f.flags.dsync || f.flags.sync) =>
            {
                current.map(|f| f.path.clone()).into_iter().collect()
            }
            "sync" => {
                let mut paths: Vec<String> = self.files.iter().map(|f| f.path.clone()).collect();
                paths.sort();
                paths.dedup();
                paths
            }
            _ => Vec::new(),
        }
    }

    /// Records what the file at `path` holds now, as durable.
    fn record_synced(&mut self, path: &str) {
        match crate::replay::read_whole(&self.vol, path) {
            Ok(data) => self.record_mark(&crate::replay::synced_mark(path, &data)),
            Err(e) => self.fail(&format!(
                "record: reading {path} back for its synced mark: {e}"
            )),
        }
    }

    /// Runs one command line; reports its error, if any, and remembers the
    /// failure for the exit status.
    fn execute(&mut self, line: &str) -> Flow {
        let words = match shell::split(line) {
            Ok(words) => words,
            Err(e) => {
                self.fail(&format!("cannot parse command {:?}: {e}", line.trim()));
                return Flow::Continue;
            }
        };
        let Some((name, argv)) = words.split_first() else {
            return Flow::Continue;
        };
        if name.starts_with('#') {
            return Flow::Continue;
        }
        let Some(spec) = find_command(name) else {
            self.fail(&format!("{name}: unknown command (try 'help')"));
            return Flow::Continue;
        };
        let usage_hint = || format!("usage: {} {}", spec.name, spec.usage);
        let parsed = match getopt(argv, spec.opts) {
            Ok(p) => p,
            Err(e) => {
                self.fail(&format!("{}: {e}; {}", spec.name, usage_hint()));
                return Flow::Continue;
            }
        };
        let n = parsed.args.len();
        if n < spec.min_args || n > spec.max_args {
            let expected = if spec.min_args == spec.max_args {
                format!("{}", spec.min_args)
            } else {
                format!("{} to {}", spec.min_args, spec.max_args)
            };
            self.fail(&format!(
                "{}: expected {expected} argument(s), got {n}; {}",
                spec.name,
                usage_hint()
            ));
            return Flow::Continue;
        }
        if spec.name == "quit" {
            return Flow::Quit;
        }
        let recording = self.recorder.is_some();
        if recording {
            for path in self.paths_changed_by(spec, &parsed) {
                self.record_mark(&crate::replay::changing_mark(&path));
            }
        }
        match (spec.run)(self, spec, &parsed) {
            Err(e) => self.fail(&e),
            Ok(()) if recording => {
                for path in self.paths_synced_by(spec, &parsed) {
                    self.record_synced(&path);
                }
            }
            Ok(()) => {}
        }
        Flow::Continue
    }

    fn fail(&mut self, message: &str) {
        self.failed = true;
        report_error(message);
    }

    /// Closes every file and unmounts. Returns whether anything failed.
    fn finish(mut self) -> bool {
        self.files.clear();
        self.current = None;
        if let Err(e) = self.vol.unmount() {
            report_error(&format!("unmount: {e}"));
            self.failed = true;
        }
        if let Some(r) = self.recorder.take() {
            if let Err(e) = r.flush_log() {
                report_error(&format!("record: {e}"));
                self.failed = true;
            }
        }
        self.failed
    }

    fn current(&self, cmd: &str) -> Result<&OpenFile, String> {
        self.current.and_then(|i| self.files.get(i)).ok_or_else(|| {
            format!("{cmd}: no file is open; open one first with 'open -c PATH' (see 'help open')")
        })
    }

    fn number(&self, cmd: &str, what: &str, text: &str) -> Result<u64, String> {
        parse_size(text, self.block_size).map_err(|e| format!("{cmd}: bad {what}: {e}"))
    }
}

/// Paths on the volume are absolute; a relative one is taken from the root.
fn volume_path(p: &str) -> String {
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!("/{p}")
    }
}

/// `CMD: cause`, naming `path` unless the cause already does.
fn ns_error(cmd: &str, path: &str, e: &Error) -> String {
    let cause = e.to_string();
    if cause.contains(path) {
        format!("{cmd}: {cause}")
    } else {
        format!("{cmd}: {path}: {cause}")
    }
}

/// `CMD: PATH CONTEXT: cause`, where CONTEXT is e.g. ` at offset 4096`;
/// when the library's message already names the file (and so says where),
/// just `CMD: cause`.
fn file_error(cmd: &str, path: &str, context: &str, e: &Error) -> String {
    let cause = e.to_string();
    if cause.contains(path) {
        format!("{cmd}: {cause}")
    } else {
        format!("{cmd}: {path}{context}: {cause}")
    }
}

fn flag_words(f: &OpenFlags) -> String {
    let sync = if f.sync {
        "sync"
    } else if f.dsync {
        "dsync"
    } else {
        "non-sync"
    };
    let direct = if f.direct { "direct" } else { "non-direct" };
    let rw = if f.read_only {
        "read-only"
    } else {
        "read-write"
    };
    format!("{sync},{direct},{rw}")
}

fn kind_name(k: FileKind) -> &'static str {
    match k {
        FileKind::Regular => "regular file",
        FileKind::Directory => "directory",
        FileKind::Symlink => "symbolic link",
        FileKind::Fifo => "fifo",
        FileKind::Socket => "socket",
        FileKind::CharDevice => "character device",
        FileKind::BlockDevice => "block device",
    }
}

fn off_len(s: &Session, cmd: &str, p: &Parsed) -> Result<(u64, u64), String> {
    let off = s.number(cmd, "offset", &p.args[0])?;
    let len = s.number(cmd, "length", &p.args[1])?;
    if off.checked_add(len).is_none() {
        return Err(format!("{cmd}: offset {off} + length {len} overflows"));
    }
    Ok((off, len))
}

fn print_io_report(verb: &str, elapsed: Duration, offset: u64, count: u64, total: u64, ops: u64) {
    println!("{verb} {total}/{count} bytes at offset {offset}");
    println!(
        "{}, {ops} ops; {} ({}/sec and {:.4} ops/sec)",
        cvtstr(total as f64),
        timestr(elapsed),
        cvtstr(per_second(total as f64, elapsed)),
        per_second(ops as f64, elapsed)
    );
}

/// xfs_io's `dump_buffer`: offset, 16 hex bytes, then the alphanumeric
/// characters (others as '.').
fn dump_buffer(offset: u64, data: &[u8]) {
    let mut out = String::new();
    for (i, chunk) in data.chunks(16).enumerate() {
        out.clear();
        out.push_str(&format!("{:08x}:  ", offset + (i as u64) * 16));
        for b in chunk {
            out.push_str(&format!("{b:02x} "));
        }
        out.push(' ');
        for &b in chunk {
            out.push(if b.is_ascii_alphanumeric() {
                b as char
            } else {
                '.'
            });
        }
        println!("{out}");
    }
}

fn io_buffer_size(s: &Session, cmd: &str, p: &Parsed) -> Result<u64, String> {
    let bsize = match p.value('b') {
        Some(v) => s.number(cmd, "block size (-b)", v)?,
        None => DEFAULT_IO_BUFFER,
    };
    if bsize == 0 || bsize > MAX_IO_BUFFER {
        return Err(format!(
            "{cmd}: -b {bsize}: must be from 1 byte to {} bytes",
            MAX_IO_BUFFER
        ));
    }
    Ok(bsize)
}

/// A buffer aligned for O_DIRECT, like xfs_io's memalign'd buffer, so
/// direct I/O goes straight to the device without a bounce copy.
fn io_buffer(s: &Session, cmd: &str, len: u64) -> Result<AlignedBuf, String> {
    let align = (s.vol.device().caps().memory_alignment as usize).max(IO_BUFFER_ALIGN);
    AlignedBuf::new(len as usize, align).map_err(|e| format!("{cmd}: {e}"))
}

fn cmd_open(s: &mut Session, _spec: &Spec, p: &Parsed) -> Result<(), String> {
    let Some(arg) = p.args.first() else {
        return cmd_stat(s, _spec, p);
    };
    let path = volume_path(arg);
    let flags = OpenFlags {
        create: p.has('c') || p.has('f'),
        exclusive: p.has('x'),
        truncate: p.has('t'),
        direct: p.has('d'),
        dsync: p.has('D') || p.has('s'),
        sync: p.has('s'),
        read_only: p.has('r'),
    };
    if flags.exclusive && !flags.create {
        return Err("open: -x (exclusive) needs -c (create)".to_string());
    }
    let file = s
        .vol
        .open_file(&path, flags)
        .map_err(|e| ns_error("open", &path, &e))?;
    s.files.push(OpenFile { path, file, flags });
    s.current = Some(s.files.len() - 1);
    Ok(())
}

fn cmd_close(s: &mut Session, _spec: &Spec, _p: &Parsed) -> Result<(), String> {
    let idx = s
        .current
        .ok_or_else(|| "close: no file is open".to_string())?;
    s.files.remove(idx);
    s.current = s.files.len().checked_sub(1);
    Ok(())
}

fn cmd_file(s: &mut Session, _spec: &Spec, p: &Parsed) -> Result<(), String> {
    if let Some(n) = p.args.first() {
        let idx: usize = n
            .parse()
            .map_err(|_| format!("file: '{n}' is not a file number (see 'file')"))?;
        if idx >= s.files.len() {
            return Err(format!(
                "file: no open file number {idx} ({} open)",
                s.files.len()
            ));
        }
        s.current = Some(idx);
    }
    for (i, f) in s.files.iter().enumerate() {
        let (l, r) = if Some(i) == s.current {
            ('[', ']')
        } else {
            (' ', ' ')
        };
        println!("{l}{i:03}{r} {:<14} ({})", f.path, flag_words(&f.flags));
    }
    Ok(())
}

fn cmd_pwrite(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let cmd = spec.name;
    let bsize = io_buffer_size(s, cmd, p)?;
    let pattern = match p.value('S') {
        Some(v) => (s.number(cmd, "pattern (-S)", v)? & 0xff) as u8,
        None => DEFAULT_PATTERN,
    };
    let (offset, count) = off_len(s, cmd, p)?;
    let of = s.current(cmd)?;
    if of.flags.read_only {
        return Err(format!("{cmd}: {}: file is open read-only", of.path));
    }

    // Per-call O_DSYNC: a second handle to the same inode opened with dsync.
    let dsync_handle;
    let file: &File = if p.has('D') {
        let flags = OpenFlags {
            dsync: true,
            create: false,
            exclusive: false,
            truncate: false,
            ..of.flags
        };
        let h = s
            .vol
            .open_file(&of.path, flags)
            .map_err(|e| format!("{cmd} -D: {}: reopening with O_DSYNC: {e}", of.path))?;
        if h.ino() != of.file.ino() {
            return Err(format!(
                "{cmd} -D: {} now names another file (renamed or replaced since it \
                 was opened); open it again",
                of.path
            ));
        }
        dsync_handle = h;
        &dsync_handle
    } else {
        &of.file
    };

    let mut buf = io_buffer(s, cmd, bsize.min(count))?;
    buf.fill(pattern);
    let start = Instant::now();
    let (mut pos, mut total, mut ops) = (offset, 0u64, 0u64);
    while total < count {
        let n = (count - total).min(bsize) as usize;
        let written = file
            .pwrite(&buf[..n], pos)
            .map_err(|e| file_error(cmd, &of.path, &format!(" at offset {pos}"), &e))?;
        if written == 0 {
            return Err(format!(
                "{cmd}: {} at offset {pos}: write made no progress",
                of.path
            ));
        }
        total += written as u64;
        pos += written as u64;
        ops += 1;
    }
    if p.has('w') {
        of.file
            .fdatasync()
            .map_err(|e| file_error(&format!("{cmd} -w: fdatasync"), &of.path, "", &e))?;
    }
    if p.has('W') {
        of.file
            .fsync()
            .map_err(|e| file_error(&format!("{cmd} -W: fsync"), &of.path, "", &e))?;
    }
    let elapsed = start.elapsed();
    if !p.has('q') {
        print_io_report("wrote", elapsed, offset, count, total, ops);
    }
    Ok(())
}

fn cmd_pread(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let cmd = spec.name;
    let bsize = io_buffer_size(s, cmd, p)?;
    let (offset, count) = off_len(s, cmd, p)?;
    let of = s.current(cmd)?;
    let mut buf = io_buffer(s, cmd, bsize.min(count))?;
    let verbose = p.has('v') && !p.has('q');
    let start = Instant::now();
    let (mut pos, mut total, mut ops) = (offset, 0u64, 0u64);
    while total < count {
        let n = (count - total).min(bsize) as usize;
        let got = of
            .file
            .pread(&mut buf[..n], pos)
            .map_err(|e| file_error(cmd, &of.path, &format!(" at offset {pos}"), &e))?;
        if got == 0 {
            break; // end of file
        }
        if verbose {
            dump_buffer(pos, &buf[..got]);
        }
        total += got as u64;
        pos += got as u64;
        ops += 1;
        if got < n {
            break;
        }
    }
    let elapsed = start.elapsed();
    if !p.has('q') {
        print_io_report("read", elapsed, offset, count, total, ops);
    }
    Ok(())
}

fn cmd_fsync(s: &mut Session, spec: &Spec, _p: &Parsed) -> Result<(), String> {
    let of = s.current(spec.name)?;
    of.file
        .fsync()
        .map_err(|e| file_error(spec.name, &of.path, "", &e))
}

fn cmd_fdatasync(s: &mut Session, spec: &Spec, _p: &Parsed) -> Result<(), String> {
    let of = s.current(spec.name)?;
    of.file
        .fdatasync()
        .map_err(|e| file_error(spec.name, &of.path, "", &e))
}

fn cmd_falloc(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let (off, len) = off_len(s, spec.name, p)?;
    let of = s.current(spec.name)?;
    of.file.fallocate(off, len, p.has('k')).map_err(|e| {
        file_error(
            spec.name,
            &of.path,
            &format!(" at offset {off} length {len}"),
            &e,
        )
    })
}

fn cmd_fpunch(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let (off, len) = off_len(s, spec.name, p)?;
    let of = s.current(spec.name)?;
    of.file.punch_hole(off, len).map_err(|e| {
        file_error(
            spec.name,
            &of.path,
            &format!(" at offset {off} length {len}"),
            &e,
        )
    })
}

fn cmd_truncate(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let size = s.number(spec.name, "length", &p.args[0])?;
    let of = s.current(spec.name)?;
    of.file
        .truncate(size)
        .map_err(|e| file_error(spec.name, &of.path, &format!(" to {size} bytes"), &e))
}

fn print_stat(st: &iomapfs_fs::Stat) {
    println!("stat.ino = {}", st.ino);
    println!("stat.type = {}", kind_name(st.kind));
    println!("stat.size = {}", st.size);
    println!("stat.blocks = {}", st.allocated_bytes.div_ceil(SECTOR));
    println!("stat.nlink = {}", st.nlink);
    println!("stat.mode = {:#o}", st.st_mode());
    println!("stat.uid = {}", st.uid);
    println!("stat.gid = {}", st.gid);
    println!("stat.blksize = {}", st.block_size);
    for (name, t) in [
        ("atime", st.atime),
        ("mtime", st.mtime),
        ("ctime", st.ctime),
    ] {
        println!("stat.{name} = {}.{:09}", t.sec, t.nsec);
    }
    println!("fsxattr.nextents = {}", st.extents);
}

fn cmd_stat(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let cmd = spec.name;
    if let Some(arg) = p.args.first() {
        let path = volume_path(arg);
        let st = s.vol.stat(&path).map_err(|e| ns_error(cmd, &path, &e))?;
        println!("path = \"{path}\"");
        print_stat(&st);
    } else {
        let of = s.current(cmd)?;
        let st = of
            .file
            .stat()
            .map_err(|e| file_error(cmd, &of.path, "", &e))?;
        println!("fd.path = \"{}\"", of.path);
        println!("fd.flags = {}", flag_words(&of.flags));
        print_stat(&st);
    }
    println!("dev.backend = {}", describe_device(s.vol.device().as_ref()));
    Ok(())
}

/// Ranges `fiemap` asks for and prints at a time: a map of millions of
/// extents is printed as it is read, never held whole.
const FIEMAP_PART: usize = 4096;

fn cmd_fiemap(s: &mut Session, spec: &Spec, _p: &Parsed) -> Result<(), String> {
    let of = s.current(spec.name)?;
    let fail = |e: &iomapfs_fs::Error| file_error(spec.name, &of.path, "", e);
    let mut parts = of.file.fiemap_parts(FIEMAP_PART).peekable();
    if let Some(Err(e)) = parts.next_if(Result::is_err) {
        return Err(fail(&e));
    }
    println!("{}:", of.path);
    if parts.peek().is_none() {
        return Ok(());
    }
    // Columns as wide as the numbers the file's size and the device give,
    // so that every part lines up without the whole map in memory
    // (unwritten space kept past EOF can reach further: its rows then
    // stand out to the right).
    let size = of.file.stat().map_err(|e| fail(&e))?.size;
    let device = s.vol.device().caps().size_bytes;
    let (file_sectors, device_sectors) = (size.max(device) / SECTOR, device / SECTOR);
    let w0 = format!("[{file_sectors}..{file_sectors}]:").len().max(16);
    let w1 = format!("{device_sectors}..{device_sectors}").len().max(16);
    let w2 = file_sectors.to_string().len().max(5);
    println!(
        "{:>5} {:<w0$} {:<w1$} {:>w2$} TYPE",
        "EXT:", "FILE-OFFSET", "BLOCK-RANGE", "TOTAL"
    );
    let mut index = 0;
    for part in parts {
        for r in part.map_err(|e| fail(&e))?.iter().map(fiemap_row) {
            println!(
                "{:>4}: {:<w0$} {:<w1$} {:>w2$} {}",
                index, r[0], r[1], r[2], r[3]
            );
            index += 1;
        }
    }
    Ok(())
}

/// One range of a map as `fiemap` prints it: file sectors, device
/// sectors (or "hole"), sector count, kind.
fn fiemap_row(x: &FiemapExtent) -> [String; 4] {
    let start = x.offset / SECTOR;
    let sectors = x.length.div_ceil(SECTOR);
    let last = start + sectors.saturating_sub(1);
    let (range, kind) = match x.kind {
        FiemapKind::Hole => ("hole".to_string(), "hole"),
        k => {
            let a = x.addr / SECTOR;
            let kind = if k == FiemapKind::Data {
                "data"
            } else {
                "unwritten"
            };
            (format!("{a}..{}", a + sectors.saturating_sub(1)), kind)
        }
    };
    [
        format!("[{start}..{last}]:"),
        range,
        sectors.to_string(),
        kind.to_string(),
    ]
}

fn cmd_mkdir(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let path = volume_path(&p.args[0]);
    s.vol
        .mkdir(&path)
        .map_err(|e| ns_error(spec.name, &path, &e))
}

fn cmd_ls(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let cmd = spec.name;
    let path = p
        .args
        .first()
        .map(|a| volume_path(a))
        .unwrap_or_else(|| "/".to_string());
    let st = s.vol.stat(&path).map_err(|e| ns_error(cmd, &path, &e))?;
    let line = |ino: u64, kind: FileKind, size: Option<u64>, name: &str| {
        let size = size.map_or_else(|| "?".to_string(), |n| n.to_string());
        let (k, slash) = match kind {
            FileKind::Directory => ("dir", "/"),
            FileKind::Regular => ("file", ""),
            FileKind::Symlink => ("link", "@"),
            _ => ("node", ""),
        };
        println!("{ino:>8}  {k:<4} {size:>12}  {name}{slash}");
    };
    if st.kind == FileKind::Regular {
        line(st.ino, st.kind, Some(st.size), &path);
        return Ok(());
    }
    let mut entries = s.vol.readdir(&path).map_err(|e| ns_error(cmd, &path, &e))?;
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    for e in entries {
        let child = if path.ends_with('/') {
            format!("{path}{}", e.name)
        } else {
            format!("{path}/{}", e.name)
        };
        let size = s.vol.stat(&child).ok().map(|st| st.size);
        line(e.ino, e.kind, size, &e.name);
    }
    Ok(())
}

fn cmd_rm(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let path = volume_path(&p.args[0]);
    if path == "/" {
        return Err(format!("{}: cannot remove the root directory", spec.name));
    }
    let st = s
        .vol
        .stat(&path)
        .map_err(|e| ns_error(spec.name, &path, &e))?;
    let result = match st.kind {
        FileKind::Directory => s.vol.rmdir(&path),
        _ => s.vol.unlink(&path),
    };
    result.map_err(|e| ns_error(spec.name, &path, &e))
}

fn cmd_mv(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let from = volume_path(&p.args[0]);
    let to = volume_path(&p.args[1]);
    s.vol
        .rename(&from, &to)
        .map_err(|e| ns_error(spec.name, &format!("{from} -> {to}"), &e))?;
    // Keep the names of open files current, for messages and 'pwrite -D'.
    for f in &mut s.files {
        if f.path == from {
            f.path = to.clone();
        }
    }
    Ok(())
}

fn cmd_mark(s: &mut Session, spec: &Spec, p: &Parsed) -> Result<(), String> {
    let name = &p.args[0];
    let Some(r) = &s.recorder else {
        return Err(format!(
            "{}: not recording (start with --record LOG)",
            spec.name
        ));
    };
    if name.starts_with(crate::replay::MARK_PREFIX) {
        return Err(format!(
            "{}: names starting with {:?} are reserved",
            spec.name,
            crate::replay::MARK_PREFIX
        ));
    }
    r.mark(name).map_err(|e| format!("{}: {e}", spec.name))
}

fn cmd_sync(s: &mut Session, spec: &Spec, _p: &Parsed) -> Result<(), String> {
    s.vol.sync().map_err(|e| format!("{}: {e}", spec.name))
}

fn cmd_statfs(s: &mut Session, _spec: &Spec, _p: &Parsed) -> Result<(), String> {
    let sfs = s.vol.statfs();
    println!("statfs.block_size = {}", sfs.block_size);
    println!("statfs.data_bytes = {}", sfs.data_bytes);
    println!("statfs.free_bytes = {}", sfs.free_bytes);
    println!(
        "statfs.used_bytes = {}",
        sfs.data_bytes.saturating_sub(sfs.free_bytes)
    );
    println!("statfs.inodes = {}", sfs.inodes);
    println!("dev.backend = {}", describe_device(s.vol.device().as_ref()));
    Ok(())
}

fn cmd_help(_s: &mut Session, _spec: &Spec, p: &Parsed) -> Result<(), String> {
    let line = |c: &Spec| {
        let alias = c.alias.map(|a| format!(" ({a})")).unwrap_or_default();
        let usage = if c.usage.is_empty() {
            String::new()
        } else {
            format!(" {}", c.usage)
        };
        println!("{}{usage}{alias} -- {}", c.name, c.oneline);
    };
    match p.args.first() {
        Some(name) => {
            let c = find_command(name)
                .ok_or_else(|| format!("help: {name}: unknown command (try 'help')"))?;
            line(c);
            println!();
            println!("{}", c.help);
        }
        None => {
            for c in COMMANDS {
                line(c);
            }
            println!();
            println!("Use 'help commandname' for extended help.");
        }
    }
    Ok(())
}

fn cmd_quit(_s: &mut Session, _spec: &Spec, _p: &Parsed) -> Result<(), String> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn getopt_like_glibc() {
        let p = getopt(&args(&["-S", "0xab", "-b4k", "0", "4k", "-q"]), "b:S:DqwW").unwrap();
        assert_eq!(p.value('S'), Some("0xab"));
        assert_eq!(p.value('b'), Some("4k"));
        assert!(p.has('q'));
        assert!(!p.has('D'));
        assert_eq!(p.args, ["0", "4k"]);

        let p = getopt(&args(&["-cd", "/a"]), "cfdsDtrx").unwrap();
        assert!(p.has('c') && p.has('d'));
        assert_eq!(p.args, ["/a"]);

        let p = getopt(&args(&["--", "-x"]), "v").unwrap();
        assert_eq!(p.args, ["-x"]);

        assert!(getopt(&args(&["-z"]), "v")
            .unwrap_err()
            .contains("unknown option -z"));
        assert!(getopt(&args(&["-b"]), "b:")
            .unwrap_err()
            .contains("needs a value"));
        assert!(getopt(&args(&["-:"]), "b:").is_err());
    }

    #[test]
    fn every_command_is_findable_and_documented() {
        for c in COMMANDS {
            assert!(std::ptr::eq(find_command(c.name).unwrap(), c));
            if let Some(a) = c.alias {
                assert!(std::ptr::eq(find_command(a).unwrap(), c), "{a}");
            }
            assert!(!c.oneline.is_empty() && !c.help.is_empty(), "{}", c.name);
            assert!(c.min_args <= c.max_args);
        }
        assert!(find_command("nonsense").is_none());
    }

    #[test]
    fn paths() {
        assert_eq!(volume_path("a"), "/a");
        assert_eq!(volume_path("/a/b"), "/a/b");
    }
}
