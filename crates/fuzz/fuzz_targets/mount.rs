//! libFuzzer entry point of [`iomapfs_fuzz::mount`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::mount(data));
