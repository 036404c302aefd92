//! A client for PyTorch's c10d `TCPStore`, the key-value server torchrun's elastic agent hosts at
//! `MASTER_ADDR:MASTER_PORT`. Only the client side, and only the queries the rendezvous needs.
//!
//! The wire format is the one torch 2.x speaks, with both of its server backends (libuv, the
//! default since torch 2.4, and the older poll-based one). Every query is one byte naming it,
//! then its arguments:
//!
//! - a string or byte vector is a `u64` length followed by the bytes;
//! - a number is its bytes (`u32` for the magic number and the ping nonce, `i64` for counters);
//! - a key list is a `u64` count followed by that many strings.
//!
//! Torch writes these in the host's byte order; every platform torch ships for is little endian,
//! so this client writes and reads little endian.
//!
//! | query         | byte | arguments            | reply                                   |
//! |---------------|------|----------------------|-----------------------------------------|
//! | `VALIDATE`    | 0    | `u32` magic          | none                                    |
//! | `SET`         | 1    | key, value           | none                                    |
//! | `GET`         | 3    | key                  | value                                   |
//! | `ADD`         | 4    | key, `i64` delta     | `i64` new value                         |
//! | `CHECK`       | 5    | key list             | `u8`: 0 all present, 1 not              |
//! | `WAIT`        | 6    | key list             | `u8` 0 once all are present             |
//! | `DELETE_KEY`  | 8    | key                  | `i64` number deleted                    |
//! | `CANCEL_WAIT` | 12   | none                 | `u8` 1 (possibly after a late 0)        |
//! | `PING`        | 13   | `u32` nonce          | the same `u32`                          |
//!
//! A connection must start with `VALIDATE` carrying [`VALIDATION_MAGIC`]; servers close
//! connections that do not. Torch's client follows it with `PING` and checks the echoed nonce;
//! so does this one, which is how it tells a store that speaks the protocol from anything else.
//! Like torch's `TCPStore` class, the client puts `/` in front of every key.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::DistError;

/// The number a client sends with `VALIDATE` (torch's `validationMagicNumber`).
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// Longest key the libuv server accepts.
pub(crate) const MAX_KEY_LEN: usize = 8 * 1024;
/// Largest value the libuv server accepts.
pub(crate) const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;
/// What torch's `TCPStore` puts in front of every key.
pub(crate) const KEY_PREFIX: &str = "/";

/// Query bytes: torch's `QueryType` enum (TCPStoreBackend.hpp), which only grows at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    DeleteKey = 8,
    CancelWait = 12,
    Ping = 13,
}

/// `CheckResponseType::READY`.
const CHECK_READY: u8 = 0;
/// `CheckResponseType::NOT_READY`.
const CHECK_NOT_READY: u8 = 1;
/// `WaitResponseType::STOP_WAITING`.
const STOP_WAITING: u8 = 0;
/// `WaitResponseType::WAIT_CANCELED`.
const WAIT_CANCELED: u8 = 1;

/// Connection attempts that are answered and then closed before the handshake completes, after
/// which the server counts as refusing (torch's client also retries these: a full listen
/// backlog looks the same).
const HANDSHAKE_ATTEMPTS: u32 = 3;
const RETRY: Duration = Duration::from_millis(100);

/// One query being encoded.
struct Frame(Vec<u8>);

impl Frame {
    fn new(query: Query) -> Frame {
        Frame(vec![query as u8])
    }

    fn bytes(mut self, data: &[u8]) -> Frame {
        self.0.extend_from_slice(&(data.len() as u64).to_le_bytes());
        self.0.extend_from_slice(data);
        self
    }

    fn u32(mut self, v: u32) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn i64(mut self, v: i64) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn keys(mut self, keys: &[String]) -> Frame {
        self.0.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            self = self.bytes(k.as_bytes());
        }
        self
    }
}

pub(crate) fn validate_frame() -> Vec<u8> {
    Frame::new(Query::Validate).u32(VALIDATION_MAGIC).0
}

pub(crate) fn ping_frame(nonce: u32) -> Vec<u8> {
    Frame::new(Query::Ping).u32(nonce).0
}

pub(crate) fn set_frame(key: &str, value: &[u8]) -> Vec<u8> {
    Frame::new(Query::Set).bytes(key.as_bytes()).bytes(value).0
}

pub(crate) fn get_frame(key: &str) -> Vec<u8> {
    Frame::new(Query::Get).bytes(key.as_bytes()).0
}

