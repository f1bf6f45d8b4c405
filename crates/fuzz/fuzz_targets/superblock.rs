//! libFuzzer entry point of [`iomapfs_fuzz::superblock`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::superblock(data));
