//! libFuzzer entry point of [`iomapfs_fuzz::checkpoint_delta`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::checkpoint_delta(data));