pub(crate) fn add_frame(key: &str, delta: i64) -> Vec<u8> {
    Frame::new(Query::Add).bytes(key.as_bytes()).i64(delta).0
}

pub(crate) fn check_frame(keys: &[String]) -> Vec<u8> {
    Frame::new(Query::Check).keys(keys).0
}

pub(crate) fn wait_frame(keys: &[String]) -> Vec<u8> {
    Frame::new(Query::Wait).keys(keys).0
}

pub(crate) fn delete_frame(key: &str) -> Vec<u8> {
    Frame::new(Query::DeleteKey).bytes(key.as_bytes()).0
}

pub(crate) fn cancel_wait_frame() -> Vec<u8> {
    Frame::new(Query::CancelWait).0
}

/// Why a reply could not be read.
#[derive(Debug)]
pub(crate) enum ReplyError {
    /// The socket failed, closed or timed out.
    Io(std::io::Error),
    /// The bytes are not a reply this query can have.
    Malformed(String),
}

impl From<std::io::Error> for ReplyError {
    fn from(e: std::io::Error) -> Self {
        ReplyError::Io(e)
    }
}

pub(crate) fn read_u8(r: &mut impl Read) -> Result<u8, ReplyError> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u32(r: &mut impl Read) -> Result<u32, ReplyError> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(crate) fn read_i64(r: &mut impl Read) -> Result<i64, ReplyError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

/// A length-prefixed value (the reply to `GET`), refusing lengths above `max`.
pub(crate) fn read_value(r: &mut impl Read, max: usize) -> Result<Vec<u8>, ReplyError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    let len = u64::from_le_bytes(b);
    if len > max as u64 {
        return Err(ReplyError::Malformed(format!(
            "a value of {len} bytes was announced, at most {max} expected"
        )));
    }
    let mut value = vec![0u8; len as usize];
    r.read_exact(&mut value)?;
    Ok(value)
}

/// The reply to `CHECK`: whether every key is present.
pub(crate) fn read_check(r: &mut impl Read) -> Result<bool, ReplyError> {
    match read_u8(r)? {
        CHECK_READY => Ok(true),
        CHECK_NOT_READY => Ok(false),
        other => Err(ReplyError::Malformed(format!(
            "CHECK answered {other}, expected {CHECK_READY} (ready) or {CHECK_NOT_READY} (not ready)"
        ))),
    }
}

