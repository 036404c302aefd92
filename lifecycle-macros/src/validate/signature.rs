//! The item and its signature: what kind of item it is, qualifiers, receiver, return type, and
//! the helpers that read and print parameters.

use proc_macro2::{Delimiter, Group, TokenStream, TokenTree};
use quote::{quote, ToTokens};
use syn::visit::{self, Visit};
use syn::{
    FnArg, GenericArgument, Item, Pat, PatType, PathArguments, Receiver, ReturnType, Signature,
    Type, TypePath,
};

use super::errors::Errors;

/// The kind of a non-function item (with its article) and the tokens naming it.
pub(super) fn describe(item: &Item) -> (&'static str, TokenStream) {
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

pub(super) fn check_qualifiers(sig: &Signature, errors: &mut Errors) {
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

pub(super) fn check_receiver(sig: &Signature, errors: &mut Errors) {
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
pub(super) fn param_name(param: &PatType) -> String {
    match &*param.pat {
        Pat::Ident(p) => p.ident.to_string(),
        other => other.to_token_stream().to_string(),
    }
}

/// `fn name(..)`: where to report a problem with the parameter list as a whole.
pub(super) fn signature_head(sig: &Signature) -> TokenStream {
    let (fn_token, ident, inputs) = (&sig.fn_token, &sig.ident, &sig.inputs);
    let mut parens = Group::new(Delimiter::Parenthesis, quote!(#inputs));
    parens.set_span(sig.paren_token.span.join());
    let mut tokens = quote!(#fn_token #ident);
    tokens.extend([TokenTree::Group(parens)]);
    tokens
}

pub(super) fn check_return(output: &ReturnType, errors: &mut Errors) {
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
pub(super) struct Elided {
    pub(super) found: Vec<TokenStream>,
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
pub(super) fn parameter_list(sig: &Signature) -> String {
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

/// The path type whose last segment is `name` (`RolloutView`, `EngineMut`), through invisible
/// groups and parentheses: the one way a parameter's type is recognised.
pub(super) fn path_named<'t>(ty: &'t Type, name: &str) -> Option<&'t TypePath> {
    match ty {
        Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == name) => Some(p),
        Type::Group(g) => path_named(&g.elem, name),
        Type::Paren(p) => path_named(&p.elem, name),
        _ => None,
    }
}

/// How a parameter type of the form `Name<'_, T>` is named in its errors.
pub(super) struct Form {
    /// What the lifetime borrows (`the engine`).
    pub(super) borrowed: &'static str,
    /// The form with its subject (``the engine is `EngineMut<'_, E>` ``).
    pub(super) written: &'static str,
    /// The message for a type written without its type argument.
    pub(super) missing: &'static str,
}

/// The type argument `T` of a parameter type `Name<'_, T>` (`path`, inside `ty` as written), and
/// whether its other arguments were only the elided lifetime. A named lifetime or a second
/// argument is reported on its tokens; a missing type argument is reported on `ty` and gives
/// `None`.
pub(super) fn type_argument(
    ty: &Type,
    path: &TypePath,
    form: &Form,
    errors: &mut Errors,
) -> (Option<Type>, bool) {
    let args = match path.path.segments.last().map(|s| &s.arguments) {
        Some(PathArguments::AngleBracketed(args)) => args,
        _ => {
            errors.at(ty, form.missing);
            return (None, false);
        }
    };
    let mut found = None;
    let mut ok = true;
    for arg in &args.args {
        match arg {
            GenericArgument::Lifetime(l) if l.ident == "_" => {}
            GenericArgument::Lifetime(l) => {
                errors.at(
                    l,
                    format_args!(
                        "{} is borrowed for one call only; write `'_` instead of `{l}`",
                        form.borrowed
                    ),
                );
                ok = false;
            }
            GenericArgument::Type(t) if found.is_none() => found = Some(t.clone()),
            other => {
                errors.at(
                    other,
                    format_args!("unexpected generic argument: {}", form.written),
                );
                ok = false;
            }
        }
    }
    if found.is_none() {
        errors.at(ty, form.missing);
    }
    (found, ok)
}
