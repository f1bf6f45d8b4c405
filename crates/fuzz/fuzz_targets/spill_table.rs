//! libFuzzer entry point of [`iomapfs_fuzz::spill_table`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::spill_table(data));