/// The replies after `CANCEL_WAIT`: `WAIT_CANCELED`, or a `STOP_WAITING` that crossed the
/// cancellation followed by `WAIT_CANCELED`. Returns whether the keys arrived after all.
pub(crate) fn read_cancel(r: &mut impl Read) -> Result<bool, ReplyError> {
    match read_u8(r)? {
        WAIT_CANCELED => Ok(false),
        STOP_WAITING => match read_u8(r)? {
            WAIT_CANCELED => Ok(true),
            other => Err(ReplyError::Malformed(format!(
                "CANCEL_WAIT answered {STOP_WAITING} then {other}, expected {WAIT_CANCELED}"
            ))),
        },
        other => Err(ReplyError::Malformed(format!(
            "CANCEL_WAIT answered {other}, expected {WAIT_CANCELED} (canceled) or {STOP_WAITING}"
        ))),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// A validated connection to a c10d TCPStore server.
pub(crate) struct StoreClient {
    stream: TcpStream,
    addr: String,
    port: u16,
    rank: usize,
}

impl StoreClient {
    /// Connects to `addr:port`, retrying until `deadline`, and runs the handshake.
    pub(crate) fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        deadline: Instant,
    ) -> Result<StoreClient, DistError> {
        let start = Instant::now();
        let bad = |reason: String| DistError::BadAddress {
            addr: addr.to_string(),
            port,
            reason,
        };
        let targets: Vec<SocketAddr> = (addr, port)
            .to_socket_addrs()
            .map_err(|e| bad(format!("it does not resolve ({e})")))?
            .collect();
        if targets.is_empty() {
            return Err(bad("it resolves to no address".into()));
        }
        let refused = |reason: String| DistError::StoreRefused {
            addr: addr.to_string(),
            port,
            reason,
        };
        let mut last_error = String::from("no attempt finished");
        let mut closed = 0u32;
        loop {
            for target in &targets {
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    break;
                }
                let stream =
                    match TcpStream::connect_timeout(target, remaining.min(Duration::from_secs(1)))
                    {
                        Ok(s) => s,
                        Err(e) => {
                            last_error = format!("connecting to {target}: {e}");
                            continue;
                        }
                    };
                let mut client = StoreClient {
                    stream,
                    addr: addr.to_string(),
                    port,
                    rank,
                };
                match client.handshake(deadline) {
                    Ok(()) => return Ok(client),
                    Err(Handshake::Refused(reason)) => return Err(refused(reason)),
                    Err(Handshake::Closed(reason)) => {
                        closed += 1;
                        if closed >= HANDSHAKE_ATTEMPTS {
                            return Err(refused(format!(
                                "{reason} ({closed} connections in a row)"
                            )));
                        }
                        last_error = reason;
                    }
                }
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(DistError::StoreUnreachable {
                    rank,
                    addr: addr.to_string(),
                    port,
                    waited: start.elapsed(),
                    last_error,
                });
            }
            std::thread::sleep(RETRY.min(remaining));
        }
    }

    fn handshake(&mut self, deadline: Instant) -> Result<(), Handshake> {
        let setup = |e: std::io::Error| Handshake::Closed(format!("configuring the socket: {e}"));
        self.stream.set_nodelay(true).map_err(setup)?;
        let answer_within = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(200), Duration::from_secs(10));
        self.stream
            .set_read_timeout(Some(answer_within))
            .map_err(setup)?;
        let nonce = std::process::id();
        // Two writes, as torch's client does: the server checks VALIDATE on its own.
        let sent = self
            .stream
            .write_all(&validate_frame())
            .and_then(|_| self.stream.write_all(&ping_frame(nonce)));
        if let Err(e) = sent {
            return Err(Handshake::Closed(format!(
                "it closed the connection after VALIDATE and PING instead of answering ({e})"
            )));
        }
        match read_u32(&mut self.stream) {
            Ok(echo) if echo == nonce => Ok(()),
            Ok(echo) => Err(Handshake::Refused(format!(
                "it answered PING with {echo:#010x}, expected the nonce {nonce:#010x}"
            ))),
            Err(ReplyError::Io(e)) if is_timeout(&e) => Err(Handshake::Refused(format!(
                "it accepted the connection but did not answer PING within {answer_within:?}"
            ))),
            Err(ReplyError::Io(e)) => Err(Handshake::Closed(format!(
                "it closed the connection after VALIDATE and PING instead of answering ({e})"
            ))),
            Err(ReplyError::Malformed(m)) => Err(Handshake::Refused(m)),
        }
    }

    /// `host:port` of the server.
    pub(crate) fn endpoint(&self) -> (&str, u16) {
        (&self.addr, self.port)
    }

    fn lost(&self, doing: &str, e: std::io::Error) -> DistError {
        DistError::io(
            format!(
                "rank {}: torchrun's store at {}:{} failed while {doing} (did the torchrun agent \
                 exit?)",
                self.rank, self.addr, self.port
            ),
            e,
        )
    }

    fn reply_err(&self, doing: &str, e: ReplyError) -> DistError {
        match e {
            ReplyError::Io(e) => self.lost(doing, e),
            ReplyError::Malformed(m) => DistError::Protocol(format!(
                "rank {}: torchrun's store at {}:{} sent a malformed reply while {doing}: {m}",
                self.rank, self.addr, self.port
            )),
        }
    }

    fn send(&mut self, frame: &[u8], doing: &str) -> Result<(), DistError> {
        self.stream
            .write_all(frame)
            .map_err(|e| self.lost(doing, e))
    }

    /// Replies to queries other than `WAIT` come at once; allow `within` for them.
    fn expect_reply_within(&mut self, within: Duration) -> Result<(), DistError> {
        self.stream
            .set_read_timeout(Some(within.max(Duration::from_millis(100))))
            .map_err(|e| DistError::io("configuring the store connection", e))
    }

    fn check_key(key: &str) -> Result<(), DistError> {
        if key.len() > MAX_KEY_LEN {
            return Err(DistError::Protocol(format!(
                "a store key of {} bytes exceeds the {MAX_KEY_LEN} bytes a TCPStore accepts",
                key.len()
            )));
        }
        Ok(())
    }

    /// `SET key value` (no reply).
    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<(), DistError> {
        let key = format!("{KEY_PREFIX}{key}");
        Self::check_key(&key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(DistError::Protocol(format!(
                "a store value of {} bytes exceeds the {MAX_VALUE_LEN} bytes a TCPStore accepts",
                value.len()
            )));
        }
        self.send(&set_frame(&key, value), &format!("setting {key:?}"))
    }

    /// `GET key`; the key must be present (wait for it first).
    pub(crate) fn get(&mut self, key: &str, reply_within: Duration) -> Result<Vec<u8>, DistError> {
        let key = format!("{KEY_PREFIX}{key}");
        Self::check_key(&key)?;
        let doing = format!("reading {key:?}");
        self.expect_reply_within(reply_within)?;
        self.send(&get_frame(&key), &doing)?;
        read_value(&mut self.stream, MAX_VALUE_LEN).map_err(|e| self.reply_err(&doing, e))
    }

    /// `ADD key delta`: the counter's new value (`delta` 0 reads it).
    pub(crate) fn add(
        &mut self,
        key: &str,
        delta: i64,
        reply_within: Duration,
    ) -> Result<i64, DistError> {
        let key = format!("{KEY_PREFIX}{key}");
        Self::check_key(&key)?;
        let doing = format!("adding to {key:?}");
        self.expect_reply_within(reply_within)?;
        self.send(&add_frame(&key, delta), &doing)?;
        read_i64(&mut self.stream).map_err(|e| self.reply_err(&doing, e))
    }

    /// `CHECK keys`: whether all are present.
    pub(crate) fn check(
        &mut self,
        keys: &[&str],
        reply_within: Duration,
    ) -> Result<bool, DistError> {
        let keys = self.wire_keys(keys)?;
        let doing = format!("checking {keys:?}");
        self.expect_reply_within(reply_within)?;
        self.send(&check_frame(&keys), &doing)?;
        read_check(&mut self.stream).map_err(|e| self.reply_err(&doing, e))
    }

    /// `WAIT keys` for at most `timeout`: `true` once all are present, `false` if the time ran
    /// out (the wait is then cancelled on the server, as torch's client does, so the connection
    /// stays usable).
    pub(crate) fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<bool, DistError> {
        let keys = self.wire_keys(keys)?;
        let doing = format!("waiting for {keys:?}");
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|e| DistError::io("configuring the store connection", e))?;
        self.send(&wait_frame(&keys), &doing)?;
        match read_u8(&mut self.stream) {
            Ok(STOP_WAITING) => return Ok(true),
            Ok(other) => {
                return Err(self.reply_err(
                    &doing,
                    ReplyError::Malformed(format!(
                        "WAIT answered {other}, expected {STOP_WAITING} (stop waiting)"
                    )),
                ))
            }
            Err(ReplyError::Io(e)) if is_timeout(&e) => {}
            Err(e) => return Err(self.reply_err(&doing, e)),
        }
        let doing = format!("cancelling the wait for {keys:?}");
        self.expect_reply_within(Duration::from_secs(5))?;
        self.send(&cancel_wait_frame(), &doing)?;
        read_cancel(&mut self.stream).map_err(|e| self.reply_err(&doing, e))
    }

    /// `DELETE_KEY` for every key, pipelined: all queries are sent before the replies are read.
    pub(crate) fn delete_all(
        &mut self,
        keys: &[String],
        reply_within: Duration,
    ) -> Result<(), DistError> {
        let keys = self.wire_keys(&keys.iter().map(String::as_str).collect::<Vec<_>>())?;
        let frames: Vec<u8> = keys.iter().flat_map(|k| delete_frame(k)).collect();
        let doing = "deleting the rendezvous keys";
        self.expect_reply_within(reply_within)?;
        self.send(&frames, doing)?;
        for _ in &keys {
            read_i64(&mut self.stream).map_err(|e| self.reply_err(doing, e))?;
        }
        Ok(())
    }

    fn wire_keys(&self, keys: &[&str]) -> Result<Vec<String>, DistError> {
        keys.iter()
            .map(|k| {
                let key = format!("{KEY_PREFIX}{k}");
                Self::check_key(&key).map(|_| key)
            })
            .collect()
    }
}

