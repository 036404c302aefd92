//! Handing work between the caller and the rank threads without the scheduler's wake-up cost.
//!
//! A blocked thread woken through a channel (a futex) starts again tens of microseconds later
//! on some kernels and sandboxes (10–45 µs a wake-up measured on a sandboxed H100 host,
//! 2026-12-05), and one switch hands work over six times (the rollout allocation, the
//! transfer, the offload phase, each there and back): a tenth of a millisecond on a 7 ms
//! switch. [`recv_soon`] polls the channel first, yielding between polls, and blocks only when
//! nothing came within its window: the rank threads poll for the next job briefly after each
//! one ([`NEXT_JOB_WINDOW`]), the caller for the ranks' answers for as long as a switch's
//! transfer usually runs ([`ANSWER_WINDOW`]).

use std::sync::mpsc::{Receiver, RecvError, TryRecvError};
use std::time::{Duration, Instant};

/// How long a rank thread polls for its next job before it blocks: the jobs of one switch
/// follow each other within a fraction of a millisecond.
pub(crate) const NEXT_JOB_WINDOW: Duration = Duration::from_millis(2);

/// How long a caller polls for the ranks' answers before it blocks: a switch's transfer at a
/// few billion parameters takes 5–30 ms; longer work (a verification pass, a stalled
/// collective) blocks after it, costing one wake-up.
pub(crate) const ANSWER_WINDOW: Duration = Duration::from_millis(32);

/// The next message of `rx`: polled (yielding the core between polls) for up to `window`, then
/// awaited blocking. `Err` once every sender is gone and the channel is empty, as
/// [`Receiver::recv`].
pub(crate) fn recv_soon<T>(rx: &Receiver<T>, window: Duration) -> Result<T, RecvError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) if start.elapsed() < window => std::thread::yield_now(),
            Err(TryRecvError::Empty) => return rx.recv(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_message_sent_before_or_during_the_window_or_after_it_arrives() {
        let (tx, rx) = channel();
        tx.send(1).unwrap();
        assert_eq!(recv_soon(&rx, Duration::from_millis(1)), Ok(1));
        // Sent while the receiver polls.
        let t = std::thread::spawn({
            let tx = tx.clone();
            move || {
                std::thread::sleep(Duration::from_micros(200));
                tx.send(2).unwrap();
            }
        });
        assert_eq!(recv_soon(&rx, Duration::from_millis(50)), Ok(2));
        t.join().unwrap();
        // Sent after the window: the receiver blocked and still gets it.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(3).unwrap();
        });
        assert_eq!(recv_soon(&rx, Duration::from_millis(1)), Ok(3));
        t.join().unwrap();
        // Every sender gone: an error, not a hang.
        assert_eq!(recv_soon(&rx, Duration::from_millis(1)), Err(RecvError));
    }

    #[test]
    fn a_closed_channel_ends_the_poll_at_once() {
        let (tx, rx) = channel::<u8>();
        drop(tx);
        let start = Instant::now();
        assert_eq!(recv_soon(&rx, Duration::from_secs(10)), Err(RecvError));
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
