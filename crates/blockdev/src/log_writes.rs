//! Log-writes recording: a device wrapper that appends every write (with its
//! data), every FUA write, every flush and every user mark, in the order
//! they complete, to a log file — the idea of Linux's dm-log-writes, which
//! this kernel lacks. [`LogReader`] reads a log back, and replaying its
//! entries onto a copy of the device as it was when the recording began
//! rebuilds the device at any point: after entry N, at a mark, or at each
//! flush (what a power cut there may leave, with every write before it
//! landed).
//!
//! # Log format (little-endian)
//!
//! A 32-byte header — magic `IOMAPLOG`, version (u32, 1), logical block
//! size (u32), device size (u64), 8 reserved bytes — then entries, each a
//! 32-byte header followed by its payload:
//!
//! | bytes  | field                                               |
//! |--------|-----------------------------------------------------|
//! | 0..4   | magic `LENT`                                        |
//! | 4      | kind: 1 write, 2 FUA write, 3 flush, 4 mark         |
//! | 5..8   | zero                                                |
//! | 8..16  | device byte offset (writes; 0 otherwise)            |
//! | 16..24 | payload length (write data, or the mark's UTF-8 name)|
//! | 24..28 | crc32c of bytes 0..24 and the payload               |
//! | 28..32 | zero                                                |
//!
//! A log cut short (the recording process killed mid-append) ends at the
//! last whole entry whose crc verifies: [`LogReader`] reports where it
//! stopped and why.
//!
//! # What is recorded, and when
//!
//! A write is logged after the device completed it, a flush after it
//! completed; failed requests are not logged (they changed nothing). Entries
//! of concurrent requests appear in completion order, so replaying up to a
//! flush applies every write completed before the flush was — the state a
//! power cut right after that flush leaves when nothing more landed. The
//! wrapper has no queue of its own: asynchronous requests reach it through
//! an inline queue, one at a time per queue.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::{BlockDevice, DeviceCaps, DeviceCounters, DeviceError, WriteMode};

pub const LOG_MAGIC: [u8; 8] = *b"IOMAPLOG";
pub const LOG_VERSION: u32 = 1;
pub const LOG_HEADER_LEN: usize = 32;
pub const ENTRY_MAGIC: [u8; 4] = *b"LENT";
pub const ENTRY_HEADER_LEN: usize = 32;
/// Longest mark name.
pub const MAX_MARK_LEN: usize = 4096;

/// What one log entry records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogEntry {
    Write {
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    },
    Flush,
    Mark(String),
}

impl LogEntry {
    fn kind(&self) -> u8 {
        match self {
            LogEntry::Write { fua: false, .. } => 1,
            LogEntry::Write { fua: true, .. } => 2,
            LogEntry::Flush => 3,
            LogEntry::Mark(_) => 4,
        }
    }

    /// Applies the entry to `dev` (marks and flushes: nothing but a flush).
    pub fn apply(&self, dev: &dyn BlockDevice) -> Result<(), DeviceError> {
        match self {
            LogEntry::Write { offset, data, .. } => dev.write_at(data, *offset, WriteMode::Normal),
            LogEntry::Flush => dev.flush(),
            LogEntry::Mark(_) => Ok(()),
        }
    }
}

/// The log's header: the device it was recorded on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogHeader {
    pub logical_block_size: u32,
    pub device_size: u64,
}

fn log_error(path: &Path, what: &str, source: std::io::Error) -> DeviceError {
    DeviceError::Unusable {
        path: path.to_path_buf(),
        reason: format!("log-writes: {what}: {source}"),
    }
}

fn entry_crc(header: &[u8], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&header[..24]), payload)
}

/// A device that records every write, flush and mark to a log file; see
/// the module docs.
pub struct LogWritesDevice {
    inner: Arc<dyn BlockDevice>,
    path: PathBuf,
    log: Mutex<BufWriter<File>>,
}

impl LogWritesDevice {
    /// Records `inner` to a new log at `path` (replacing a file there).
    pub fn create(
        inner: Arc<dyn BlockDevice>,
        path: &Path,
    ) -> Result<LogWritesDevice, DeviceError> {
        let file = File::create(path).map_err(|e| log_error(path, "creating the log", e))?;
        let mut log = BufWriter::new(file);
        let caps = inner.caps();
        let mut header = [0u8; LOG_HEADER_LEN];
        header[..8].copy_from_slice(&LOG_MAGIC);
        header[8..12].copy_from_slice(&LOG_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&caps.logical_block_size.to_le_bytes());
        header[16..24].copy_from_slice(&caps.size_bytes.to_le_bytes());
        log.write_all(&header)
            .map_err(|e| log_error(path, "writing the log header", e))?;
        Ok(LogWritesDevice {
            inner,
            path: path.to_path_buf(),
            log: Mutex::new(log),
        })
    }

