//! The lenient reading of a rejected function, for the stub emitted beside its errors.

use syn::visit::Visit;
use syn::{FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, Signature, Type};

use super::args::Args;
use super::engine::{is_engine, is_reference_to_engine, ENGINE_ATTR};
use super::model::Fallback;
use super::signature::{param_name, Elided};
use super::weights::{is_reference_to_view, is_view, view_path, WEIGHTS_ATTR};

/// The parameters marked `#[weights]` and `#[engine]`, in order.
#[derive(Default)]
pub(super) struct Marked {
    pub(super) weights: Vec<usize>,
    pub(super) engine: Vec<usize>,
}

impl Marked {
    pub(super) fn of(sig: &Signature) -> Self {
        let mut marked = Marked::default();
        for (index, input) in sig.inputs.iter().enumerate() {
            let FnArg::Typed(param) = input else { continue };
            if param.attrs.iter().any(|a| a.path().is_ident(WEIGHTS_ATTR)) {
                marked.weights.push(index);
            }
            if param.attrs.iter().any(|a| a.path().is_ident(ENGINE_ATTR)) {
                marked.engine.push(index);
            }
        }
        marked
    }
}

/// The lenient reading of a rejected function. What validation found is taken as it is; what it
/// could not find is guessed the way a caller would have read the function: the view is the
/// marked parameter, else the first typed `RolloutView` (or a reference to one), else a parameter
/// named like the weights; the engine is every parameter marked, named or typed as one.
pub(super) fn fallback(
    args: Args,
    mut func: ItemFn,
    marked: &Marked,
    weights: Option<usize>,
    weights_ty: Option<Type>,
    engine: Option<usize>,
    engine_ty: Option<Type>,
) -> Fallback {
    strip_markers(&mut func);
    let sig = &func.sig;
    let typed = |index: usize| match &sig.inputs[index] {
        FnArg::Typed(p) => Some(p),
        FnArg::Receiver(_) => None,
    };
    let named = |index: usize, name: &Ident| {
        typed(index).is_some_and(|p| matches!(&*p.pat, Pat::Ident(i) if i.ident == *name))
    };
    let indices = 0..sig.inputs.len();
    let engines: Vec<usize> = indices
        .clone()
        .filter(|&i| {
            engine == Some(i)
                || marked.engine.contains(&i)
                || args.engine.as_ref().is_some_and(|name| named(i, name))
                || typed(i).is_some_and(|p| is_engine(&p.ty) || is_reference_to_engine(&p.ty))
        })
        .collect();
    let weights = weights
        .or_else(|| marked.weights.first().copied())
        .or_else(|| {
            let by_arg = args.weights.as_ref()?;
            indices.clone().find(|&i| named(i, by_arg))
        })
        .or_else(|| {
            indices
                .clone()
                .find(|&i| typed(i).is_some_and(|p| is_view(&p.ty) || is_reference_to_view(&p.ty)))
        })
        .or_else(|| {
            indices.clone().filter(|i| !engines.contains(i)).find(|&i| {
                typed(i).is_some_and(|p| {
                    let name = param_name(p);
                    name == "w" || name.contains("weights")
                })
            })
        });
    let weights_ty = weights_ty.or_else(|| {
        let param = typed(weights?)?;
        lenient_weights_type(&param.ty)
    });
    let mut replaced = engines;
    if let Some(index) = weights
        && !replaced.contains(&index)
    {
        replaced.push(index);
    }
    replaced.sort_unstable();
    Fallback {
        krate: args
            .krate
            .unwrap_or_else(|| syn::parse_quote!(::lifecycle_core)),
        func,
        replaced,
        weights_ty,
        engine_ty,
    }
}

/// `W` of a view type that failed its checks, when it is still a type the stub can name: the
/// first type argument of `RolloutView<..>` (behind references too), without elided lifetimes.
fn lenient_weights_type(ty: &Type) -> Option<Type> {
    let mut ty = ty;
    while let Type::Reference(r) = ty {
        ty = &r.elem;
    }
    let segment = view_path(ty)?.path.segments.last()?;
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
        return None;
    };
    let weights = args.args.iter().find_map(|arg| match arg {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    })?;
    let mut elided = Elided::default();
    elided.visit_type(&weights);
    elided.found.is_empty().then_some(weights)
}

/// Removes the `#[weights]` and `#[engine]` markers from every parameter, so the item can be
/// emitted as written (beside the errors) without a second "cannot find attribute" error.
pub fn strip_markers(func: &mut ItemFn) {
    for input in &mut func.sig.inputs {
        if let FnArg::Typed(param) = input {
            param
                .attrs
                .retain(|a| !a.path().is_ident(WEIGHTS_ATTR) && !a.path().is_ident(ENGINE_ATTR));
        }
    }
}
