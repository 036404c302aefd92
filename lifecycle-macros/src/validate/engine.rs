//! The rollout engine parameter: which one it is (`#[engine]`, `engine = name` or the one
//! `EngineMut`), and how it is taken.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{FnArg, Ident, Pat, PatType, Signature, Type, TypePath};

use super::errors::Errors;
use super::signature::{param_name, parameter_list, path_named, type_argument, Elided, Form};
use super::weights::WEIGHTS_ATTR;

/// The name of the engine access type, matched on a parameter type's last path segment.
const ENGINE: &str = "EngineMut";

/// How the engine's type is named in its errors.
const ENGINE_FORM: Form = Form {
    borrowed: "the engine",
    written: "the engine is `EngineMut<'_, E>`",
    missing: "write the engine type: `EngineMut<'_, E>`, where `E` is the lifecycle's \
              `RolloutEngine`",
};

/// The parameter attribute that selects the engine.
pub(super) const ENGINE_ATTR: &str = "engine";

/// The outcome of looking for the engine parameter.
pub(super) enum EngineSearch {
    /// The function takes no engine.
    None,
    /// The engine parameter, at this index of the inputs.
    Found(usize),
    /// The selection itself was wrong (already reported).
    Failed,
}

pub(super) fn is_engine(ty: &Type) -> bool {
    engine_path(ty).is_some()
}

fn engine_path(ty: &Type) -> Option<&TypePath> {
    path_named(ty, ENGINE)
}

pub(super) fn is_reference_to_engine(ty: &Type) -> bool {
    matches!(ty, Type::Reference(r) if is_engine(&r.elem))
}

