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
        "{operation} would rewrite or free the rollout weights while {}: drop them first (del, \
         or let them go out of scope), then call it again",
        in_use(held)
    )]
    InUse {
        /// What was refused.
        operation: &'static str,
        /// Names of the tensors still referenced (each once).
        held: Vec<String>,
    },
    /// A training weight holds a NaN or an infinity: the switch refused it (nothing rolls out
    /// until the weights are fixed and a switch succeeds).
    #[error(
        "tensor `{name}` holds a non-finite value ({detail}): the rollout would sample from \
         poisoned weights, so the switch refused it; fix the training step that produced it \
         (the masters are as the trainer left them) and roll out again"
    )]
    NonFinite {
        /// The tensor's name.
        name: String,
        /// The value, where it is.
        detail: String,
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

/// How many handed-out tensors are referenced, naming at most three (`switch.held()` lists
/// every one).
fn in_use(held: &[String]) -> String {
    let named: Vec<String> = held.iter().take(3).map(|n| format!("`{n}`")).collect();
    match held.len() {
        1 => format!("a handed-out tensor is still referenced ({})", named[0]),
        n if n <= 3 => format!(
            "{n} handed-out tensors are still referenced ({})",
            named.join(", ")
        ),
        n => format!(
            "{n} handed-out tensors are still referenced (e.g. {}; `switch.held()` lists them)",
            named.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_in_use_list_is_summarised() {
        let held: Vec<String> = (0..339).map(|i| format!("model.layers.{i}.w")).collect();
        let e = BridgeError::InUse {
            operation: "exit",
            held,
        }
        .to_string();
        assert!(e.len() < 300, "{} characters: {e}", e.len());
        assert!(e.contains("339 handed-out tensors"), "{e}");
        assert!(
            e.contains("`model.layers.2.w`; `switch.held()` lists them"),
            "{e}"
        );
        let one = BridgeError::InUse {
            operation: "close",
            held: vec!["lm_head.weight".into()],
        }
        .to_string();
        assert!(
            one.starts_with(
                "close would rewrite or free the rollout weights while a handed-out \
                             tensor is still referenced (`lm_head.weight`)"
            ),
            "{one}"
        );
    }
}
