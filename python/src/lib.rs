//! `lifecycle._lifecycle`: the extension behind the `lifecycle` Python package (its front is
//! plain Python, `python/lifecycle/`). Thin: every check and switch is `lifecycle-bridge`'s;
//! this crate converts arguments, releases the GIL while a switch runs, and hands rollout
//! tensors out through DLPack. No panic crosses into Python: pyo3 turns one into an exception,
//! and every error is one of the package's exception classes.

mod errors;
mod owner;
mod shared;
mod stream;
mod switch;
mod tensor;

use pyo3::prelude::*;

#[pymodule]
fn _lifecycle(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<switch::PySwitch>()?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<stream::PyGroupStream>()?;
    m.add("LifecycleError", py.get_type::<errors::LifecycleError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add(
        "TensorMismatchError",
        py.get_type::<errors::TensorMismatchError>(),
    )?;
    m.add(
        "StaleWeightsError",
        py.get_type::<errors::StaleWeightsError>(),
    )?;
    m.add(
        "TensorsInUseError",
        py.get_type::<errors::TensorsInUseError>(),
    )?;
    m.add("NonFiniteError", py.get_type::<errors::NonFiniteError>())?;
    m.add("BackendError", py.get_type::<errors::BackendError>())?;
    m.add_function(wrap_pyfunction!(switch::expected_parameters, m)?)?;
    m.add_function(wrap_pyfunction!(switch::vllm_names, m)?)?;
    m.add_function(wrap_pyfunction!(switch::megatron_parameters, m)?)?;
    m.add_function(wrap_pyfunction!(shared::_finalizing, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
