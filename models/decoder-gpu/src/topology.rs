//! How the GPU decoder spreads over a rank pool: one tensor-parallel group, or data-parallel
//! replicas at T = 1; and which sequences each replica decodes.

use std::ops::Range;

use crate::error::GpuDecodeError;

/// How [`GpuDecoder`](crate::GpuDecoder) uses the ranks of its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeTopology {
    /// One tensor-parallel group of `T = W` ranks (threads of one process, or one process per
    /// rank); every rank takes part in every sequence.
    Group,
    /// `W` data-parallel replicas at `T = 1`, all in this process: each GPU decodes a contiguous
    /// share of the batch ([`replica_rows`]) on its own full copy of the rollout weights, with no
    /// collective between them.
    Replicas(usize),
}

impl DecodeTopology {
    /// Replicas the batch is split over (1 for a tensor-parallel group).
    pub fn replicas(self) -> usize {
        match self {
            DecodeTopology::Group => 1,
            DecodeTopology::Replicas(r) => r,
        }
    }
}

/// Checks a pool of `world` ranks (`local_ranks` of them in this process) against the layout's
/// tensor-parallel degree `tp`, before any GPU work.
///
/// ```
/// use lifecycle_decoder_gpu::{decode_topology, DecodeTopology};
/// assert_eq!(decode_topology(2, 2, 2)?, DecodeTopology::Group);
/// assert_eq!(decode_topology(2, 2, 1)?, DecodeTopology::Group); // one process per rank
/// assert_eq!(decode_topology(2, 1, 2)?, DecodeTopology::Replicas(2));
/// assert!(decode_topology(4, 2, 4).is_err()); // several TP groups: not supported
/// assert!(decode_topology(2, 1, 1).is_err()); // replicas across processes: not supported
/// # Ok::<(), lifecycle_decoder_gpu::GpuDecodeError>(())
/// ```
pub fn decode_topology(
    world: usize,
    tp: usize,
    local_ranks: usize,
) -> Result<DecodeTopology, GpuDecodeError> {
    let err = |reason: &str| GpuDecodeError::Topology {
        world,
        tp,
        reason: reason.to_string(),
    };
    if world == 0 || tp == 0 {
        return Err(err("W and T must be at least 1"));
    }
    if local_ranks == 0 || local_ranks > world {
        return Err(err(&format!(
            "this process drives {local_ranks} of the {world} ranks: it must drive at least one"
        )));
    }
    if world == tp {
        return Ok(DecodeTopology::Group);
    }
    if world < tp {
        return Err(err(
            "a tensor-parallel group of T ranks needs at least T ranks in the pool",
        ));
    }
    if tp > 1 {
        return Err(err(
            "several tensor-parallel groups (W > T with T > 1) are not supported: use W = T, or \
             T = 1 for data-parallel replicas",
        ));
    }
    if local_ranks != world {
        return Err(err(
            "data-parallel replicas (W > T = 1) are not supported with one process per rank: \
             run one process driving every GPU (thread mode), or use T = W",
        ));
    }
    Ok(DecodeTopology::Replicas(world))
}

/// The sequences replica `replica` of `replicas` decodes in a batch of `batch`: contiguous and
/// balanced (sizes differ by at most one), in order, covering `0..batch` once.
///
/// ```
/// use lifecycle_decoder_gpu::replica_rows;
/// assert_eq!(replica_rows(5, 2, 0), 0..2);
/// assert_eq!(replica_rows(5, 2, 1), 2..5);
/// assert_eq!(replica_rows(1, 2, 0), 0..0);
/// ```
pub fn replica_rows(batch: usize, replicas: usize, replica: usize) -> Range<usize> {
    let r = replicas.max(1);
    let at = |k: usize| k.min(r) * batch / r;
    at(replica)..at(replica + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_checks_name_the_problem() {
        let msg = |w, t, l| decode_topology(w, t, l).unwrap_err().to_string();
        assert!(msg(4, 2, 4).contains("several tensor-parallel groups"));
        assert!(msg(2, 1, 1).contains("one process per rank"));
        assert!(msg(1, 2, 1).contains("at least T ranks"));
        assert!(msg(0, 1, 1).contains("at least 1"));
        assert!(msg(2, 2, 3).contains("drives 3 of the 2"));
        let m = msg(4, 2, 4);
        assert!(m.contains("W = 4") && m.contains("T = 2"), "{m}");
        assert_eq!(decode_topology(1, 1, 1).unwrap(), DecodeTopology::Group);
        assert_eq!(
            decode_topology(3, 1, 3).unwrap(),
            DecodeTopology::Replicas(3)
        );
        assert_eq!(DecodeTopology::Replicas(3).replicas(), 3);
        assert_eq!(DecodeTopology::Group.replicas(), 1);
    }

    #[test]
    fn replica_rows_cover_the_batch_in_order() {
        for batch in 0..20 {
            for replicas in 1..6 {
                let parts: Vec<_> = (0..replicas)
                    .map(|r| replica_rows(batch, replicas, r))
                    .collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[replicas - 1].end, batch);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let (lo, hi) = parts.iter().fold((usize::MAX, 0), |(lo, hi), p| {
                    (lo.min(p.len()), hi.max(p.len()))
                });
                assert!(hi - lo <= 1, "batch {batch} over {replicas}: {parts:?}");
            }
        }
    }
}
