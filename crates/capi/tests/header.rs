//! The checked-in C header is what cbindgen makes of the crate now: fails
//! (with the difference) when someone changed the API without regenerating
//! it. `IOMAPFS_BLESS_HEADER=1` rewrites it instead.

use std::path::Path;

#[test]
fn checked_in_header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not read the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = crate_dir.join("include/iomapfs.h");
    if std::env::var_os("IOMAPFS_BLESS_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let first = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "{} is not current (first difference at line {}): regenerate it with \
             IOMAPFS_BLESS_HEADER=1 cargo test -p iomapfs-capi --test header\n\
             checked in: {:?}\ngenerated:  {:?}",
            path.display(),
            first + 1,
            checked_in.lines().nth(first),
            generated.lines().nth(first),
        );
    }
}

#[test]
fn header_declares_every_entry_point() {
    let header = include_str!("../include/iomapfs.h");
    for name in [
        "iomapfs_format",
        "iomapfs_volume_open",
        "iomapfs_volume_close",
        "iomapfs_file_open",
        "iomapfs_pread",
        "iomapfs_pwrite",
        "iomapfs_fsync",
        "iomapfs_fdatasync",
        "iomapfs_fallocate",
        "iomapfs_truncate",
        "iomapfs_file_stat",
        "iomapfs_mkdir",
        "iomapfs_readdir",
        "iomapfs_rename",
        "iomapfs_unlink",
        "iomapfs_queue_create",
        "iomapfs_queue_read",
        "iomapfs_queue_write",
        "iomapfs_queue_submit",
        "iomapfs_queue_reap",
        "iomapfs_volume_cache_info",
        "iomapfs_file_drop_cache",
        "iomapfs_file_cached_bytes",
        "iomapfs_last_error",
    ] {
        assert!(header.contains(&format!(" {name}(")), "{name} missing");
    }
}
