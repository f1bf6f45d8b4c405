//! Manual runs of the benchmark engine with an indicatif progress bar, until
//! `iomapfs bench` is wired into the CLI:
//!
//! ```text
//! cargo run --release -p iomapfs-bench --example bench -- \
//!     [--device PATH] [--runtime SECS] [--workload NAME]... [--json FILE] \
//!     [--no-kernel] [--force] [--backend auto|sync|uring]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use iomapfs_bench::{render_table, run, BenchOptions, Progress};

struct Bar(ProgressBar);

impl Progress for Bar {
    fn set_length(&self, steps: u64) {
        self.0.set_length(steps);
    }
    fn set_message(&self, message: &str) {
        self.0.set_message(message.to_string());
    }
    fn inc(&self, steps: u64) {
        self.0.inc(steps);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

fn usage() -> String {
    let mut text = String::from(
        "usage: bench [--device PATH] [--runtime SECS] [--workload NAME]... [--json FILE] \
         [--no-kernel] [--force] [--backend auto|sync|uring]\nworkloads:\n",
    );
    for (name, summary) in iomapfs_bench::workloads() {
        text.push_str(&format!("  {name:<28} {summary}\n"));
    }
    text
}

fn parse() -> Result<BenchOptions, String> {
    let mut opts = BenchOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--device" => opts.device = Some(PathBuf::from(value()?)),
            "--runtime" => {
                let secs: f64 = value()?.parse().map_err(|e| format!("--runtime: {e}"))?;
                opts.runtime =
                    Duration::try_from_secs_f64(secs).map_err(|e| format!("--runtime: {e}"))?;
            }
            "--workload" => opts.workloads.push(value()?),
            "--json" => opts.json = Some(PathBuf::from(value()?)),
            "--backend" => opts.backend = value()?.parse().map_err(|e| format!("{e}"))?,
            "--no-kernel" => opts.no_kernel = true,
            "--force" => opts.force = true,
            "-h" | "--help" => return Err(usage()),
            other => return Err(format!("unknown argument {other}\n{}", usage())),
        }
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(opts) => opts,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    match run(&opts, &Bar(bar)) {
        Ok(report) => {
            print!("{}", render_table(&report));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::from(1)
        }
    }
}
