//! `_GroupStream`: DAPO's dynamic sampling streamed ([`GroupStream`]) for Python. It holds the
//! stream (its partial rollouts between fills) and the sampling settings of its requests; the
//! switch runs a fill ([`PySwitch::fill`](crate::switch::PySwitch)), calling back into Python
//! for each group's prompt and for each finished group's score.

use std::sync::Mutex;

use lifecycle_bridge::settings::{group_stream, GroupSampling, SamplingText, StreamText};
use lifecycle_decoder::GroupStream;
use pyo3::prelude::*;

use crate::errors::to_py;

/// A stream of prompt groups and the settings its requests are sampled with.
#[pyclass(name = "_GroupStream", module = "lifecycle._lifecycle")]
pub struct PyGroupStream {
    pub(crate) stream: Mutex<GroupStream>,
    pub(crate) sampling: GroupSampling,
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
        let text = StreamText {
            group_size,
            max_new_tokens,
            sampling: SamplingText {
                temperature,
                top_p,
                top_k,
                stop_tokens,
            },
            seed,
            leftovers,
            max_staleness,
            max_groups,
        };
        let (stream, sampling) = group_stream(&text).map_err(to_py)?;
        Ok(PyGroupStream {
            stream: Mutex::new(stream),
            sampling,
        })
    }
}