enum Handshake {
    /// The server answered something no TCPStore answers, or nothing at all.
    Refused(String),
    /// The connection closed: a refusal, or a full backlog; worth another attempt.
    Closed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le64(n: u64) -> Vec<u8> {
        n.to_le_bytes().to_vec()
    }

    #[test]
    fn query_bytes_are_torchs() {
        let bytes: Vec<u8> = [
            Query::Validate,
            Query::Set,
            Query::Get,
            Query::Add,
            Query::Check,
            Query::Wait,
            Query::DeleteKey,
            Query::CancelWait,
            Query::Ping,
        ]
        .iter()
        .map(|q| *q as u8)
        .collect();
        assert_eq!(bytes, [0, 1, 3, 4, 5, 6, 8, 12, 13]);
    }

    #[test]
    fn validate_and_ping_frames() {
        assert_eq!(validate_frame(), [0x00, 0xCE, 0xF7, 0x85, 0x3C]);
        assert_eq!(ping_frame(0x0102_0304), [0x0D, 0x04, 0x03, 0x02, 0x01]);
    }

    #[test]
    fn set_frame_is_key_then_value() {
        let mut want = vec![0x01];
        want.extend(le64(4));
        want.extend(b"/a/b");
        want.extend(le64(3));
        want.extend([0xFF, 0x00, 0x7F]);
        assert_eq!(set_frame("/a/b", &[0xFF, 0x00, 0x7F]), want);
        // an empty value still carries its length
        assert_eq!(
            set_frame("/k", &[]),
            [vec![0x01], le64(2), b"/k".to_vec(), le64(0)].concat()
        );
    }

