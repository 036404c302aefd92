//! Validation: every rule of the attribute, each failure a `syn::Error` on the offending tokens.
//!
//! Errors are collected and combined, so one expansion reports every mistake at once.

use std::fmt::Display;

use proc_macro2::{Delimiter, Group, TokenStream, TokenTree};
use quote::{quote, ToTokens};
use syn::visit::{self, Visit};
use syn::{
    Expr, ExprLit, ExprPath, FnArg, GenericArgument, Ident, Item, ItemFn, Lit, Pat, PatType, Path,
    PathArguments, Receiver, ReturnType, Signature, Type, TypePath,
};

use crate::parse::{Input, RawArg, RawArgs};

/// The name of the rollout weights view type, matched on a parameter type's last path segment.
const VIEW: &str = "RolloutView";
/// The parameter attribute that selects the weights view.
const WEIGHTS_ATTR: &str = "weights";
/// The name of the engine access type, matched on a parameter type's last path segment.
const ENGINE: &str = "EngineMut";
/// The parameter attribute that selects the engine.
const ENGINE_ATTR: &str = "engine";
/// The known attribute arguments, for the "unknown argument" message.
const KNOWN_ARGS: &str = "`crate = \"path\"`, `weights = ident`, `engine = ident` or \
                          `switching = \"eager\" | \"lazy\" | \"inherit\"`";

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

/// Collects errors so they can be reported together.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn at<T: ToTokens, D: Display>(&mut self, tokens: T, message: D) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// The attribute arguments, checked.
#[derive(Default)]
struct Args {
    krate: Option<Path>,
    weights: Option<Ident>,
    engine: Option<Ident>,
    switching: Switching,
}

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

/// The parameters marked `#[weights]` and `#[engine]`, in order.
#[derive(Default)]
struct Marked {
    weights: Vec<usize>,
    engine: Vec<usize>,
}

