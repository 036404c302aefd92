//! Starts `N` processes of a program on this node with the variables torchrun would set, so the
//! program's `RankEnv::from_env()` finds its rank; stops the others as soon as one fails.
//! It hosts no store: rank 0 of the program hosts the rendezvous, so the children do not inherit
//! the `TORCHELASTIC_*` variables of an enclosing torchrun.
//!
//! ```text
//! lifecycle-launch --nproc-per-node 2 -- ./my_program --its --args
//! lifecycle-launch --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node01 -- ./prog
//! ```

use std::process::{Child, Command, ExitCode};
use std::time::Duration;

use clap::Parser;

/// Launch one process per GPU on this node (like `torchrun --nproc-per-node`).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Processes to start on this node.
    #[arg(long)]
    nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index (0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node that runs rank 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on that node.
    #[arg(long, default_value_t = lifecycle_dist::DEFAULT_PORT)]
    master_port: u16,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn stop_all(children: &mut [(usize, Child)]) {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.nproc_per_node == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        eprintln!(
            "lifecycle-launch: need --nproc-per-node ≥ 1, --nnodes ≥ 1 and --node-rank < --nnodes \
             (got {}, {}, {})",
            args.nproc_per_node, args.nnodes, args.node_rank
        );
        return ExitCode::from(2);
    }
    let world = args.nnodes * args.nproc_per_node;
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("lifecycle-launch: no program given after `--`");
        return ExitCode::from(2);
    };
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let spawned = Command::new(program)
            .args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("TORCHELASTIC_RUN_ID")
            .env_remove("TORCHELASTIC_RESTART_COUNT")
            .spawn();
        match spawned {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                eprintln!("lifecycle-launch: cannot start {program:?} for rank {rank}: {e}");
                stop_all(&mut children);
                return ExitCode::from(2);
            }
        }
    }
    loop {
        let mut running = false;
        for i in 0..children.len() {
            let (rank, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    let rank = *rank;
                    eprintln!("lifecycle-launch: rank {rank} exited with {status}; stopping the other ranks");
                    children.remove(i);
                    stop_all(&mut children);
                    return ExitCode::from(
                        status
                            .code()
                            .and_then(|c| u8::try_from(c).ok())
                            .unwrap_or(1),
                    );
                }
                Ok(Some(_)) => {}
                Ok(None) => running = true,
                Err(e) => {
                    eprintln!("lifecycle-launch: cannot wait for rank {rank}: {e}");
                    stop_all(&mut children);
                    return ExitCode::from(2);
                }
            }
        }
        if !running {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
