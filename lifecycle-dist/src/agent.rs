//! The rendezvous through torchrun's agent store: every rank is a client of the c10d `TCPStore`
//! the torchrun agent hosts at `MASTER_ADDR:MASTER_PORT`.
//!
//! The keys of one exchange live under `<prefix>/<name>/` where the prefix names the run and
//! the restart attempt ([`AgentStore::key_prefix`]) and the name the exchange (by default
//! `nccl-id/<n>` for the process's `n`-th call):
//!
//! - `rank/<r>/claims`: a counter each rank `r` increments; a second claim means two processes
//!   were started with the same rank;
//! - `rank/<r>/world`: rank `r`'s world size, in decimal;
//! - `id`: what rank 0 publishes once ranks `1..world` have registered: a status byte (0 the
//!   payload, 1 a refusal), rank 0's world size (`u64`, little endian), then the payload or the
//!   refusal's text;
//! - `done`: a counter the other ranks increment once they have read `id`; the last one deletes
//!   the exchange's keys, so a later worker group of the same run and attempt starts clean.
//!
//! Rank 0 waits up to the timeout for the other ranks, checking each one's world size and claim;
//! the others wait for `id` up to one and a half times the timeout (plus a second), long enough
//! to read rank 0's reason when it gives up.

use std::time::{Duration, Instant};

use crate::env::{AgentStore, RankEnv};
use crate::error::DistError;
use crate::store::StoreClient;

/// Time allowed for replies to queries the server answers at once.
const REPLY: Duration = Duration::from_secs(10);

const OK: u8 = 0;
const REFUSED: u8 = 1;

struct Keys {
    base: String,
}

impl Keys {
    fn new(store: &AgentStore, name: &str) -> Keys {
        Keys {
            base: format!("{}/{name}", store.key_prefix()),
        }
    }

    fn claims(&self, rank: usize) -> String {
        format!("{}/rank/{rank}/claims", self.base)
    }

    fn world(&self, rank: usize) -> String {
        format!("{}/rank/{rank}/world", self.base)
    }

    fn id(&self) -> String {
        format!("{}/id", self.base)
    }

    fn done(&self) -> String {
        format!("{}/done", self.base)
    }

    fn all(&self, world: usize) -> Vec<String> {
        let mut keys = vec![self.id(), self.done()];
        for r in 0..world {
            keys.push(self.claims(r));
            keys.push(self.world(r));
        }
        keys
    }
}

fn encode_answer(status: u8, world: usize, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(9 + body.len());
    v.push(status);
    v.extend_from_slice(&(world as u64).to_le_bytes());
    v.extend_from_slice(body);
    v
}

fn decode_answer(v: &[u8]) -> Option<(u8, u64, &[u8])> {
    let (&status, rest) = v.split_first()?;
    let world = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    Some((status, world, &rest[8..]))
}

/// Shares `payload` (rank 0's, already evaluated there) with every rank through the store.
pub(crate) fn share(
    env: &RankEnv,
    store: &AgentStore,
    name: &str,
    payload: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<Vec<u8>, DistError> {
    let start = Instant::now();
    let keys = Keys::new(store, name);
    let mut client =
        StoreClient::connect(&env.master_addr, env.master_port, env.rank, start + timeout)?;
    let claims = client.add(&keys.claims(env.rank), 1, REPLY)?;
    if claims > 1 {
        return Err(DistError::DuplicateRank { rank: env.rank });
    }
    client.set(&keys.world(env.rank), env.world_size.to_string().as_bytes())?;
    match payload {
        Some(payload) => serve(env, &mut client, &keys, payload, start + timeout, start),
        None => {
            let answer_by = start + timeout + timeout / 2 + Duration::from_secs(1);
            join(env, &mut client, &keys, answer_by, start)
        }
    }
}

fn serve(
    env: &RankEnv,
    client: &mut StoreClient,
    keys: &Keys,
    payload: Vec<u8>,
    deadline: Instant,
    start: Instant,
) -> Result<Vec<u8>, DistError> {
    match check_ranks(env, client, keys, deadline, start) {
        Ok(()) if env.world_size == 1 => {
            // Nobody to tell; leave nothing behind.
            let _ = client.delete_all(&keys.all(1), REPLY);
            Ok(payload)
        }
        Ok(()) => {
            client.set(&keys.id(), &encode_answer(OK, env.world_size, &payload))?;
            Ok(payload)
        }
        Err(err) => {
            let message = format!("rank 0 gave up: {err}");
            // Best effort: the other ranks time out with their own error if this fails too.
            let _ = client.set(
                &keys.id(),
                &encode_answer(REFUSED, env.world_size, message.as_bytes()),
            );
            Err(err)
        }
    }
}

/// Waits for ranks `1..world` in order, checking each one's world size and claim.
fn check_ranks(
    env: &RankEnv,
    client: &mut StoreClient,
    keys: &Keys,
    deadline: Instant,
    start: Instant,
) -> Result<(), DistError> {
    for rank in 1..env.world_size {
        let world_key = keys.world(rank);
        let remaining = deadline.saturating_duration_since(Instant::now());
        if !client.wait(&[&world_key], remaining)? {
            let mut missing = vec![rank];
            for later in rank + 1..env.world_size {
                if !client.check(&[&keys.world(later)], REPLY)? {
                    missing.push(later);
                }
            }
            return Err(DistError::RanksMissing {
                missing,
                world: env.world_size,
                waited: start.elapsed(),
            });
        }
        let value = client.get(&world_key, REPLY)?;
        let theirs: usize = std::str::from_utf8(&value)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                DistError::Protocol(format!(
                    "rank {rank} registered the world size {:?} under {world_key:?}, expected a \
                     decimal number: is another program using these keys?",
                    String::from_utf8_lossy(&value)
                ))
            })?;
        if theirs != env.world_size {
            return Err(DistError::WorldMismatch {
                rank,
                theirs,
                ours: env.world_size,
            });
        }
        if client.add(&keys.claims(rank), 0, REPLY)? > 1 {
            return Err(DistError::DuplicateRank { rank });
        }
    }
    Ok(())
}

