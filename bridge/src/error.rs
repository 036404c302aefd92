//! The bridge's errors: one enum whose variants the Python package maps to its exception classes.

/// What went wrong, by kind (the Python package raises one exception class per kind).
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// A setting or argument is invalid (nothing was read or moved).
    #[error("{0}")]
    Config(String),
    /// A tensor does not fit the model: missing, unexpected, or of the wrong shape, dtype or
    /// device (nothing was read or moved).
    #[error("tensor `{name}`: {problem}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// What was expected and what was found.
        problem: String,
    },
    /// A rollout tensor (or session) used after its session ended or after the weights changed.
    #[error("rollout tensor `{name}` is stale: {reason}")]
    Stale {
        /// The tensor's name (or `"session"`).
        name: String,
        /// Why.
        reason: String,
    },
    /// The rollout weights would be rewritten or freed while tensors handed out from them are
    /// still referenced.
    #[error(
        "{operation} would rewrite or free the rollout weights while {} handed-out tensor(s) \
         are still referenced ({}): drop them first (del / let them go out of scope)",
        held.len(),
        held.join(", ")
    )]
    InUse {
        /// What was refused.
        operation: &'static str,
        /// Names of the tensors still referenced (each once).
        held: Vec<String>,
    },
    /// The backend failed (its message, with the lifecycle's account of the state).
    #[error("{0}")]
    Backend(String),
}

impl BridgeError {
    /// A [`BridgeError::Tensor`].
    pub fn tensor(name: impl Into<String>, problem: impl Into<String>) -> Self {
        BridgeError::Tensor {
            name: name.into(),
            problem: problem.into(),
        }
    }

    /// A backend error from anything displayable (the lifecycle's errors carry the backend's).
    pub fn backend(e: impl std::fmt::Display) -> Self {
        BridgeError::Backend(e.to_string())
    }
}
