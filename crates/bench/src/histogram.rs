//! A log-linear latency histogram: exact below [`LINEAR_LIMIT`] ns, then
//! [`SUB_BUCKETS`] equal-width buckets per power of two, so every recorded
//! value is known to within 1/[`SUB_BUCKETS`] of itself (< 1.6 %) at any
//! magnitude. Count, sum, min and max are kept exactly, so the mean is exact.
//!
//! One histogram per measuring thread (no sharing on the hot path); merged
//! at the end.

/// log2 of [`SUB_BUCKETS`].
const SUB_BITS: u32 = 6;
/// Buckets per power of two above the linear range.
pub const SUB_BUCKETS: u64 = 1 << SUB_BITS;
/// Values below this are counted in exact one-nanosecond buckets.
pub const LINEAR_LIMIT: u64 = 2 * SUB_BUCKETS;
/// Largest shift a u64 value can need: msb 63 minus SUB_BITS.
const MAX_SHIFT: u64 = 63 - SUB_BITS as u64;
/// Bucket count: the linear range, then SUB_BUCKETS per shift 1..=MAX_SHIFT.
const BUCKETS: usize = ((MAX_SHIFT + 2) * SUB_BUCKETS) as usize;

#[derive(Clone, Debug)]
pub struct Histogram {
    buckets: Vec<u64>,
    count: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new()
    }
}

impl Histogram {
    pub fn new() -> Histogram {
        Histogram {
            buckets: vec![0; BUCKETS],
            count: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    fn index(value: u64) -> usize {
        if value < LINEAR_LIMIT {
            return value as usize;
        }
        let msb = 63 - u64::from(value.leading_zeros());
        let shift = msb - u64::from(SUB_BITS);
        let top = value >> shift; // in [SUB_BUCKETS, 2 * SUB_BUCKETS)
        (shift * SUB_BUCKETS + top) as usize
    }

    /// The smallest value counted in bucket `index`, and the bucket's width.
    fn bucket_range(index: usize) -> (u64, u64) {
        let index = index as u64;
        if index < LINEAR_LIMIT {
            return (index, 1);
        }
        let shift = index / SUB_BUCKETS - 1;
        let top = index % SUB_BUCKETS + SUB_BUCKETS;
        (top << shift, 1 << shift)
    }

    pub fn record(&mut self, value: u64) {
        self.buckets[Self::index(value)] += 1;
        self.count += 1;
        self.sum += u128::from(value);
        self.min = self.min.min(value);
        self.max = self.max.max(value);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Exact mean; 0 when empty.
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    pub fn min(&self) -> Option<u64> {
        (self.count > 0).then_some(self.min)
    }

    pub fn max(&self) -> Option<u64> {
        (self.count > 0).then_some(self.max)
    }

    /// The value at quantile `q` (0..=1): the middle of the bucket holding
    /// the `ceil(q * count)`-th smallest value, clamped to the exact min and
    /// max. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (index, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (low, width) = Self::bucket_range(index);
                return (low + width / 2).clamp(self.min, self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_and_range_agree_everywhere() {
        let mut probes = vec![0u64, 1, 127, 128, 129, 255, 256, 1000, u64::MAX];
        for shift in 0..64 {
            probes.push(1 << shift);
            probes.push((1u64 << shift).wrapping_sub(1));
            probes.push((1u64 << shift) + (1 << shift) / 3);
        }
        let mut last = 0;
        for v in probes {
            let i = Histogram::index(v);
            assert!(i < BUCKETS, "{v} -> {i}");
            let (low, width) = Histogram::bucket_range(i);
            assert!(
                low <= v && v - low < width,
                "{v} in bucket {i} = [{low}, +{width})"
            );
            // Relative width bound above the linear range.
            if v >= LINEAR_LIMIT {
                assert!(width * SUB_BUCKETS <= low, "bucket too wide at {v}");
            }
            last = last.max(i);
        }
        assert_eq!(last, BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let mut h = Histogram::new();
        for v in 1..=10_000u64 {
            h.record(v * 100);
        }
        assert_eq!(h.count(), 10_000);
        assert!((h.mean() - 500_050.0).abs() < 1e-6);
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.016, "p99 {p99}");
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.016, "p50 {p50}");
        assert_eq!(h.quantile(1.0), 1_000_000);
        assert_eq!(h.quantile(0.0), 100);
    }

    #[test]
    fn merge_is_the_sum() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        for v in 0..1000 {
            a.record(v);
            b.record(v + 5000);
        }
        let mut m = a.clone();
        m.merge(&b);
        assert_eq!(m.count(), 2000);
        assert_eq!(m.min(), Some(0));
        assert_eq!(m.max(), Some(5999));
        assert!((m.mean() - (a.mean() + b.mean()) / 2.0).abs() < 1e-9);
        assert_eq!(Histogram::new().quantile(0.99), 0);
    }
}
