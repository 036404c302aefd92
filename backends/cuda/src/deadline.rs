//! Waiting on GPU work that depends on peer ranks, with a deadline.
//!
//! A stream synchronisation blocks forever when the NCCL kernel on it waits for a peer that
//! stalled or died. [`wait_with_deadline`] polls instead: each round it asks a [`WaitProbe`]
//! whether the work finished, whether the communicator reported an asynchronous error, and
//! whether another rank of the pool already aborted; past the deadline it aborts the
//! communicator (which makes NCCL's kernels and helper threads quit) and returns a typed error.
//! The loop itself is pure logic over the probe, so it is tested without a GPU.

use std::time::{Duration, Instant};

use crate::CudaError;

/// What a deadline-aware wait observes each time it polls.
pub(crate) trait WaitProbe {
    /// `Ok(true)` once the awaited work finished, `Ok(false)` while it runs, `Err` when the
    /// device reported an error (returned as is).
    fn finished(&mut self) -> Result<bool, CudaError>;
    /// An asynchronous error of this rank's communicator, if one occurred (`None` while healthy
    /// or once aborted).
    fn comm_error(&mut self) -> Option<String>;
    /// Why the pool's communicators were aborted, if another rank (or an earlier call) did.
    fn pool_fault(&self) -> Option<String>;
    /// Aborts this rank's communicator and records `cause` as the pool's fault (idempotent).
    fn abort(&mut self, cause: &str);
}

/// How long a wait keeps polling for the aborted work to drain before it returns its error
/// anyway: NCCL's kernels quit within milliseconds of an abort.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// How long a wait only yields between polls: a switch's transfer (5–30 ms at a few billion
/// parameters) is noticed within microseconds of its end.
const YIELD_FOR: Duration = Duration::from_millis(32);

/// The pause before the next poll: none (the core is yielded) during the first [`YIELD_FOR`],
/// then a sleep growing with the time waited, 1/512 of it between 50 and 200 µs. A sleep
/// overshoots by the kernel's timer slack (50 µs on Linux), so a wait past 32 ms ends at most
/// ~0.4 % of its length after its work, and a 10-minute stall polls 4 000 times a second.
pub(crate) fn poll_pause(waited: Duration) -> Duration {
    if waited < YIELD_FOR {
        Duration::ZERO
    } else {
        (waited / 512).clamp(Duration::from_micros(50), Duration::from_micros(200))
    }
}

fn pause(waited: Duration) {
    let p = poll_pause(waited);
    if p.is_zero() {
        std::thread::yield_now();
    } else {
        std::thread::sleep(p);
    }
}

/// Polls `probe` until the work finished (`Ok`), or returns the typed error of what went wrong:
/// - an asynchronous NCCL error: the communicator is aborted, [`CudaError::Nccl`];
/// - another rank aborted the pool's communicators while this work was pending: this rank's
///   communicator is aborted too, [`CudaError::CommAborted`];
/// - `timeout` passed: the communicator is aborted (recording the pool's fault),
///   [`CudaError::CollectiveTimeout`] naming `rank`, `op` and the deadline.
///
/// After an abort it waits up to [`DRAIN_GRACE`] for the aborted work to drain, so buffers the
/// caller frees next are no longer in use.
pub(crate) fn wait_with_deadline(
    probe: &mut impl WaitProbe,
    timeout: Duration,
    rank: usize,
    op: &str,
) -> Result<(), CudaError> {
    let start = Instant::now();
    loop {
        if probe.finished()? {
            return Ok(());
        }
        let failure = if let Some(detail) = probe.comm_error() {
            let cause = format!("rank {rank} hit an NCCL error during {op}: {detail}");
            probe.abort(&cause);
            Some(CudaError::Nccl {
                rank,
                op: op.to_string(),
                detail: format!("{detail} (asynchronous; the communicator was aborted)"),
            })
        } else if let Some(cause) = probe.pool_fault() {
            probe.abort(&cause);
            Some(CudaError::CommAborted {
                rank,
                op: op.to_string(),
                cause,
            })
        } else if start.elapsed() >= timeout {
            let cause = format!(
                "rank {rank} timed out after {:.1} s waiting for {op}",
                timeout.as_secs_f64()
            );
            probe.abort(&cause);
            Some(CudaError::CollectiveTimeout {
                rank,
                op: op.to_string(),
                deadline: timeout,
            })
        } else {
            None
        };
        if let Some(err) = failure {
            drain(probe);
            return Err(err);
        }
        pause(start.elapsed());
    }
}

