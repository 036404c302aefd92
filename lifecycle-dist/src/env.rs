//! Rank discovery from the variables torchrun and Slurm set, and the choice of rendezvous.

use crate::error::DistError;

/// Which launcher's variables were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun, `lifecycle-launch`, or anything setting `RANK` / `WORLD_SIZE`.
    Torchrun,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, …).
    Slurm,
}

/// Where this process sits in a multi-process job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank on this node (the GPU index to use).
    pub local_rank: usize,
    /// Processes on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Address of the node where rank 0 runs.
    pub master_addr: String,
    /// Rendezvous port on that node.
    pub master_port: u16,
    /// Where the values came from.
    pub launcher: Launcher,
    /// How [`share_from_root`](crate::share_from_root) meets the other ranks: through
    /// torchrun's agent store when torchrun advertises it, else through a rendezvous rank 0
    /// hosts.
    pub rendezvous: Rendezvous,
}

/// How the ranks of a job meet to share rank 0's bytes (the NCCL unique id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 listens at `MASTER_ADDR:MASTER_PORT` and the other ranks connect to it: under
    /// `lifecycle-launch`, Slurm's `srun`, or any launcher that leaves that port free.
    Host,
    /// torchrun's elastic agent already hosts a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`
    /// (it sets `TORCHELASTIC_USE_AGENT_STORE=True` for its workers); every rank joins it as a
    /// client and rank 0 publishes the bytes under a key of this job.
    AgentStore(AgentStore),
}

/// torchrun's agent store, as advertised to the workers: which run and which restart attempt
/// this process belongs to. The store itself is at the [`RankEnv`]'s `master_addr` and
/// `master_port`.
///
/// Keys of one exchange start with [`key_prefix`](AgentStore::key_prefix), so that two jobs
/// sharing a store, and the restarts of one job, never read each other's ids.
///
/// ```
/// use lifecycle_dist::AgentStore;
/// let store = AgentStore::new(Some("job-7".into()), 2)?;
/// assert_eq!(store.key_prefix(), "lifecycle/job-7/attempt_2");
/// assert_eq!(AgentStore::new(None, 0)?.key_prefix(), "lifecycle/attempt_0");
/// # Ok::<(), lifecycle_dist::DistError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStore {
    run_id: Option<String>,
    restart_count: u64,
}

/// The longest `TORCHELASTIC_RUN_ID` accepted (keys must stay below the store's 8 KiB limit).
const MAX_RUN_ID: usize = 1024;

impl AgentStore {
    /// The agent store of run `run_id` (`TORCHELASTIC_RUN_ID`; `None` or empty when unknown) at
    /// restart attempt `restart_count` (`TORCHELASTIC_RESTART_COUNT`). Fails if the run id is
    /// longer than 1024 bytes.
    pub fn new(run_id: Option<String>, restart_count: u64) -> Result<AgentStore, DistError> {
        let run_id = run_id.filter(|r| !r.is_empty());
        if let Some(r) = &run_id
            && r.len() > MAX_RUN_ID
        {
            return Err(DistError::BadVar {
                var: "TORCHELASTIC_RUN_ID",
                value: r.clone(),
                expected: "a run id of at most 1024 bytes",
            });
        }
        Ok(AgentStore {
            run_id,
            restart_count,
        })
    }

    /// The run id, when torchrun gave one.
    pub fn run_id(&self) -> Option<&str> {
        self.run_id.as_deref()
    }

    /// The restart attempt (0 for the first start of the workers).
    pub fn restart_count(&self) -> u64 {
        self.restart_count
    }

    /// The start of every key this process writes: `lifecycle/<run id>/attempt_<n>`, or
    /// `lifecycle/attempt_<n>` without a run id. (On the server, like every `TCPStore` key, it
    /// is preceded by `/`.)
    pub fn key_prefix(&self) -> String {
        match &self.run_id {
            Some(run) => format!("lifecycle/{run}/attempt_{}", self.restart_count),
            None => format!("lifecycle/attempt_{}", self.restart_count),
        }
    }
}

