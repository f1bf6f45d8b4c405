//! libFuzzer entry point of [`iomapfs_fuzz::extent_pages`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::extent_pages(data));
