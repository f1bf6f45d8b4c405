//! The ratios of a buffered workload's rows, each named for its baseline
//! (the goals are read off them):
//! - `ratio_to_xfs`, `cpu_ratio_to_xfs`: IOPS and CPU per I/O over XFS's
//!   of the same variant (goals: IOPS ≥ 2× at 4 KiB, ≥ 1× at 64 KiB and
//!   1 MiB);
//! - `ratio_to_memcpy`: bandwidth over the memcpy ceiling's (goal ≥ 0.8);
//! - `ratio_to_raw_seq_write`: for variants whose window includes
//!   writeback, bandwidth over the raw device's sequential writes (goal
//!   ≥ 0.9);
//! - `fsync_write_ratio_to_raw_seq_write`: the same for the writeback
//!   alone (iomapfs: bytes written during the fsyncs over their time);
//! - `ratio_to_raw_seq_read`: for cold reads, which read every byte from
//!   the device, bandwidth over the raw device's sequential reads (the
//!   device's rate, which bounds them and XFS alike up to its noise).
//!
//! A ratio whose baseline was not measured (no root, no fio) is absent.

use crate::report::BenchResult;
use crate::workload::{BufferedVariant, Op};

/// What a row of a buffered workload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// memcpy of the I/O size: the memory-bandwidth ceiling.
    Ceiling,
    /// The raw device's sequential direct reads (read workloads).
    RawSeqRead,
    /// The raw device's sequential direct writes (write workloads).
    RawSeqWrite,
    /// A target (iomapfs, xfs, ext4) measured in one variant.
    Measured(BufferedVariant),
}

impl Role {
    /// The raw device's baseline for a workload of `op`.
    pub fn raw_sequential(op: Op) -> Role {
        match op {
            Op::Read => Role::RawSeqRead,
            Op::Write => Role::RawSeqWrite,
        }
    }