/// The port used under Slurm when `MASTER_PORT` is not set (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

impl RankEnv {
    /// Reads the process environment. `Ok(None)` means no launcher variables: run in the
    /// single-process mode (one thread per GPU).
    pub fn from_env() -> Result<Option<RankEnv>, DistError> {
        RankEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](RankEnv::from_env) with variables from `get`.
    ///
    /// Under torchrun (`RANK` or `WORLD_SIZE` set), `TORCHELASTIC_USE_AGENT_STORE=True` selects
    /// [`Rendezvous::AgentStore`], with `TORCHELASTIC_RUN_ID` and `TORCHELASTIC_RESTART_COUNT`;
    /// otherwise, and always under Slurm, the rendezvous is [`Rendezvous::Host`].
    ///
    /// ```
    /// use lifecycle_dist::RankEnv;
    /// let vars = [("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"),
    ///     ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29501")];
    /// let env = RankEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))?
    ///     .expect("launcher variables are set");
    /// assert_eq!((env.rank, env.world_size, env.local_rank), (3, 4, 1));
    /// assert_eq!(env.rendezvous, lifecycle_dist::Rendezvous::Host);
    /// # Ok::<(), lifecycle_dist::DistError>(())
    /// ```
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, DistError> {
        let env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            torchrun(&get)?
        } else if get("SLURM_PROCID").is_some() {
            slurm(&get)?
        } else {
            return Ok(None);
        };
        env.check()?;
        Ok(Some(env))
    }

    fn check(&self) -> Result<(), DistError> {
        if self.world_size == 0 {
            return Err(DistError::Inconsistent("the world size is 0".into()));
        }
        if self.rank >= self.world_size {
            return Err(DistError::Inconsistent(format!(
                "rank {} is not below the world size {}",
                self.rank, self.world_size
            )));
        }
        if let Some(local) = self.local_world_size {
            if self.local_rank >= local {
                return Err(DistError::Inconsistent(format!(
                    "local rank {} is not below the local world size {local}",
                    self.local_rank
                )));
            }
            if local > self.world_size {
                return Err(DistError::Inconsistent(format!(
                    "local world size {local} exceeds the world size {}",
                    self.world_size
                )));
            }
        }
        check_host(&self.master_addr, self.master_port)
    }
}

fn parse<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    expected: &'static str,
) -> Result<Option<T>, DistError> {
    match get(var) {
        None => Ok(None),
        Some(value) => value
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| DistError::BadVar {
                var,
                value,
                expected,
            }),
    }
}

fn required<T>(value: Option<T>, var: &'static str, hint: &'static str) -> Result<T, DistError> {
    value.ok_or(DistError::MissingVar { var, hint })
}

const TORCHRUN_HINT: &str = "launch with torchrun, `lifecycle-launch --nproc-per-node N`, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT";

fn port(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>, DistError> {
    let p: Option<u16> = parse(get, "MASTER_PORT", "a TCP port number in 1..=65535")?;
    if p == Some(0) {
        return Err(DistError::BadVar {
            var: "MASTER_PORT",
            value: "0".into(),
            expected: "a TCP port number in 1..=65535",
        });
    }
    Ok(p)
}

fn torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, DistError> {
    const INT: &str = "a non-negative integer";
    let rank = required(parse(get, "RANK", INT)?, "RANK", TORCHRUN_HINT)?;
    let world_size = required(parse(get, "WORLD_SIZE", INT)?, "WORLD_SIZE", TORCHRUN_HINT)?;
    let local_world_size = parse(get, "LOCAL_WORLD_SIZE", INT)?;
    let local_rank = match parse(get, "LOCAL_RANK", INT)? {
        Some(l) => l,
        None => match local_world_size {
            Some(n) if n > 0 => rank % n,
            _ => {
                return Err(DistError::MissingVar {
                    var: "LOCAL_RANK",
                    hint: "set LOCAL_RANK (the GPU index on this node) or LOCAL_WORLD_SIZE",
                })
            }
        },
    };
    Ok(RankEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr: required(get("MASTER_ADDR"), "MASTER_ADDR", TORCHRUN_HINT)?,
        master_port: required(port(get)?, "MASTER_PORT", TORCHRUN_HINT)?,
        launcher: Launcher::Torchrun,
        rendezvous: agent_store(get)?,
    })
}