impl Marked {
    fn of(sig: &Signature) -> Self {
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
fn fallback(
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
    if let Some(index) = weights {
        if !replaced.contains(&index) {
            replaced.push(index);
        }
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

fn check_args(raw: RawArgs, errors: &mut Errors) -> Args {
    let mut args = Args::default();
    let mut seen: Vec<Ident> = Vec::new();
    for RawArg { key, value } in raw.0 {
        let name = key.to_string();
        if let Some(first) = seen.iter().find(|k| **k == key) {
            let mut e = syn::Error::new_spanned(&key, format_args!("duplicate argument `{name}`"));
            e.combine(syn::Error::new_spanned(
                first,
                format_args!("`{name}` is first given here"),
            ));
            errors.push(e);
            continue;
        }
        match name.as_str() {
            "crate" => {
                args.krate = string(&value)
                    .ok_or_else(|| {
                        syn::Error::new_spanned(
                            &value,
                            "expected a string: `crate = \"path::to::lifecycle_core\"`",
                        )
                    })
                    .and_then(|s| {
                        s.parse::<Path>().map_err(|_| {
                            syn::Error::new_spanned(
                                s,
                                "expected the path of the runtime crate, e.g. `::lifecycle_core`",
                            )
                        })
                    })
                    .map_err(|e| errors.push(e))
                    .ok();
            }
            "weights" => match &value {
                Expr::Path(ExprPath {
                    qself: None, path, ..
                }) if path.get_ident().is_some() => {
                    args.weights = path.get_ident().cloned();
                }
                other => errors.at(
                    other,
                    "expected the name of the weights parameter: `weights = w`",
                ),
            },
            "engine" => match &value {
                Expr::Path(ExprPath {
                    qself: None, path, ..
                }) if path.get_ident().is_some() => {
                    args.engine = path.get_ident().cloned();
                }
                other => errors.at(
                    other,
                    "expected the name of the engine parameter: `engine = decoder`",
                ),
            },
            "switching" => match string(&value).map(|s| (s, s.value())) {
                Some((_, v)) if v == "inherit" => args.switching = Switching::Inherit,
                Some((_, v)) if v == "eager" => args.switching = Switching::Eager,
                Some((_, v)) if v == "lazy" => args.switching = Switching::Lazy,
                Some((s, v)) => errors.at(
                    s,
                    format_args!(
                        "unknown switching policy `{v}`: expected \"eager\", \"lazy\" or \"inherit\""
                    ),
                ),
                None => errors.at(
                    &value,
                    "expected a string: `switching = \"eager\"`, `\"lazy\"` or `\"inherit\"`",
                ),
            },
            _ => errors.at(
                &key,
                format_args!("unknown argument `{name}`: expected {KNOWN_ARGS}"),
            ),
        }
        seen.push(key);
    }
    args
}

fn string(value: &Expr) -> Option<&syn::LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s),
        _ => None,
    }
}

/// The kind of a non-function item (with its article) and the tokens naming it.
fn describe(item: &Item) -> (&'static str, TokenStream) {
    match item {
        Item::Struct(i) => ("a struct", {
            let (t, n) = (&i.struct_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Enum(i) => ("an enum", {
            let (t, n) = (&i.enum_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Union(i) => ("a union", {
            let (t, n) = (&i.union_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Trait(i) => ("a trait", {
            let (t, n) = (&i.trait_token, &i.ident);
            quote!(#t #n)
        }),
        Item::TraitAlias(i) => ("a trait alias", {
            let (t, n) = (&i.trait_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Impl(i) => ("an impl block", {
            let (t, n) = (&i.impl_token, &i.self_ty);
            quote!(#t #n)
        }),
        Item::Mod(i) => ("a module", {
            let (t, n) = (&i.mod_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Const(i) => ("a constant", {
            let (t, n) = (&i.const_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Static(i) => ("a static", {
            let (t, n) = (&i.static_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Type(i) => ("a type alias", {
            let (t, n) = (&i.type_token, &i.ident);
            quote!(#t #n)
        }),
        Item::Use(i) => ("a `use` declaration", i.to_token_stream()),
        Item::ExternCrate(i) => ("an `extern crate`", i.to_token_stream()),
        Item::ForeignMod(i) => ("an `extern` block", i.abi.to_token_stream()),
        Item::Macro(i) => ("a macro invocation", i.mac.path.to_token_stream()),
        other => (
            "an item that is not a function with a body",
            other.to_token_stream(),
        ),
    }
}

fn check_qualifiers(sig: &Signature, errors: &mut Errors) {
    if let Some(c) = &sig.constness {
        errors.at(
            c,
            "#[sharded_rollout] cannot apply to a `const fn`: switching the lifecycle happens at \
             run time",
        );
    }
    if let Some(u) = &sig.unsafety {
        errors.at(
            u,
            "#[sharded_rollout] cannot apply to an `unsafe fn`: keep the function safe and use an \
             `unsafe` block in its body",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.at(
            abi,
            "#[sharded_rollout] cannot apply to a function with an `extern` ABI: the generated \
             function takes a `&mut Lifecycle` and returns a `Result`",
        );
    }
    if let Some(v) = &sig.variadic {
        errors.at(v, "#[sharded_rollout] cannot apply to a variadic function");
    }
}

fn check_receiver(sig: &Signature, errors: &mut Errors) {
    let Some(FnArg::Receiver(r)) = sig.inputs.first() else {
        return;
    };
    if receiver_is_reference(r) {
        return;
    }
    let found = if r.colon_token.is_some() {
        "a `self: Type` receiver other than `self: &Self` or `self: &mut Self`"
    } else if r.mutability.is_some() {
        "`mut self`"
    } else {
        "`self` by value"
    };
    errors.at(
        r,
        format_args!(
            "unsupported receiver: #[sharded_rollout] methods take `&self` or `&mut self` (so the \
             object can serve rollout after rollout), not {found}"
        ),
    );
}

/// `&self`, `&'a self`, `&mut self`, `self: &Self`, `self: &mut Self`.
fn receiver_is_reference(r: &Receiver) -> bool {
    if r.colon_token.is_none() {
        return r.reference.is_some();
    }
    match &*r.ty {
        Type::Reference(reference) => {
            matches!(&*reference.elem, Type::Path(p) if p.qself.is_none() && p.path.is_ident("Self"))
        }
        _ => false,
    }
}

/// The name of a parameter for messages: its pattern as written.
fn param_name(param: &PatType) -> String {
    match &*param.pat {
        Pat::Ident(p) => p.ident.to_string(),
        other => other.to_token_stream().to_string(),
    }
}

fn is_view(ty: &Type) -> bool {
    view_path(ty).is_some()
}

fn view_path(ty: &Type) -> Option<&TypePath> {
    match ty {
        Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == VIEW) => Some(p),
        Type::Group(g) => view_path(&g.elem),
        Type::Paren(p) => view_path(&p.elem),
        _ => None,
    }
}

fn is_reference_to_view(ty: &Type) -> bool {
    matches!(ty, Type::Reference(r) if is_view(&r.elem))
}

/// Finds the weights parameter (removing `#[weights]` markers); `None` after reporting an error.
fn find_weights(
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

/// The outcome of looking for the engine parameter.
enum EngineSearch {
    /// The function takes no engine.
    None,
    /// The engine parameter, at this index of the inputs.
    Found(usize),
    /// The selection itself was wrong (already reported).
    Failed,
}

fn is_engine(ty: &Type) -> bool {
    engine_path(ty).is_some()
}

fn engine_path(ty: &Type) -> Option<&TypePath> {
    match ty {
        Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == ENGINE) => Some(p),
        Type::Group(g) => engine_path(&g.elem),
        Type::Paren(p) => engine_path(&p.elem),
        _ => None,
    }
}

fn is_reference_to_engine(ty: &Type) -> bool {
    matches!(ty, Type::Reference(r) if is_engine(&r.elem))
}

/// Finds the engine parameter (removing `#[engine]` markers): the one marked `#[engine]`, named
/// by `engine = name`, or typed `EngineMut<..>`.
fn find_engine(sig: &mut Signature, by_arg: Option<&Ident>, errors: &mut Errors) -> EngineSearch {
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
fn check_engine(param: &PatType, errors: &mut Errors) -> Option<(Type, bool)> {
    let ty = &param.ty;
    let (engine, by_reference) = if let Some(path) = engine_path(ty) {
        let segment = path
            .path
            .segments
            .last()
            .expect("engine_path checked the last segment");
        let PathArguments::AngleBracketed(args) = &segment.arguments else {
            errors.at(
                ty,
                "write the engine type: `EngineMut<'_, E>`, where `E` is the lifecycle's \
                 `RolloutEngine`",
            );
            return None;
        };
        let mut engine = None;
        let mut ok = true;
        for arg in &args.args {
            match arg {
                GenericArgument::Lifetime(l) if l.ident == "_" => {}
                GenericArgument::Lifetime(l) => {
                    errors.at(
                        l,
                        format_args!(
                            "the engine is borrowed for one call only; write `'_` instead of \
                             `{l}`"
                        ),
                    );
                    ok = false;
                }
                GenericArgument::Type(t) if engine.is_none() => engine = Some(t.clone()),
                other => {
                    errors.at(
                        other,
                        "unexpected generic argument: the engine is `EngineMut<'_, E>`",
                    );
                    ok = false;
                }
            }
        }
        let Some(engine) = engine else {
            errors.at(
                ty,
                "write the engine type: `EngineMut<'_, E>`, where `E` is the lifecycle's \
                 `RolloutEngine`",
            );
            return None;
        };
        if !ok {
            return None;
        }
        (engine, false)
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

/// `fn name(..)`: where to report a problem with the parameter list as a whole.
fn signature_head(sig: &Signature) -> TokenStream {
    let (fn_token, ident, inputs) = (&sig.fn_token, &sig.ident, &sig.inputs);
    let mut parens = Group::new(Delimiter::Parenthesis, quote!(#inputs));
    parens.set_span(sig.paren_token.span.join());
    let mut tokens = quote!(#fn_token #ident);
    tokens.extend([TokenTree::Group(parens)]);
    tokens
}

/// Checks the weights parameter's type is `RolloutView<'_, W>`; returns `W`.
fn check_view(param: &PatType, errors: &mut Errors) -> Option<Type> {
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
    let segment = path
        .path
        .segments
        .last()
        .expect("view_path checked the last segment");
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
        errors.at(
            ty,
            "write the weights type: `RolloutView<'_, W>`, where `W` is the backend's \
             `Reshard::Rollout`",
        );
        return None;
    };
    let mut weights = None;
    let mut ok = true;
    for arg in &args.args {
        match arg {
            GenericArgument::Lifetime(l) if l.ident == "_" => {}
            GenericArgument::Lifetime(l) => {
                errors.at(
                    l,
                    format_args!(
                        "the rollout weights view is borrowed for one call only; write `'_` \
                         instead of `{l}`"
                    ),
                );
                ok = false;
            }
            GenericArgument::Type(t) if weights.is_none() => weights = Some(t.clone()),
            other => {
                errors.at(
                    other,
                    "unexpected generic argument: the view is `RolloutView<'_, W>`",
                );
                ok = false;
            }
        }
    }
    let Some(weights) = weights else {
        errors.at(
            ty,
            "write the weights type: `RolloutView<'_, W>`, where `W` is the backend's \
             `Reshard::Rollout`",
        );
        return None;
    };
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

fn check_return(output: &ReturnType, errors: &mut Errors) {
    let ReturnType::Type(_, ty) = output else {
        return;
    };
    let mut elided = Elided::default();
    elided.visit_type(ty);
    for tokens in elided.found {
        errors.at(
            tokens,
            "a rollout function cannot return borrows of the weights: they would outlive the \
             session; return owned data (or name a lifetime of another parameter)",
        );
    }
}

/// Finds references without a lifetime and `'_` lifetimes, outside of `fn(..)` pointer types and
/// `Fn(..)` bounds (where elision is higher-ranked and borrows nothing).
#[derive(Default)]
struct Elided {
    found: Vec<TokenStream>,
}

impl<'ast> Visit<'ast> for Elided {
    fn visit_type_reference(&mut self, r: &'ast syn::TypeReference) {
        match &r.lifetime {
            None => self.found.push(r.to_token_stream()),
            Some(l) if l.ident == "_" => self.found.push(r.to_token_stream()),
            Some(_) => {}
        }
        // Do not report the `'_` of this reference twice.
        self.visit_type(&r.elem);
    }

    fn visit_lifetime(&mut self, l: &'ast syn::Lifetime) {
        if l.ident == "_" {
            self.found.push(l.to_token_stream());
        }
    }

    fn visit_type_bare_fn(&mut self, _: &'ast syn::TypeBareFn) {}

    fn visit_parenthesized_generic_arguments(
        &mut self,
        _: &'ast syn::ParenthesizedGenericArguments,
    ) {
    }

    fn visit_type(&mut self, ty: &'ast Type) {
        visit::visit_type(self, ty);
    }
}

/// The typed parameters of `sig` as the error messages list them (`none` when there is none).
fn parameter_list(sig: &Signature) -> String {
    let params: Vec<String> = sig
        .inputs
        .iter()
        .filter_map(|i| match i {
            FnArg::Typed(p) => Some(format!("`{}`", param_name(p))),
            FnArg::Receiver(_) => None,
        })
        .collect();
    if params.is_empty() {
        "none".to_owned()
    } else {
        params.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use crate::parse;

    fn errors(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> Vec<String> {
        let input = parse::item(item).expect("an item");
        match super::validate(syn::parse2(args), input) {
            Ok(_) => Vec::new(),
            Err(rejected) => rejected.errors.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn every_mistake_is_reported() {
        let found = errors(
            quote!(switching = "never", retries = 3, crate = 1),
            quote!(
                const unsafe extern "C" fn f<'a>(self, w: RolloutView<'a, W>) -> &'_ W {
                    todo!()
                }
            ),
        );
        let expected = [
            "unknown switching policy",
            "unknown argument `retries`",
            "expected a string: `crate",
            "`const fn`",
            "`unsafe fn`",
            "`extern` ABI",
            "unsupported receiver",
            "write `'_` instead of `'a`",
            "cannot return borrows",
        ];
        assert_eq!(found.len(), expected.len(), "{found:#?}");
        for (found, expected) in found.iter().zip(expected) {
            assert!(found.contains(expected), "{found} lacks {expected}");
        }
    }

    #[test]
    fn accepted_shapes() {
        for item in [
            quote!(
                fn f(w: RolloutView<'_, W>) {}
            ),
            quote!(
                fn f(w: lifecycle_core::RolloutView<W>) -> Vec<f32> {
                    todo!()
                }
            ),
            quote!(
                async fn f(&mut self, x: &str, w: RolloutView<'_, W>) -> &'static str {
                    x
                }
            ),
            quote!(
                fn f<'a>(self: &Self, x: &'a [f32], w: RolloutView<'_, W>) -> &'a f32 {
                    todo!()
                }
            ),
            quote!(
                fn f(w: RolloutView<'_, W>) -> Box<dyn Fn(&f32) -> &f32> {
                    todo!()
                }
            ),
            quote!(
                fn f(w: RolloutView<'_, W>, o: RolloutView<'_, W>) {}
            ),
        ] {
            let args = if item.to_string().contains(" o :") {
                quote!(weights = w)
            } else {
                quote!()
            };
            assert_eq!(errors(args, item.clone()), Vec::<String>::new(), "{item}");
        }
    }

    #[test]
    fn engine_mistakes_are_reported_together() {
        let found = errors(
            quote!(engine = nothing),
            quote!(
                fn f(w: RolloutView<'_, W>, e: EngineMut<'_, Kv>, #[engine] g: &Kv) {}
            ),
        );
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(
            found[0].contains("`engine = nothing` names no parameter"),
            "{found:#?}"
        );
        let found = errors(
            quote!(),
            quote!(
                fn f(a: EngineMut<'_, Kv>, b: EngineMut<'_, Kv>) {}
            ),
        );
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(
            found[0].contains("a second engine parameter `b`"),
            "{found:#?}"
        );
        assert!(
            found[1].contains("needs one parameter of type"),
            "{found:#?}"
        );
        let found = errors(
            quote!(),
            quote!(
                fn f(w: RolloutView<'_, W>, e: EngineMut<'_, Kv<&u8>>) {}
            ),
        );
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(
            found[0].contains("engine type cannot contain elided"),
            "{found:#?}"
        );
    }

    #[test]
    fn accepted_engine_shapes() {
        for (args, item) in [
            (
                quote!(),
                quote!(
                    fn f(w: RolloutView<'_, W>, e: EngineMut<'_, Kv>) {}
                ),
            ),
            (
                quote!(),
                quote!(
                    fn f(w: RolloutView<'_, W>, e: lifecycle_core::EngineMut<E>) {}
                ),
            ),
            (
                quote!(),
                quote!(
                    fn f(&self, #[engine] e: &'_ mut Kv, w: RolloutView<'_, W>) {}
                ),
            ),
            (
                quote!(engine = e),
                quote!(
                    fn f(w: RolloutView<'_, W>, e: &mut Kv, other: EngineMut<'_, Kv>) {}
                ),
            ),
        ] {
            assert_eq!(errors(args, item.clone()), Vec::<String>::new(), "{item}");
        }
    }

    #[test]
    fn variadic_functions_are_rejected() {
        let found = errors(
            quote!(),
            quote!(
                fn f(w: RolloutView<'_, W>, ...) {}
            ),
        );
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(found[0].contains("variadic"), "{found:#?}");
    }

    #[test]
    fn non_functions_are_named() {
        for (item, kind) in [
            (
                quote!(
                    enum E {}
                ),
                "an enum",
            ),
            (quote!(impl S {}), "an impl block"),
            (
                quote!(
                    mod m {}
                ),
                "a module",
            ),
            (
                quote!(
                    trait T {}
                ),
                "a trait",
            ),
        ] {
            let found = errors(quote!(), item);
            assert_eq!(found.len(), 1, "{found:#?}");
            assert!(found[0].ends_with(kind), "{found:#?}");
        }
    }

    #[test]
    fn bad_view_types() {
        let found = errors(
            quote!(),
            quote!(
                fn f(#[weights(x)] w: RolloutView<'_, Vec<&f32>>) {}
            ),
        );
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].contains("#[weights] takes no arguments"));
        assert!(found[1].contains("cannot contain elided lifetimes"));
        let found = errors(
            quote!(),
            quote!(
                fn f(w: RolloutView) {}
            ),
        );
        assert!(found[0].contains("write the weights type"), "{found:#?}");
    }
}
