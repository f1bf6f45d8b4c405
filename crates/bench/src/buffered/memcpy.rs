//! The ceiling of buffered I/O: what a read served from a cache, or a
//! write into one, cannot beat — copying the same number of bytes from
//! one buffer to another in memory, in the same thread.
//!
//! It runs in the same window as iomapfs ([`super::passes`]), with the
//! same per-I/O clock reads and latency records, so the harness's own cost
//! is in both figures and their ratio is the cache's cost alone. Both
//! buffers are the I/O size, so this is the copy at its best (for 4 KiB
//! and 64 KiB, from and to the CPU's caches): a ceiling, not an estimate.

use blockdev::{AlignedBuf, RequestCounts};

use super::passes::PassTarget;
use crate::workload::Rng;
use crate::BenchError;

/// Page-aligned, like the cache's folios and the I/O buffers.
const ALIGN: usize = 4096;

/// The source buffer; the window's I/O buffer is the destination.
pub struct Memcpy {
    src: AlignedBuf,
}

impl Memcpy {
    pub fn new(io_size: usize) -> Result<Memcpy, BenchError> {
        let mut src = AlignedBuf::new(io_size, ALIGN)
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

    fn io(&mut self, buf: &mut [u8], _offset: u64) -> Result<(), BenchError> {
        let len = buf.len();
        buf.copy_from_slice(&self.src[..len]);
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
        let mut m = Memcpy::new(8192).unwrap();
        let mut buf = vec![0u8; 8192];
        m.io(&mut buf, 0).unwrap();
        assert_eq!(&buf[..], &m.src[..]);
        assert!(buf.iter().any(|b| *b != 0));
        // Shorter I/Os copy a prefix.
        let mut short = vec![0u8; 100];
        m.io(&mut short, 0).unwrap();
        assert_eq!(&short[..], &m.src[..100]);
    }
}
