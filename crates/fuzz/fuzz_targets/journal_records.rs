//! libFuzzer entry point of [`iomapfs_fuzz::journal_records`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iomapfs_fuzz::journal_records(data));
