//! The ceiling of buffered I/O: what a read served from a cache, or a
//! write into one, cannot beat — copying the same bytes between memory
//! and the I/O buffer, in the same thread, at memory bandwidth.
//!
//! It runs in the same window as iomapfs ([`super::passes`]), with the
//! same per-I/O clock reads and latency records, so the harness's own cost
//! is in both figures and their ratio is the cache's cost alone. The other
//! side of the copy is as large as the file and is walked at the same
//! offsets, as a cache holding the file is: a file larger than the CPU's
//! caches comes from memory, and so does this copy. (A buffer of the I/O
//! size would stay in the CPU's caches, a ceiling no cache of a 64 MiB
//! file can reach.) A read copies from that buffer, a write into it, as
//! a cache's copies go: stores into memory that is not in the core's
//! caches cost more than loads from it (each line is read for ownership
//! first), so a read's copy is no ceiling for a write.

use blockdev::{AlignedBuf, RequestCounts};

use super::passes::PassTarget;
use crate::workload::{Op, Rng};
use crate::BenchError;

/// Page-aligned, like the cache's folios and the I/O buffers.
const ALIGN: usize = 4096;

/// The file-sized buffer, copied from by reads and into by writes.
pub struct Memcpy {
    file: AlignedBuf,
    op: Op,
}

impl Memcpy {
    pub fn new(span: usize, op: Op) -> Result<Memcpy, BenchError> {
        let mut file = AlignedBuf::new(span, ALIGN)
            .map_err(|e| BenchError::setup("memcpy buffer", e.to_string()))?;
        // Not zeros: nothing may take a shortcut for them.
        Rng::new(0x6d65_6d63_7079).fill(&mut file);
        Ok(Memcpy { file, op })
    }
}

impl PassTarget for Memcpy {
    fn before_pass(&mut self) -> Result<(), BenchError> {
        Ok(())
    }

    fn io(&mut self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        let from = usize::try_from(offset)
            .ok()
            .filter(|from| from.saturating_add(buf.len()) <= self.file.len())
            .ok_or_else(|| {
                BenchError::failed(
                    "memcpy ceiling",
                    format!(
                        "{} bytes at {offset} are past its {}-byte buffer",
                        buf.len(),
                        self.file.len()
                    ),
                )
            })?;
        let file = &mut self.file[from..from + buf.len()];
        match self.op {
            Op::Read => buf.copy_from_slice(file),
            Op::Write => file.copy_from_slice(buf),
        }
        // The copy has no other reader: keep the compiler from dropping it.
        std::hint::black_box((buf, file));
        Ok(())
    }

    fn end_pass(&mut self) -> Result<(), BenchError> {
        Ok(())
    }

    fn requests(&self) -> Option<RequestCounts> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_copies_from_the_file_sized_buffer() {
        let mut m = Memcpy::new(3 * 8192, Op::Read).unwrap();
        let before = m.file.to_vec();
        let mut buf = vec![0u8; 8192];
        m.io(&mut buf, 8192).unwrap();
        assert_eq!(&buf[..], &m.file[8192..16384]);
        assert!(buf.iter().any(|b| *b != 0));
        let mut short = vec![0u8; 100];
        m.io(&mut short, 100).unwrap();
        assert_eq!(&short[..], &m.file[100..200]);
        assert_eq!(&m.file[..], &before[..], "a read changes nothing");
        // Past the buffer is an error, not a panic.
        assert!(m.io(&mut buf, 2 * 8192 + 1).is_err());
    }

    #[test]
    fn a_write_copies_into_the_file_sized_buffer() {
        let mut m = Memcpy::new(3 * 8192, Op::Write).unwrap();
        let before = m.file.to_vec();
        let mut buf = vec![0xa5u8; 8192];
        m.io(&mut buf, 8192).unwrap();
        assert_eq!(&m.file[8192..16384], &buf[..]);
        assert_eq!(&m.file[..8192], &before[..8192]);
        assert_eq!(&m.file[16384..], &before[16384..]);
        assert!(
            buf.iter().all(|&b| b == 0xa5),
            "the I/O buffer is the source"
        );
        assert!(m.io(&mut buf, 2 * 8192 + 1).is_err());
    }
}
