//! Every file of the seed corpus (`corpus/TARGET/`) and of the regressions
//! (`regressions/TARGET/`: inputs that once crashed a target) runs through
//! its target as an ordinary test, on any toolchain.

use std::path::{Path, PathBuf};

use iomapfs_fuzz::{seeds, TARGETS};

fn dir(kind: &str, target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(kind)
        .join(target)
}

fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn corpus_and_regressions_run_clean() {
    let mut ran = 0;
    for (name, target) in TARGETS {
        for kind in ["corpus", "regressions"] {
            for (path, data) in files(&dir(kind, name)) {
                let r = std::panic::catch_unwind(|| target(&data));
                assert!(r.is_ok(), "{name}: {} panics", path.display());
                ran += 1;
            }
        }
    }
    eprintln!("corpus: {ran} inputs");
}

/// Every target has a seed corpus in the tree (a fuzz run starts from
/// it). `IOMAPFS_WRITE_CORPUS=1` adds fresh seeds made from a real volume
/// (after a format change, say).
#[test]
fn every_target_has_a_seed_corpus() {
    let write = std::env::var_os("IOMAPFS_WRITE_CORPUS").is_some();
    for (name, _) in TARGETS {
        let d = dir("corpus", name);
        if write {
            std::fs::create_dir_all(&d).unwrap();
            for (i, seed) in seeds(name).into_iter().enumerate() {
                std::fs::write(d.join(format!("seed-{i:02}")), &seed).unwrap();
            }
        }
        assert!(
            !files(&d).is_empty(),
            "{name}: no seed corpus in {} (IOMAPFS_WRITE_CORPUS=1 cargo test -p iomapfs-fuzz writes one)",
            d.display()
        );
    }
}
