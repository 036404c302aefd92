//! [`FreeingRoom`]: device memory an overlapped offload gives up while the rollout already runs,
//! so that the rollout's allocations wait (on the device, in stream order) only for the memory
//! they need.
//!
//! An overlapped offload ([`SwitchDriver::finish_offload_overlapped`]) queues, on each rank's
//! copy stream, the free of every moved buffer right after its device→host copy, and records an
//! event after each free. [`FreeingRoom`] keeps those events with the bytes freed once each has
//! passed, beside the device's free memory when they were queued. A reader that allocates
//! (the rollout engine's KV cache) asks [`FreeingRoom::order_for`] to order its stream after the
//! first free that makes room for what it will hold; the stream-ordered pool then reuses the
//! freed memory (it follows event dependencies).
//!
//! [`SwitchDriver::finish_offload_overlapped`]: crate::driver::SwitchDriver::finish_offload_overlapped

use cudarc::driver::{CudaEvent, CudaStream};

use crate::{CudaError, RankCtx};

/// How many of a rank's queued frees must have run before `need` bytes fit, given `free` bytes
/// free on the device when they were queued and `freed[i]`, the bytes freed once the first
/// `i + 1` have run (non-decreasing): `Some(0)` when they fit now, `None` when they do not fit
/// even after all of them.
///
/// ```
/// use lifecycle_cuda::frees_needed;
/// let freed = [4, 10, 16]; // three buffers of 4, 6 and 6 bytes
/// assert_eq!(frees_needed(8, &freed, 5), Some(0)); // fits now
/// assert_eq!(frees_needed(8, &freed, 12), Some(1)); // after the first free
/// assert_eq!(frees_needed(8, &freed, 13), Some(2));
/// assert_eq!(frees_needed(8, &freed, 24), Some(3));
/// assert_eq!(frees_needed(8, &freed, 25), None); // more than the device will have
/// ```
pub fn frees_needed(free: u64, freed: &[u64], need: u64) -> Option<usize> {
    if need <= free {
        return Some(0);
    }
    freed
        .iter()
        .position(|&f| free.saturating_add(f) >= need)
        .map(|i| i + 1)
}

/// One rank's memory that an overlapped offload frees in stream order: the device's free memory
/// when the frees were queued and, per free, the bytes given back once it has run and the event
/// after it on the copy stream. A reader orders its allocations after the frees they need with
/// [`FreeingRoom::order_for`].
pub struct FreeingRoom {
    free: u64,
    freed: Vec<u64>,
    events: Vec<CudaEvent>,
}

impl std::fmt::Debug for FreeingRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreeingRoom")
            .field("free_when_queued", &self.free)
            .field("freed", &self.freed)
            .finish()
    }
}

impl FreeingRoom {
    /// Nothing being freed, `free` bytes free on the device.
    pub fn new(free: u64) -> Self {
        FreeingRoom {
            free,
            freed: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Adds a free of `bytes` queued on `stream`: an event recorded after it on that stream
    /// marks when the memory is back in the device's pool.
    pub fn push(
        &mut self,
        ctx: &RankCtx,
        stream: &CudaStream,
        bytes: u64,
    ) -> Result<(), CudaError> {
        let event = ctx.event()?;
        event
            .record(stream)
            .map_err(ctx.drv("recording the event of a free", bytes))?;
        let total = self.freed.last().copied().unwrap_or(0) + bytes;
        self.freed.push(total);
        self.events.push(event);
        Ok(())
    }

    /// Bytes free on the device when the frees were queued.
    pub fn free_when_queued(&self) -> u64 {
        self.free
    }

    /// Bytes the queued frees give back in all.
    pub fn freeing(&self) -> u64 {
        self.freed.last().copied().unwrap_or(0)
    }

    /// Whether every queued free has run (a query, no wait).
    pub fn settled(&self) -> bool {
        self.events.last().is_none_or(CudaEvent::is_complete)
    }

    /// Orders `stream` after the first queued free with which `need` bytes (what the caller
    /// will hold on the device once it allocated, beyond what it held when the frees were
    /// queued) fit; after all of them when they do not fit even then (the allocation then
    /// fails as it would have, with an out-of-memory error). Returns how many frees the stream
    /// now waits for (0: it fits already).
    pub fn order_for(
        &self,
        ctx: &RankCtx,
        stream: &CudaStream,
        need: u64,
    ) -> Result<usize, CudaError> {
        let n = frees_needed(self.free, &self.freed, need).unwrap_or(self.events.len());
        if let Some(event) = n.checked_sub(1).and_then(|i| self.events.get(i)) {
            stream
                .wait(event)
                .map_err(ctx.drv("waiting for the offload's frees", need))?;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_needed_counts_the_first_covering_free() {
        assert_eq!(frees_needed(0, &[], 0), Some(0));
        assert_eq!(frees_needed(0, &[], 1), None);
        assert_eq!(frees_needed(10, &[], 10), Some(0));
        assert_eq!(frees_needed(10, &[5, 5, 20], 15), Some(1));
        // an empty free (a buffer of zero bytes) does not change the count that covers
        assert_eq!(frees_needed(10, &[5, 5, 20], 30), Some(3));
        assert_eq!(frees_needed(u64::MAX, &[1], u64::MAX), Some(0));
        assert_eq!(frees_needed(u64::MAX - 1, &[5], u64::MAX), Some(1));
    }
}
