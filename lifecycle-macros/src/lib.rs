//! Procedural macros of `lifecycle-core`; use them through that crate.
//!
//! The crate is split like the usual derive crates: `parse` reads the attribute and the item into
//! a small AST, `validate` checks every rule (each error on the offending tokens, all errors
//! reported together), `expand` writes the generated items and `fallback` the stub emitted beside
//! the errors of a rejected function, so that its callers still type-check and the errors are the
//! only ones.

mod expand;
mod fallback;
mod parse;
mod validate;

use proc_macro::TokenStream;
use quote::ToTokens;

use crate::parse::{Input, RawArgs};
use crate::validate::Rejected;

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
/// (`&T`, `'_`), which would outlive the session. (Edition 2024: a returned `impl Trait` captures
/// every lifetime in scope, the view's included, so it cannot outlive the session unless it
/// says what it captures, `-> impl Iterator<Item = f32> + use<'p>`; the generated function adds
/// its own parameters to that list.) Methods of trait impls are not supported (the
/// macro adds items to the impl block), nor associated functions without a receiver (the
/// generated entry point calls the body as a free function).
///
/// A rejected function is not emitted as written: beside the errors the attribute emits a stub of
/// `name`, `name_enter` and `name_exit` with the signatures it would have generated (the view and
/// engine replaced by the lifecycle, the other parameters as written), so callers type-check and
/// the attribute's errors are the only ones.
///
/// See `lifecycle_core`'s crate documentation, "The attribute", for a compiled example.
#[proc_macro_attribute]
pub fn sharded_rollout(args: TokenStream, item: TokenStream) -> TokenStream {
    attribute(args.into(), item.into()).into()
}

/// The macro: parse, validate, expand. On error: every error, and for a function the stub of what
/// the expansion would have generated ([`fallback`]), so that the errors are the only ones; for
/// any other item, the item as written.
fn attribute(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let args = syn::parse2::<RawArgs>(args);
    let input = match parse::item(item.clone()) {
        Ok(input) => input,
        Err(e) => {
            let mut out = item;
            out.extend(e.to_compile_error());
            return out;
        }
    };
    let as_written = match &input {
        Input::Fn(_) => None,
        Input::Other(item) => Some(item.to_token_stream()),
    };
    match validate::validate(args, input) {
        Ok(model) => expand::expand(model),
        Err(Rejected { errors, fallback }) => {
            let mut out = errors.to_compile_error();
            out.extend(match fallback {
                Some(fallback) => fallback::stub(*fallback),
                None => as_written.unwrap_or_default(),
            });
            out
        }
    }
}
