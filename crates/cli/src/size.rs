//! Byte counts on the command line and in reports.
//!
//! Parsing follows xfs_io's `cvtnum`: a decimal or `0x` hexadecimal number,
//! optionally followed by a binary unit suffix. Reports follow xfs_io's
//! `cvtstr` (`4 KiB`, `97.656 MiB`) and `timestr` (`0.0001 sec`,
//! `0:00:02.16`).

use std::time::Duration;

/// Parses a byte count: `4096`, `0x1000`, `4k`, `4K`, `4KiB`, `1.5m` is *not*
/// accepted (whole numbers only, like xfs_io). Suffixes are binary:
/// `k`=2^10, `m`=2^20, `g`=2^30, `t`=2^40, `p`=2^50, `e`=2^60; `s` is a
/// 512-byte sector and `b` is one file-system block (`block_size`), as in
/// xfs_io. A trailing `b`/`ib`/`iB` after a multiple (`4kb`, `4KiB`) is allowed.
pub fn parse_size(text: &str, block_size: u64) -> Result<u64, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty number".to_string());
    }
    let (digits, radix, rest) =
        if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            let end = hex
                .find(|c: char| !c.is_ascii_hexdigit())
                .unwrap_or(hex.len());
            (&hex[..end], 16, &hex[end..])
        } else {
            let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            (&s[..end], 10, &s[end..])
        };
    if digits.is_empty() {
        return Err(format!(
            "'{text}' is not a number (expected e.g. 4096, 0x1000, 64k, 16m, 1g)"
        ));
    }
    let value = u64::from_str_radix(digits, radix).map_err(|_| format!("'{text}' is too large"))?;
    let multiplier = suffix_multiplier(rest, block_size).ok_or_else(|| {
        format!(
            "'{text}' has an unknown unit suffix '{rest}' (use k, m, g, t, p, e \
             for KiB..EiB, s for 512-byte sectors, b for file-system blocks)"
        )
    })?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("'{text}' is too large (over 2^64 bytes)"))
}

fn suffix_multiplier(suffix: &str, block_size: u64) -> Option<u64> {
    let lower = suffix.to_ascii_lowercase();
    let unit = match lower.as_str() {
        "" => return Some(1),
        "b" => return Some(block_size),
        "s" => return Some(512),
        other => {
            let rest = other
                .strip_suffix("ib")
                .or_else(|| other.strip_suffix('b'))
                .unwrap_or(other);
            rest
        }
    };
    let shift = match unit {
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        "e" => 60,
        _ => return None,
    };
    Some(1u64 << shift)
}

/// xfs_io's `cvtstr`: `4 KiB` when the byte count is a whole number,
/// `97.656 MiB` otherwise; `512.000000 bytes` below one KiB.
pub fn cvtstr(value: f64) -> String {
    const UNITS: [(&str, i32); 6] = [
        ("EiB", 60),
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ];
    let precise = value.fract() == 0.0;
    for (name, shift) in UNITS {
        let unit = 2f64.powi(shift);
        if value >= unit {
            let scaled = value / unit;
            return if precise {
                format!("{scaled:.0} {name}")
            } else {
                format!("{scaled:.3} {name}")
            };
        }
    }
    format!("{value:.6} bytes")
}

/// xfs_io's `timestr`: `0.0123 sec` under a second, `H:MM:SS.cc` otherwise.
pub fn timestr(elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    let frac = elapsed.subsec_micros();
    if secs == 0 {
        format!("0.{:04} sec", frac / 100)
    } else {
        format!(
            "{}:{:02}:{:02}.{:02}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60,
            frac / 10_000
        )
    }
}

/// `value / elapsed`, with xfs_io's convention of never dividing by zero.
pub fn per_second(value: f64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        value / secs
    } else {
        // xfs_io uses microsecond timing; treat "too fast to measure" as 1 us.
        value * 1e6
    }
}