    /// Records a user mark (a name replay can stop at).
    pub fn mark(&self, name: &str) -> Result<(), DeviceError> {
        if name.len() > MAX_MARK_LEN {
            return Err(DeviceError::Unusable {
                path: self.path.clone(),
                reason: format!(
                    "log-writes: mark of {} bytes (at most {MAX_MARK_LEN})",
                    name.len()
                ),
            });
        }
        self.append(&LogEntry::Mark(name.to_string()))
    }

    /// Writes whatever is buffered to the log file.
    pub fn flush_log(&self) -> Result<(), DeviceError> {
        self.log
            .lock()
            .flush()
            .map_err(|e| log_error(&self.path, "writing the log", e))
    }

    fn append(&self, entry: &LogEntry) -> Result<(), DeviceError> {
        let (offset, payload): (u64, &[u8]) = match entry {
            LogEntry::Write { offset, data, .. } => (*offset, data),
            LogEntry::Flush => (0, &[]),
            LogEntry::Mark(name) => (0, name.as_bytes()),
        };
        let mut header = [0u8; ENTRY_HEADER_LEN];
        header[..4].copy_from_slice(&ENTRY_MAGIC);
        header[4] = entry.kind();
        header[8..16].copy_from_slice(&offset.to_le_bytes());
        header[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        let crc = entry_crc(&header, payload);
        header[24..28].copy_from_slice(&crc.to_le_bytes());
        let mut log = self.log.lock();
        log.write_all(&header)
            .and_then(|()| log.write_all(payload))
            .map_err(|e| log_error(&self.path, "appending to the log", e))
    }
}

impl Drop for LogWritesDevice {
    fn drop(&mut self) {
        // Errors were reported by `flush_log` to a caller who wanted them.
        let _ = self.log.get_mut().flush();
    }
}

impl BlockDevice for LogWritesDevice {
    fn caps(&self) -> &DeviceCaps {
        self.inner.caps()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, mode: WriteMode) -> Result<(), DeviceError> {
        self.inner.write_at(buf, offset, mode)?;
        self.append(&LogEntry::Write {
            offset,
            data: buf.to_vec(),
            fua: mode == WriteMode::Fua,
        })
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()?;
        self.append(&LogEntry::Flush)
    }

    fn counters(&self) -> &DeviceCounters {
        self.inner.counters()
    }

    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
}

/// Where and why reading a log stopped before its end of file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogTail {
    /// Byte offset in the log file of the entry that could not be read.
    pub at: u64,
    pub reason: String,
}

/// Reads a log written by [`LogWritesDevice`], entry by entry.
pub struct LogReader {
    path: PathBuf,
    input: BufReader<File>,
    pub header: LogHeader,
    pos: u64,
    /// Set when reading stopped at a damaged or cut-short entry.
    pub tail: Option<LogTail>,
}

impl LogReader {
    pub fn open(path: &Path) -> Result<LogReader, DeviceError> {
        let file = File::open(path).map_err(|e| log_error(path, "opening the log", e))?;
        let mut input = BufReader::new(file);
        let mut h = [0u8; LOG_HEADER_LEN];
        input
            .read_exact(&mut h)
            .map_err(|e| log_error(path, "reading the log header", e))?;
        let bad = |reason: String| DeviceError::Unusable {
            path: path.to_path_buf(),
            reason: format!("log-writes: not a log: {reason}"),
        };
        if h[..8] != LOG_MAGIC {
            return Err(bad(format!("magic {:?}", &h[..8])));
        }
        let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        if version != LOG_VERSION {
            return Err(bad(format!(
                "version {version} (this build reads {LOG_VERSION})"
            )));
        }
        let header = LogHeader {
            logical_block_size: u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")),
            device_size: u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")),
        };
        if !header.logical_block_size.is_power_of_two() {
            return Err(bad(format!(
                "logical block size {}",
                header.logical_block_size
            )));
        }
        Ok(LogReader {
            path: path.to_path_buf(),
            input,
            header,
            pos: LOG_HEADER_LEN as u64,
            tail: None,
        })
    }

