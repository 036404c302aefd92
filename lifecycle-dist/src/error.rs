use std::time::Duration;

/// Why rank discovery, the rendezvous or the launcher failed; each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A variable the launcher should have set is missing.
    #[error("environment variable {var} is not set: {hint}")]
    MissingVar {
        /// The variable.
        var: &'static str,
        /// How to set it.
        hint: &'static str,
    },
    /// A variable has a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    BadVar {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// Variables that are valid alone but contradict each other.
    #[error("inconsistent launch environment: {0}")]
    Inconsistent(String),
    /// MASTER_ADDR is not a usable address.
    #[error("MASTER_ADDR {addr:?} (port {port}) is not usable: {reason}")]
    BadAddress {
        /// The address.
        addr: String,
        /// The port.
        port: u16,
        /// Why.
        reason: String,
    },
    /// Rank 0 could not listen because the port is taken.
    #[error(
        "rank 0 cannot listen on {addr}:{port}: the port is in use (another job, or a previous run \
         still exiting); choose another MASTER_PORT"
    )]
    PortInUse {
        /// The address.
        addr: String,
        /// The port.
        port: u16,
    },
    /// Rank 0 could not listen because MASTER_ADDR is not an address of its host.
    #[error(
        "rank 0 cannot listen on {addr}:{port}: it is not an address of this host; MASTER_ADDR must \
         name the node where rank 0 runs"
    )]
    NotLocal {
        /// The address.
        addr: String,
        /// The port.
        port: u16,
    },
    /// A rank could not reach rank 0 before the deadline.
    #[error(
        "rank {rank} could not reach rank 0 at {addr}:{port} within {waited:?}: is rank 0 running, \
         and are MASTER_ADDR / MASTER_PORT the same on every rank?"
    )]
    RootUnreachable {
        /// This rank.
        rank: usize,
        /// The address tried.
        addr: String,
        /// The port tried.
        port: u16,
        /// How long it retried.
        waited: Duration,
    },
    /// Rank 0 waited for ranks that never arrived.
    #[error(
        "rank 0 waited {waited:?} for ranks {missing:?} of {world}, which never arrived: check that \
         every rank was started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
    )]
    RanksMissing {
        /// Ranks that did not connect.
        missing: Vec<usize>,
        /// World size.
        world: usize,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// Two ranks disagree on the world size.
    #[error("rank {rank} was started with WORLD_SIZE={theirs} but rank 0 with WORLD_SIZE={ours}: start every rank with the same world size")]
    WorldMismatch {
        /// The rank that disagrees.
        rank: usize,
        /// Its world size.
        theirs: usize,
        /// Rank 0's.
        ours: usize,
    },
    /// Two processes claim the same rank.
    #[error("two processes claim rank {rank}: every process needs its own RANK")]
    DuplicateRank {
        /// The rank.
        rank: usize,
    },
    /// Rank 0 refused this rank.
    #[error("rank 0 refused rank {rank}: {message}")]
    Rejected {
        /// This rank.
        rank: usize,
        /// Rank 0's reason.
        message: String,
    },
    /// Rank 0 closed or stalled the connection before answering.
    #[error("rank {rank}: rank 0 at {addr}:{port} accepted the connection but did not answer within {waited:?}")]
    NoAnswer {
        /// This rank.
        rank: usize,
        /// The address.
        addr: String,
        /// The port.
        port: u16,
        /// How long it waited.
        waited: Duration,
    },
    /// Something spoke to the rendezvous port that is not a rank of this job.
    #[error("rendezvous protocol error: {0}")]
    Protocol(String),
    /// A socket or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl DistError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        DistError::Io {
            context: context.into(),
            source,
        }
    }
}