/// The rendezvous torchrun advertises: its agent store when `TORCHELASTIC_USE_AGENT_STORE` is
/// true (torchrun writes Python's `str(True)`).
fn agent_store(get: &impl Fn(&str) -> Option<String>) -> Result<Rendezvous, DistError> {
    const VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
    let use_store = match get(VAR) {
        None => false,
        Some(v) => match v.trim() {
            "True" | "true" | "TRUE" | "1" => true,
            "False" | "false" | "FALSE" | "0" | "" => false,
            _ => {
                return Err(DistError::BadVar {
                    var: VAR,
                    value: v,
                    expected: "True or False (torchrun sets it)",
                })
            }
        },
    };
    if !use_store {
        return Ok(Rendezvous::Host);
    }
    let restart = parse(
        get,
        "TORCHELASTIC_RESTART_COUNT",
        "a non-negative integer (torchrun sets it)",
    )?
    .unwrap_or(0);
    Ok(Rendezvous::AgentStore(AgentStore::new(
        get("TORCHELASTIC_RUN_ID"),
        restart,
    )?))
}

fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<RankEnv, DistError> {
    const INT: &str = "a non-negative integer";
    const HINT: &str = "run under `srun` (sbatch alone does not start tasks)";
    let rank = required(parse(get, "SLURM_PROCID", INT)?, "SLURM_PROCID", HINT)?;
    let world_size = required(parse(get, "SLURM_NTASKS", INT)?, "SLURM_NTASKS", HINT)?;
    let local_rank = required(parse(get, "SLURM_LOCALID", INT)?, "SLURM_LOCALID", HINT)?;
    // SLURM_NTASKS_PER_NODE is a plain number only with --ntasks-per-node; ignore other forms.
    let local_world_size = get("SLURM_NTASKS_PER_NODE").and_then(|v| v.trim().parse().ok());
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let list = get("SLURM_JOB_NODELIST")
                .or_else(|| get("SLURM_NODELIST"))
                .ok_or(DistError::MissingVar {
                    var: "MASTER_ADDR",
                    hint: "set it to rank 0's node, e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)",
                })?;
            first_host(&list).ok_or(DistError::BadVar {
                var: "SLURM_JOB_NODELIST",
                value: list.clone(),
                expected: "a Slurm node list such as `node[01-04],gpu7`; or set MASTER_ADDR",
            })?
        }
    };
    Ok(RankEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port: port(get)?.unwrap_or(DEFAULT_PORT),
        launcher: Launcher::Slurm,
        rendezvous: Rendezvous::Host,
    })
}

/// The first host of a Slurm node list: `node[01-04,07],gpu2` → `node01`.
///
/// ```
/// assert_eq!(lifecycle_dist::first_host("node[01-04,07],gpu2").as_deref(), Some("node01"));
/// assert_eq!(lifecycle_dist::first_host("gpu2,gpu3").as_deref(), Some("gpu2"));
/// ```
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let (prefix, rest) = match list.find(['[', ',']) {
        None => return (!list.is_empty()).then(|| list.to_string()),
        Some(i) if list.as_bytes()[i] == b',' => {
            let first = &list[..i];
            return (!first.is_empty()).then(|| first.to_string());
        }
        Some(i) => (&list[..i], &list[i + 1..]),
    };
    let close = rest.find(']')?;
    let first = rest[..close].split([',', '-']).next()?.trim();
    if prefix.is_empty() || first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let suffix: String = rest[close + 1..]
        .split(',')
        .next()
        .unwrap_or("")
        .to_string();
    Some(format!("{prefix}{first}{suffix}"))
}

