//! `_Switch`: a host or GPU switch of `lifecycle-bridge` behind one Python class.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use lifecycle_bridge::gpu::GpuRankParts;
use lifecycle_bridge::settings::{
    self, buffer_class, engine_settings, gpu_pool, requests, switch_settings, RankHome,
    SamplingText, SettingsText,
};
use lifecycle_bridge::shards::Shard;
use lifecycle_bridge::SwitchStats;
use lifecycle_bridge::{BridgeError, Entered, GpuFront, MegatronParallel, ModelBinding, Switch};
use lifecycle_cuda::driver::{BufferClass, LentOffload};
use lifecycle_decoder::{DecodeError, Sample, SamplingParams};
use lifecycle_decoder_gpu::GpuDecodeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::owner::PyOwner;
use crate::shared::{Owner, Shared};
use crate::stream::PyGroupStream;
use crate::tensor::PyTensor;

/// One buffer an offload may move, as Python gives it: `(name, "params" | "optimizer", address,
/// bytes, release(rank, ptr), restore(rank, bytes) -> ptr)`.
type PyOffload = (String, String, u64, usize, Py<PyAny>, Py<PyAny>);

/// The switch (see the [module docs](self)).
#[pyclass(name = "_Switch", module = "lifecycle._lifecycle")]
pub struct PySwitch {
    shared: Owner,
}

impl PySwitch {
    fn lock(&self) -> MutexGuard<'_, Switch> {
        self.shared.lock()
    }

    /// Runs `f` on the GPU switch, or says why there is none.
    fn with_gpu<R>(
        &self,
        f: impl FnOnce(&mut dyn GpuFront) -> Result<R, BridgeError>,
    ) -> Result<R, BridgeError> {
        f(self.lock().gpu()?)
    }
}

fn stats_dict<'py>(py: Python<'py>, s: SwitchStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("enters", s.enters)?;
    d.set_item("refreshes", s.refreshes)?;
    d.set_item("exits", s.exits)?;
    d.set_item("reuses", s.reuses)?;
    d.set_item("switch_seconds", s.switch_time.as_secs_f64())?;
    d.set_item("generation", s.generation)?;
    Ok(d)
}

/// A front's LoRA configuration: `(r, lora_alpha, target_modules, use_rslora, trained)`, the
/// last the whole tensors trained beside the adapters (the model's names).
type LoraArgs = (usize, f64, Vec<String>, bool, Vec<String>);

/// The parameters (Hugging Face names, full shapes, checkpoint order) of the model a Hugging
/// Face `config.json` describes, with the LoRA adapters of `lora` beside their bases.
#[pyfunction]
#[pyo3(signature = (config_json, lora=None))]
pub fn expected_parameters(
    config_json: &str,
    lora: Option<LoraArgs>,
) -> PyResult<Vec<(String, Vec<usize>)>> {
    match lora {
        None => ModelBinding::expected(config_json),
        Some((r, alpha, targets, rslora, trained)) => {
            settings::lora(r, alpha, &targets, rslora, &trained)
                .and_then(|l| ModelBinding::expected_with_lora(config_json, &l))
        }
    }
    .map_err(to_py)
}

/// vLLM's runtime parameters (names, rank-local shapes) of the model a Hugging Face
/// `config.json` describes at tensor-parallel degree `tp`.
#[pyfunction]
#[pyo3(signature = (config_json, tp, experts, dtype))]
pub fn vllm_names(
    config_json: &str,
    tp: usize,
    experts: &str,
    dtype: &str,
) -> PyResult<Vec<(String, Vec<usize>)>> {
    ModelBinding::vllm_names(config_json, tp, experts, dtype).map_err(to_py)
}

/// Megatron-Core's parameters (names, rank-local shapes, the order a Megatron switch lends
/// them) of the model a Hugging Face `config.json` describes at `(tp, pp, dp)` with expert
/// parallelism `ep` and expert tensor parallelism `etp` (TP where `None`), of global rank
/// `rank`, the embedding padded to `padded_vocab` rows (Megatron's default rule where `None`).
#[pyfunction]
#[pyo3(signature = (config_json, tp, pp, dp, padded_vocab=None, rank=0, ep=1, etp=None))]
#[allow(clippy::too_many_arguments)]
pub fn megatron_parameters(
    config_json: &str,
    tp: usize,
    pp: usize,
    dp: usize,
    padded_vocab: Option<usize>,
    rank: usize,
    ep: usize,
    etp: Option<usize>,
) -> PyResult<Vec<(String, Vec<usize>)>> {
    let degrees = MegatronParallel::new(tp, pp, dp).with_experts(ep, etp.unwrap_or(tp));
    ModelBinding::megatron_parameters(config_json, degrees, padded_vocab, rank).map_err(to_py)
}

