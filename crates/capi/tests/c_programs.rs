//! The C side of libiomapfs, built with the system compiler (`cc`) against
//! the checked-in header and the library cargo just built, and run:
//! - `tests/c/test_api.c` on each backend (sync always; io_uring where the
//!   kernel has it), and once under valgrind (memcheck: no error, no
//!   definite leak), which checks the Rust side's memory use as well;
//! - the README's C example (its ```c block) against the shared library.
//!
//! Without `cc` or valgrind these tests say why and pass, unless
//! `IOMAPFS_REQUIRE_PRIVILEGED=1` (CI), which makes that a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn required() -> bool {
    std::env::var("IOMAPFS_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// Skips (or, in CI, fails) when `program` is missing.
fn have(program: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            !required(),
            "{program} not found, and IOMAPFS_REQUIRE_PRIVILEGED=1 (CI) needs it"
        );
        eprintln!("skipped: {program} not found");
    }
    found
}

/// The directory holding libiomapfs.a and libiomapfs.so of this build:
/// cargo builds the library (all its crate types) before this test, into
/// the profile directory's `deps`.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        if dir.join("libiomapfs.a").is_file() && dir.join("libiomapfs.so").is_file() {
            return dir.to_path_buf();
        }
    }
    panic!("libiomapfs.a/.so not found next to {}", exe.display());
}

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn run(cmd: &mut Command) -> String {
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("{shown}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{text}",
        out.status
    );
    text
}

/// Compiles `source` into `out`, statically linked with libiomapfs.a
/// (`static_link`) or dynamically with libiomapfs.so.
fn compile(source: &Path, out: &Path, static_link: bool) {
    let lib = lib_dir();
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-D_DEFAULT_SOURCE")
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(source)
        .arg("-o")
        .arg(out);
    if static_link {
        // What `cargo rustc -- --print native-static-libs` lists.
        cc.arg(lib.join("libiomapfs.a")).args([
            "-lgcc_s",
            "-lutil",
            "-lrt",
            "-lpthread",
            "-lm",
            "-ldl",
            "-lc",
        ]);
    } else {
        cc.arg("-L")
            .arg(&lib)
            .arg("-liomapfs")
            .arg(format!("-Wl,-rpath,{}", lib.display()));
    }
    run(&mut cc);
}

fn build_test_api(dir: &Path) -> PathBuf {
    let exe = dir.join("test_api");
    compile(&crate_dir().join("tests/c/test_api.c"), &exe, true);
    exe
}

#[test]
fn c_tests_pass_on_the_sync_backend() {
    if !have("cc") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = build_test_api(dir.path());
    let out = run(Command::new(&exe).arg(dir.path()).arg("sync"));
    assert!(out.contains("checks passed"), "{out}");
}

#[test]
fn c_tests_pass_on_the_chosen_backend() {
    if !have("cc") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = build_test_api(dir.path());
    let out = run(Command::new(&exe).arg(dir.path()).arg("auto"));
    assert!(out.contains("checks passed"), "{out}");
}

#[test]
fn c_tests_run_clean_under_valgrind() {
    if !have("cc") || !have("valgrind") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = build_test_api(dir.path());
    let out = run(Command::new("valgrind")
        .args([
            "--tool=memcheck",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "--show-leak-kinds=definite",
        ])
        .arg(&exe)
        .arg(dir.path())
        .arg("sync"));
    assert!(out.contains("checks passed"), "{out}");
    assert!(out.contains("ERROR SUMMARY: 0 errors"), "{out}");
}

#[test]
fn readme_example_builds_and_runs_against_the_shared_library() {
    if !have("cc") {
        return;
    }
    let readme = std::fs::read_to_string(crate_dir().join("../../README.md")).unwrap();
    let (_, after) = readme
        .split_once("```c\n")
        .expect("README.md has a ```c block");
    let (code, _) = after.split_once("```").expect("the ```c block ends");
    assert!(code.contains("iomapfs_queue_reap"), "not the C API example");
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("example.c");
    std::fs::write(&source, code).unwrap();
    let exe = dir.path().join("example");
    compile(&source, &exe, false);
    let out = run(Command::new(&exe).arg(dir.path().join("vol.img")));
    assert!(
        out.contains("read 4096 bytes, first byte 7, token 7"),
        "{out}"
    );
}
