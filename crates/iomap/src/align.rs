//! Alignment arithmetic for byte offsets.
//!
//! Every helper tolerates an alignment of zero (a corrupt image or a bad
//! probe must give an error somewhere, not a division-by-zero panic here):
//! nothing is aligned to zero, and rounding by zero leaves the value as is.

/// `x` is a multiple of `align` (never true for `align == 0`).
pub fn is_aligned(x: u64, align: u64) -> bool {
    x.checked_rem(align) == Some(0)
}

/// The largest multiple of `align` not above `x`.
pub fn align_down(x: u64, align: u64) -> u64 {
    x - x.checked_rem(align).unwrap_or(0)
}

/// The smallest multiple of `align` not below `x`; `None` on overflow.
pub fn align_up(x: u64, align: u64) -> Option<u64> {
    match x.checked_rem(align) {
        None | Some(0) => Some(x),
        Some(r) => x.checked_add(align - r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert!(is_aligned(8192, 4096) && !is_aligned(8193, 4096));
        assert!(!is_aligned(0, 0));
        assert_eq!(align_down(5000, 4096), 4096);
        assert_eq!(align_down(5000, 0), 5000);
        assert_eq!(align_up(5000, 4096), Some(8192));
        assert_eq!(align_up(8192, 4096), Some(8192));
        assert_eq!(align_up(u64::MAX - 1, 4096), None);
    }
}
