//! Procedural macros of `lifecycle-core`; use them through that crate.
//!
//! The crate is split like the usual derive crates: `parse` reads the attribute and the item into
//! a small AST, `validate` checks every rule (each error on the offending tokens, all errors
//! reported together) and `expand` writes the generated items.

mod expand;
mod parse;
mod validate;

use proc_macro::TokenStream;

/// Turns a function that reads the rollout weights into one that drives the lifecycle.
///
/// Apply it to a free function or a method (sync or `async`) with one parameter of type
/// `RolloutView<'_, W>`: the rollout weights view. When several parameters have that type, or to
/// be explicit, mark the view with `#[weights]` or name it with `weights = name`.
///
/// Next to the view, the function may take the lifecycle's rollout engine: a parameter of type
/// `EngineMut<'_, E>`, or a `&mut E` marked `#[engine]` (or named with `engine = name`). The
/// generated function then takes a `&mut Lifecycle<B, E>` and passes the engine borrowed from the
/// same session as the view (`RolloutSession::parts`), awake for the current weights. Without an
/// engine parameter it takes a lifecycle with any engine.
///
/// For a function `name` it generates, in the same module (or the same impl block):
///
/// - `name`, with the same visibility, asyncness, receiver and generics, whose first parameter
///   (after the receiver) is `lifecycle: &mut Lifecycle<B>` for any backend `B` with
///   `Reshard<Rollout = W>`, followed by the other parameters. It opens a rollout session
///   (entering rollout mode only when the resident weights are missing or stale), runs the body
///   with the weights view, ends the session by the switching policy and returns the body's value
///   as `Result<T, LifecycleError<B::Error>>`.
/// - `name_enter(lifecycle)` and `name_exit(lifecycle)`: explicit switches.
/// - a hidden `__name_body`: the function as written (so `return`, `?`, generics and `async` keep
///   their meaning).
///
/// # Arguments
///
/// All optional, written `key = value`:
///
/// - `crate = "path"`: where the runtime crate is (default `::lifecycle_core`), for crates that
///   re-export it.
/// - `weights = ident`: the weights view parameter.
/// - `engine = ident`: the engine parameter.
/// - `switching = "inherit" | "eager" | "lazy"`: `inherit` (default) applies the lifecycle's
///   switching policy after each call; `eager` always leaves rollout mode after each call; `lazy`
///   always keeps the weights resident after each call.
///
/// # Rejected
///
/// Items other than functions; `const`, `unsafe`, `extern` and variadic functions; receivers other
/// than `&self` and `&mut self`; zero or two weights views; two engine parameters, an engine
/// without a weights view, an engine taken by value, by shared reference, as `&EngineMut`, with a
/// named lifetime, or a parameter marked both `#[weights]` and `#[engine]`; a named lifetime on
/// the view (it is borrowed for one call only: write `'_`); a return type that borrows through an elided lifetime
/// (`&T`, `'_`), which would outlive the session. Methods of trait impls are not supported (the
/// macro adds items to the impl block), nor associated functions without a receiver (the
/// generated entry point calls the body as a free function).
///
/// See `lifecycle_core`'s crate documentation, "The attribute", for a compiled example.
#[proc_macro_attribute]
pub fn sharded_rollout(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::sharded_rollout(args.into(), item.into()).into()
}
