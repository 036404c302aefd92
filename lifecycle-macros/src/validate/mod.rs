//! Validation: every rule of the attribute, each failure a `syn::Error` on the offending tokens.
//!
//! Errors are collected and combined, so one expansion reports every mistake at once.
//!
//! [`validate`] reads the item in the order below; each rule lives with what it checks:
//! [`args`] (the attribute's arguments), [`signature`] (item kind, qualifiers, receiver, return
//! type), [`engine`] and [`weights`] (the two parameters the lifecycle supplies); what it hands on
//! is in [`model`], and a rejected function's lenient reading, for the stub, in [`lenient`].

mod args;
mod engine;
mod errors;
mod lenient;
mod model;
mod signature;
#[cfg(test)]
mod tests;
mod weights;

pub use model::{EngineParam, Fallback, Model, Rejected, Switching};

use syn::FnArg;

use crate::parse::{Input, RawArgs};
use args::{check_args, Args};
use engine::{check_engine, find_engine, EngineSearch};
use errors::Errors;
use lenient::{fallback, Marked};
use signature::{check_qualifiers, check_receiver, check_return, describe};
use weights::{check_view, find_weights};

/// Checks the arguments and the item; on failure returns every error found, combined, with the
/// lenient reading of the function for the stub.
pub fn validate(args: syn::Result<RawArgs>, input: Input) -> Result<Model, Rejected> {
    let mut errors = Errors::default();
    let args = match args {
        Ok(raw) => check_args(raw, &mut errors),
        Err(e) => {
            errors.push(e);
            Args::default()
        }
    };
    let mut func = match input {
        Input::Fn(func) => func,
        Input::Other(item) => {
            let (kind, tokens) = describe(&item);
            return Err(Rejected {
                errors: syn::Error::new_spanned(
                    tokens,
                    format_args!("#[sharded_rollout] applies to a function: found {kind}"),
                ),
                fallback: None,
            });
        }
    };
    // Read before the markers are removed, for the stub of a rejected function.
    let marked = Marked::of(&func.sig);
    check_qualifiers(&func.sig, &mut errors);
    check_receiver(&func.sig, &mut errors);
    let engine = find_engine(&mut func.sig, args.engine.as_ref(), &mut errors);
    let engine_index = match engine {
        EngineSearch::Found(index) => Some(index),
        EngineSearch::None | EngineSearch::Failed => None,
    };
    let weights = find_weights(
        &mut func.sig,
        args.weights.as_ref(),
        engine_index,
        &mut errors,
    );
    let view = weights.and_then(|index| {
        let FnArg::Typed(param) = &func.sig.inputs[index] else {
            unreachable!("the receiver is never the weights view")
        };
        check_view(param, &mut errors).map(|w| (index, (*param.ty).clone(), w))
    });
    let engine = match engine_index {
        Some(index) => {
            let FnArg::Typed(param) = &func.sig.inputs[index] else {
                unreachable!("the receiver is never the engine")
            };
            check_engine(param, &mut errors).map(|(engine_ty, by_reference)| EngineParam {
                index,
                param_ty: (*param.ty).clone(),
                engine_ty,
                by_reference,
            })
        }
        None => None,
    };
    check_return(&func.sig.output, &mut errors);
    if let Err(errors) = errors.finish() {
        let engine_ty = engine.map(|e| e.engine_ty);
        let weights_ty = view.map(|(_, _, w)| w);
        let fallback = fallback(
            args,
            func,
            &marked,
            weights,
            weights_ty,
            engine_index,
            engine_ty,
        );
        return Err(Rejected {
            errors,
            fallback: Some(Box::new(fallback)),
        });
    }
    let (weights_index, view_ty, weights_ty) = view.expect("no error means a weights view");
    Ok(Model {
        krate: args
            .krate
            .unwrap_or_else(|| syn::parse_quote!(::lifecycle_core)),
        switching: args.switching,
        func,
        weights_index,
        view_ty,
        weights_ty,
        engine,
    })
}