    /// The row's `variant` in results.
    pub fn name(self) -> &'static str {
        match self {
            Role::Ceiling => "ceiling",
            Role::RawSeqRead => "seq-read",
            Role::RawSeqWrite => "seq-write",
            Role::Measured(v) => v.name(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Row {
    pub role: Role,
    pub result: BenchResult,
}

fn ratio(x: f64, base: Option<f64>) -> Option<f64> {
    base.filter(|b| *b > 0.0 && b.is_finite()).map(|b| x / b)
}

/// Fills in every row's ratios from the baselines among `rows`.
pub fn apply(rows: &mut [Row]) {
    let find = |rows: &[Row], role: Role, target: &str| {
        rows.iter()
            .find(|r| r.role == role && r.result.target == target)
            .map(|r| r.result.clone())
    };
    let memcpy_bw = rows
        .iter()
        .find(|r| r.role == Role::Ceiling)
        .map(|r| r.result.bw_bytes);
    let raw_bw = |role: Role| {
        rows.iter()
            .find(|r| r.role == role)
            .map(|r| r.result.bw_bytes)
    };
    let (raw_read_bw, raw_write_bw) = (raw_bw(Role::RawSeqRead), raw_bw(Role::RawSeqWrite));
    let xfs: Vec<Option<BenchResult>> = rows
        .iter()
        .map(|r| match r.role {
            Role::Measured(_) => find(rows, r.role, "xfs"),
            Role::Ceiling | Role::RawSeqRead | Role::RawSeqWrite => None,
        })
        .collect();
    for (row, xfs) in rows.iter_mut().zip(xfs) {
        let r = &mut row.result;
        match row.role {
            Role::Ceiling => r.ratio_to_memcpy = ratio(r.bw_bytes, memcpy_bw),
            Role::RawSeqRead => r.ratio_to_raw_seq_read = ratio(r.bw_bytes, raw_read_bw),
            Role::RawSeqWrite => r.ratio_to_raw_seq_write = ratio(r.bw_bytes, raw_write_bw),
            Role::Measured(variant) => {
                r.ratio_to_memcpy = ratio(r.bw_bytes, memcpy_bw);
                if let Some(x) = &xfs {
                    r.ratio_to_xfs = ratio(r.iops, Some(x.iops));
                    r.cpu_ratio_to_xfs = r.cpu_per_io.as_ref().and_then(|c| {
                        ratio(c.total_us, x.cpu_per_io.as_ref().map(|xc| xc.total_us))
                    });
                }
                if variant.includes_writeback() {
                    r.ratio_to_raw_seq_write = ratio(r.bw_bytes, raw_write_bw);
                    r.fsync_write_ratio_to_raw_seq_write = r
                        .fsync_write_bw_bytes
                        .and_then(|bw| ratio(bw, raw_write_bw));
                }
                if variant == BufferedVariant::Cold {
                    r.ratio_to_raw_seq_read = ratio(r.bw_bytes, raw_read_bw);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{CpuPerIo, CPU_SCOPE_PROCESS};

    const WARM: Role = Role::Measured(BufferedVariant::Warm);
    const COLD: Role = Role::Measured(BufferedVariant::Cold);
    const OVERWRITE: Role = Role::Measured(BufferedVariant::Overwrite { fsync: false });
    const OVERWRITE_FSYNC: Role = Role::Measured(BufferedVariant::Overwrite { fsync: true });

    fn row(role: Role, target: &str, iops: f64, cpu_us: Option<f64>) -> Row {
        Row {
            role,
            result: BenchResult {
                workload: "buffered-x-64k".into(),
                variant: Some(role.name().into()),
                target: target.into(),
                iops,
                bw_bytes: iops * 65536.0,
                cpu_per_io: cpu_us.map(|total_us| CpuPerIo {
                    total_us,
                    user_us: total_us,
                    system_us: 0.0,
                    scope: CPU_SCOPE_PROCESS.into(),
                    io_threads_us: None,
                }),
                ..BenchResult::default()
            },
        }
    }

    fn get<'a>(rows: &'a [Row], role: Role, target: &str) -> &'a BenchResult {
        &rows
            .iter()
            .find(|r| r.role == role && r.result.target == target)
            .unwrap()
            .result
    }

    #[test]
    fn each_row_is_compared_with_xfs_of_its_own_variant_and_with_memcpy() {
        let mut rows = vec![
            row(Role::Ceiling, "memcpy", 200_000.0, Some(5.0)),
            row(WARM, "iomapfs", 100_000.0, Some(8.0)),
            row(WARM, "xfs", 50_000.0, Some(16.0)),
            row(WARM, "ext4", 40_000.0, None),
            row(COLD, "iomapfs", 30_000.0, Some(30.0)),
            row(COLD, "xfs", 10_000.0, Some(20.0)),
        ];
        apply(&mut rows);
        let warm = get(&rows, WARM, "iomapfs");
        assert_eq!(warm.ratio_to_xfs, Some(2.0));
        assert_eq!(warm.cpu_ratio_to_xfs, Some(0.5));
        assert_eq!(warm.ratio_to_memcpy, Some(0.5));
        let cold = get(&rows, COLD, "iomapfs");
        assert_eq!(cold.ratio_to_xfs, Some(3.0));
        assert_eq!(cold.cpu_ratio_to_xfs, Some(1.5));
        assert_eq!(cold.ratio_to_memcpy, Some(0.15));
        let xfs = get(&rows, WARM, "xfs");
        assert_eq!(
            (xfs.ratio_to_xfs, xfs.cpu_ratio_to_xfs),
            (Some(1.0), Some(1.0))
        );
        let ext4 = get(&rows, WARM, "ext4");
        assert_eq!(
            (ext4.ratio_to_xfs, ext4.cpu_ratio_to_xfs),
            (Some(0.8), None)
        );
        let memcpy = get(&rows, Role::Ceiling, "memcpy");
        assert_eq!(memcpy.ratio_to_memcpy, Some(1.0));
        assert_eq!(memcpy.ratio_to_xfs, None);
        // No writes here: nothing is compared with raw, nothing with raw's
        // baseline of direct workloads.
        assert!(rows
            .iter()
            .all(|r| r.result.ratio_to_raw_seq_write.is_none()));
        assert!(rows.iter().all(|r| r.result.ratio_to_raw.is_none()));
    }

    #[test]
    fn only_windows_with_writeback_are_compared_with_raw_sequential_writes() {
        let mut rows = vec![
            row(Role::RawSeqWrite, "raw", 1_000.0, Some(1.0)),
            row(OVERWRITE, "iomapfs", 100_000.0, None),
            row(OVERWRITE_FSYNC, "iomapfs", 900.0, None),
            row(OVERWRITE_FSYNC, "xfs", 1_800.0, None),
        ];
        apply(&mut rows);
        assert_eq!(
            get(&rows, Role::RawSeqWrite, "raw").ratio_to_raw_seq_write,
            Some(1.0)
        );
        assert_eq!(
            get(&rows, OVERWRITE, "iomapfs").ratio_to_raw_seq_write,
            None
        );
        assert_eq!(
            get(&rows, OVERWRITE_FSYNC, "iomapfs").ratio_to_raw_seq_write,
            Some(0.9)
        );
        assert_eq!(
            get(&rows, OVERWRITE_FSYNC, "xfs").ratio_to_raw_seq_write,
            Some(1.8)
        );
        assert_eq!(
            get(&rows, OVERWRITE_FSYNC, "iomapfs").ratio_to_xfs,
            Some(0.5)
        );
        // No xfs row for plain overwrite, no memcpy row: no such ratios.
        let plain = get(&rows, OVERWRITE, "iomapfs");
        assert_eq!((plain.ratio_to_xfs, plain.ratio_to_memcpy), (None, None));
    }

    #[test]
    fn only_cold_reads_are_compared_with_raw_sequential_reads() {
        let mut rows = vec![
            row(Role::RawSeqRead, "raw", 2_000.0, Some(1.0)),
            row(WARM, "iomapfs", 100_000.0, None),
            row(COLD, "iomapfs", 1_900.0, None),
            row(COLD, "xfs", 1_600.0, None),
        ];
        apply(&mut rows);
        assert_eq!(
            get(&rows, Role::RawSeqRead, "raw").ratio_to_raw_seq_read,
            Some(1.0)
        );
        assert_eq!(get(&rows, WARM, "iomapfs").ratio_to_raw_seq_read, None);
        assert_eq!(
            get(&rows, COLD, "iomapfs").ratio_to_raw_seq_read,
            Some(0.95)
        );
        assert_eq!(get(&rows, COLD, "xfs").ratio_to_raw_seq_read, Some(0.8));
        // Reads are never compared with the device's writes.
        assert!(rows
            .iter()
            .all(|r| r.result.ratio_to_raw_seq_write.is_none()));
    }
}
