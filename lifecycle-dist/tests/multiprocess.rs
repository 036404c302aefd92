//! The rendezvous with real processes on loopback: the launcher's ranks all receive rank 0's id;
//! a late rank 0, mismatched world sizes, a rank that never arrives and a port in use fail with
//! errors that name the rank and the fix.

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const CHECK: &str = env!("CARGO_BIN_EXE_rendezvous-check");
const LAUNCH: &str = env!("CARGO_BIN_EXE_lifecycle-launch");

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("loopback is available")
}

fn rank(rank: usize, world: usize, port: u16, timeout_ms: u64) -> Child {
    Command::new(CHECK)
        .args(["--timeout-ms", &timeout_ms.to_string()])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the check binary starts")
}

fn finish(child: Child) -> (bool, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = child.wait_with_output().expect("the check binary ends");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    (status.success(), text)
}

#[test]
fn launcher_ranks_share_one_id() {
    let port = free_port();
    let out = Command::new(LAUNCH)
        .args([
            "--nproc-per-node",
            "4",
            "--master-port",
            &port.to_string(),
            "--",
            CHECK,
        ])
        .output()
        .expect("the launcher runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split(" id ").nth(1))
        .collect();
    assert_eq!(ids.len(), 4, "{text}");
    assert!(ids.iter().all(|id| *id == ids[0]), "{text}");
    for r in 0..4 {
        assert!(text.contains(&format!("rank {r}/4")), "{text}");
    }
}

#[test]
fn ranks_wait_for_a_late_rank_zero() {
    let port = free_port();
    let early = rank(1, 2, port, 10_000);
    std::thread::sleep(Duration::from_millis(600));
    let root = rank(0, 2, port, 10_000);
    let (ok0, t0) = finish(root);
    let (ok1, t1) = finish(early);
    assert!(ok0 && ok1, "{t0}\n{t1}");
}

#[test]
fn mismatched_world_sizes_are_refused() {
    let port = free_port();
    let root = rank(0, 2, port, 5_000);
    let other = rank(1, 3, port, 5_000);
    let (ok0, t0) = finish(root);
    let (ok1, t1) = finish(other);
    assert!(!ok0 && !ok1);
    assert!(
        t0.contains("WORLD_SIZE=3 but rank 0 with WORLD_SIZE=2"),
        "{t0}"
    );
    assert!(t1.contains("rank 0 refused rank 1"), "{t1}");
}

#[test]
fn a_rank_that_never_arrives_times_out_on_every_rank() {
    let port = free_port();
    let root = rank(0, 3, port, 1_500);
    let one = rank(1, 3, port, 1_500);
    let (ok0, t0) = finish(root);
    let (ok1, t1) = finish(one);
    assert!(!ok0 && !ok1);
    assert!(
        t0.contains("for ranks [2] of 3, which never arrived"),
        "{t0}"
    );
    assert!(t1.contains("rank 0 gave up"), "{t1}");
}

#[test]
fn a_port_in_use_is_named() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("loopback is available");
    let port = taken.local_addr().expect("bound").port();
    let (ok, text) = finish(rank(0, 2, port, 1_000));
    assert!(!ok);
    assert!(
        text.contains(&format!("127.0.0.1:{port}: the port is in use")),
        "{text}"
    );
}

#[test]
fn no_rank_zero_means_unreachable() {
    let port = free_port();
    let (ok, text) = finish(rank(1, 2, port, 800));
    assert!(!ok);
    assert!(
        text.contains("could not reach rank 0 at 127.0.0.1"),
        "{text}"
    );
}

#[test]
fn launcher_stops_the_job_when_a_rank_fails() {
    let port = free_port();
    // world of 2 on a port that is taken: rank 0 fails at once, rank 1 must be stopped
    let taken = TcpListener::bind(("127.0.0.1", port)).expect("loopback is available");
    let out = Command::new(LAUNCH)
        .args([
            "--nproc-per-node",
            "2",
            "--master-port",
            &port.to_string(),
            "--",
            CHECK,
        ])
        .output()
        .expect("the launcher runs");
    drop(taken);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("exited with"), "{err}");
    assert!(err.contains("stopping the other ranks"), "{err}");
}
