//! The package's exceptions, one class per kind of [`BridgeError`], all under `LifecycleError`.

use lifecycle_bridge::BridgeError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(
    _lifecycle,
    LifecycleError,
    PyException,
    "Base class of every error the lifecycle package raises."
);
create_exception!(
    _lifecycle,
    ConfigError,
    LifecycleError,
    "An invalid setting or argument (nothing was read or moved)."
);
create_exception!(
    _lifecycle,
    TensorMismatchError,
    LifecycleError,
    "A tensor that does not fit the model, named (nothing was read or moved)."
);
create_exception!(
    _lifecycle,
    StaleWeightsError,
    LifecycleError,
    "A rollout tensor or session used after its session ended or after the weights changed."
);
create_exception!(
    _lifecycle,
    TensorsInUseError,
    LifecycleError,
    "A switch refused to rewrite or free rollout weights that handed-out tensors still reference."
);
create_exception!(
    _lifecycle,
    NonFiniteError,
    LifecycleError,
    "A training weight holds a NaN or an infinity: the switch refused it, nothing rolled out."
);
create_exception!(
    _lifecycle,
    BackendError,
    LifecycleError,
    "The switch itself failed; the message says what state the training tensors are in."
);

/// The Python exception of `e`.
pub fn to_py(e: BridgeError) -> PyErr {
    let message = e.to_string();
    match e {
        BridgeError::Config(_) => ConfigError::new_err(message),
        BridgeError::Tensor { .. } => TensorMismatchError::new_err(message),
        BridgeError::Stale { .. } => StaleWeightsError::new_err(message),
        BridgeError::InUse { .. } => TensorsInUseError::new_err(message),
        BridgeError::NonFinite { .. } => NonFiniteError::new_err(message),
        BridgeError::Backend(_) => BackendError::new_err(message),
    }
}