/// Human-readable size for summaries, exact where it can be:
/// `16 MiB (16777216 bytes)`, `14.75 MiB (15462400 bytes)`, `512 bytes`.
/// (Unlike [`cvtstr`], never rounds 14.75 MiB to "15 MiB".)
pub fn human_bytes(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", short_bytes(bytes))
}

/// [`human_bytes`] without the exact count: `16 MiB`, `14.75 MiB`.
pub fn short_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u32); 6] = [
        ("EiB", 60),
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ];
    for (name, shift) in UNITS {
        let unit = 1u64 << shift;
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes >> shift)
            } else {
                format!("{:.2} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_hex_numbers() {
        assert_eq!(parse_size("0", 4096), Ok(0));
        assert_eq!(parse_size("4096", 4096), Ok(4096));
        assert_eq!(parse_size("0x1000", 4096), Ok(4096));
        assert_eq!(parse_size("0X10", 4096), Ok(16));
        assert_eq!(parse_size(" 12 ", 4096), Ok(12));
    }

    #[test]
    fn binary_suffixes() {
        assert_eq!(parse_size("4k", 4096), Ok(4096));
        assert_eq!(parse_size("4K", 4096), Ok(4096));
        assert_eq!(parse_size("4KiB", 4096), Ok(4096));
        assert_eq!(parse_size("4kb", 4096), Ok(4096));
        assert_eq!(parse_size("16m", 4096), Ok(16 << 20));
        assert_eq!(parse_size("1g", 4096), Ok(1 << 30));
        assert_eq!(parse_size("2T", 4096), Ok(2 << 40));
        assert_eq!(parse_size("1p", 4096), Ok(1 << 50));
        assert_eq!(parse_size("1e", 4096), Ok(1 << 60));
        assert_eq!(parse_size("3s", 4096), Ok(1536));
        assert_eq!(parse_size("2b", 4096), Ok(8192));
        assert_eq!(parse_size("2b", 512), Ok(1024));
        assert_eq!(parse_size("0x10k", 4096), Ok(16 << 10));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        for bad in [
            "",
            "k",
            "abc",
            "-1",
            "4x",
            "4 k",
            "1.5m",
            "4kk",
            "0x",
            "16e",
            "99999999999999999999",
            "18446744073709551615k",
        ] {
            assert!(parse_size(bad, 4096).is_err(), "{bad:?} should be rejected");
        }
        let msg = parse_size("4q", 4096).unwrap_err();
        assert!(msg.contains("suffix"), "{msg}");
        let msg = parse_size("lots", 4096).unwrap_err();
        assert!(msg.contains("not a number"), "{msg}");
    }

    #[test]
    fn cvtstr_matches_xfs_io() {
        assert_eq!(cvtstr(4096.0), "4 KiB");
        assert_eq!(cvtstr(65536.0), "64 KiB");
        assert_eq!(cvtstr(1048576.0), "1 MiB");
        assert_eq!(cvtstr(512.0), "512.000000 bytes");
        assert_eq!(cvtstr(102400000.0 / 1.0000001), "97.656 MiB");
        assert_eq!(cvtstr((1u64 << 30) as f64), "1 GiB");
    }

    #[test]
    fn human_bytes_is_exact() {
        assert_eq!(human_bytes(16 << 20), "16 MiB (16777216 bytes)");
        assert_eq!(human_bytes(15462400), "14.75 MiB (15462400 bytes)");
        assert_eq!(short_bytes(512), "512 bytes");
        assert_eq!(short_bytes(0), "0 bytes");
        assert_eq!(short_bytes(1536), "1.50 KiB");
    }

    #[test]
    fn timestr_matches_xfs_io() {
        assert_eq!(timestr(Duration::from_micros(100)), "0.0001 sec");
        assert_eq!(timestr(Duration::from_micros(123_456)), "0.1234 sec");
        assert_eq!(timestr(Duration::from_millis(2160)), "0:00:02.16");
        assert_eq!(timestr(Duration::from_secs(3723)), "1:02:03.00");
    }
}
