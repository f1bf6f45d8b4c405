//! The mount table of this process's namespace, from /proc/self/mountinfo:
//! read without touching any mount point (a stat of a FUSE mount waits for
//! its server, forever if it hangs).

use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// One line of /proc/self/mountinfo (the fields callers use).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted device (for FUSE, the minor is the
    /// connection number, the name of its fusectl directory).
    pub device: (u32, u32),
    /// Where it is mounted, with the kernel's octal escapes undone.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `nosuid`, `noatime`...).
    pub options: Vec<String>,
}

/// The mounts of this process's namespace, in mount order (a later entry
/// for the same point is mounted over an earlier one).
pub fn mounts() -> std::io::Result<Vec<MountEntry>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The topmost mount at `point`, if any.
pub fn mount_at(point: &std::path::Path) -> std::io::Result<Option<MountEntry>> {
    Ok(mounts()?.into_iter().rev().find(|m| m.mount_point == point))
}

fn parse(table: &str) -> Vec<MountEntry> {
    table.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let mut fields = line.split(' ');
    let (major, minor) = fields.nth(2)?.split_once(':')?;
    let point = fields.nth(1)?;
    let options = fields.next()?;
    Some(MountEntry {
        device: (major.parse().ok()?, minor.parse().ok()?),
        mount_point: PathBuf::from(std::ffi::OsString::from_vec(unescape(point))),
        options: options.split(',').map(str::to_string).collect(),
    })
}

/// Undoes the kernel's escapes of space, tab, newline and backslash
/// (`\040`, `\011`, `\012`, `\134`: a backslash and three octal digits).
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0')));
        match octal.and_then(|n| u8::try_from(n).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_undoes_escapes() {
        let table = "36 35 98:0 / /mnt/a\\040b rw,noatime master:1 - ext4 /dev/root rw\n\
                     40 36 0:52 / /tmp/x\\134y\\011z rw,nosuid,nodev - fuse.iomapfs /i.img rw,user_id=0\n\
                     garbage\n";
        let mounts = parse(table);
        assert_eq!(mounts.len(), 2);
        assert_eq!(mounts[0].device, (98, 0));
        assert_eq!(mounts[0].mount_point, PathBuf::from("/mnt/a b"));
        assert_eq!(mounts[0].options, ["rw", "noatime"]);
        assert_eq!(mounts[1].device, (0, 52));
        assert_eq!(mounts[1].mount_point, PathBuf::from("/tmp/x\\y\tz"));
        assert_eq!(mounts[1].options, ["rw", "nosuid", "nodev"]);
    }

    #[test]
    fn a_backslash_without_three_octal_digits_stays() {
        assert_eq!(unescape("a\\b\\04"), b"a\\b\\04");
        assert_eq!(unescape("\\101"), b"A");
    }
}
