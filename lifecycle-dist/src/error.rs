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
    /// torchrun's agent store could not be reached before the deadline.
    #[error(
        "rank {rank} could not reach torchrun's agent store (a c10d TCPStore) at {addr}:{port} \
         within {waited:?} (last error: {last_error}): TORCHELASTIC_USE_AGENT_STORE=True says \
         torchrun's agent hosts it there; check that the torchrun agent is still running, that \
         MASTER_ADDR / MASTER_PORT are the ones torchrun set, and that this node can reach that \
         port (firewall, network interface)"
    )]
    StoreUnreachable {
        /// This rank.
        rank: usize,
        /// The store's address (`MASTER_ADDR`).
        addr: String,
        /// The store's port (`MASTER_PORT`).
        port: u16,
        /// How long it retried.
        waited: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// The server at the store address does not speak the c10d TCPStore protocol this crate
    /// speaks: it refused the validation handshake or answered it wrongly.
    #[error(
        "the server at {addr}:{port} refused the c10d TCPStore handshake (VALIDATE with the magic \
         number, then PING): {reason}; this client speaks the protocol of torch 2.x TCPStore \
         servers that answer PING (torch 2.11 does): run the job with such a torch, or check that \
         MASTER_PORT is the port of torchrun's agent store and not another service"
    )]
    StoreRefused {
        /// The store's address.
        addr: String,
        /// The store's port.
        port: u16,
        /// What went wrong.
        reason: String,
    },
    /// A key in torchrun's store did not appear before the deadline.
    #[error(
        "rank {rank} waited {waited:?} for key {key:?} in torchrun's store at {addr}:{port}, which \
         never arrived: rank 0 may have died or hung before sharing it (check rank 0's log), or was \
         started with another TORCHELASTIC_RUN_ID / TORCHELASTIC_RESTART_COUNT, or made a different \
         number of communicators than this rank"
    )]
    KeyTimeout {
        /// The rank that waited.
        rank: usize,
        /// The key it waited for, as stored on the server.
        key: String,
        /// The store's address.
        addr: String,
        /// The store's port.
        port: u16,
        /// How long it waited.
        waited: Duration,
    },
    /// A name given to [`share_from_root_named`](crate::share_from_root_named) cannot be used.
    #[error("rendezvous name {name:?} is invalid: expected {expected}")]
    BadName {
        /// The name.
        name: String,
        /// What was expected.
        expected: &'static str,
    },
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
