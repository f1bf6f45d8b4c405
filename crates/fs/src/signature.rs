//! What a device already holds, judged from its first bytes: tools refuse to
//! format over a file system or partition table unless told to.

use crate::superblock::SUPERBLOCK_MAGIC;

/// Bytes from the start of a device that [`recognise`] looks at.
pub const SIGNATURE_PROBE_BYTES: usize = 4096;

/// Where each known signature sits, and what it means.
const SIGNATURES: [(usize, &[u8], &str); 5] = [
    (0, &SUPERBLOCK_MAGIC, "an iomapfs volume"),
    (0, b"XFSB", "an XFS file system"),
    (1080, &[0x53, 0xEF], "an ext2/ext3/ext4 file system"),
    (512, b"EFI PART", "a GPT partition table"),
    (510, &[0x55, 0xAA], "an MBR partition table or boot sector"),
];

/// What the first [`SIGNATURE_PROBE_BYTES`] of a device say it holds, if
/// anything recognisable.
pub fn recognise(head: &[u8]) -> Option<&'static str> {
    SIGNATURES.iter().find_map(|&(offset, magic, what)| {
        (head.get(offset..offset + magic.len()) == Some(magic)).then_some(what)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_each_signature_and_nothing_in_zeros() {
        assert_eq!(recognise(&[0u8; SIGNATURE_PROBE_BYTES]), None);
        assert_eq!(recognise(&[]), None);
        for &(offset, magic, what) in &SIGNATURES {
            let mut head = vec![0u8; SIGNATURE_PROBE_BYTES];
            head[offset..offset + magic.len()].copy_from_slice(magic);
            assert_eq!(recognise(&head), Some(what));
        }
    }
}