/// Rejects addresses that are neither an IP literal nor a host name, before any lookup.
fn check_host(addr: &str, port: u16) -> Result<(), DistError> {
    let is_ip = addr.parse::<std::net::IpAddr>().is_ok();
    let is_name = !addr.is_empty()
        && addr.len() <= 253
        && addr.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if is_ip || is_name {
        Ok(())
    } else {
        Err(DistError::BadAddress {
            addr: addr.to_string(),
            port,
            reason: "not an IP address or a host name".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<RankEnv>, DistError> {
        RankEnv::from_lookup(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn no_launcher_means_single_process() {
        assert!(env(&[]).unwrap().is_none());
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node01"),
            ("MASTER_PORT", "29400"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e.local_rank, 1,
            "LOCAL_RANK derived from RANK mod LOCAL_WORLD_SIZE"
        );
        assert_eq!(e.launcher, Launcher::Torchrun);
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_ADDR is not set"), "{err}");
        let err = env(&[
            ("RANK", "two"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("RANK=\"two\""), "{err}");
        let err = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 2 is not below the world size 2"),
            "{err}"
        );
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "bad host!"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("not an IP address or a host name"),
            "{err}"
        );
    }

    #[test]
    fn torchrun_agent_store() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            env(&v)
        };
        let e = with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "job-7"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
        ])
        .unwrap()
        .unwrap();
        let Rendezvous::AgentStore(store) = &e.rendezvous else {
            panic!("agent store expected, got {:?}", e.rendezvous);
        };
        assert_eq!(store.run_id(), Some("job-7"));
        assert_eq!(store.restart_count(), 3);
        assert_eq!(store.key_prefix(), "lifecycle/job-7/attempt_3");
        let e = with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")])
            .unwrap()
            .unwrap();
        assert_eq!(
            e.rendezvous,
            Rendezvous::AgentStore(AgentStore::new(None, 0).unwrap())
        );
        for off in ["False", "0", ""] {
            let e = with(&[("TORCHELASTIC_USE_AGENT_STORE", off)])
                .unwrap()
                .unwrap();
            assert_eq!(e.rendezvous, Rendezvous::Host, "{off:?}");
        }
        assert_eq!(with(&[]).unwrap().unwrap().rendezvous, Rendezvous::Host);
        let err = with(&[("TORCHELASTIC_USE_AGENT_STORE", "yes please")]).unwrap_err();
        assert!(err.to_string().contains("True or False"), "{err}");
        let err = with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "-1"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("TORCHELASTIC_RESTART_COUNT=\"-1\""),
            "{err}"
        );
        let long = "r".repeat(MAX_RUN_ID + 1);
        assert!(AgentStore::new(Some(long), 0).is_err());
        assert_eq!(
            AgentStore::new(Some(String::new()), 0).unwrap().run_id(),
            None
        );
    }

    #[test]
    fn slurm_variables() {
        let e = env(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "6"),
            ("SLURM_NTASKS_PER_NODE", "8"),
            ("SLURM_JOB_NODELIST", "gpu-[003-004]"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.master_addr, "gpu-003");
        assert_eq!(e.master_port, DEFAULT_PORT);
        assert_eq!(e.local_world_size, Some(8));
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!(e.rendezvous, Rendezvous::Host);
        let err = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).unwrap_err();
        assert!(err.to_string().contains("SLURM_LOCALID"), "{err}");
    }

    #[test]
    fn node_lists() {
        assert_eq!(first_host("a").as_deref(), Some("a"));
        assert_eq!(first_host("n[7,9-10]").as_deref(), Some("n7"));
        assert_eq!(first_host("rack[1-2]-gpu,x").as_deref(), Some("rack1-gpu"));
        assert_eq!(first_host("n[x]"), None);
        assert_eq!(first_host(""), None);
    }
}