    /// The next entry; `Ok(None)` at the end of the log, or where it stops
    /// being readable (see [`LogReader::tail`]). `Err` only for I/O errors.
    pub fn next_entry(&mut self) -> Result<Option<LogEntry>, DeviceError> {
        if self.tail.is_some() {
            return Ok(None);
        }
        let at = self.pos;
        let mut h = [0u8; ENTRY_HEADER_LEN];
        match read_full(&mut self.input, &mut h) {
            Ok(0) => return Ok(None),
            Ok(n) if n < ENTRY_HEADER_LEN => {
                return Ok(self.stop(at, "cut short inside an entry header"))
            }
            Ok(_) => {}
            Err(e) => return Err(log_error(&self.path, "reading the log", e)),
        }
        if h[..4] != ENTRY_MAGIC {
            return Ok(self.stop(at, "no entry magic"));
        }
        let kind = h[4];
        let offset = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        let crc = u32::from_le_bytes(h[24..28].try_into().expect("4 bytes"));
        let max_len = match kind {
            1 | 2 => self.header.device_size,
            3 => 0,
            4 => MAX_MARK_LEN as u64,
            _ => return Ok(self.stop(at, &format!("unknown entry kind {kind}"))),
        };
        if len > max_len
            || (kind <= 2
                && offset
                    .checked_add(len)
                    .is_none_or(|e| e > self.header.device_size))
        {
            return Ok(self.stop(
                at,
                &format!("entry of {len} bytes at device byte {offset} does not fit"),
            ));
        }
        let mut payload = vec![0u8; len as usize];
        match read_full(&mut self.input, &mut payload) {
            Ok(n) if n < payload.len() => {
                return Ok(self.stop(at, "cut short inside an entry's data"))
            }
            Ok(_) => {}
            Err(e) => return Err(log_error(&self.path, "reading the log", e)),
        }
        if entry_crc(&h, &payload) != crc {
            return Ok(self.stop(at, "entry crc does not match"));
        }
        self.pos += (ENTRY_HEADER_LEN as u64) + len;
        Ok(Some(match kind {
            1 | 2 => LogEntry::Write {
                offset,
                data: payload,
                fua: kind == 2,
            },
            3 => LogEntry::Flush,
            _ => match String::from_utf8(payload) {
                Ok(name) => LogEntry::Mark(name),
                Err(_) => return Ok(self.stop(at, "mark name is not UTF-8")),
            },
        }))
    }

    fn stop(&mut self, at: u64, reason: &str) -> Option<LogEntry> {
        self.tail = Some(LogTail {
            at,
            reason: reason.to_string(),
        });
        None
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match input.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl std::fmt::Display for LogEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LogEntry::Write { offset, data, fua } => write!(
                f,
                "{} {} bytes at device byte {offset}",
                if *fua { "fua-write" } else { "write" },
                data.len()
            ),
            LogEntry::Flush => f.write_str("flush"),
            LogEntry::Mark(name) => write!(f, "mark {name}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn read_all(path: &Path) -> (Vec<LogEntry>, Option<LogTail>) {
        let mut r = LogReader::open(path).unwrap();
        let mut out = Vec::new();
        while let Some(e) = r.next_entry().unwrap() {
            out.push(e);
        }
        (out, r.tail)
    }

    fn recorded() -> (tempfile::TempDir, PathBuf, Arc<MemDevice>, Vec<LogEntry>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mem = Arc::new(MemDevice::new(64 * 1024, 512));
        let dev = LogWritesDevice::create(mem.clone(), &path).unwrap();
        dev.write_at(&[1u8; 1024], 512, WriteMode::Normal).unwrap();
        dev.flush().unwrap();
        dev.mark("after first flush").unwrap();
        dev.write_at(&[2u8; 512], 4096, WriteMode::Fua).unwrap();
        mem.inject(crate::FaultRule::new(crate::FaultOp::Write).count(1));
        assert!(dev.write_at(&[3u8; 512], 0, WriteMode::Normal).is_err());
        drop(dev);
        let want = vec![
            LogEntry::Write {
                offset: 512,
                data: vec![1; 1024],
                fua: false,
            },
            LogEntry::Flush,
            LogEntry::Mark("after first flush".into()),
            LogEntry::Write {
                offset: 4096,
                data: vec![2; 512],
                fua: true,
            },
        ];
        (dir, path, mem, want)
    }

    #[test]
    fn records_writes_flushes_and_marks_in_order_and_not_failed_writes() {
        let (_dir, path, mem, want) = recorded();
        let (entries, tail) = read_all(&path);
        assert_eq!(entries, want);
        assert_eq!(tail, None);
        let r = LogReader::open(&path).unwrap();
        assert_eq!(
            r.header,
            LogHeader {
                logical_block_size: 512,
                device_size: 64 * 1024
            }
        );
        // Replaying onto a zeroed copy rebuilds the device.
        let replica = MemDevice::new(64 * 1024, 512);
        for e in &entries {
            e.apply(&replica).unwrap();
        }
        assert_eq!(replica.snapshot(), mem.snapshot());
    }

    #[test]
    fn a_cut_short_or_damaged_log_ends_at_the_last_whole_entry() {
        let (_dir, path, _mem, want) = recorded();
        let full = std::fs::read(&path).unwrap();
        // Cut inside the last entry's data.
        std::fs::write(&path, &full[..full.len() - 100]).unwrap();
        let (entries, tail) = read_all(&path);
        assert_eq!(entries, want[..3]);
        assert!(tail.unwrap().reason.contains("cut short"));
        // A flipped byte in the first entry's data.
        let mut bad = full.clone();
        bad[LOG_HEADER_LEN + ENTRY_HEADER_LEN + 10] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let (entries, tail) = read_all(&path);
        assert!(entries.is_empty());
        let tail = tail.unwrap();
        assert_eq!(tail.at, LOG_HEADER_LEN as u64);
        assert!(tail.reason.contains("crc"), "{}", tail.reason);
        // Not a log at all.
        std::fs::write(&path, b"something else entirely, 32 bytes+").unwrap();
        assert!(LogReader::open(&path).is_err());
    }
}
