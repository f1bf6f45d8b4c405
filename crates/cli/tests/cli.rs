//! End-to-end tests of the `iomapfs` binary on small image files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tempfile::TempDir;

const IMAGE_SIZE: &str = "16m";

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn iomapfs<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(env!("CARGO_BIN_EXE_iomapfs"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("run iomapfs");
    finish(out)
}

fn finish(out: Output) -> Run {
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    // Whatever happened, never a panic.
    assert!(
        !run.stderr.contains("panicked") && !run.stderr.contains("internal error"),
        "iomapfs panicked:\n{}",
        run.stderr
    );
    run
}

/// `io TARGET -c C1 -c C2 ...`
fn io(image: &Path, cmds: &[&str]) -> Run {
    let mut args: Vec<String> = vec!["io".into(), image.display().to_string()];
    for c in cmds {
        args.push("-c".into());
        args.push((*c).into());
    }
    iomapfs(args)
}

fn scratch() -> TempDir {
    tempfile::Builder::new()
        .prefix("iomapfs-cli-test.")
        .tempdir()
        .unwrap()
}

/// A freshly formatted 16 MiB image.
fn formatted(dir: &TempDir) -> PathBuf {
    let image = dir.path().join("vol.img");
    let r = iomapfs(["mkfs", image.to_str().unwrap(), "--size", IMAGE_SIZE]);
    assert_eq!(r.code, 0, "mkfs failed:\n{}{}", r.stdout, r.stderr);
    image
}

fn assert_ok(r: &Run, what: &str) {
    assert_eq!(
        r.code, 0,
        "{what} failed (exit {}):\nstdout:\n{}\nstderr:\n{}",
        r.code, r.stdout, r.stderr
    );
}

/// Every error line is `iomapfs: ...`.
fn assert_error_lines(r: &Run) {
    for line in r.stderr.lines().filter(|l| !l.trim().is_empty()) {
        assert!(line.starts_with("iomapfs: "), "stray stderr line: {line:?}");
    }
}

/// The second line of an xfs_io report: `4 KiB, 1 ops; 0.0001 sec (... /sec and ... ops/sec)`.
fn is_rate_line(line: &str, size: &str, ops: u64) -> bool {
    let Some(rest) = line.strip_prefix(&format!("{size}, {ops} ops; ")) else {
        return false;
    };
    // "0.0001 sec (" under a second, "0:00:01.23 (" above.
    let timed = rest.starts_with("0.") && rest.contains(" sec (") || rest.contains(':');
    timed && rest.contains("/sec and ") && rest.ends_with(" ops/sec)")
}

// ---------------------------------------------------------------- help and usage

#[test]
fn help_answers_without_the_readme() {
    for sub in [
        vec!["--help"],
        vec!["mkfs", "--help"],
        vec!["fsck", "--help"],
        vec!["io", "--help"],
        vec!["demo", "--help"],
    ] {
        let r = iomapfs(&sub);
        assert_ok(&r, &format!("{sub:?}"));
        assert!(
            r.stdout.contains("Example"),
            "{sub:?} has no examples:\n{}",
            r.stdout
        );
        assert!(
            r.stdout.contains("Exit status"),
            "{sub:?} has no exit status:\n{}",
            r.stdout
        );
    }
    let r = iomapfs(["io", "--help"]);
    for cmd in [
        "pwrite", "pread", "falloc", "fpunch", "fiemap", "truncate", "mkdir", "statfs",
    ] {
        assert!(r.stdout.contains(cmd), "io --help does not mention {cmd}");
    }
}

#[test]
fn bad_arguments_give_clear_errors() {
    let dir = scratch();
    let missing = dir.path().join("missing.img");
    let missing = missing.to_str().unwrap();

    // clap usage errors: exit 2.
    let r = iomapfs(["mkfs"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("TARGET"), "{}", r.stderr);
    let r = iomapfs(["mkfs", missing, "--size", "12q"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("suffix"), "{}", r.stderr);
    let r = iomapfs(["mkfs", missing, "--size", "lots"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not a number"), "{}", r.stderr);
    let r = iomapfs(["frobnicate"]);
    assert_eq!(r.code, 2);

    // Our own refusals: exit 1, one clear line.
    let r = iomapfs(["mkfs", missing]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("iomapfs: mkfs: "), "{}", r.stderr);
    assert!(r.stderr.contains("--size"), "{}", r.stderr);
    assert!(!Path::new(missing).exists());
    let r = iomapfs(["mkfs", missing, "--size", "16m", "--block-size", "3000"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("power of two"), "{}", r.stderr);
    assert!(
        !Path::new(missing).exists(),
        "a refused mkfs left an image behind"
    );

    // fsck of something unreadable: exit 2.
    let r = iomapfs(["fsck", missing]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.starts_with("iomapfs: fsck: "), "{}", r.stderr);
    assert!(r.stderr.contains("missing.img"), "{}", r.stderr);

    let r = io(Path::new(missing), &["stat"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("iomapfs: io: "), "{}", r.stderr);

    let r = iomapfs(["demo", "--size", "1m"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("at least"), "{}", r.stderr);
}

// ---------------------------------------------------------------- mkfs

fn image_with(dir: &TempDir, name: &str, offset: usize, magic: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    let mut bytes = vec![0u8; 1 << 20];
    bytes[offset..offset + magic.len()].copy_from_slice(magic);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn mkfs_refuses_foreign_file_systems_and_partition_tables() {
    let dir = scratch();
    for (name, offset, magic, what) in [
        ("xfs.img", 0, &b"XFSB"[..], "XFS"),
        ("ext4.img", 1080, &[0x53, 0xEF][..], "ext2/ext3/ext4"),
        ("mbr.img", 510, &[0x55, 0xAA][..], "MBR"),
        ("gpt.img", 512, &b"EFI PART"[..], "GPT"),
        ("iomapfs.img", 0, &b"IOMAPFS1"[..], "iomapfs"),
    ] {
        let img = image_with(&dir, name, offset, magic);
        let before = std::fs::read(&img).unwrap();
        let r = iomapfs(["mkfs", img.to_str().unwrap()]);
        assert_eq!(r.code, 1, "{name}: {}", r.stderr);
        assert!(r.stderr.contains(what), "{name}: {}", r.stderr);
        assert!(r.stderr.contains("--force"), "{name}: {}", r.stderr);
        assert_error_lines(&r);
        assert_eq!(std::fs::read(&img).unwrap(), before, "{name} was modified");
    }
}

#[test]
fn mkfs_resizes_an_existing_image_only_with_force() {
    let dir = scratch();
    let img = dir.path().join("plain.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let r = iomapfs(["mkfs", img.to_str().unwrap(), "--size", "16m"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("--force"), "{}", r.stderr);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 1 << 20);
}

#[test]
fn mkfs_refuses_an_existing_volume_without_force() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = iomapfs(["mkfs", img.to_str().unwrap()]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("already holds an iomapfs volume"),
        "{}",
        r.stderr
    );
    let r = iomapfs(["mkfs", img.to_str().unwrap(), "--force"]);
    assert_ok(&r, "mkfs --force");
}

#[test]
fn mkfs_prints_a_summary() {
    let dir = scratch();
    let img = dir.path().join("s.img");
    let r = iomapfs([
        "mkfs",
        img.to_str().unwrap(),
        "--size",
        "0x1000000",
        "--block-size",
        "4k",
        "--journal-size",
        "256k",
    ]);
    assert_ok(&r, "mkfs");
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 16 << 20);
    for want in [
        "formatted",
        "16 MiB",
        "block size    4096",
        "journal",
        "checkpoint0",
        "data area",
    ] {
        assert!(
            r.stdout.contains(want),
            "summary lacks {want:?}:\n{}",
            r.stdout
        );
    }
}

// ---------------------------------------------------------------- io

#[test]
fn io_pwrite_pread_round_trip() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = io(
        &img,
        &[
            "open -c /a",
            "pwrite 0 4k",
            "pwrite -S 0xab 4096 4096",
            "pread -v 4090 16",
            "pread -b 4k 0 8k",
            "fsync",
        ],
    );
    assert_ok(&r, "io");
    let lines: Vec<&str> = r.stdout.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| *l == needle)
            .unwrap_or_else(|| panic!("no line {needle:?} in:\n{}", r.stdout))
    };
    let w0 = at("wrote 4096/4096 bytes at offset 0");
    assert!(is_rate_line(lines[w0 + 1], "4 KiB", 1), "{}", lines[w0 + 1]);
    let w1 = at("wrote 4096/4096 bytes at offset 4096");
    assert!(is_rate_line(lines[w1 + 1], "4 KiB", 1), "{}", lines[w1 + 1]);
    at("00000ffa:  cd cd cd cd cd cd ab ab ab ab ab ab ab ab ab ab  ................");
    let r0 = at("read 16/16 bytes at offset 4090");
    assert!(
        lines[r0 + 1].starts_with("16.000000 bytes, 1 ops; "),
        "{}",
        lines[r0 + 1]
    );
    let r1 = at("read 8192/8192 bytes at offset 0");
    assert!(is_rate_line(lines[r1 + 1], "8 KiB", 2), "{}", lines[r1 + 1]);

    // After unmount and a new mount, the data is still there.
    let r = io(
        &img,
        &["open /a", "pread -v 0 32", "pread -v 8190 100", "stat"],
    );
    assert_ok(&r, "io after remount");
    assert!(
        r.stdout.contains(
            "00000000:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................\n\
         00000010:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................\n\
         read 32/32 bytes at offset 0"
        ),
        "{}",
        r.stdout
    );
    // Short read at end of file.
    assert!(
        r.stdout
            .contains("00001ffe:  ab ab  ..\nread 2/100 bytes at offset 8190"),
        "{}",
        r.stdout
    );
    for want in [
        "fd.path = \"/a\"",
        "fd.flags = non-sync,non-direct,read-write",
        "stat.type = regular file",
        "stat.size = 8192",
        "dev.backend = ",
    ] {
        assert!(
            r.stdout.contains(want),
            "stat lacks {want:?}:\n{}",
            r.stdout
        );
    }
}

#[test]
fn io_direct_and_dsync_writes() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = io(
        &img,
        &[
            "open -cd /d",
            "pwrite -b 64k 0 256k",
            "pwrite -D -S 0x11 0 4k",
            "pwrite -w -S 0x22 4k 4k",
            "pwrite -W -q -S 0x33 8k 4k",
            "open -c -s /s",
            "pwrite 0 1k",
            "stat",
            "file",
            "file 0",
            "pread -q 0 4k",
            "open /d",
            "pread -v 0 16",
            "pread -v 4096 16",
            "pread -v 8192 16",
        ],
    );
    assert_ok(&r, "io");
    assert!(
        r.stdout
            .contains("wrote 262144/262144 bytes at offset 0\n256 KiB, 4 ops; "),
        "{}",
        r.stdout
    );
    assert!(
        !r.stdout.contains("wrote 4096/4096 bytes at offset 8192"),
        "-q printed:\n{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("fd.flags = sync,non-direct,read-write"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("[000] /d"), "{}", r.stdout);
    assert!(r.stdout.contains("00000000:  11 11"), "{}", r.stdout);
    assert!(r.stdout.contains("00001000:  22 22"), "{}", r.stdout);
    assert!(r.stdout.contains("00002000:  33 33"), "{}", r.stdout);

    // O_DIRECT at any byte offset and length: read-modify-write of the
    // device block, neighbours kept.
    let r = io(
        &img,
        &[
            "open -d /d",
            "pwrite -S 0x44 3 5",
            "pread -v 0 16",
            "pread 4095 2",
        ],
    );
    assert_ok(&r, "io");
    assert!(
        r.stdout.contains("wrote 5/5 bytes at offset 3"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("00000000:  11 11 11 44 44 44 44 44 11 11 11 11 11 11 11 11"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("read 2/2 bytes at offset 4095"),
        "{}",
        r.stdout
    );
}

#[test]
fn io_errors_name_the_command_and_processing_continues() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = io(
        &img,
        &[
            "pwrite 0 4k",       // no file open
            "open /nonexistent", // ENOENT
            "open -c /a",
            "pwrite x 4k",                 // bad number
            "pwrite 0",                    // missing argument
            "pwrite -Z 0 4k",              // unknown option
            "pwrite -b 0 0 4k",            // zero buffer
            "pwrite 0xffffffffffffffff 2", // overflow
            "frobnicate",                  // unknown command
            "open 'unterminated",          // bad quoting
            "truncate 12q",                // bad suffix
            "pread 0 4k",                  // works: empty file
            "rm /",
            "mkdir /a", // exists
            "open -r /a",
            "pwrite 0 1", // read-only
            "help",
            "help pwrite",
        ],
    );
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert_error_lines(&r);
    let err = &r.stderr;
    for want in [
        "iomapfs: pwrite: no file is open",
        "iomapfs: open: /nonexistent: no such file or directory",
        "iomapfs: pwrite: bad offset: 'x' is not a number",
        "iomapfs: pwrite: expected 2 argument(s), got 1; usage: pwrite",
        "iomapfs: pwrite: unknown option -Z",
        "iomapfs: pwrite: -b 0: must be",
        "overflows",
        "iomapfs: frobnicate: unknown command",
        "unterminated single quote",
        "iomapfs: truncate: bad length: '12q' has an unknown unit suffix",
        "iomapfs: rm: cannot remove the root directory",
        "iomapfs: mkdir: /a: file exists",
        "iomapfs: pwrite: /a: file is open read-only",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    assert!(
        r.stdout.contains("read 0/4096 bytes at offset 0"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("pwrite [-b bs] [-S pattern]"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("-D          O_DSYNC"), "{}", r.stdout);
}

#[test]
fn io_fiemap_shows_data_unwritten_and_holes() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = io(
        &img,
        &[
            "open -c /f",
            "pwrite 0 4k",
            "falloc 16k 16k",
            "truncate 64k",
            "fsync",
            "fiemap",
        ],
    );
    assert_ok(&r, "io");
    let out = &r.stdout;
    let map: Vec<&str> = out
        .lines()
        .skip_while(|l| *l != "/f:")
        .skip(2) // path, header
        .collect();
    assert!(out.contains("EXT: FILE-OFFSET"), "{out}");
    let kinds: Vec<&str> = map
        .iter()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    assert_eq!(kinds, ["data", "hole", "unwritten", "hole"], "{out}");
    let cols: Vec<Vec<&str>> = map.iter().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(&cols[0][..2], ["0:", "[0..7]:"], "{out}");
    assert_eq!(cols[0][3], "8", "{out}");
    assert_eq!(&cols[1][1..4], ["[8..31]:", "hole", "24"], "{out}");
    assert_eq!(&cols[2][1..2], ["[32..63]:"], "{out}");
    assert_eq!(&cols[3][1..4], ["[64..127]:", "hole", "64"], "{out}");
    // Device ranges are N..M with M - N + 1 == TOTAL.
    for c in [&cols[0], &cols[2]] {
        let (a, b) = c[2].split_once("..").unwrap();
        let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
        assert_eq!(b - a + 1, c[3].parse::<u64>().unwrap(), "{out}");
    }
}

/// A map longer than one part of `fiemap` (4096 ranges) is printed whole,
/// numbered on across parts, every row in the same columns.
#[test]
fn io_fiemap_prints_a_long_map_in_parts() {
    const EXTENTS: usize = 2100;
    let dir = scratch();
    let img = formatted(&dir);
    let fallocs: Vec<String> = (0..EXTENTS)
        .map(|k| format!("falloc {}k 4k", 8 * k))
        .collect();
    let mut cmds = vec!["open -c /f"];
    cmds.extend(fallocs.iter().map(String::as_str));
    cmds.push("fiemap");
    let r = io(&img, &cmds);
    assert_ok(&r, "io");
    let rows: Vec<&str> = r
        .stdout
        .lines()
        .skip_while(|l| *l != "/f:")
        .skip(2)
        .collect();
    // Unwritten and hole in turn, the last range unwritten up to EOF.
    assert_eq!(rows.len(), 2 * EXTENTS - 1);
    // Where the row's word `n` starts.
    let column = |row: &str, n: usize| {
        let bytes = row.as_bytes();
        (0..bytes.len())
            .filter(|&i| bytes[i] != b' ' && (i == 0 || bytes[i - 1] == b' '))
            .nth(n)
            .unwrap()
    };
    for (i, row) in rows.iter().enumerate() {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[0], format!("{i}:"), "{row}");
        let kind = if i % 2 == 0 { "unwritten" } else { "hole" };
        assert_eq!(cols[cols.len() - 1], kind, "{row}");
        assert_eq!(
            (column(row, 1), column(row, 2)),
            (column(rows[0], 1), column(rows[0], 2)),
            "row {i} out of line: {row}"
        );
    }
}

#[test]
fn io_namespace_commands() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = io(
        &img,
        &[
            "mkdir /d",
            "open -c /d/x",
            "pwrite 0 100",
            "close",
            "mv d/x /d/y",
            "ls /d",
            "rm /d",
            "rm /d/y",
            "rm /d",
            "ls",
            "statfs",
        ],
    );
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("iomapfs: rm: /d: directory not empty"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(r.stdout.contains("file          100  y\n"), "{}", r.stdout);
    assert!(!r.stdout.contains(" d/\n"), "{}", r.stdout);
    assert!(
        r.stdout.contains("statfs.block_size = 4096"),
        "{}",
        r.stdout
    );
}

#[test]
fn io_reads_commands_from_stdin() {
    let dir = scratch();
    let img = formatted(&dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_iomapfs"))
        .args(["io", img.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"# a comment\nopen -c \"/with space\"\n\npwrite 0 1k\nquit\npwrite 0 1k\n")
            .unwrap();
    }
    let r = finish(child.wait_with_output().unwrap());
    assert_ok(&r, "io from stdin");
    assert_eq!(
        r.stdout
            .matches("wrote 1024/1024 bytes at offset 0")
            .count(),
        1,
        "{}",
        r.stdout
    );
}

// ---------------------------------------------------------------- fsck

#[test]
fn fsck_is_clean_on_a_fresh_and_a_used_volume() {
    let dir = scratch();
    let img = formatted(&dir);
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_ok(&r, "fsck");
    assert!(r.stdout.contains("clean"), "{}", r.stdout);
    for want in [
        "inodes",
        "directories",
        "extents",
        "journal records replayed",
        "checkpoint generation",
    ] {
        assert!(
            r.stdout.contains(want),
            "report lacks {want}:\n{}",
            r.stdout
        );
    }

    let w = io(
        &img,
        &[
            "mkdir /d",
            "open -c /d/f",
            "pwrite 0 64k",
            "falloc 64k 64k",
            "fsync",
        ],
    );
    assert_ok(&w, "io");
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_ok(&r, "fsck after writes");
}

/// The checkpoint slots, from the superblock.
fn checkpoint_slots(img: &Path) -> Vec<(u64, u64)> {
    let bytes = std::fs::read(img).unwrap();
    let sb = iomapfs_fs::superblock::Superblock::decode(&bytes[..4096]).expect("superblock");
    sb.layout
        .checkpoint_slots
        .iter()
        .map(|r| (r.start, r.len))
        .collect()
}

fn clobber(img: &Path, offset: u64, len: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    let junk: Vec<u8> = (0..len).map(|i| (i * 7 + 13) as u8).collect();
    f.write_all_at(&junk, offset).unwrap();
}

#[test]
fn fsck_fails_on_a_corrupted_volume() {
    let dir = scratch();
    let img = formatted(&dir);
    assert_ok(&io(&img, &["open -c /f", "pwrite 0 64k"]), "io");
    for (start, len) in checkpoint_slots(&img) {
        clobber(&img, start, len.min(64 << 10));
    }
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_ne!(r.code, 0, "fsck passed a clobbered volume:\n{}", r.stdout);
    assert!(r.code == 1 || r.code == 2, "exit {}", r.code);
    assert_error_lines(&r);
    if r.code == 2 {
        assert!(r.stderr.starts_with("iomapfs: fsck: "), "{}", r.stderr);
        assert!(r.stderr.contains("cannot read the volume"), "{}", r.stderr);
    } else {
        assert!(r.stdout.contains("problem"), "{}", r.stdout);
    }
    // And io refuses to mount it, with a message, not a panic.
    let r = io(&img, &["stat"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with("iomapfs: io: cannot mount"),
        "{}",
        r.stderr
    );
}

/// Rewrites the newest checkpoint with `edit` applied to its metadata,
/// keeping it well-formed (valid checksum) so that only fsck's cross-checks
/// can notice.
fn rewrite_checkpoint(img: &Path, edit: impl FnOnce(&mut iomapfs_fs::types::MetaImage)) {
    use blockdev::sync_backend::{SyncDevice, SyncOpenOptions};
    use iomapfs_fs::{checkpoint, superblock};
    let dev = SyncDevice::open(img, SyncOpenOptions { read_only: false }).unwrap();
    let sb = superblock::read_superblock(&dev).unwrap();
    let (slot, mut ckpt) = checkpoint::read_newest_checkpoint(&dev, &sb).unwrap();
    edit(&mut ckpt.image);
    checkpoint::write_checkpoint(&dev, &sb, slot, &ckpt).unwrap();
}

#[test]
fn fsck_lists_problems_in_a_well_formed_but_inconsistent_volume() {
    let dir = scratch();
    // `rewrite_checkpoint` edits a whole-image checkpoint: the layout
    // without extent pages.
    let img = dir.path().join("vol.img");
    let r = iomapfs([
        "mkfs",
        img.to_str().unwrap(),
        "--size",
        IMAGE_SIZE,
        "--no-extent-pages",
    ]);
    assert_eq!(r.code, 0, "mkfs failed:\n{}{}", r.stdout, r.stderr);
    assert_ok(&io(&img, &["open -c /f", "pwrite 0 64k"]), "io");
    rewrite_checkpoint(&img, |image| {
        let file = image
            .inodes
            .iter_mut()
            .find(|i| !i.extents.is_empty())
            .expect("an inode with extents");
        file.nlink = 2;
    });
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_eq!(r.code, 1, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("problem(s) found:\n  - "), "{}", r.stdout);
    assert!(!r.stdout.contains("clean"), "{}", r.stdout);
}

/// Issue 14's reproduction: after `pwrite 4m`, `fsync`, `falloc -k 8m 1m`
/// and a clean unmount, eight bytes of the *active* checkpoint (the newest
/// record of the newest slot's chain) flip.
/// The older slot, marked superseded when the newer checkpoint became
/// durable, must not be used silently: fsck reports the lost generation
/// (exit 1) and io refuses to mount.
#[test]
fn damaged_active_checkpoint_is_reported_not_rolled_back() {
    use iomapfs_fs::{checkpoint, superblock};
    let dir = scratch();
    let img = formatted(&dir);
    assert_ok(
        &io(
            &img,
            &["open -c /f", "pwrite 0 4m", "fsync", "falloc -k 8m 1m"],
        ),
        "io",
    );
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_ok(&r, "fsck before the damage");
    assert!(
        r.stdout.contains("extents                   2"),
        "{}",
        r.stdout
    );
    let (active, generation) = {
        use blockdev::sync_backend::{SyncDevice, SyncOpenOptions};
        let dev = SyncDevice::open(&img, SyncOpenOptions { read_only: true }).unwrap();
        let sb = superblock::read_superblock(&dev).unwrap();
        let newest = checkpoint::read_checkpoints(&dev, &sb).unwrap();
        // The newest record: a delta after its chain's base, or a base.
        (
            sb.layout.checkpoint_slots[newest.slot].start + newest.chain.last_offset,
            newest.checkpoint.generation,
        )
    };
    clobber(&img, active + 100, 8);
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_eq!(r.code, 1, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout
            .contains(&format!("checkpoint generation {generation} in slot"))
            && r.stdout.contains("was durable and is damaged"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(&format!(
            "what follows is generation {}'s state",
            generation - 1
        )),
        "{}",
        r.stdout
    );
    let r = io(&img, &["open /f", "stat"]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("cannot mount") && r.stderr.contains("refusing to mount"),
        "{}",
        r.stderr
    );
}

/// Block 0 damaged: io mounts through the backup superblock with a warning,
/// fsck reports it (exit 1), `fsck --repair` restores the primary, then
/// fsck is clean and io says nothing.
#[test]
fn damaged_block_0_mounts_from_the_backup_and_fsck_repair_restores_it() {
    let dir = scratch();
    let img = formatted(&dir);
    assert_ok(&io(&img, &["open -c /f", "pwrite 0 64k"]), "io");
    clobber(&img, 64, 16);
    let r = io(&img, &["open /f", "pread -q 0 64k"]);
    assert_ok(&r, "io through the backup superblock");
    assert!(
        r.stderr.contains("warning") && r.stderr.contains("using the backup superblock"),
        "{}",
        r.stderr
    );
    assert_error_lines(&r);
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("primary superblock (block 0) unusable"),
        "{}",
        r.stdout
    );
    let r = iomapfs(["fsck", "--repair", img.to_str().unwrap()]);
    assert_ok(&r, "fsck --repair");
    assert!(
        r.stdout
            .contains("repaired: restored the primary superblock from the backup"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("clean: no problems found"),
        "{}",
        r.stdout
    );
    assert_ok(
        &iomapfs(["fsck", img.to_str().unwrap()]),
        "fsck after repair",
    );
    let r = io(&img, &["open /f", "stat"]);
    assert_ok(&r, "io after repair");
    assert!(r.stderr.is_empty(), "{}", r.stderr);
}

#[test]
fn fsck_of_a_non_iomapfs_image_says_so() {
    let dir = scratch();
    let img = dir.path().join("zero.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("not iomapfs"), "{}", r.stderr);
}

// ---------------------------------------------------------------- demo

#[test]
fn demo_verifies_and_cleans_up() {
    let dir = scratch();
    let img = dir.path().join("demo.img");
    let r = iomapfs([
        "demo",
        "--image",
        img.to_str().unwrap(),
        "--size",
        IMAGE_SIZE,
    ]);
    assert_ok(&r, "demo");
    assert!(r.stdout.contains("every byte matches"), "{}", r.stdout);
    assert!(r.stdout.lines().any(|l| l == "OK"), "{}", r.stdout);
    assert!(img.exists(), "--image should be kept");
    let r = iomapfs(["fsck", img.to_str().unwrap()]);
    assert_ok(&r, "fsck of the demo image");
    let r = io(&img, &["ls /demo"]);
    assert_ok(&r, "ls /demo");
    for f in ["direct.dat", "buffered.dat", "wal.log", "sparse.dat"] {
        assert!(r.stdout.contains(f), "{}", r.stdout);
    }
    // It refuses to reuse an existing image.
    let r = iomapfs(["demo", "--image", img.to_str().unwrap()]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("already exists"), "{}", r.stderr);
}

/// `--cache-size` on any command that mounts: a buffered write and read
/// through a small cache work, and a cache too small to hold four of the
/// largest folios is refused with the reason.
#[test]
fn cache_size_is_honoured_and_checked() {
    let dir = scratch();
    let image = dir.path().join("big.img");
    let image_arg = image.display().to_string();
    assert_ok(&iomapfs(["mkfs", &image_arg, "--size", "64m"]), "mkfs");
    let r = iomapfs([
        "--cache-size",
        "16m",
        "io",
        &image_arg,
        "-c",
        "open -c /f",
        "-c",
        "pwrite -S 0x5a 0 40m",
        "-c",
        "fsync",
        "-c",
        "pread -v 40959k 16",
    ]);
    assert_ok(&r, "io with a 16 MiB cache");
    assert!(r.stdout.contains("5a 5a"), "{}", r.stdout);
    let r = iomapfs(["--cache-size", "1m", "io", &image_arg, "-c", "statfs"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("cache"), "{}", r.stderr);
    assert!(r.stderr.contains("8388608"), "{}", r.stderr);
    // The dirty limits and write-behind: accepted when they hold together,
    // refused with the reason when not.
    let r = iomapfs([
        "--cache-size",
        "64m",
        "--dirty-background",
        "4m",
        "--dirty-limit",
        "8m",
        "--write-behind",
        "0",
        "io",
        &image_arg,
        "-c",
        "open /f",
        "-c",
        "pwrite -S 0x33 0 20m",
        "-c",
        "fsync",
        "-c",
        "pread -v 20479k 16",
    ]);
    assert_ok(&r, "io with dirty limits and write-behind off");
    assert!(r.stdout.contains("33 33"), "{}", r.stdout);
    let r = iomapfs(["--write-behind", "3m", "io", &image_arg, "-c", "statfs"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("write-behind chunk 3145728"),
        "{}",
        r.stderr
    );
    let r = iomapfs([
        "--cache-size",
        "64m",
        "--dirty-limit",
        "64m",
        "io",
        &image_arg,
        "-c",
        "statfs",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("dirty limit"), "{}", r.stderr);
}

/// Copies `from` to a new file `name` in `dir`.
fn copy_image(dir: &TempDir, from: &Path, name: &str) -> PathBuf {
    let to = dir.path().join(name);
    std::fs::copy(from, &to).unwrap();
    to
}

/// Rewrites log `from` to `to` without the entries `drop` selects (by
/// index), through the recorder itself.
fn rewrite_log(from: &Path, to: &Path, drop: impl Fn(u64, &blockdev::LogEntry) -> bool) {
    use blockdev::{BlockDevice, LogEntry, LogReader, LogWritesDevice, MemDevice, WriteMode};
    let mut r = LogReader::open(from).unwrap();
    let scratch = std::sync::Arc::new(MemDevice::new(
        r.header.device_size,
        r.header.logical_block_size,
    ));
    let w = LogWritesDevice::create(scratch, to).unwrap();
    let mut i = 0;
    while let Some(e) = r.next_entry().unwrap() {
        if !drop(i, &e) {
            match &e {
                LogEntry::Write { offset, data, fua } => {
                    let mode = if *fua {
                        WriteMode::Fua
                    } else {
                        WriteMode::Normal
                    };
                    w.write_at(data, *offset, mode).unwrap();
                }
                LogEntry::Flush => w.flush().unwrap(),
                LogEntry::Mark(name) => w.mark(name).unwrap(),
            }
        }
        i += 1;
    }
    w.flush_log().unwrap();
}

/// `io --record` then `replay`: the log lists the session's marks; a full
/// replay onto the starting image passes every flush point and rebuilds
/// the recorded image byte for byte; `--mark` and `--to` stop early; and a
/// log missing a synced file's writes fails the check (the checker can
/// fail).
#[test]
fn record_and_replay_check_every_flush_point() {
    let dir = scratch();
    let base = formatted(&dir);
    let disk = copy_image(&dir, &base, "disk.img");
    let log = dir.path().join("run.log");
    let mut args: Vec<String> = vec![
        "io".into(),
        disk.display().to_string(),
        "--record".into(),
        log.display().to_string(),
    ];
    for c in [
        "open -c /a",
        "pwrite -q -S 0x11 0 64k",
        "fsync",
        "open -cd /b",
        "pwrite -q -D -S 0x22 0 8k",
        "pwrite -q -S 0x23 100 3000",
        "falloc -k 64k 32k",
        "mark before-rm",
        "file 0",
        "pwrite -q -S 0x33 64k 16k",
        "truncate 70000",
        "fpunch 4k 8k",
        "sync",
        "mv /a /c",
        "rm /b",
    ] {
        args.push("-c".into());
        args.push(c.into());
    }
    assert_ok(&iomapfs(&args), "io --record");

    let list = iomapfs(["replay", log.to_str().unwrap(), "--list"]);
    assert_ok(&list, "replay --list");
    assert!(list.stdout.contains("mark before-rm"), "{}", list.stdout);
    assert!(
        list.stdout.contains("mark iomapfs:synced 65536"),
        "{}",
        list.stdout
    );
    assert!(list.stdout.contains("flush"), "{}", list.stdout);

    let full = copy_image(&dir, &base, "full.img");
    let r = iomapfs([
        "replay",
        log.to_str().unwrap(),
        full.to_str().unwrap(),
        "--check-every-flush",
    ]);
    assert_ok(&r, "replay --check-every-flush");
    let points: u64 = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("checked "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no 'checked N flush points' line:\n{}", r.stdout));
    assert!(points >= 5, "only {points} flush points:\n{}", r.stdout);
    assert!(r.stdout.contains(", 0 failed"), "{}", r.stdout);
    assert!(
        std::fs::read(&full).unwrap() == std::fs::read(&disk).unwrap(),
        "a full replay did not rebuild the recorded image"
    );

    let at_mark = copy_image(&dir, &base, "mark.img");
    let r = iomapfs([
        "replay",
        log.to_str().unwrap(),
        at_mark.to_str().unwrap(),
        "--mark",
        "before-rm",
    ]);
    assert_ok(&r, "replay --mark");
    let ls = io(&at_mark, &["ls /", "open /a", "stat"]);
    assert_ok(&ls, "io on the image replayed to the mark");
    assert!(
        ls.stdout.contains(" b\n") || ls.stdout.contains(" b "),
        "{}",
        ls.stdout
    );
    assert!(ls.stdout.contains("stat.size = 65536"), "{}", ls.stdout);

    let none = copy_image(&dir, &base, "none.img");
    let r = iomapfs([
        "replay",
        log.to_str().unwrap(),
        none.to_str().unwrap(),
        "--to",
        "0",
    ]);
    assert_ok(&r, "replay --to 0");
    assert!(std::fs::read(&none).unwrap() == std::fs::read(&base).unwrap());

    // The data writes of the first 'pwrite' of /a gone (its metadata kept):
    // every flush point after its synced mark must report the content.
    let names: Vec<String> = {
        let mut r = blockdev::LogReader::open(&log).unwrap();
        std::iter::from_fn(|| r.next_entry().unwrap())
            .map(|e| match e {
                blockdev::LogEntry::Mark(n) => n,
                _ => String::new(),
            })
            .collect()
    };
    let synced_a = names
        .iter()
        .position(|n| n.starts_with("iomapfs:synced 65536"))
        .unwrap() as u64;
    let tampered = dir.path().join("tampered.log");
    let data_area = {
        let bytes = std::fs::read(&base).unwrap();
        let mem = blockdev::MemDevice::from_bytes(bytes, 512, true, false);
        let l = iomapfs_fs::superblock::read_superblock(&mem)
            .unwrap()
            .layout;
        l.data.start..l.data.end()
    };
    rewrite_log(&log, &tampered, |i, e| {
        i < synced_a
            && matches!(e, blockdev::LogEntry::Write { offset, .. } if data_area.contains(offset))
    });
    let t = copy_image(&dir, &base, "tampered.img");
    let r = iomapfs([
        "replay",
        tampered.to_str().unwrap(),
        t.to_str().unwrap(),
        "--check-every-flush",
    ]);
    assert_eq!(
        r.code, 1,
        "a log missing synced writes passed:\n{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("synced data lost: /a, synced at entry")
            && r.stdout.contains("holds 65536 bytes"),
        "no report of /a's content:\n{}",
        r.stdout
    );
}

/// Holds an `flock` on `path` as another iomapfs process (a mount) would.
struct HeldLock(#[allow(dead_code)] std::fs::File);

fn hold_lock(path: &Path, op: libc::c_int) -> HeldLock {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(
        unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) },
        0
    );
    HeldLock(file)
}

#[test]
fn io_fsck_and_mkfs_refuse_an_image_another_process_holds() {
    let dir = scratch();
    let img = formatted(&dir);
    let shown = img.display().to_string();
    // A mount holds its TARGET exclusively: every command is refused, the
    // volume untouched.
    let held = hold_lock(&img, libc::LOCK_EX);
    let before = std::fs::read(&img).unwrap();
    for (args, code) in [
        (
            vec!["io", &shown, "-c", "open -c /f", "-c", "pwrite 0 4096"],
            1,
        ),
        (vec!["fsck", &shown], 2),
        (vec!["mkfs", &shown, "--force"], 1),
    ] {
        let r = iomapfs(&args);
        assert_eq!(r.code, code, "{args:?}: {}{}", r.stdout, r.stderr);
        assert!(
            r.stderr.contains(&format!("{}: {shown}: in use", args[0])),
            "{args:?}: {}",
            r.stderr
        );
    }
    assert!(std::fs::read(&img).unwrap() == before, "the volume changed");
    drop(held);
    // fsck only reads: it runs beside another reader, never beside a
    // writer; io writes: refused beside a reader.
    let reader = hold_lock(&img, libc::LOCK_SH);
    assert_ok(&iomapfs(["fsck", &shown]), "fsck beside a reader");
    let r = io(&img, &["open -c /f"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    drop(reader);
    // Released: all of them work again.
    assert_ok(&io(&img, &["open -c /f", "pwrite 0 4096"]), "io");
    assert_ok(&iomapfs(["fsck", &shown]), "fsck");
}

/// `bench --record`: the iomapfs target of one direct-I/O workload is
/// recorded from its format on; replaying the log onto a zeroed image checks
/// every flush point after the format (mount + fsck). Other selections are
/// refused with what to do.
#[test]
fn bench_record_replays_flush_by_flush() {
    let dir = scratch();
    let img = dir.path().join("bench.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let log = dir.path().join("bench.log");
    let args = |workload: &str| {
        vec![
            "bench".to_string(),
            "--device".into(),
            img.display().to_string(),
            "--no-kernel".into(),
            "--runtime".into(),
            "0.1".into(),
            "--workload".into(),
            workload.into(),
            "--record".into(),
            log.display().to_string(),
        ]
    };
    let r = iomapfs(args("dsync-overwrite-4k"));
    assert_ok(&r, "bench --record");
    let base = dir.path().join("base.img");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let r = iomapfs([
        "replay",
        log.to_str().unwrap(),
        base.to_str().unwrap(),
        "--check-every-flush",
    ]);
    assert_ok(&r, "replay --check-every-flush of a bench recording");
    let points: u64 = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("checked "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no 'checked N flush points' line:\n{}", r.stdout));
    assert!(points >= 3, "only {points} flush points:\n{}", r.stdout);
    assert!(r.stdout.contains(", 0 failed"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("flush points before the volume was formatted"),
        "{}",
        r.stdout
    );
    // The replayed image is the volume bench left: it mounts, fsck clean.
    assert_ok(
        &iomapfs(["fsck", base.to_str().unwrap()]),
        "fsck of the replay",
    );

    let mut two = args("dsync-overwrite-4k");
    two.extend(["--workload".into(), "randread-4k-qd1".into()]);
    let r = iomapfs(two);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("--record records the iomapfs target of one direct-I/O workload"),
        "{}",
        r.stderr
    );
}