/// After an abort: polls until the work drained or [`DRAIN_GRACE`] passed (device errors end it
/// too; the caller reports the abort's error, not these).
fn drain(probe: &mut impl WaitProbe) {
    let start = Instant::now();
    while start.elapsed() < DRAIN_GRACE {
        match probe.finished() {
            Ok(false) => pause(start.elapsed()),
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted probe: finishes after `finish_after` polls (never if `None`), reports an async
    /// error at poll `error_at`, sees a pool fault from poll `fault_at`; aborting makes the work
    /// finish `drain_polls` polls later.
    #[derive(Default)]
    struct Script {
        polls: usize,
        finish_after: Option<usize>,
        error_at: Option<usize>,
        fault_at: Option<usize>,
        drain_polls: usize,
        aborted_at: Option<usize>,
        aborts: Vec<String>,
    }

    impl WaitProbe for Script {
        fn finished(&mut self) -> Result<bool, CudaError> {
            self.polls += 1;
            if let Some(a) = self.aborted_at {
                return Ok(self.polls >= a + self.drain_polls);
            }
            Ok(self.finish_after.is_some_and(|n| self.polls > n))
        }
        fn comm_error(&mut self) -> Option<String> {
            (self.aborted_at.is_none() && self.error_at.is_some_and(|n| self.polls >= n))
                .then(|| "ncclRemoteError".to_string())
        }
        fn pool_fault(&self) -> Option<String> {
            self.fault_at
                .filter(|&n| self.polls >= n)
                .map(|_| "rank 1 timed out".to_string())
        }
        fn abort(&mut self, cause: &str) {
            self.aborted_at.get_or_insert(self.polls);
            self.aborts.push(cause.to_string());
        }
    }

    #[test]
    fn finished_work_returns_ok_without_aborting() {
        let mut p = Script {
            finish_after: Some(5),
            ..Default::default()
        };
        wait_with_deadline(&mut p, Duration::from_secs(5), 0, "the transfer").unwrap();
        assert!(p.aborts.is_empty());
        assert_eq!(p.polls, 6);
    }

    #[test]
    fn a_stalled_peer_times_out_with_the_rank_op_and_deadline_after_one_abort() {
        let mut p = Script {
            drain_polls: 3,
            ..Default::default()
        };
        let deadline = Duration::from_millis(60);
        let start = Instant::now();
        let err = wait_with_deadline(&mut p, deadline, 1, "the transfer's NCCL work").unwrap_err();
        let took = start.elapsed();
        assert!(took >= deadline, "{took:?}");
        assert!(took < deadline + Duration::from_secs(1), "{took:?}");
        match &err {
            CudaError::CollectiveTimeout {
                rank,
                op,
                deadline: d,
            } => {
                assert_eq!(
                    (*rank, op.as_str(), *d),
                    (1, "the transfer's NCCL work", deadline)
                );
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(p.aborts.len(), 1, "aborted exactly once");
        assert!(
            p.aborts[0].contains("rank 1 timed out after 0.1 s"),
            "{:?}",
            p.aborts
        );
        assert!(err.is_comm_lost());
        let msg = err.to_string();
        assert!(
            msg.contains("rank 1 waited 0.1 s for the transfer's NCCL work")
                && msg.contains("rebuild")
                && msg.contains("LIFECYCLE_NCCL_TIMEOUT_S"),
            "{msg}"
        );
        // it waited for the aborted work to drain
        assert_eq!(p.polls, p.aborted_at.unwrap() + 3);
    }

    #[test]
    fn an_async_nccl_error_aborts_at_once() {
        let mut p = Script {
            error_at: Some(4),
            ..Default::default()
        };
        let start = Instant::now();
        let err =
            wait_with_deadline(&mut p, Duration::from_secs(60), 0, "ncclGroupEnd").unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(&err, CudaError::Nccl { rank: 0, detail, .. } if detail.contains("ncclRemoteError")),
            "{err:?}"
        );
        assert_eq!(p.aborts.len(), 1);
    }

    #[test]
    fn a_fault_of_another_rank_aborts_this_one_with_the_cause() {
        let mut p = Script {
            fault_at: Some(2),
            ..Default::default()
        };
        let err =
            wait_with_deadline(&mut p, Duration::from_secs(60), 0, "the transfer").unwrap_err();
        match err {
            CudaError::CommAborted { rank, op, cause } => {
                assert_eq!((rank, op.as_str()), (0, "the transfer"));
                assert_eq!(cause, "rank 1 timed out");
            }
            other => panic!("expected CommAborted, got {other:?}"),
        }
        assert_eq!(p.aborts, vec!["rank 1 timed out".to_string()]);
    }

    #[test]
    fn work_that_finished_before_a_fault_is_not_an_error() {
        let mut p = Script {
            finish_after: Some(0),
            fault_at: Some(0),
            ..Default::default()
        };
        wait_with_deadline(&mut p, Duration::from_secs(1), 0, "download").unwrap();
        assert!(p.aborts.is_empty());
    }

    #[test]
    fn the_poll_pause_yields_through_a_switch_then_grows_and_is_capped() {
        assert_eq!(poll_pause(Duration::ZERO), Duration::ZERO);
        assert_eq!(poll_pause(Duration::from_millis(31)), Duration::ZERO);
        assert_eq!(
            poll_pause(Duration::from_millis(32)),
            Duration::from_nanos(62_500)
        );
        assert_eq!(
            poll_pause(Duration::from_millis(40)),
            Duration::from_nanos(78_125)
        );
        assert_eq!(
            poll_pause(Duration::from_secs(600)),
            Duration::from_micros(200)
        );
    }
}
