//! What validation hands on: a [`Model`] to expand, or a [`Rejected`] item with the lenient
//! reading of it ([`Fallback`]) for the stub beside its errors.

use syn::{ItemFn, Path, Type};

/// What a call does when the body returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Switching {
    /// Apply the lifecycle's policy (`RolloutSession::finish`).
    #[default]
    Inherit,
    /// Leave rollout mode after every call, whatever the lifecycle's policy.
    Eager,
    /// Keep the weights resident after every call, whatever the lifecycle's policy.
    Lazy,
}

/// A validated `#[sharded_rollout]` function, ready for expansion.
pub struct Model {
    /// Path of the runtime crate (`::lifecycle_core` unless `crate = "..."`).
    pub krate: Path,
    /// What a call does when the body returns.
    pub switching: Switching,
    /// The user's function, with the `#[weights]` marker removed.
    pub func: ItemFn,
    /// Index of the weights view in `func.sig.inputs` (counting the receiver).
    pub weights_index: usize,
    /// The view's type as written (for spans).
    pub view_ty: Type,
    /// `W` in `RolloutView<'_, W>`: the backend's `Reshard::Rollout`.
    pub weights_ty: Type,
    /// The engine parameter, when the function takes one.
    pub engine: Option<EngineParam>,
}

/// A rejected item: every error found, and what the expansion would have generated from it, as
/// far as it can be read.
pub struct Rejected {
    /// Every error, combined.
    pub errors: syn::Error,
    /// The function's reading for the stub emitted beside the errors; `None` for an item that is
    /// not a function.
    pub fallback: Option<Box<Fallback>>,
}

/// A rejected function, read leniently: enough to write the signature the expansion would have
/// generated, so that its callers type-check and the macro's errors are the only ones.
pub struct Fallback {
    /// Path of the runtime crate (`::lifecycle_core` unless a valid `crate = "..."` was given).
    pub krate: Path,
    /// The function as written, without the `#[weights]` and `#[engine]` markers.
    pub func: ItemFn,
    /// Indices in `func.sig.inputs` of the parameters the generated function replaces by the
    /// lifecycle: the weights view and the engine, found or, failing that, guessed.
    pub replaced: Vec<usize>,
    /// `W` of the view, when it can be read.
    pub weights_ty: Option<Type>,
    /// The engine type, when the engine parameter was valid.
    pub engine_ty: Option<Type>,
}

/// How the function takes the rollout engine.
pub struct EngineParam {
    /// Index in `func.sig.inputs` (counting the receiver).
    pub index: usize,
    /// The parameter's type as written (for spans).
    pub param_ty: Type,
    /// `E` in `EngineMut<'_, E>` or `&mut E`: the lifecycle's engine type.
    pub engine_ty: Type,
    /// Taken as `&mut E` (else as `EngineMut<'_, E>`).
    pub by_reference: bool,
}
