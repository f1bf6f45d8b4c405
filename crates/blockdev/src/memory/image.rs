//! The device's contents as copy-on-write chunks.
//!
//! Power-cut tests make 10,000+ devices per run, so the image is stored as
//! copy-on-write chunks shared between the durable image, the current
//! contents and every device a cut produces. A flush costs O(writes since the
//! last flush), a cut O(chunks + writes since the last flush), and a write
//! copies at most the chunks it touches that are still shared.

use std::ops::Range;
use std::sync::Arc;

/// Granularity of copy-on-write sharing. Small enough that a 4 KiB write
/// after a flush copies little, large enough that a 16 MiB device is 1024
/// chunks, so cloning an image stays in the microseconds.
pub(super) const CHUNK_BYTES: usize = 16 * 1024;

/// Device contents as copy-on-write chunks of `CHUNK_BYTES` (the last one
/// padded; bytes past the device size are never read or written). Cloning
/// shares every chunk; writing copies only shared chunks it touches.
#[derive(Clone)]
pub(super) struct Image {
    chunks: Vec<Arc<Vec<u8>>>,
}

impl Image {
    pub(super) fn zeroed(size: usize) -> Image {
        // One zero chunk shared by all: a fresh 16 MiB device costs 1024
        // pointers, not 16 MiB.
        let zero = Arc::new(vec![0; CHUNK_BYTES]);
        Image {
            chunks: vec![zero; size.div_ceil(CHUNK_BYTES)],
        }
    }

    pub(super) fn from_bytes(bytes: &[u8]) -> Image {
        let chunks = bytes
            .chunks(CHUNK_BYTES)
            .map(|c| {
                let mut chunk = vec![0; CHUNK_BYTES];
                chunk[..c.len()].copy_from_slice(c);
                Arc::new(chunk)
            })
            .collect();
        Image { chunks }
    }

    pub(super) fn filled(size: usize, pattern: &[u8]) -> Image {
        if pattern.is_empty() {
            return Image::zeroed(size);
        }
        let chunk_at = |start: usize| {
            let chunk: Vec<u8> = (start..start + CHUNK_BYTES)
                .map(|pos| pattern[pos % pattern.len()])
                .collect();
            Arc::new(chunk)
        };
        let n = size.div_ceil(CHUNK_BYTES);
        let chunks = if CHUNK_BYTES.is_multiple_of(pattern.len()) {
            // Every chunk starts at a multiple of the period: all identical.
            let shared = chunk_at(0);
            vec![shared; n]
        } else {
            (0..n).map(|i| chunk_at(i * CHUNK_BYTES)).collect()
        };
        Image { chunks }
    }

    /// Calls `f(chunk index, offset in chunk, range in the request)` for
    /// each piece of `[offset, offset + len)`.
    fn for_each_piece(offset: usize, len: usize, mut f: impl FnMut(usize, usize, Range<usize>)) {
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let in_chunk = pos % CHUNK_BYTES;
            let n = (CHUNK_BYTES - in_chunk).min(len - done);
            f(pos / CHUNK_BYTES, in_chunk, done..done + n);
            done += n;
        }
    }

    pub(super) fn read(&self, offset: usize, buf: &mut [u8]) {
        Image::for_each_piece(offset, buf.len(), |ci, at, r| {
            let n = r.len();
            buf[r].copy_from_slice(&self.chunks[ci][at..at + n]);
        });
    }

    pub(super) fn write(&mut self, offset: usize, data: &[u8]) {
        Image::for_each_piece(offset, data.len(), |ci, at, r| {
            let n = r.len();
            Arc::make_mut(&mut self.chunks[ci])[at..at + n].copy_from_slice(&data[r]);
        });
    }

    /// Makes the chunks covering `[offset, offset + len)` the same chunks as
    /// `other`'s. Whole chunks are shared, so this is only right where the
    /// two images already agree outside that range within those chunks.
    pub(super) fn share_from(&mut self, other: &Image, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset / CHUNK_BYTES;
        let last = (offset + len - 1) / CHUNK_BYTES;
        self.chunks[first..=last].clone_from_slice(&other.chunks[first..=last]);
    }

    pub(super) fn to_vec(&self, size: usize) -> Vec<u8> {
        let mut out = vec![0; size];
        self.read(0, &mut out);
        out
    }
}
