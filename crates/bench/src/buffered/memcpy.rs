//! The ceiling of buffered I/O: what a read served from a cache, or a
//! write into one, cannot beat — copying the same bytes between memory
//! and the I/O buffer, in the same thread, at memory bandwidth.
//!
//! It runs in the same window as iomapfs ([`super::passes`]), with the
//! same per-I/O clock reads and latency records, so the harness's own cost
//! is in both figures and their ratio is the cache's cost alone. The other
//! side of the copy is as large as the file and is walked at the same
//! offsets, as a cache holding the file is: a file larger than the CPU's
//! caches comes from memory, and so does this copy. (A source of the I/O
//! size would stay in the CPU's caches, a ceiling no cache of a 64 MiB
//! file can reach.)

use blockdev::{AlignedBuf, RequestCounts};

use super::passes::PassTarget;
use crate::workload::Rng;
use crate::BenchError;

/// Page-aligned, like the cache's folios and the I/O buffers.
const ALIGN: usize = 4096;

/// The source buffer, as large as the file; the window's I/O buffer is
/// the destination.
pub struct Memcpy {
    src: AlignedBuf,
}

impl Memcpy {
    pub fn new(span: usize) -> Result<Memcpy, BenchError> {
        let mut src = AlignedBuf::new(span, ALIGN)
            .map_err(|e| BenchError::setup("memcpy buffer", e.to_string()))?;
        // Not zeros: nothing may take a shortcut for them.
        Rng::new(0x6d65_6d63_7079).fill(&mut src);
        Ok(Memcpy { src })
    }
}

impl PassTarget for Memcpy {
    fn before_pass(&mut self) -> Result<(), BenchError> {
        Ok(())
    }

    fn io(&mut self, buf: &mut [u8], offset: u64) -> Result<(), BenchError> {
        let from = usize::try_from(offset)
            .ok()
            .filter(|from| from.saturating_add(buf.len()) <= self.src.len())
            .ok_or_else(|| {
                BenchError::failed(
                    "memcpy ceiling",
                    format!(
                        "{} bytes at {offset} are past its {}-byte source",
                        buf.len(),
                        self.src.len()
                    ),
                )
            })?;
        buf.copy_from_slice(&self.src[from..from + buf.len()]);
        // The copy has no other reader: keep the compiler from dropping it.
        std::hint::black_box(buf);
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
    fn copies_the_source_into_the_buffer() {
        let mut m = Memcpy::new(3 * 8192).unwrap();
        let mut buf = vec![0u8; 8192];
        m.io(&mut buf, 8192).unwrap();
        assert_eq!(&buf[..], &m.src[8192..16384]);
        assert!(buf.iter().any(|b| *b != 0));
        let mut short = vec![0u8; 100];
        m.io(&mut short, 100).unwrap();
        assert_eq!(&short[..], &m.src[100..200]);
        // Past the source is an error, not a panic.
        assert!(m.io(&mut buf, 2 * 8192 + 1).is_err());
    }
}
