//! Hardware ceilings, measured on the ranks of the benchmark's own pool: the NCCL all-gather and
//! grouped send/receive rates, the device-to-device copy rate and the pinned host↔device rates
//! (the copy-engine peer-copy rate is [`lifecycle_cuda::peer_copy_rate`]).
//!
//! Every figure is the slowest rank's (the longest time, the lowest rate): a switch waits for
//! its slowest rank. Buffer contents are never read: only the time counts.

use std::time::Instant;

use half::bf16;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::cudarc::driver::CudaStream;
use lifecycle_cuda::{alloc_device, alloc_pinned, CudaError, RankCtx, RankExecutor};

use crate::timing::{median, nothing, Repeats};

/// What a link ceiling reads where there is no link: one rank.
pub const NO_LINK: &str = "n/a (W = 1)";

/// How a ceiling is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Warm-up and timed runs of each figure.
    pub repeats: Repeats,
    /// Whether each run first waits for its stream to be idle, outside the timer (every run
    /// ends by waiting for its work anyway).
    pub drain_first: bool,
}

impl Timing {
    /// `warm_up` untimed runs, then `timed` timed ones, each starting when its stream is idle.
    pub fn after_idle(warm_up: usize, timed: usize) -> Self {
        Timing {
            repeats: Repeats::new(warm_up, timed),
            drain_first: true,
        }
    }

    /// `warm_up` untimed runs, then `timed` timed ones, back to back.
    pub fn back_to_back(warm_up: usize, timed: usize) -> Self {
        Timing {
            repeats: Repeats::new(warm_up, timed),
            drain_first: false,
        }
    }
}

/// One all-gather figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllGather {
    /// Bytes each rank receives into (its output buffer), W pieces of bf16.
    pub out_bytes: u64,
    /// The slowest rank's median time, in seconds.
    pub secs: f64,
    /// Bytes per second each rank receives from the others ((W − 1) / W of the output);
    /// `None` at W = 1, where nothing crosses a link.
    pub recv_rate: Option<f64>,
}

/// Times an NCCL all-gather into `out_bytes` per rank (rounded down to W equal bf16 pieces), all
/// ranks at once.
pub fn all_gather(
    pool: &impl RankExecutor,
    out_bytes: usize,
    timing: Timing,
) -> Result<AllGather, CudaError> {
    let world = pool.world();
    let n = out_bytes / 2 / world * world;
    let secs = time_on_nccl(
        pool,
        timing,
        |ctx| {
            // SAFETY: contents are irrelevant to the timing; nothing reads them on the host.
            let inp: CudaSlice<bf16> =
                unsafe { alloc_device(&ctx.compute, n / world, ctx.rank, "all-gather input")? };
            // SAFETY: as above.
            let out: CudaSlice<bf16> =
                unsafe { alloc_device(&ctx.compute, n, ctx.rank, "all-gather output")? };
            Ok((inp, out))
        },
        |ctx, nccl, (inp, out)| {
            ctx.comm
                .all_gather(inp, out)
                .map_err(|e| CudaError::nccl(ctx.rank, "all_gather", e))?;
            nccl.synchronize().map_err(ctx.drv("sync", 0))
        },
    )?;
    let recv = (n as f64 * 2.0) * (world as f64 - 1.0) / world as f64;
    Ok(AllGather {
        out_bytes: n as u64 * 2,
        secs,
        recv_rate: (world > 1).then(|| recv / secs),
    })
}

/// One grouped send/receive figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SendRecv {
    /// The slowest rank's median time, in seconds.
    pub secs: f64,
    /// Bytes per second each rank receives.
    pub recv_rate: f64,
}