fn join(
    env: &RankEnv,
    client: &mut StoreClient,
    keys: &Keys,
    answer_by: Instant,
    start: Instant,
) -> Result<Vec<u8>, DistError> {
    let id_key = keys.id();
    let remaining = answer_by.saturating_duration_since(Instant::now());
    if !client.wait(&[&id_key], remaining)? {
        let (addr, port) = client.endpoint();
        return Err(DistError::KeyTimeout {
            rank: env.rank,
            key: format!("{}{id_key}", crate::store::KEY_PREFIX),
            addr: addr.to_string(),
            port,
            waited: start.elapsed(),
        });
    }
    let answer = client.get(&id_key, REPLY)?;
    let Some((status, root_world, body)) = decode_answer(&answer) else {
        return Err(DistError::Protocol(format!(
            "rank {}: the value under {id_key:?} has {} bytes, which is not an answer of rank 0",
            env.rank,
            answer.len()
        )));
    };
    match status {
        OK => {}
        REFUSED => {
            return Err(DistError::Rejected {
                rank: env.rank,
                message: String::from_utf8_lossy(body).into_owned(),
            })
        }
        other => {
            return Err(DistError::Protocol(format!(
                "rank {}: rank 0's answer under {id_key:?} has status {other}, expected 0 or 1",
                env.rank
            )))
        }
    }
    if root_world != env.world_size as u64 {
        return Err(DistError::WorldMismatch {
            rank: env.rank,
            theirs: env.world_size,
            ours: usize::try_from(root_world).unwrap_or(usize::MAX),
        });
    }
    let body = body.to_vec();
    // The last rank to read the id removes the exchange's keys. Best effort: the id is ours.
    if let Ok(done) = client.add(&keys.done(), 1, REPLY)
        && done == env.world_size as i64 - 1
    {
        let _ = client.delete_all(&keys.all(env.world_size), REPLY);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_the_run_the_attempt_and_the_exchange() {
        let store = AgentStore::new(Some("job".into()), 1).unwrap();
        let keys = Keys::new(&store, "nccl-id/0");
        assert_eq!(keys.id(), "lifecycle/job/attempt_1/nccl-id/0/id");
        assert_eq!(
            keys.world(3),
            "lifecycle/job/attempt_1/nccl-id/0/rank/3/world"
        );
        assert_eq!(
            keys.claims(0),
            "lifecycle/job/attempt_1/nccl-id/0/rank/0/claims"
        );
        assert_eq!(keys.all(2).len(), 6);
    }

    #[test]
    fn answers_round_trip() {
        let a = encode_answer(OK, 4, b"id");
        assert_eq!(a, [0, 4, 0, 0, 0, 0, 0, 0, 0, b'i', b'd']);
        assert_eq!(decode_answer(&a), Some((OK, 4, &b"id"[..])));
        assert_eq!(decode_answer(&a[..5]), None);
        assert_eq!(decode_answer(&[]), None);
        assert_eq!(
            decode_answer(&encode_answer(REFUSED, 2, b"")),
            Some((REFUSED, 2, &b""[..]))
        );
    }
}
