//! The rendezvous through torchrun's agent store, against a fake c10d TCPStore server written
//! here from the protocol (the server side: VALIDATE, PING, SET, GET, ADD, CHECK, WAIT,
//! CANCEL_WAIT, DELETE_KEY): ranks as threads and as processes share one id; an unreachable
//! store, a key that never arrives, a server that refuses the handshake, mismatched world sizes
//! and a rank claimed twice fail with errors that name the fix.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use lifecycle_dist::{share_from_root_named, DistError, RankEnv, Rendezvous};

const CHECK: &str = env!("CARGO_BIN_EXE_rendezvous-check");
const MAGIC: u32 = 0x3C85_F7CE;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A working store.
    Store,
    /// Closes every connection once it has read VALIDATE, as a server refusing the client does.
    CloseOnValidate,
    /// Answers PING with another number.
    WrongNonce,
    /// Accepts connections and never answers.
    Mute,
}

#[derive(Default)]
struct Data {
    kv: HashMap<String, Vec<u8>>,
    /// Every key ever set or added, in order.
    written: Vec<String>,
}

struct FakeStore {
    port: u16,
    data: Arc<Mutex<Data>>,
}

impl FakeStore {
    fn start(mode: Mode) -> FakeStore {
        let listener = TcpListener::bind("127.0.0.1:0").expect("loopback is available");
        let port = listener.local_addr().expect("bound").port();
        let data = Arc::new(Mutex::new(Data::default()));
        let shared = Arc::clone(&data);
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let data = Arc::clone(&shared);
                thread::spawn(move || {
                    let _ = serve_client(stream, mode, &data);
                });
            }
        });
        FakeStore { port, data }
    }

    fn keys_with(&self, prefix: &str) -> Vec<String> {
        let d = self.data.lock().unwrap();
        let mut keys: Vec<String> =
            d.kv.keys()
                .filter(|k| k.starts_with(prefix))
                .cloned()
                .collect();
        keys.sort();
        keys
    }

    fn written(&self) -> Vec<String> {
        self.data.lock().unwrap().written.clone()
    }

    fn seed(&self, key: &str, value: Vec<u8>) {
        self.data.lock().unwrap().kv.insert(key.to_string(), value);
    }

    fn wait_for_key(&self, key: &str) {
        let start = Instant::now();
        while !self.data.lock().unwrap().kv.contains_key(key) {
            assert!(start.elapsed() < Duration::from_secs(10), "{key} never set");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

fn read_u8(s: &mut TcpStream) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(s: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = read_u64(s)?;
    assert!(len <= 8 << 20, "the client sent a length of {len}");
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_key(s: &mut TcpStream) -> std::io::Result<String> {
    Ok(String::from_utf8(read_bytes(s)?).expect("keys are UTF-8 here"))
}

fn read_keys(s: &mut TcpStream) -> std::io::Result<Vec<String>> {
    let n = read_u64(s)?;
    (0..n).map(|_| read_key(s)).collect()
}

/// The server side of one connection; returning closes it.
fn serve_client(mut s: TcpStream, mode: Mode, data: &Mutex<Data>) -> std::io::Result<()> {
    if read_u8(&mut s)? != 0 || read_u32(&mut s)? != MAGIC {
        return Ok(()); // the first query must be VALIDATE with the magic number
    }
    match mode {
        Mode::CloseOnValidate => return Ok(()),
        Mode::Mute => {
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            return Ok(());
        }
        Mode::Store | Mode::WrongNonce => {}
    }
    loop {
        let query = match read_u8(&mut s) {
            Ok(q) => q,
            Err(_) => return Ok(()),
        };
        match query {
            13 => {
                let nonce = read_u32(&mut s)?;
                let echo = if mode == Mode::WrongNonce {
                    nonce ^ 0xFFFF
                } else {
                    nonce
                };
                s.write_all(&echo.to_le_bytes())?;
            }
            1 => {
                let key = read_key(&mut s)?;
                let value = read_bytes(&mut s)?;
                let mut d = data.lock().unwrap();
                d.written.push(key.clone());
                d.kv.insert(key, value);
            }
            3 => {
                let key = read_key(&mut s)?;
                let value = data
                    .lock()
                    .unwrap()
                    .kv
                    .get(&key)
                    .cloned()
                    .unwrap_or_default();
                s.write_all(&(value.len() as u64).to_le_bytes())?;
                s.write_all(&value)?;
            }
            4 => {
                let key = read_key(&mut s)?;
                let delta = read_u64(&mut s)? as i64;
                let mut d = data.lock().unwrap();
                let old: i64 =
                    d.kv.get(&key)
                        .map(|v| String::from_utf8_lossy(v).parse().expect("a counter"))
                        .unwrap_or(0);
                let new = old + delta;
                d.written.push(key.clone());
                d.kv.insert(key, new.to_string().into_bytes());
                drop(d);
                s.write_all(&new.to_le_bytes())?;
            }
            5 => {
                let keys = read_keys(&mut s)?;
                let d = data.lock().unwrap();
                let ready = keys.iter().all(|k| d.kv.contains_key(k));
                drop(d);
                s.write_all(&[if ready { 0 } else { 1 }])?;
            }
            6 => {
                let keys = read_keys(&mut s)?;
                s.set_read_timeout(Some(Duration::from_millis(10)))?;
                loop {
                    let ready = {
                        let d = data.lock().unwrap();
                        keys.iter().all(|k| d.kv.contains_key(k))
                    };
                    if ready {
                        s.write_all(&[0])?; // STOP_WAITING
                        break;
                    }
                    let mut b = [0u8; 1];
                    match s.read(&mut b) {
                        Ok(0) => return Ok(()),
                        Ok(_) if b[0] == 12 => {
                            s.write_all(&[1])?; // WAIT_CANCELED
                            break;
                        }
                        Ok(_) => return Ok(()), // nothing else may come during a wait
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                        Err(e) => return Err(e),
                    }
                }
                s.set_read_timeout(None)?;
            }
            8 => {
                let key = read_key(&mut s)?;
                let removed = data.lock().unwrap().kv.remove(&key).is_some();
                s.write_all(&i64::from(removed).to_le_bytes())?;
            }
            12 => s.write_all(&[1])?,
            _ => return Ok(()),
        }
    }
}

fn vars(rank: usize, world: usize, port: u16, run: &str, attempt: u32) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RUN_ID", run.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", attempt.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn torchrun_env(rank: usize, world: usize, port: u16, run: &str, attempt: u32) -> RankEnv {
    let v = vars(rank, world, port, run, attempt);
    let env = RankEnv::from_lookup(|k| v.iter().find(|(n, _)| n == k).map(|(_, x)| x.clone()))
        .expect("valid variables")
        .expect("launcher variables are set");
    assert!(matches!(env.rendezvous, Rendezvous::AgentStore(_)));
    env
}

fn payload(rank: usize) -> Vec<u8> {
    (0..128).map(|i| (i * 7 + rank * 31) as u8).collect()
}

type Outcome = Result<Vec<u8>, DistError>;

/// Runs `share_from_root_named` on a thread for `env`.
fn spawn_rank(env: RankEnv, name: &'static str, timeout: Duration) -> thread::JoinHandle<Outcome> {
    thread::spawn(move || {
        let rank = env.rank;
        share_from_root_named(&env, name, || payload(rank), timeout)
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("loopback is available")
}

#[test]
fn ranks_as_threads_share_rank_zeros_id_and_clean_up() {
    let store = FakeStore::start(Mode::Store);
    let handles: Vec<_> = (0..4)
        .map(|r| {
            spawn_rank(
                torchrun_env(r, 4, store.port, "job-a", 2),
                "test/ok",
                Duration::from_secs(10),
            )
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("no panic");
        assert_eq!(got.as_ref().ok(), Some(&payload(0)), "rank {r}: {got:?}");
    }
    let base = "/lifecycle/job-a/attempt_2/test/ok";
    let written = store.written();
    assert!(written.contains(&format!("{base}/id")), "{written:?}");
    for r in 0..4 {
        assert!(
            written.contains(&format!("{base}/rank/{r}/world")),
            "{written:?}"
        );
    }
    assert_eq!(
        store.keys_with("/lifecycle/"),
        Vec::<String>::new(),
        "keys left behind"
    );
}

#[test]
fn ranks_as_processes_use_the_store_torchrun_advertises() {
    let store = FakeStore::start(Mode::Store);
    let spawn = |rank: usize, agent_store: bool| {
        let mut cmd = Command::new(CHECK);
        cmd.args(["--timeout-ms", "10000"]);
        for (k, v) in vars(rank, 3, store.port, "job-p", 0) {
            cmd.env(k, v);
        }
        if !agent_store {
            cmd.env_remove("TORCHELASTIC_USE_AGENT_STORE");
        }
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the check binary starts")
    };
    let children: Vec<_> = (0..3).map(|r| spawn(r, true)).collect();
    let mut ids = Vec::new();
    for child in children {
        let out = child.wait_with_output().expect("the check binary ends");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        ids.push(
            text.split(" id ")
                .nth(1)
                .map(str::to_owned)
                .expect("an id line"),
        );
    }
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    // share_from_root names its first exchange nccl-id/0
    let written = store.written();
    assert!(
        written.contains(&"/lifecycle/job-p/attempt_0/nccl-id/0/id".to_string()),
        "{written:?}"
    );
    // Without the variable, rank 0 tries to host on the agent's port: issue 16's failure.
    let out = spawn(0, false).wait_with_output().expect("ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("the port is in use"), "{err}");
}

#[test]
fn an_unreachable_store_names_the_address_and_what_to_check() {
    let port = free_port();
    let env = torchrun_env(1, 2, port, "job-u", 0);
    let start = Instant::now();
    let err = share_from_root_named(&env, "test/u", Vec::new, Duration::from_millis(500))
        .expect_err("nothing listens there");
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "retried until the deadline"
    );
    assert!(
        matches!(&err, DistError::StoreUnreachable { rank: 1, port: p, .. } if *p == port),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("torchrun agent is still running"), "{text}");
}

#[test]
fn a_key_that_never_arrives_times_out_naming_rank_key_and_wait() {
    let store = FakeStore::start(Mode::Store);
    let timeout = Duration::from_millis(300);
    let err = spawn_rank(
        torchrun_env(1, 2, store.port, "job-k", 0),
        "test/late",
        timeout,
    )
    .join()
    .expect("no panic")
    .expect_err("rank 0 never comes");
    let DistError::KeyTimeout {
        rank, key, waited, ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(*rank, 1);
    assert_eq!(key, "/lifecycle/job-k/attempt_0/test/late/id");
    assert!(
        *waited >= timeout * 3 / 2 + Duration::from_secs(1) && *waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert!(err.to_string().contains("rank 0 may have died"), "{err}");
}

#[test]
fn rank_zero_gives_up_on_missing_ranks_and_says_why() {
    let store = FakeStore::start(Mode::Store);
    let err = spawn_rank(
        torchrun_env(0, 3, store.port, "job-m", 0),
        "test/missing",
        Duration::from_millis(300),
    )
    .join()
    .expect("no panic")
    .expect_err("ranks 1 and 2 never come");
    assert!(
        matches!(&err, DistError::RanksMissing { missing, world: 3, .. } if missing == &[1, 2]),
        "{err:?}"
    );
    // A rank arriving late reads rank 0's reason at once.
    let start = Instant::now();
    let late = spawn_rank(
        torchrun_env(2, 3, store.port, "job-m", 0),
        "test/missing",
        Duration::from_secs(10),
    )
    .join()
    .expect("no panic")
    .expect_err("rank 0 gave up");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(late, DistError::Rejected { rank: 2, .. }),
        "{late:?}"
    );
    assert!(
        late.to_string().contains("rank 0 gave up: rank 0 waited"),
        "{late}"
    );
}

#[test]
fn a_server_that_refuses_the_handshake_is_reported_quickly() {
    for (mode, reason) in [
        (
            Mode::CloseOnValidate,
            "closed the connection after VALIDATE and PING",
        ),
        (Mode::WrongNonce, "expected the nonce"),
        (Mode::Mute, "did not answer PING"),
    ] {
        let store = FakeStore::start(mode);
        let env = torchrun_env(1, 2, store.port, "job-v", 0);
        let start = Instant::now();
        let err = share_from_root_named(&env, "test/v", Vec::new, Duration::from_secs(1))
            .expect_err("the server refuses");
        assert!(start.elapsed() < Duration::from_secs(15));
        assert!(
            matches!(&err, DistError::StoreRefused { port, reason: r, .. }
                if *port == store.port && r.contains(reason)),
            "{err:?}"
        );
        assert!(err.to_string().contains("torch 2.x TCPStore"), "{err}");
    }
}

#[test]
fn mismatched_world_sizes_fail_on_both_sides() {
    let store = FakeStore::start(Mode::Store);
    let t = Duration::from_secs(10);
    let root = spawn_rank(torchrun_env(0, 2, store.port, "job-w", 0), "test/w", t);
    let other = spawn_rank(torchrun_env(1, 3, store.port, "job-w", 0), "test/w", t);
    let e0 = root.join().expect("no panic").expect_err("refused");
    let e1 = other.join().expect("no panic").expect_err("refused");
    assert!(
        matches!(
            e0,
            DistError::WorldMismatch {
                rank: 1,
                theirs: 3,
                ours: 2
            }
        ),
        "{e0:?}"
    );
    assert!(matches!(e1, DistError::Rejected { rank: 1, .. }), "{e1:?}");
    assert!(
        e1.to_string()
            .contains("WORLD_SIZE=3 but rank 0 with WORLD_SIZE=2"),
        "{e1}"
    );
}

#[test]
fn a_rank_claimed_twice_is_refused() {
    let store = FakeStore::start(Mode::Store);
    let t = Duration::from_secs(10);
    let first = spawn_rank(torchrun_env(1, 2, store.port, "job-d", 0), "test/d", t);
    store.wait_for_key("/lifecycle/job-d/attempt_0/test/d/rank/1/world");
    let second = spawn_rank(torchrun_env(1, 2, store.port, "job-d", 0), "test/d", t)
        .join()
        .expect("no panic")
        .expect_err("rank 1 is taken");
    assert!(
        matches!(second, DistError::DuplicateRank { rank: 1 }),
        "{second:?}"
    );
    let root = spawn_rank(torchrun_env(0, 2, store.port, "job-d", 0), "test/d", t)
        .join()
        .expect("no panic")
        .expect_err("rank 1 was claimed twice");
    assert!(
        matches!(root, DistError::DuplicateRank { rank: 1 }),
        "{root:?}"
    );
    let first = first.join().expect("no panic").expect_err("rank 0 gave up");
    assert!(
        first.to_string().contains("two processes claim rank 1"),
        "{first}"
    );
}

#[test]
fn a_restart_does_not_read_the_previous_attempts_id() {
    let store = FakeStore::start(Mode::Store);
    let mut stale = vec![0u8];
    stale.extend_from_slice(&2u64.to_le_bytes());
    stale.extend_from_slice(b"stale id");
    store.seed("/lifecycle/job-r/attempt_0/test/r/id", stale);
    let t = Duration::from_secs(10);
    // The same name at attempt 0 would take the stale id...
    let old = spawn_rank(torchrun_env(1, 2, store.port, "job-r", 0), "test/r", t)
        .join()
        .expect("no panic");
    assert_eq!(old.ok().as_deref(), Some(&b"stale id"[..]));
    // ...but the restarted workers meet under attempt 1.
    let one = spawn_rank(torchrun_env(1, 2, store.port, "job-r", 1), "test/r", t);
    let zero = spawn_rank(torchrun_env(0, 2, store.port, "job-r", 1), "test/r", t);
    assert_eq!(zero.join().expect("no panic").ok(), Some(payload(0)));
    assert_eq!(one.join().expect("no panic").ok(), Some(payload(0)));
}

#[test]
fn a_single_rank_needs_nobody_and_leaves_nothing() {
    let store = FakeStore::start(Mode::Store);
    let got = spawn_rank(
        torchrun_env(0, 1, store.port, "job-s", 0),
        "test/s",
        Duration::from_secs(5),
    )
    .join()
    .expect("no panic");
    assert_eq!(got.ok(), Some(payload(0)));
    assert_eq!(store.keys_with("/lifecycle/"), Vec::<String>::new());
}

#[test]
fn a_rank_beyond_rank_zeros_world_refuses_its_answer() {
    // Rank 0 of a world of 2 never waits for rank 2; rank 2 (world 3) checks rank 0's answer.
    let store = FakeStore::start(Mode::Store);
    let mut answer = vec![0u8];
    answer.extend_from_slice(&2u64.to_le_bytes());
    answer.extend_from_slice(b"an id for two ranks");
    store.seed("/lifecycle/job-x/attempt_0/test/x/id", answer);
    let err = spawn_rank(
        torchrun_env(2, 3, store.port, "job-x", 0),
        "test/x",
        Duration::from_secs(5),
    )
    .join()
    .expect("no panic")
    .expect_err("rank 0 has another world size");
    assert!(
        matches!(
            err,
            DistError::WorldMismatch {
                rank: 2,
                theirs: 3,
                ours: 2
            }
        ),
        "{err:?}"
    );
}
