use std::str::FromStr;

/// A training layout given on the command line: `fsdp:W` or `megatron:tp=…,pp=…,dp=…`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainLayout {
    /// FSDP over `world` ranks.
    Fsdp {
        /// W.
        world: usize,
    },
    /// Megatron with tensor, pipeline and data parallel degrees, and for mixture-of-experts
    /// models the expert-parallel and expert tensor-parallel degrees.
    Megatron {
        /// TP.
        tp: usize,
        /// PP.
        pp: usize,
        /// DP.
        dp: usize,
        /// EP (1 by default).
        ep: usize,
        /// Expert TP (Megatron's default: TP).
        etp: usize,
    },
}

impl TrainLayout {
    /// Ranks in the job.
    pub fn world(&self) -> usize {
        match *self {
            TrainLayout::Fsdp { world } => world,
            TrainLayout::Megatron { tp, pp, dp, .. } => tp * pp * dp,
        }
    }
}

impl TrainLayout {
    /// The degrees a spec leaves out and the parser fills with their defaults, e.g.
    /// `["dp = 1"]` for `megatron:tp=2,pp=2`: what a command should print, so that a spec
    /// missing a degree is never taken silently.
    ///
    /// ```
    /// use lifecycle_plan::TrainLayout;
    /// assert_eq!(TrainLayout::defaulted("megatron:tp=2,pp=2"), vec!["dp = 1"]);
    /// assert!(TrainLayout::defaulted("megatron:tp=2,pp=1,dp=4").is_empty());
    /// assert!(TrainLayout::defaulted("fsdp:8").is_empty());
    /// ```
    pub fn defaulted(spec: &str) -> Vec<String> {
        let Ok(TrainLayout::Megatron { tp, ep, .. }) = spec.parse::<TrainLayout>() else {
            return Vec::new();
        };
        let rest = spec.split_once(':').map_or("", |(_, r)| r);
        let given: Vec<&str> = rest
            .split(',')
            .filter_map(|p| p.split_once('=').map(|(k, _)| k.trim()))
            .collect();
        let mut out = Vec::new();
        for (key, value) in [("pp", 1), ("dp", 1)] {
            if !given.contains(&key) {
                out.push(format!("{key} = {value}"));
            }
        }
        if ep > 1 && !given.contains(&"etp") {
            out.push(format!("etp = {tp}"));
        }
        out
    }
}

impl std::fmt::Display for TrainLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrainLayout::Fsdp { world } => write!(f, "fsdp:{world}"),
            TrainLayout::Megatron {
                tp,
                pp,
                dp,
                ep,
                etp,
            } => {
                write!(f, "megatron:tp={tp},pp={pp},dp={dp}")?;
                if *ep > 1 || etp != tp {
                    write!(f, ",ep={ep},etp={etp}")?;
                }
                Ok(())
            }
        }
    }
}

const USAGE: &str = "expected `fsdp:W` or `megatron:tp=N,pp=N,dp=N[,ep=N,etp=N]` (pp, dp and ep \
                     default to 1, etp to tp)";

impl FromStr for TrainLayout {
    type Err = String;

    /// ```
    /// use lifecycle_plan::TrainLayout;
    /// assert_eq!("fsdp:8".parse(), Ok(TrainLayout::Fsdp { world: 8 }));
    /// assert_eq!(
    ///     "megatron:tp=2,pp=2".parse(),
    ///     Ok(TrainLayout::Megatron { tp: 2, pp: 2, dp: 1, ep: 1, etp: 2 })
    /// );
    /// assert_eq!(
    ///     "megatron:tp=2,dp=4,ep=4,etp=1".parse(),
    ///     Ok(TrainLayout::Megatron { tp: 2, pp: 1, dp: 4, ep: 4, etp: 1 })
    /// );
    /// assert!("megatron:tp=2,cp=2".parse::<TrainLayout>().unwrap_err().contains("cp"));
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        let positive = |what: &str, v: &str| -> Result<usize, String> {
            v.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    format!("training layout `{s}`: {what} = `{v}` is not a positive integer")
                })
        };
        match s.split_once(':') {
            Some(("fsdp", w)) => Ok(TrainLayout::Fsdp {
                world: positive("W", w)?,
            }),
            Some(("megatron", rest)) => {
                let (mut tp, mut pp, mut dp, mut ep, mut etp) = (None, 1, 1, 1, None);
                for part in rest.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = part.split_once('=').ok_or_else(|| {
                        format!("training layout `{s}`: `{part}` is not key=value; {USAGE}")
                    })?;
                    match k.trim() {
                        "tp" => tp = Some(positive("tp", v)?),
                        "pp" => pp = positive("pp", v)?,
                        "dp" => dp = positive("dp", v)?,
                        "ep" => ep = positive("ep", v)?,
                        "etp" => etp = Some(positive("etp", v)?),
                        other => {
                            return Err(format!(
                                "training layout `{s}`: unknown degree `{other}`; {USAGE}"
                            ))
                        }
                    }
                }
                let tp =
                    tp.ok_or_else(|| format!("training layout `{s}`: tp is missing; {USAGE}"))?;
                Ok(TrainLayout::Megatron {
                    tp,
                    pp,
                    dp,
                    ep,
                    etp: etp.unwrap_or(tp),
                })
            }
            _ => Err(format!("training layout `{s}`: {USAGE}")),
        }
    }
}