#[pymethods]
impl PySwitch {
    #[new]
    #[pyo3(signature = (config_json, names, *, world, tp, dtype_name, experts_name, offload, switching, device, gpu=0, fp8_keep="none", lora=None, shared=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config_json: &str,
        names: Vec<(String, Vec<usize>)>,
        world: usize,
        tp: usize,
        dtype_name: &str,
        experts_name: &str,
        offload: &str,
        switching: &str,
        device: &str,
        gpu: usize,
        fp8_keep: &str,
        lora: Option<LoraArgs>,
        shared: Option<Vec<(String, Vec<usize>, u64)>>,
    ) -> PyResult<Self> {
        let shared = shared.unwrap_or_default();
        let build = || -> Result<Switch, BridgeError> {
            // the shared tensors are the model's too: bound with the others, then set apart
            let all: Vec<(String, Vec<usize>)> = names
                .into_iter()
                .chain(shared.iter().map(|(n, s, _)| (n.clone(), s.clone())))
                .collect();
            let binding = match lora {
                None => ModelBinding::new(config_json, all)?,
                Some((r, alpha, targets, rslora, trained)) => ModelBinding::with_lora(
                    config_json,
                    all,
                    settings::lora(r, alpha, &targets, rslora, &trained)?,
                )?,
            };
            let names: Vec<String> = shared.iter().map(|(n, _, _)| n.clone()).collect();
            let binding = binding.with_shared(&names)?;
            let text = SettingsText {
                world,
                tp,
                dtype: dtype_name,
                experts: experts_name,
                offload,
                switching,
                fp8_keep,
            };
            let settings = switch_settings(&text, binding.names(), binding.lora())?;
            let mut switch = Switch::build(binding, settings, device, || {
                gpu_pool(world, gpu, RankHome::Process)
            })?;
            if !shared.is_empty() {
                let addresses = shared.iter().map(|(_, _, at)| *at).collect();
                // SAFETY: the front (lifecycle/switch.py, from_peft) passes the addresses of the
                // frozen bf16 base on this GPU and keeps a reference to each tensor as long as
                // the switch; its calls run one at a time with the trainer's (a write between
                // them is refused by check_shared).
                unsafe { switch.gpu()?.share_base(addresses)? };
            }
            Ok(switch)
        };
        let inner = py.detach(build).map_err(to_py)?;
        Ok(PySwitch {
            shared: Owner::new(&Shared::new(inner)),
        })
    }

    /// A switch of Megatron-Core parameters (see `lifecycle.Switch.from_megatron`): the model of
    /// `config_json` trained at `(tp, pp, dp)` (its experts at `ep`, `etp`: TP where `None`)
    /// with `padded_vocab` embedding rows, into the
    /// fused rollout layout at `rollout_tp`, on GPU `gpu` (one rank), the launcher's ranks
    /// (`ranks="process"`), or every rank of the job on GPU `gpu` (`ranks="shared-gpu"`).
    #[staticmethod]
    #[pyo3(signature = (config_json, *, tp, pp, dp, padded_vocab, rollout_tp, dtype_name, experts_name, offload, switching, gpu=0, fp8_keep="none", ranks="process", ep=1, etp=None))]
    #[allow(clippy::too_many_arguments)]
    fn megatron(
        py: Python<'_>,
        config_json: &str,
        tp: usize,
        pp: usize,
        dp: usize,
        padded_vocab: usize,
        rollout_tp: usize,
        dtype_name: &str,
        experts_name: &str,
        offload: &str,
        switching: &str,
        gpu: usize,
        fp8_keep: &str,
        ranks: &str,
        ep: usize,
        etp: Option<usize>,
    ) -> PyResult<Self> {
        let degrees = MegatronParallel::new(tp, pp, dp).with_experts(ep, etp.unwrap_or(tp));
        let world = degrees.world();
        let home: RankHome = ranks.parse().map_err(to_py)?;
        let text = SettingsText {
            world,
            tp: rollout_tp,
            dtype: dtype_name,
            experts: experts_name,
            offload,
            switching,
            fp8_keep,
        };
        let build = || {
            Switch::megatron(config_json, degrees, padded_vocab, &text, || {
                gpu_pool(world, gpu, home)
            })
        };
        let inner = py.detach(build).map_err(to_py)?;
        Ok(PySwitch {
            shared: Owner::new(&Shared::new(inner)),
        })
    }

    /// The Megatron-Core names and shapes local rank `local` lends, in the order `enter` takes
    /// them (a Megatron switch only).
    #[pyo3(signature = (local=0))]
    fn parameters(&self, local: usize) -> PyResult<Vec<(String, Vec<usize>)>> {
        self.lock().parameters(local).map_err(to_py)
    }

    /// Checks shards as `enter` would (`shards[local][tensor]` = `(address, elements)`) without
    /// reading them: what a constructor can know before the first rollout.
    fn check_shards(&self, shards: Vec<Vec<Shard>>) -> PyResult<()> {
        self.lock().check_shards(&shards).map_err(to_py)
    }

    /// Enters rollout mode (see `lifecycle.Switch.rollout`): `shards[local][tensor]` =
    /// `(address, elements)`; `versions` the trainer's tensors' version counters and
    /// `refresh` a change they do not show (the switch decides from both whether the weights
    /// changed); `offload[local]` the buffers an offload may move (GPU); `stream` the trainer's
    /// CUDA stream. Returns `(switched, generation, seconds)`.
    #[pyo3(signature = (shards, versions, refresh, stream=None, offload=None))]
    fn enter(
        &self,
        py: Python<'_>,
        shards: Vec<Vec<Shard>>,
        versions: Vec<u64>,
        refresh: bool,
        stream: Option<u64>,
        offload: Option<Vec<Vec<PyOffload>>>,
    ) -> PyResult<(bool, u64, f64)> {
        let run = || -> Result<Entered, BridgeError> {
            let lent = lent_parts(shards, offload, stream)?;
            // SAFETY: the Python front passes, for a host switch, the addresses of the arrays
            // it holds alive for the call, each of its stated length; for a GPU switch, the live
            // fp32 shards of the module's parameters on this process's GPUs, the module (and the
            // storages it lends to offload) kept alive as long as the switch
            // (lifecycle/switch.py).
            unsafe { self.lock().enter(lent, versions, refresh) }
        };
        let e = py.detach(run).map_err(to_py)?;
        self.shared
            .token
            .generation
            .store(e.generation, Ordering::SeqCst);
        Ok((e.switched, e.generation, e.wall.as_secs_f64()))
    }

    /// A rollout call on the resident weights where nothing changed since the last enter
    /// (`versions`, `refresh` as `enter` takes them) and the shards cannot have moved:
    /// `(False, generation, 0.0)`, or `None` when `enter` with the shards is needed.
    fn reuse(
        &self,
        py: Python<'_>,
        versions: Vec<u64>,
        refresh: bool,
        may_have_moved: bool,
    ) -> PyResult<Option<(bool, u64, f64)>> {
        let e = py
            .detach(|| self.lock().reuse(&versions, refresh, may_have_moved))
            .map_err(to_py)?;
        Ok(e.map(|e| (e.switched, e.generation, e.wall.as_secs_f64())))
    }

    /// Checks the shared base before a rollout (`lifecycle_bridge::SharedWatch::check`):
    /// `versions` the flattened tuple of each shared tensor's versions, `addresses` where each
    /// one's parameter is now; the first call records them.
    fn check_shared(&self, versions: Vec<u64>, addresses: Vec<u64>) -> PyResult<()> {
        self.lock()
            .check_shared(&versions, &addresses)
            .map_err(to_py)
    }

    /// Whether the trainer's weights changed since the last enter (`versions`, `refresh` as
    /// `enter` takes them): the switch's own decision, which the front asks before it gathers
    /// sources anew.
    fn changed(&self, versions: Vec<u64>, refresh: bool) -> bool {
        self.lock().changed(&versions, refresh)
    }

    /// Opens a session: tensors taken from now on are valid until `close_session`.
    fn open_session(&self) -> u64 {
        let id = self.shared.sessions.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.token.session.store(id, Ordering::SeqCst);
        id
    }

    /// Ends the open session: its tensors become stale.
    fn close_session(&self) {
        self.shared.token.session.store(0, Ordering::SeqCst);
    }

    /// The rollout tensors of local rank `local` (in a session).
    #[pyo3(signature = (local=0, bits=false))]
    fn tensors(&self, py: Python<'_>, local: usize, bits: bool) -> PyResult<Vec<PyTensor>> {
        if self.shared.token.session.load(Ordering::SeqCst) == 0 {
            return Err(to_py(BridgeError::Stale {
                name: "session".into(),
                reason: "no rollout session is open (use `with switch.rollout() as w:`)".into(),
            }));
        }
        let views = py.detach(|| self.lock().views(local)).map_err(to_py)?;
        Ok(views
            .into_iter()
            .map(|v| PyTensor::new(v, bits, self.shared.shared()))
            .collect())
    }

    /// Leaves rollout mode (bringing offloaded state back); refused while handed-out tensors are
    /// referenced.
    fn exit(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().exit()).map_err(to_py)
    }

    /// Leaves rollout mode and frees the switch's memory; refused while handed-out tensors are
    /// referenced; a second call does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let gone = py.detach(|| self.lock().close()).map_err(to_py)?;
        // freed here, with the GIL held (a GPU switch holds Python callables)
        drop(gone);
        Ok(())
    }

    /// Whether `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_closed()
    }

    /// Names of handed-out tensors still referenced.
    fn held(&self) -> Vec<String> {
        self.shared.leases.held()
    }

    /// Counts and times of the switches so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock().stats().map_err(to_py)?;
        stats_dict(py, s)
    }

    /// The ranks whose rollout tensors this process reads: the rollout ranks `0..T` of a host
    /// switch, the global ranks this process drives on the GPU.
    fn local_ranks(&self) -> PyResult<Vec<usize>> {
        self.lock().local_ranks().map_err(to_py)
    }

    /// Attaches the project's GPU engine (up to `max_sequences` of up to `max_tokens` at once in
    /// a paged KV cache of `kv_tokens` positions, by default all of them at their longest; fp8
    /// products computed as `fp8_compute` says: `w8a8` (the default) or `weight-only`; K and V
    /// kept in `kv_dtype`: `bf16`, `f32` or `fp8`; LoRA adapters applied as `lora_mode` says:
    /// `unmerged` or `merged`). Every setting, and that the switch is a GPU one, is checked
    /// before the switch leaves rollout mode.
    #[pyo3(signature = (max_sequences, max_tokens, fp8_compute="w8a8", kv_dtype="bf16", kv_tokens=None, lora_mode="unmerged"))]
    #[allow(clippy::too_many_arguments)]
    fn attach_engine(
        &self,
        py: Python<'_>,
        max_sequences: usize,
        max_tokens: usize,
        fp8_compute: &str,
        kv_dtype: &str,
        kv_tokens: Option<usize>,
        lora_mode: &str,
    ) -> PyResult<()> {
        let settings = engine_settings(
            (max_sequences, max_tokens),
            kv_tokens,
            (fp8_compute, kv_dtype),
            lora_mode,
        )
        .map_err(to_py)?;
        py.detach(|| self.with_gpu(|s| s.attach_engine(settings)))
            .map_err(to_py)
    }

    /// Serves one request per prompt with the attached engine on the resident weights
    /// (continuous batching); per request its tokens, three log-probability lists and its
    /// finish reason.
    #[pyo3(signature = (prompts, max_new_tokens, temperature, top_p, top_k, stop_tokens, seeds))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        max_new_tokens: Vec<usize>,
        temperature: f32,
        top_p: f32,
        top_k: Option<u32>,
        stop_tokens: Vec<u32>,
        seeds: Vec<u64>,
    ) -> PyResult<Vec<SampleTuple>> {
        let sampling = SamplingText {
            temperature,
            top_p,
            top_k,
            stop_tokens,
        };
        let requests = requests(prompts, max_new_tokens, seeds, &sampling).map_err(to_py)?;
        let samples = py
            .detach(|| self.with_gpu(|s| s.run(requests)))
            .map_err(to_py)?;
        Ok(samples.iter().map(sample_tuple).collect())
    }

    /// One fill of `stream` ([`GpuSwitch::fill`]): `group(g)` gives group `g`'s prompt,
    /// `keep(g, samples)` scores a finished group (its samples as `run` gives them). The kept
    /// groups (id and samples) and the fill's counts. A callback's exception ends the fill
    /// (every request in flight aborted) and is raised here. The callbacks run while the
    /// switch is busy: they must not call the switch.
    fn fill<'py>(
        &self,
        py: Python<'py>,
        stream: &PyGroupStream,
        want: usize,
        group: Py<PyAny>,
        keep: Py<PyAny>,
    ) -> PyResult<(Vec<KeptGroup>, Bound<'py, PyDict>)> {
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        let stash = |e: PyErr| {
            if let Ok(mut r) = raised.lock() {
                r.get_or_insert(e);
            }
            GpuDecodeError::Decode(DecodeError::Usage("a Python callback raised".into()))
        };
        let mut groups = Vec::new();
        let filled = py.detach(|| {
            let mut s = stream
                .stream
                .lock()
                .map_err(|_| BridgeError::Config("the group stream is in use".into()))?;
            self.with_gpu(|sw| {
                sw.fill(
                    &mut s,
                    want,
                    &mut |g| {
                        Python::attach(|py| -> PyResult<Vec<u32>> {
                            group.call1(py, (g,))?.extract(py)
                        })
                        .map(|prompt| stream.sampling.requests(g, &prompt))
                        .map_err(stash)
                    },
                    &mut |g, samples| {
                        let tuples: Vec<SampleTuple> = samples.iter().map(sample_tuple).collect();
                        let kept = Python::attach(|py| -> PyResult<bool> {
                            keep.call1(py, (g, tuples.clone()))?.extract(py)
                        })
                        .map_err(stash)?;
                        if kept {
                            groups.push((g, tuples));
                        }
                        Ok(kept)
                    },
                )
            })
        });
        if let Some(e) = raised.lock().ok().and_then(|mut r| r.take()) {
            return Err(e);
        }
        let f = filled.map_err(to_py)?;
        // keep's own verdicts beyond `want` are not kept by the stream
        groups.truncate(f.kept.len());
        let d = PyDict::new(py);
        d.set_item("dropped_groups", f.dropped_groups)?;
        d.set_item("finished", f.finished)?;
        d.set_item("finished_tokens", f.finished_tokens)?;
        d.set_item("aborted", f.aborted)?;
        d.set_item("aborted_tokens", f.aborted_tokens)?;
        d.set_item("carried", f.carried)?;
        d.set_item("stale", f.stale)?;
        d.set_item("steps", f.steps)?;
        d.set_item("kept_mean_len", f.kept_mean_len())?;
        d.set_item("finished_mean_len", f.finished_mean_len())?;
        Ok((groups, d))
    }

    /// [`SamplingParams::seed_of`]: the seed of request `index` of a call given one seed.
    #[staticmethod]
    fn seed_of(seed: u64, index: u64) -> u64 {
        SamplingParams::seed_of(seed, index)
    }
}

