//! The rollout weights view: which parameter it is (`#[weights]`, `weights = name` or the one
//! `RolloutView`), and its type.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{FnArg, Ident, Pat, PatType, Signature, Type, TypePath};

use super::errors::Errors;
use super::signature::{
    param_name, parameter_list, path_named, signature_head, type_argument, Elided, Form,
};

/// The name of the rollout weights view type, matched on a parameter type's last path segment.
const VIEW: &str = "RolloutView";

/// How the view's type is named in its errors.
const VIEW_FORM: Form = Form {
    borrowed: "the rollout weights view",
    written: "the view is `RolloutView<'_, W>`",
    missing: "write the weights type: `RolloutView<'_, W>`, where `W` is the backend's \
              `Reshard::Rollout`",
};

/// The parameter attribute that selects the weights view.
pub(super) const WEIGHTS_ATTR: &str = "weights";

pub(super) fn is_view(ty: &Type) -> bool {
    view_path(ty).is_some()
}

pub(super) fn view_path(ty: &Type) -> Option<&TypePath> {
    path_named(ty, VIEW)
}

pub(super) fn is_reference_to_view(ty: &Type) -> bool {
    matches!(ty, Type::Reference(r) if is_view(&r.elem))
}

/// Finds the weights parameter (removing `#[weights]` markers); `None` after reporting an error.
pub(super) fn find_weights(
    sig: &mut Signature,
    by_arg: Option<&Ident>,
    engine: Option<usize>,
    errors: &mut Errors,
) -> Option<usize> {
    // Explicit selections, in parameter order: `#[weights]` markers and `weights = name`.
    let mut explicit: Vec<(usize, TokenStream, &'static str)> = Vec::new();
    let mut arg_found = false;
    for (index, input) in sig.inputs.iter_mut().enumerate() {
        let FnArg::Typed(param) = input else { continue };
        let mut marker = None;
        param.attrs.retain(|attr| {
            if !attr.path().is_ident(WEIGHTS_ATTR) {
                return true;
            }
            if let syn::Meta::Path(_) = &attr.meta {
                if marker.is_some() {
                    errors.at(attr, "duplicate #[weights] marker");
                }
                marker = Some(attr.to_token_stream());
            } else {
                errors.at(&attr.meta, "#[weights] takes no arguments");
                marker = Some(attr.to_token_stream());
            }
            false
        });
        let named =
            by_arg.is_some_and(|name| matches!(&*param.pat, Pat::Ident(p) if p.ident == *name));
        arg_found |= named;
        match (marker, named) {
            (Some(m), _) => explicit.push((index, m, "#[weights]")),
            (None, true) => explicit.push((index, by_arg.to_token_stream(), "`weights = ...`")),
            (None, false) => {}
        }
    }
    if let (Some(name), false) = (by_arg, arg_found) {
        errors.at(
            name,
            format_args!(
                "`weights = {name}` names no parameter of this function (its parameters: {})",
                parameter_list(sig)
            ),
        );
        return None;
    }
    let typed = |index: usize| match &sig.inputs[index] {
        FnArg::Typed(p) => p,
        FnArg::Receiver(_) => unreachable!("receivers are skipped"),
    };
    if let Some(&(first, _, how)) = explicit.first() {
        for (second, marker, _) in &explicit[1..] {
            errors.at(
                marker,
                format_args!(
                    "a second weights parameter `{}`: `{}` is already the rollout weights view \
                     (selected by {how}); a #[sharded_rollout] function takes exactly one",
                    param_name(typed(*second)),
                    param_name(typed(first)),
                ),
            );
        }
        return Some(first);
    }
    // No explicit selection: the one parameter typed `RolloutView<..>`.
    let views: Vec<usize> = (0..sig.inputs.len())
        .filter(|&i| matches!(&sig.inputs[i], FnArg::Typed(p) if is_view(&p.ty)))
        .collect();
    match views.as_slice() {
        [] => {
            if let Some(p) = sig.inputs.iter().find_map(|i| match i {
                FnArg::Typed(p) if is_reference_to_view(&p.ty) => Some(p),
                _ => None,
            }) {
                errors.at(
                    &p.ty,
                    "take the rollout weights view by value: `RolloutView<'_, W>` is `Copy` and \
                     already a borrow",
                );
            } else if let Some(index) = engine {
                let engine = typed(index);
                errors.at(
                    &engine.ty,
                    format_args!(
                        "the engine parameter `{}` needs the rollout weights view next to it: add a \
                         parameter of type `RolloutView<'_, W>` (the engine is borrowed from the \
                         rollout session that yields the weights, and wakes for them)",
                        param_name(engine)
                    ),
                );
            } else {
                errors.at(
                    signature_head(sig),
                    "#[sharded_rollout] needs one parameter of type `RolloutView<'_, W>` (the \
                     rollout weights view), or mark one with #[weights]",
                );
            }
            None
        }
        [one] => Some(*one),
        [first, rest @ ..] => {
            for &second in rest {
                errors.at(
                    &typed(second).ty,
                    format_args!(
                        "a second weights parameter `{}`: `{}` is already the rollout weights \
                         view; a #[sharded_rollout] function takes exactly one (mark it with \
                         #[weights] to pass other views as plain arguments)",
                        param_name(typed(second)),
                        param_name(typed(*first)),
                    ),
                );
            }
            None
        }
    }
}

/// Checks the weights parameter's type is `RolloutView<'_, W>`; returns `W`.
pub(super) fn check_view(param: &PatType, errors: &mut Errors) -> Option<Type> {
    let ty = &param.ty;
    let Some(path) = view_path(ty) else {
        if is_reference_to_view(ty) {
            errors.at(
                ty,
                "take the rollout weights view by value: `RolloutView<'_, W>` is `Copy` and \
                 already a borrow",
            );
        } else {
            errors.at(
                ty,
                "the weights parameter must have type `RolloutView<'_, W>`, where `W` is the \
                 backend's `Reshard::Rollout`",
            );
        }
        return None;
    };
    let (weights, mut ok) = type_argument(ty, path, &VIEW_FORM, errors);
    let weights = weights?;
    let mut elided = Elided::default();
    elided.visit_type(&weights);
    for tokens in elided.found {
        errors.at(
            tokens,
            "the weights type cannot contain elided lifetimes: it is the backend's \
             `Reshard::Rollout`; name the lifetime",
        );
        ok = false;
    }
    ok.then_some(weights)
}