    #[test]
    fn get_add_delete_frames() {
        assert_eq!(
            get_frame("/key"),
            [vec![0x03], le64(4), b"/key".to_vec()].concat()
        );
        assert_eq!(
            add_frame("/n", -2),
            [
                vec![0x04],
                le64(2),
                b"/n".to_vec(),
                (-2i64).to_le_bytes().to_vec()
            ]
            .concat()
        );
        assert_eq!(
            add_frame("/n", 1)[11..],
            [1, 0, 0, 0, 0, 0, 0, 0],
            "the delta is a little-endian i64 after the key"
        );
        assert_eq!(
            delete_frame("/x"),
            [vec![0x08], le64(2), b"/x".to_vec()].concat()
        );
        assert_eq!(cancel_wait_frame(), [0x0C]);
    }

    #[test]
    fn wait_and_check_frames_count_their_keys() {
        let keys = vec!["/a".to_string(), "/bc".to_string()];
        let body = [le64(2), le64(2), b"/a".to_vec(), le64(3), b"/bc".to_vec()].concat();
        assert_eq!(wait_frame(&keys), [vec![0x06], body.clone()].concat());
        assert_eq!(check_frame(&keys), [vec![0x05], body].concat());
        assert_eq!(wait_frame(&[]), [vec![0x06], le64(0)].concat());
    }

    #[test]
    fn replies_parse() {
        assert_eq!(read_i64(&mut &(-7i64).to_le_bytes()[..]).unwrap(), -7);
        assert_eq!(
            read_u32(&mut &[0xCE, 0xF7, 0x85, 0x3C][..]).unwrap(),
            VALIDATION_MAGIC
        );
        let reply = [le64(3), vec![9, 8, 7], vec![0xAA]].concat();
        let mut r = &reply[..];
        assert_eq!(read_value(&mut r, 16).unwrap(), [9, 8, 7]);
        assert_eq!(r, [0xAA], "exactly the announced bytes are consumed");
        assert!(read_check(&mut &[0u8][..]).unwrap());
        assert!(!read_check(&mut &[1u8][..]).unwrap());
        assert!(!read_cancel(&mut &[1u8][..]).unwrap());
        assert!(read_cancel(&mut &[0u8, 1][..]).unwrap());
    }

    #[test]
    fn bad_replies_are_refused() {
        // truncated value
        let reply = [le64(5), vec![1, 2]].concat();
        assert!(matches!(
            read_value(&mut &reply[..], 16),
            Err(ReplyError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof
        ));
        // absurd length: refused before allocating
        let reply = le64(u64::MAX);
        assert!(matches!(
            read_value(&mut &reply[..], 16),
            Err(ReplyError::Malformed(m)) if m.contains("at most 16")
        ));
        assert!(matches!(
            read_check(&mut &[2u8][..]),
            Err(ReplyError::Malformed(_))
        ));
        assert!(matches!(
            read_cancel(&mut &[0u8, 0][..]),
            Err(ReplyError::Malformed(_))
        ));
        assert!(matches!(
            read_cancel(&mut &[7u8][..]),
            Err(ReplyError::Malformed(_))
        ));
        assert!(matches!(
            read_i64(&mut &[1u8, 2, 3][..]),
            Err(ReplyError::Io(_))
        ));
    }
}
