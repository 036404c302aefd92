//! Timing and statistics: medians, timed repetitions, and times and rates as report text.

use std::time::{Duration, Instant};

/// Bytes in a (decimal) gigabyte: every rate and size the programs print is in GB or GB/s.
pub const GB: f64 = 1e9;

/// The median of `v` (of an even count, the upper of the two middle values); NaN when `v` is
/// empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The median of `v` (of an even count, the upper of the two middle values); `None` when `v` is
/// empty.
pub fn median_duration(mut v: Vec<Duration>) -> Option<Duration> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

/// Seconds as milliseconds with two decimals: `12.34 ms`.
pub fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1e3)
}

/// A rate in bytes per second as `12.3 GB/s` (with `decimals`), or `why` when there is none.
pub fn gbps(rate: Option<f64>, decimals: usize, why: &str) -> String {
    match rate {
        Some(r) => format!("{:.*} GB/s", decimals, r / GB),
        None => why.to_string(),
    }
}

/// `a / b`, or `None` when `b` is zero (a floor or a ceiling that does not exist).
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b != 0.0).then(|| a / b)
}

/// How a figure is timed: untimed warm-up runs, then timed runs whose median counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeats {
    /// Runs before the timed ones, not timed.
    pub warm_up: usize,
    /// Timed runs.
    pub timed: usize,
}

impl Repeats {
    /// `warm_up` untimed runs, then `timed` timed ones.
    pub fn new(warm_up: usize, timed: usize) -> Self {
        Repeats { warm_up, timed }
    }

    /// All runs, the warm-up ones first.
    pub fn total(self) -> usize {
        self.warm_up + self.timed
    }

    /// Whether run `k` (counting from 0 over [`Repeats::total`]) is timed.
    pub fn is_timed(self, k: usize) -> bool {
        k >= self.warm_up
    }

    /// The median time in seconds of `run` (which must wait for the work it queues); `before`
    /// runs before each run, outside the timer (e.g. waiting for a stream to be idle).
    pub fn median_secs<E>(
        self,
        before: impl FnMut() -> Result<(), E>,
        mut run: impl FnMut() -> Result<(), E>,
    ) -> Result<f64, E> {
        self.median_of(before, || {
            let t = Instant::now();
            run()?;
            Ok(t.elapsed().as_secs_f64())
        })
    }

    /// The median of the seconds `run` measures itself (e.g. of one of several steps); `before`
    /// runs before each run.
    pub fn median_of<E>(
        self,
        mut before: impl FnMut() -> Result<(), E>,
        mut run: impl FnMut() -> Result<f64, E>,
    ) -> Result<f64, E> {
        let mut ts = Vec::with_capacity(self.timed);
        for k in 0..self.total() {
            before()?;
            let t = run()?;
            if self.is_timed(k) {
                ts.push(t);
            }
        }
        Ok(median(ts))
    }
}

/// Nothing to do before a run ([`Repeats::median_secs`]).
pub fn nothing<E>() -> Result<(), E> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(Vec::new()).is_nan());
        let d = Duration::from_millis;
        assert_eq!(median_duration(vec![d(5), d(1), d(3)]), Some(d(3)));
        assert_eq!(median_duration(Vec::new()), None);
    }

    #[test]
    fn text() {
        assert_eq!(ms(0.012345), "12.35 ms");
        assert_eq!(gbps(Some(123.45e9), 1, "n/a"), "123.5 GB/s");
        assert_eq!(gbps(Some(123.45e9), 0, "n/a"), "123 GB/s");
        assert_eq!(gbps(None, 1, "n/a (W = 1)"), "n/a (W = 1)");
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert_eq!(ratio(3.0, 0.0), None);
    }

    #[test]
    fn repeats_time_only_after_the_warm_up() {
        let r = Repeats::new(2, 3);
        assert_eq!(r.total(), 5);
        assert!(!r.is_timed(1) && r.is_timed(2));
        let (mut before, mut runs) = (0, 0);
        let t = r
            .median_secs::<()>(
                || {
                    before += 1;
                    Ok(())
                },
                || {
                    runs += 1;
                    Ok(())
                },
            )
            .unwrap_or(f64::NAN);
        assert_eq!((before, runs), (5, 5));
        assert!(t >= 0.0);
        assert_eq!(r.median_secs(nothing, || Err("stop")), Err("stop"));
        let mut k = 0.0;
        let got = r.median_of::<()>(nothing, || {
            k += 1.0;
            Ok(k)
        });
        assert_eq!(got, Ok(4.0)); // runs 3, 4, 5 are timed
    }
}
