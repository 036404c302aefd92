//! `_GroupStream`: DAPO's dynamic sampling streamed ([`GroupStream`]) for Python. It holds the
//! stream (its partial rollouts between fills) and the sampling settings of its requests; the
//! switch runs a fill ([`PySwitch::fill`](crate::switch::PySwitch)), calling back into Python
//! for each group's prompt and for each finished group's score.

use std::sync::Mutex;

use lifecycle_decoder::{GroupStream, Leftovers, Request, SamplingParams};
use pyo3::prelude::*;

use crate::errors::to_py;
use lifecycle_bridge::BridgeError;

/// A stream of prompt groups and the settings its requests are sampled with.
#[pyclass(name = "_GroupStream", module = "lifecycle._lifecycle")]
pub struct PyGroupStream {
    pub(crate) stream: Mutex<GroupStream>,
    pub(crate) group_size: usize,
    pub(crate) params: SamplingParams,
}

#[pymethods]
impl PyGroupStream {
    /// Groups of `group_size` samples of one prompt each, sampled with these settings (the
    /// seed of sample `j` of group `g` is `seed_of(seed, g * group_size + j)`); in-flight
    /// requests at the end of a fill are aborted, or carried (`leftovers="partial"`) with a
    /// staleness bound of `max_staleness` weight versions; a fill submits at most `max_groups`
    /// new groups.
    #[new]
    #[pyo3(signature = (group_size, max_new_tokens, temperature, top_p, top_k, stop_tokens, seed, leftovers, max_staleness, max_groups))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        group_size: usize,
        max_new_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: Option<u32>,
        stop_tokens: Vec<u32>,
        seed: u64,
        leftovers: &str,
        max_staleness: Option<u64>,
        max_groups: Option<usize>,
    ) -> PyResult<Self> {
        let config = |m: String| to_py(BridgeError::Config(m));
        let leftovers =
            match (leftovers, max_staleness) {
                ("abort", None) => Leftovers::Abort,
                ("abort", Some(_)) => return Err(config(
                    "max_staleness bounds partial rollouts: pass leftovers=\"partial\" with it \
                     (aborted requests are never continued)"
                        .into(),
                )),
                ("partial", n) => Leftovers::Partial {
                    max_staleness: n.unwrap_or(1),
                },
                (other, _) => {
                    return Err(config(format!(
                        "leftovers: expected \"abort\" or \"partial\", found {other:?}"
                    )))
                }
            };
        if group_size == 0 {
            return Err(config(
                "group_size: expected a positive integer, found 0".into(),
            ));
        }
        let mut params = SamplingParams::new(max_new_tokens)
            .with_temperature(temperature)
            .with_top_p(top_p)
            .with_stop_tokens(stop_tokens)
            .with_seed(seed);
        params.top_k = top_k;
        let mut stream = GroupStream::new(group_size, leftovers);
        if let Some(n) = max_groups {
            stream = stream.with_max_groups(n);
        }
        Ok(PyGroupStream {
            stream: Mutex::new(stream),
            group_size,
            params,
        })
    }
}

impl PyGroupStream {
    /// Group `g`'s requests for `prompt`.
    pub(crate) fn requests(&self, g: u64, prompt: Vec<u32>) -> Vec<Request> {
        let n = self.group_size as u64;
        (0..n)
            .map(|j| {
                let seed = SamplingParams::seed_of(self.params.seed, g * n + j);
                Request::new(prompt.clone(), self.params.clone().with_seed(seed))
            })
            .collect()
    }
}