/// A sample as Python receives it: tokens, log-probabilities at the temperature, at T = 1 and
/// truncated, the finish reason and each token's weight version.
type SampleTuple = (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>, String, Vec<u64>);

/// A kept group as Python receives it: its id and its samples.
type KeptGroup = (u64, Vec<SampleTuple>);

fn sample_tuple(s: &Sample) -> SampleTuple {
    (
        s.tokens.clone(),
        s.logprobs.clone(),
        s.raw_logprobs.clone(),
        s.truncated_logprobs.clone(),
        s.finish.to_string(),
        s.versions.clone(),
    )
}

/// What Python lends for each local rank: its shards and, on the GPU, the buffers an offload
/// may move and the trainer's stream (a host switch reads only the shards).
fn lent_parts(
    shards: Vec<Vec<Shard>>,
    offload: Option<Vec<Vec<PyOffload>>>,
    stream: Option<u64>,
) -> Result<Vec<GpuRankParts>, BridgeError> {
    let mut offload = offload.unwrap_or_default();
    offload.resize_with(shards.len(), Vec::new);
    let mut parts = Vec::with_capacity(shards.len());
    for (list, off) in shards.into_iter().zip(offload) {
        let mut moved = Vec::with_capacity(off.len());
        let offload_at = off.iter().map(|o| (o.2, o.3)).collect();
        for (name, cls, ptr, bytes, release, restore) in off {
            let cls = buffer_class(&name, &cls)?;
            let what = match cls {
                BufferClass::Params => "a lent parameter shard",
                BufferClass::Optimizer => "a lent optimizer state tensor",
            };
            let owner = PyOwner {
                release,
                restore,
                name,
            };
            moved.push(LentOffload::new(what, cls, ptr, bytes, Box::new(owner)));
        }
        parts.push(GpuRankParts {
            shards: list,
            offload: moved,
            offload_at,
            stream,
        });
    }
    Ok(parts)
}