/// Finds the engine parameter (removing `#[engine]` markers): the one marked `#[engine]`, named
/// by `engine = name`, or typed `EngineMut<..>`.
pub(super) fn find_engine(
    sig: &mut Signature,
    by_arg: Option<&Ident>,
    errors: &mut Errors,
) -> EngineSearch {
    let mut explicit: Vec<(usize, TokenStream, &'static str)> = Vec::new();
    let mut arg_found = false;
    for (index, input) in sig.inputs.iter_mut().enumerate() {
        let FnArg::Typed(param) = input else { continue };
        let mut marker = None;
        let weights_marker = param
            .attrs
            .iter()
            .find(|a| a.path().is_ident(WEIGHTS_ATTR))
            .map(ToTokens::to_token_stream);
        param.attrs.retain(|attr| {
            if !attr.path().is_ident(ENGINE_ATTR) {
                return true;
            }
            if let syn::Meta::Path(_) = &attr.meta {
                if marker.is_some() {
                    errors.at(attr, "duplicate #[engine] marker");
                }
            } else {
                errors.at(&attr.meta, "#[engine] takes no arguments");
            }
            marker = Some(attr.to_token_stream());
            false
        });
        let named =
            by_arg.is_some_and(|name| matches!(&*param.pat, Pat::Ident(p) if p.ident == *name));
        arg_found |= named;
        let selection = match (marker, named) {
            (Some(m), _) => Some((m, "#[engine]")),
            (None, true) => Some((by_arg.to_token_stream(), "`engine = ...`")),
            (None, false) => None,
        };
        if let Some((tokens, how)) = selection {
            if let Some(weights) = weights_marker {
                let mut e = syn::Error::new_spanned(
                    tokens,
                    format_args!(
                        "`{}` is selected as the engine (by {how}) and as the weights view: a \
                         parameter is one or the other",
                        param_name(param)
                    ),
                );
                e.combine(syn::Error::new_spanned(
                    weights,
                    "selected as the weights view here",
                ));
                errors.push(e);
                return EngineSearch::Failed;
            }
            explicit.push((index, tokens, how));
        }
    }
    let typed = |sig: &Signature, index: usize| match &sig.inputs[index] {
        FnArg::Typed(p) => param_name(p),
        FnArg::Receiver(_) => unreachable!("receivers are skipped"),
    };
    if let (Some(name), false) = (by_arg, arg_found) {
        errors.at(
            name,
            format_args!(
                "`engine = {name}` names no parameter of this function (its parameters: {})",
                parameter_list(sig)
            ),
        );
        return EngineSearch::Failed;
    }
    if let Some(&(first, _, how)) = explicit.first() {
        if explicit.len() > 1 {
            for (second, marker, _) in &explicit[1..] {
                errors.at(
                    marker,
                    format_args!(
                        "a second engine parameter `{}`: `{}` is already the rollout engine \
                         (selected by {how}); a #[sharded_rollout] function takes at most one",
                        typed(sig, *second),
                        typed(sig, first),
                    ),
                );
            }
            return EngineSearch::Failed;
        }
        return EngineSearch::Found(first);
    }
    let engines: Vec<usize> = (0..sig.inputs.len())
        .filter(|&i| matches!(&sig.inputs[i], FnArg::Typed(p) if is_engine(&p.ty)))
        .collect();
    match engines.as_slice() {
        [] => {
            let by_reference = sig.inputs.iter().find_map(|i| match i {
                FnArg::Typed(p) if is_reference_to_engine(&p.ty) => Some(p),
                _ => None,
            });
            match by_reference {
                Some(p) => {
                    errors.at(
                        &p.ty,
                        "take the engine by value: `EngineMut<'_, E>` is already a borrow of the \
                         session's engine",
                    );
                    EngineSearch::Failed
                }
                None => EngineSearch::None,
            }
        }
        [one] => EngineSearch::Found(*one),
        [first, rest @ ..] => {
            for &second in rest {
                let FnArg::Typed(param) = &sig.inputs[second] else {
                    unreachable!("receivers are never engines")
                };
                errors.at(
                    &param.ty,
                    format_args!(
                        "a second engine parameter `{}`: `{}` is already the rollout engine; a \
                         #[sharded_rollout] function takes at most one",
                        param_name(param),
                        typed(sig, *first),
                    ),
                );
            }
            EngineSearch::Failed
        }
    }
}

/// Checks the engine parameter's type is `EngineMut<'_, E>` or `&mut E`; returns `E` and whether
/// it is taken by reference.
pub(super) fn check_engine(param: &PatType, errors: &mut Errors) -> Option<(Type, bool)> {
    let ty = &param.ty;
    let (engine, by_reference) = if let Some(path) = engine_path(ty) {
        let (engine, ok) = type_argument(ty, path, &ENGINE_FORM, errors);
        (engine.filter(|_| ok)?, false)
    } else {
        match ty.as_ref() {
            Type::Reference(r) if is_engine(&r.elem) => {
                errors.at(
                    ty,
                    "take the engine by value: `EngineMut<'_, E>` is already a borrow of the \
                     session's engine",
                );
                return None;
            }
            Type::Reference(r) if r.mutability.is_some() => {
                if let Some(l) = r.lifetime.as_ref().filter(|l| l.ident != "_") {
                    errors.at(
                        l,
                        format_args!(
                            "the engine is borrowed for one call only; write `&mut E` or `&'_ mut \
                             E` instead of naming `{l}`"
                        ),
                    );
                    return None;
                }
                ((*r.elem).clone(), true)
            }
            Type::Reference(r) => {
                errors.at(
                    ty,
                    format_args!(
                        "the engine parameter `{}` must be mutable: write `&mut {}` or \
                         `EngineMut<'_, {}>`",
                        param_name(param),
                        r.elem.to_token_stream(),
                        r.elem.to_token_stream(),
                    ),
                );
                return None;
            }
            other => {
                let ty = other.to_token_stream();
                errors.at(
                    other,
                    format_args!(
                        "the engine parameter `{}` must have type `EngineMut<'_, {ty}>` or `&mut \
                         {ty}`: the lifecycle owns the engine, a rollout call borrows it",
                        param_name(param),
                    ),
                );
                return None;
            }
        }
    };
    let mut elided = Elided::default();
    elided.visit_type(&engine);
    let found = !elided.found.is_empty();
    for tokens in elided.found {
        errors.at(
            tokens,
            "the engine type cannot contain elided lifetimes: it is the lifecycle's engine type; \
             name the lifetime",
        );
    }
    (!found).then_some((engine, by_reference))
}
