//! The rendezvous that shares rank 0's bytes (the NCCL unique id) with every rank, in one of two
//! ways picked by [`RankEnv::rendezvous`]:
//!
//! - [`Rendezvous::Host`]: rank 0 listens at `MASTER_ADDR:MASTER_PORT`, every other rank connects
//!   (retrying while rank 0 comes up), and rank 0 hands each of them the same payload once all
//!   have arrived.
//! - [`Rendezvous::AgentStore`]: torchrun's agent already serves a c10d `TCPStore` on that port;
//!   every rank joins it as a client and rank 0 publishes the payload under a key of this job
//!   (see the `agent` module).
//!
//! Only this bootstrap goes over TCP; the data moves over NCCL.
//!
//! Host wire format (little endian): a rank sends `b"LCRDV1"`, its rank (u32) and its world size
//! (u32); rank 0 answers a status byte (0 = accepted, 1 = refused) and a length-prefixed (u32)
//! payload or refusal message.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::env::{RankEnv, Rendezvous};
use crate::error::DistError;

const MAGIC: &[u8; 6] = b"LCRDV1";
const MAX_PAYLOAD: usize = 1 << 16;
const RETRY: Duration = Duration::from_millis(100);
/// The longest name [`share_from_root_named`] accepts.
const MAX_NAME: usize = 1024;

/// Calls of [`share_from_root`] so far in this process: the `n` of its `nccl-id/<n>` name.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Shares `root_payload()` (evaluated on rank 0 only) with every rank; returns it on every rank.
///
/// The way the ranks meet comes from the environment ([`RankEnv::rendezvous`]):
///
/// - under torchrun, which hosts a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT` and says so with
///   `TORCHELASTIC_USE_AGENT_STORE=True`, every rank joins that store as a client and rank 0
///   publishes the bytes under `lifecycle/<run id>/attempt_<restart>/nccl-id/<n>/`, `n`
///   counting this process's calls, so every rank must make its calls in the same order;
/// - otherwise (`lifecycle-launch`, Slurm's `srun`, variables set by hand) rank 0 listens at
///   `MASTER_ADDR:MASTER_PORT` and the other ranks connect to it.
///
/// Either way rank 0 fails if a rank does not arrive within `timeout`, if two processes claim
/// one rank or if a rank has another world size, and tells the other ranks why. The other ranks
/// retry until `timeout` while rank 0 or the store comes up, and wait up to `1.5 × timeout + 1 s`
/// in all for rank 0's answer.
///
/// ```no_run
/// use std::time::Duration;
/// let env = lifecycle_dist::RankEnv::from_env()?.expect("started by a launcher");
/// let id = lifecycle_dist::share_from_root(&env, || b"nccl unique id".to_vec(), Duration::from_secs(60))?;
/// # Ok::<(), lifecycle_dist::DistError>(())
/// ```
pub fn share_from_root(
    env: &RankEnv,
    root_payload: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, DistError> {
    let n = CALLS.fetch_add(1, Ordering::Relaxed);
    share_from_root_named(env, &format!("nccl-id/{n}"), root_payload, timeout)
}

/// [`share_from_root`] under an explicit `name` instead of the per-process call count: in the
/// agent-store rendezvous its keys are `lifecycle/<run id>/attempt_<restart>/<name>/…`, so ranks
/// that share several ids need not make their calls in the same order, only use the same names.
/// Each name must be used once per run and attempt. The rendezvous hosted by rank 0 does not
/// use the name. Names are 1 to 1024 bytes.
///
/// ```no_run
/// use std::time::Duration;
/// let env = lifecycle_dist::RankEnv::from_env()?.expect("started by a launcher");
/// let id = lifecycle_dist::share_from_root_named(
///     &env,
///     "tensor-parallel/nccl-id",
///     || b"nccl unique id".to_vec(),
///     Duration::from_secs(60),
/// )?;
/// # Ok::<(), lifecycle_dist::DistError>(())
/// ```
pub fn share_from_root_named(
    env: &RankEnv,
    name: &str,
    root_payload: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, DistError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(DistError::BadName {
            name: name.to_string(),
            expected: "1 to 1024 bytes",
        });
    }
    match &env.rendezvous {
        Rendezvous::Host if env.rank == 0 => serve(env, root_payload(), timeout),
        Rendezvous::Host => join(env, timeout),
        Rendezvous::AgentStore(store) => {
            let payload = if env.rank == 0 {
                let payload = root_payload();
                check_size(&payload)?;
                Some(payload)
            } else {
                None
            };
            crate::agent::share(env, store, name, payload, timeout)
        }
    }
}

fn check_size(payload: &[u8]) -> Result<(), DistError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DistError::Protocol(format!(
            "payload of {} bytes exceeds {MAX_PAYLOAD}",
            payload.len()
        )));
    }
    Ok(())
}

fn resolve(env: &RankEnv) -> Result<SocketAddr, DistError> {
    let bad = |reason: String| DistError::BadAddress {
        addr: env.master_addr.clone(),
        port: env.master_port,
        reason,
    };
    (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| bad(format!("it does not resolve ({e})")))?
        .next()
        .ok_or_else(|| bad("it resolves to no address".into()))
}