/// Times a grouped NCCL send of `bytes` (rounded down to whole bf16 elements) to the next rank
/// and receive of as many from the previous one (at W = 2: both ways between the two ranks), all
/// ranks at once. At W = 1 there is no link: nothing runs and the answer is `None`.
pub fn send_recv(
    pool: &impl RankExecutor,
    bytes: usize,
    timing: Timing,
) -> Result<Option<SendRecv>, CudaError> {
    let world = pool.world();
    if world < 2 {
        return Ok(None);
    }
    let n = bytes / 2;
    let secs = time_on_nccl(
        pool,
        timing,
        |ctx| {
            // SAFETY: contents irrelevant to the timing; never read on the host.
            let a: CudaSlice<bf16> = unsafe { alloc_device(&ctx.compute, n, ctx.rank, "send")? };
            // SAFETY: as above.
            let b: CudaSlice<bf16> = unsafe { alloc_device(&ctx.compute, n, ctx.rank, "recv")? };
            let (next, prev) = ((ctx.rank + 1) % world, (ctx.rank + world - 1) % world);
            Ok((a, b, next as i32, prev as i32))
        },
        |ctx, nccl, (a, b, next, prev)| {
            ctx.group_start()?;
            let s = ctx.comm.send(a, *next);
            let r = ctx.comm.recv(b, *prev);
            ctx.group_end()?;
            s.map_err(|e| CudaError::nccl(ctx.rank, "ncclSend", e))?;
            r.map_err(|e| CudaError::nccl(ctx.rank, "ncclRecv", e))?;
            ctx.wait(&[nccl], "send/recv ceiling")
        },
    )?;
    Ok(Some(SendRecv {
        secs,
        recv_rate: (n * 2) as f64 / secs,
    }))
}

/// The device-to-device copy rate (bytes read + written per second) of a copy of `bytes` on
/// each rank's compute stream, all ranks at once; the slowest rank's.
pub fn device_copy(
    pool: &impl RankExecutor,
    bytes: usize,
    timing: Timing,
) -> Result<f64, CudaError> {
    let rates = pool.run(&|ctx| {
        // SAFETY: contents irrelevant to the timing.
        let a: CudaSlice<u8> = unsafe { alloc_device(&ctx.compute, bytes, ctx.rank, "d2d src")? };
        // SAFETY: as above.
        let mut b: CudaSlice<u8> =
            unsafe { alloc_device(&ctx.compute, bytes, ctx.rank, "d2d dst")? };
        let t = timing.repeats.median_secs(
            || {
                drain(timing, || {
                    ctx.compute.synchronize().map_err(ctx.drv("sync", 0))
                })
            },
            || {
                ctx.compute
                    .memcpy_dtod(&a, &mut b)
                    .map_err(ctx.drv("dtod", 0))?;
                ctx.compute.synchronize().map_err(ctx.drv("sync", 0))
            },
        )?;
        Ok(2.0 * bytes as f64 / t)
    })?;
    Ok(lowest_rate(rates))
}

/// The order of the pinned copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedOrder {
    /// Each run uploads, then downloads; the rates are the medians of the runs' rates.
    Interleaved,
    /// All uploads, then all downloads; the rates are the bytes over the median times.
    Separate,
}

/// Pinned host↔device copy rates of one rank, in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinnedRates {
    /// Host to device.
    pub h2d: f64,
    /// Device to host.
    pub d2h: f64,
}