fn serve(env: &RankEnv, payload: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, DistError> {
    check_size(&payload)?;
    let addr = resolve(env)?;
    let listener = TcpListener::bind(addr).map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => DistError::PortInUse {
            addr: env.master_addr.clone(),
            port: env.master_port,
        },
        ErrorKind::AddrNotAvailable => DistError::NotLocal {
            addr: env.master_addr.clone(),
            port: env.master_port,
        },
        _ => DistError::io(format!("rank 0 cannot listen on {addr}"), e),
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| DistError::io("configuring the rendezvous socket", e))?;
    let start = Instant::now();
    let mut arrived: BTreeMap<usize, TcpStream> = BTreeMap::new();
    let mut failure: Option<DistError> = None;
    while arrived.len() + 1 < env.world_size && failure.is_none() {
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            let missing = (1..env.world_size)
                .filter(|r| !arrived.contains_key(r))
                .collect();
            failure = Some(DistError::RanksMissing {
                missing,
                world: env.world_size,
                waited: elapsed,
            });
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let remaining = timeout
                    .saturating_sub(start.elapsed())
                    .clamp(RETRY, Duration::from_secs(5));
                match read_hello(stream, remaining) {
                    Ok((rank, world, mut stream)) => {
                        if world != env.world_size {
                            let err = DistError::WorldMismatch {
                                rank,
                                theirs: world,
                                ours: env.world_size,
                            };
                            let _ = reply(&mut stream, 1, err.to_string().as_bytes());
                            failure = Some(err);
                        } else if rank == 0 || rank >= env.world_size || arrived.contains_key(&rank)
                        {
                            let err = if rank == 0 || arrived.contains_key(&rank) {
                                DistError::DuplicateRank { rank }
                            } else {
                                DistError::Protocol(format!(
                                    "rank {rank} is not below the world size {}",
                                    env.world_size
                                ))
                            };
                            let _ = reply(&mut stream, 1, err.to_string().as_bytes());
                            failure = Some(err);
                        } else {
                            arrived.insert(rank, stream);
                        }
                    }
                    // Not one of our ranks (a port scanner, a stale client): ignore it.
                    Err(_) => continue,
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(DistError::io("accepting a rank", e)),
        }
    }
    match failure {
        Some(err) => {
            let message = format!("rank 0 gave up: {err}");
            for stream in arrived.values_mut() {
                let _ = reply(stream, 1, message.as_bytes());
            }
            Err(err)
        }
        None => {
            for (rank, stream) in arrived.iter_mut() {
                reply(stream, 0, &payload)
                    .map_err(|e| DistError::io(format!("sending the id to rank {rank}"), e))?;
            }
            Ok(payload)
        }
    }
}

fn read_hello(
    mut stream: TcpStream,
    timeout: Duration,
) -> Result<(usize, usize, TcpStream), DistError> {
    stream
        .set_nonblocking(false)
        .and_then(|_| stream.set_read_timeout(Some(timeout)))
        .map_err(|e| DistError::io("configuring a rank's connection", e))?;
    let mut hello = [0u8; 14];
    stream
        .read_exact(&mut hello)
        .map_err(|e| DistError::io("reading a rank's hello", e))?;
    if &hello[..6] != MAGIC {
        return Err(DistError::Protocol(
            "a connection that is not a rank of this job".into(),
        ));
    }
    let rank = u32::from_le_bytes([hello[6], hello[7], hello[8], hello[9]]) as usize;
    let world = u32::from_le_bytes([hello[10], hello[11], hello[12], hello[13]]) as usize;
    Ok((rank, world, stream))
}

fn reply(stream: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::with_capacity(5 + body.len());
    msg.push(status);
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    stream.write_all(&msg)?;
    stream.flush()
}

fn join(env: &RankEnv, timeout: Duration) -> Result<Vec<u8>, DistError> {
    let addr = resolve(env)?;
    let start = Instant::now();
    let unreachable = |waited| DistError::RootUnreachable {
        rank: env.rank,
        addr: env.master_addr.clone(),
        port: env.master_port,
        waited,
    };
    let mut stream = loop {
        let remaining = timeout.saturating_sub(start.elapsed());
        if remaining.is_zero() {
            return Err(unreachable(start.elapsed()));
        }
        match TcpStream::connect_timeout(&addr, remaining.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(RETRY.min(timeout.saturating_sub(start.elapsed()))),
        }
    };
    let mut hello = Vec::with_capacity(14);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| DistError::io(format!("rank {}: sending hello to rank 0", env.rank), e))?;
    // Rank 0 answers once every rank has arrived, or when it gives up after its own timeout: wait
    // a little longer than that so its reason reaches us.
    let wait = timeout.saturating_sub(start.elapsed()) + timeout / 2 + Duration::from_secs(1);
    stream
        .set_read_timeout(Some(wait))
        .map_err(|e| DistError::io("configuring the rendezvous connection", e))?;
    let no_answer = || DistError::NoAnswer {
        rank: env.rank,
        addr: env.master_addr.clone(),
        port: env.master_port,
        waited: start.elapsed(),
    };
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(|_| no_answer())?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(DistError::Protocol(format!("rank 0 announced {len} bytes")));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(|_| no_answer())?;
    match head[0] {
        0 => Ok(body),
        _ => Err(DistError::Rejected {
            rank: env.rank,
            message: String::from_utf8_lossy(&body).into_owned(),
        }),
    }
}