/// The pinned host↔device copy rates of `bytes` on each rank's copy stream, the ranks at once:
/// one entry per local rank, in the pool's order; `None` for the ranks other than `only`, when
/// given (they copy nothing).
pub fn pinned(
    pool: &impl RankExecutor,
    bytes: usize,
    timing: Timing,
    order: PinnedOrder,
    only: Option<usize>,
) -> Result<Vec<Option<PinnedRates>>, CudaError> {
    pool.run(&|ctx| {
        if only.is_some_and(|r| r != ctx.rank) {
            return Ok(None);
        }
        // SAFETY: contents irrelevant to the timing.
        let mut h = unsafe { alloc_pinned::<u8>(&ctx.copy, bytes, ctx.rank, "pinned bench")? };
        // SAFETY: as above.
        let mut d: CudaSlice<u8> =
            unsafe { alloc_device(&ctx.copy, bytes, ctx.rank, "pinned bench dev")? };
        let sync = || ctx.copy.synchronize().map_err(ctx.drv("sync", 0));
        let before = || drain(timing, sync);
        // One copy (host to device when `up`) and the wait for it; its time in seconds.
        let mut copy = |up: bool| -> Result<f64, CudaError> {
            let t = Instant::now();
            if up {
                ctx.copy
                    .memcpy_htod(&h, &mut d)
                    .map_err(ctx.drv("h2d", 0))?;
            } else {
                ctx.copy
                    .memcpy_dtoh(&d, &mut h)
                    .map_err(ctx.drv("d2h", 0))?;
            }
            sync()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let rates = match order {
            PinnedOrder::Interleaved => {
                let (mut up, mut down) = (Vec::new(), Vec::new());
                for k in 0..timing.repeats.total() {
                    before()?;
                    let t1 = copy(true)?;
                    let t2 = copy(false)?;
                    if timing.repeats.is_timed(k) {
                        up.push(bytes as f64 / t1);
                        down.push(bytes as f64 / t2);
                    }
                }
                PinnedRates {
                    h2d: median(up),
                    d2h: median(down),
                }
            }
            PinnedOrder::Separate => {
                let up = timing.repeats.median_of(before, || copy(true))?;
                let down = timing.repeats.median_of(before, || copy(false))?;
                PinnedRates {
                    h2d: bytes as f64 / up,
                    d2h: bytes as f64 / down,
                }
            }
        };
        Ok(Some(rates))
    })
}

/// The slowest rank's median time of `run` on the NCCL stream, every rank at once, on buffers
/// from `buffers` (queued on the compute stream; the NCCL stream waits for them, the compute
/// stream for the runs before they are freed).
fn time_on_nccl<B>(
    pool: &impl RankExecutor,
    timing: Timing,
    buffers: impl Fn(&RankCtx) -> Result<B, CudaError> + Sync,
    run: impl Fn(&RankCtx, &CudaStream, &mut B) -> Result<(), CudaError> + Sync,
) -> Result<f64, CudaError> {
    let times = pool.run(&|ctx| {
        let mut bufs = buffers(ctx)?;
        let nccl = ctx.nccl_stream();
        ctx.order(&ctx.compute, &nccl)?;
        let t = timing.repeats.median_secs(
            || drain(timing, || nccl.synchronize().map_err(ctx.drv("sync", 0))),
            || run(ctx, &nccl, &mut bufs),
        )?;
        ctx.order(&nccl, &ctx.compute)?;
        drop(bufs);
        ctx.compute.synchronize().map_err(ctx.drv("sync", 0))?;
        Ok(t)
    })?;
    Ok(slowest_time(&times))
}

/// The slowest of per-rank pinned rates, each direction on its own (ranks without figures
/// left out); NaN in a direction no rank measured.
pub fn slowest_pinned(rates: &[Option<PinnedRates>]) -> PinnedRates {
    let measured = || rates.iter().flatten();
    let low = |v: Vec<f64>| {
        if v.is_empty() {
            f64::NAN
        } else {
            lowest_rate(v)
        }
    };
    PinnedRates {
        h2d: low(measured().map(|r| r.h2d).collect()),
        d2h: low(measured().map(|r| r.d2h).collect()),
    }
}

/// The longest of the ranks' times.
fn slowest_time(times: &[f64]) -> f64 {
    times.iter().cloned().fold(0.0, f64::max)
}

/// The lowest of the ranks' rates.
fn lowest_rate(rates: Vec<f64>) -> f64 {
    rates.into_iter().fold(f64::INFINITY, f64::min)
}

/// Runs `wait` when the timing drains the stream first.
fn drain(timing: Timing, wait: impl FnOnce() -> Result<(), CudaError>) -> Result<(), CudaError> {
    if timing.drain_first {
        wait()
    } else {
        nothing()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_pinned_skips_ranks_without_figures() {
        let r = |h2d, d2h| Some(PinnedRates { h2d, d2h });
        let got = slowest_pinned(&[r(50.0, 40.0), None, r(45.0, 48.0)]);
        assert_eq!((got.h2d, got.d2h), (45.0, 40.0));
        let none = slowest_pinned(&[None]);
        assert!(none.h2d.is_nan() && none.d2h.is_nan());
    }

    #[test]
    fn slowest_time_and_lowest_rate() {
        assert_eq!(slowest_time(&[1.0, 3.0, 2.0]), 3.0);
        assert_eq!(lowest_rate(vec![3.0, 1.0, 2.0]), 1.0);
    }
}
