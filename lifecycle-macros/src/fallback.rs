//! What the attribute emits for a function it rejects, beside its errors: a stub with the
//! signature the expansion would have generated (`name`, `name_enter`, `name_exit`), and no body.
//!
//! Emitting the function as written would leave its callers facing the function the user wrote
//! (`name(weights, ..)`), not the one they call (`name(&mut lifecycle, ..)`): every call site would
//! add a type mismatch and an error on its `?`, burying the attribute's own message. With the stub,
//! call sites type-check and the attribute's errors are the only ones. thiserror's derive emits
//! stub impls beside its errors the same way (its `fallback.rs`); tokio's `#[tokio::main]` keeps
//! emitting the function it rejects for the same reason.
//!
//! The stub follows the rejected function as far as it can be read ([`Fallback`]): the weights and
//! engine parameters found or guessed are replaced by the lifecycle; a `W` or an engine type that
//! could not be read leaves the lifecycle's backend or engine open. Its return type is the
//! function's, made nameable without the view: elided lifetimes become `'static` and `impl Trait`
//! a boxed `dyn Trait` (a body that never returns cannot pick a hidden type). The qualifiers the
//! attribute rejects (`const`, `unsafe`, `extern`, `...`) are left out. The body is never run:
//! the crate does not compile while the errors stand.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{format_ident, quote, ToTokens};
use syn::visit_mut::{self, VisitMut};
use syn::{FnArg, Ident, ReturnType, Type};

use crate::expand::{mentions, own_generics, switches, BACKEND};
use crate::validate::Fallback;

/// The stub of a rejected function: `name`, `name_enter` and `name_exit`, with the signatures
/// the expansion would have generated.
pub fn stub(fallback: Fallback) -> TokenStream {
    let Fallback {
        krate,
        func,
        replaced,
        weights_ty,
        engine_ty,
    } = fallback;
    let sig = &func.sig;
    let private = quote!(#krate::__private);
    let backend = Ident::new(BACKEND, Span::call_site());
    let rollout = match &weights_ty {
        Some(w) => w.to_token_stream(),
        None => quote!(<#backend as #private::Reshard>::Rollout),
    };
    let rollout_bound = match &weights_ty {
        Some(w) => quote!(#backend: #private::Reshard<Rollout = #w>),
        None => quote!(#backend: #private::Reshard),
    };
    let lifecycle_engine = match &engine_ty {
        Some(e) => e.to_token_stream(),
        None => quote!(impl #private::RolloutEngine<#rollout>),
    };

    let mut generics = sig.generics.clone();
    generics.params.push(syn::parse_quote!(#backend));
    let predicates = &mut generics.make_where_clause().predicates;
    // The engine type gets no `RolloutEngine` bound: `Lifecycle<B, E>` needs none, and a bound on
    // a concrete type that does not hold would be an error of the stub itself.
    predicates.push(syn::parse_quote!(#rollout_bound));
    let (_, _, where_clause) = generics.split_for_impl();
    let generic_params = &generics.params;

    // The parameters the caller passes after the lifecycle; the replaced ones are only named in
    // the body, so the imports their types use stay used.
    let mut receiver = None;
    let mut params = Vec::new();
    let mut dropped = Vec::new();
    for (index, input) in sig.inputs.iter().enumerate() {
        match input {
            FnArg::Receiver(r) => {
                // `mut self` binds mutably, which callers do not see and the stub does not need.
                let mut r = r.clone();
                if r.reference.is_none() {
                    r.mutability = None;
                }
                receiver = Some(quote!(#r,));
            }
            FnArg::Typed(p) if replaced.contains(&index) => {
                if nameable(&p.ty) {
                    dropped.push(p.ty.as_ref().clone());
                }
            }
            FnArg::Typed(p) => {
                let arg = format_ident!("__arg{}", params.len());
                let ty = &p.ty;
                params.push(quote!(#arg: #ty));
            }
        }
    }

    let output = match &sig.output {
        ReturnType::Default => quote!(()),
        ReturnType::Type(_, ty) => {
            let mut ty = ty.as_ref().clone();
            Nameable.visit_type_mut(&mut ty);
            ty.into_token_stream()
        }
    };
    let error_ty = quote!(#private::LifecycleError<<#backend as #private::Reshard>::Error>);
    // Of the attributes the entry point would carry, those callers see; lint levels would only
    // apply to the stub itself.
    let attrs = func.attrs.iter().filter(|a| {
        ["doc", "cfg", "deprecated"]
            .iter()
            .any(|n| a.path().is_ident(n))
    });
    let (vis, asyncness, fn_token, name) = (&func.vis, &sig.asyncness, &sig.fn_token, &sig.ident);
    let entry = quote! {
        #(#attrs)*
        #[allow(clippy::too_many_arguments)]
        #vis #asyncness #fn_token #name <#generic_params> (
            #receiver
            lifecycle: &mut #private::Lifecycle<#backend, #lifecycle_engine>,
            #(#params),*
        ) -> #private::Result<#output, #error_ty>
        #where_clause
        {
            let _ = (lifecycle, ::core::marker::PhantomData::<fn(#(#dropped),*)>);
            ::core::unreachable!("#[sharded_rollout] rejected this function")
        }
    };

    let is_method = receiver.is_some();
    let switch_bound = match &weights_ty {
        Some(w) if !mentions(w.to_token_stream(), &own_generics(sig)) => rollout_bound,
        _ => quote!(#backend: #private::Reshard),
    };
    let cfg_attrs: Vec<_> = func
        .attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .collect();
    let switches = switches(&private, vis, sig, &cfg_attrs, switch_bound, is_method);
    quote! {
        #entry
        #switches
    }
}

/// Whether a parameter type can be named in `fn(..)` inside the stub's body: no `impl Trait`, and
/// no view or engine without its generic arguments (the attribute reported those already).
fn nameable(ty: &Type) -> bool {
    fn clean(tokens: TokenStream) -> bool {
        let mut tokens = tokens.into_iter().peekable();
        while let Some(tt) = tokens.next() {
            match &tt {
                TokenTree::Ident(i) if i == "impl" => return false,
                TokenTree::Ident(i)
                    if (i == "RolloutView" || i == "EngineMut")
                        && !matches!(tokens.peek(), Some(TokenTree::Punct(p)) if p.as_char() == '<') =>
                {
                    return false;
                }
                TokenTree::Group(g) if !clean(g.stream()) => return false,
                _ => {}
            }
        }
        true
    }
    clean(ty.to_token_stream())
}

/// Makes a return type nameable without the view's lifetime: elided lifetimes become `'static`
/// (outside `fn(..)` types and `Fn(..)` bounds, where elision borrows nothing) and `impl Trait`
/// becomes `Box<dyn Trait>`.
struct Nameable;

impl VisitMut for Nameable {
    fn visit_type_reference_mut(&mut self, r: &mut syn::TypeReference) {
        match &r.lifetime {
            Some(l) if l.ident != "_" => {}
            _ => r.lifetime = Some(syn::parse_quote!('static)),
        }
        self.visit_type_mut(&mut r.elem);
    }

    fn visit_lifetime_mut(&mut self, l: &mut syn::Lifetime) {
        if l.ident == "_" {
            *l = syn::parse_quote!('static);
        }
    }

    fn visit_type_mut(&mut self, ty: &mut Type) {
        if let Type::ImplTrait(it) = ty {
            let bounds = it
                .bounds
                .iter()
                .filter(|b| {
                    matches!(
                        b,
                        syn::TypeParamBound::Trait(_) | syn::TypeParamBound::Lifetime(_)
                    )
                })
                .cloned();
            let bounds: Vec<_> = bounds.collect();
            *ty = syn::parse_quote!(::std::boxed::Box<dyn #(#bounds)+*>);
        }
        visit_mut::visit_type_mut(self, ty);
    }

    fn visit_type_bare_fn_mut(&mut self, _: &mut syn::TypeBareFn) {}

    fn visit_parenthesized_generic_arguments_mut(
        &mut self,
        _: &mut syn::ParenthesizedGenericArguments,
    ) {
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    /// The errors and the stub of a function the attribute rejects.
    fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        let input = crate::parse::item(item).expect("an item");
        match crate::validate::validate(syn::parse2(args), input) {
            Ok(_) => panic!("the function should be rejected"),
            Err(rejected) => {
                let mut out = rejected.errors.to_compile_error();
                out.extend(rejected.fallback.map(|f| super::stub(*f)));
                out.to_string()
            }
        }
    }

    #[test]
    fn a_rejected_function_becomes_a_stub_of_the_entry_point() {
        let out = expand(
            quote!(bogus = 1),
            quote!(
                fn f(#[weights] w: RolloutView<'_, Vec<f32>>, n: usize) -> &f32 {
                    todo!()
                }
            ),
        );
        assert!(out.starts_with(":: core :: compile_error !"), "{out}");
        // The generated signature: the lifecycle instead of the view, the rest as written.
        assert!(
            out.contains(
                "fn f < __LifecycleBackend > (lifecycle : & mut :: lifecycle_core :: __private \
                 :: Lifecycle < __LifecycleBackend , impl :: lifecycle_core :: __private :: \
                 RolloutEngine < Vec < f32 > > > , __arg0 : usize)"
            ),
            "{out}"
        );
        assert!(
            out.contains("__private :: Result < & 'static f32 ,"),
            "{out}"
        );
        assert!(out.contains("Reshard < Rollout = Vec < f32 > >"), "{out}");
        assert!(
            out.contains("fn f_enter") && out.contains("fn f_exit"),
            "{out}"
        );
        // No body as written, no marker.
        assert!(!out.contains("__f_body"), "{out}");
        assert!(!out.contains("todo"), "{out}");
        assert!(!out.contains("# [weights]"), "{out}");
    }

    #[test]
    fn the_stub_guesses_the_view_and_drops_every_engine() {
        let out = expand(
            quote!(),
            quote!(
                fn f(weights: &Vec<f32>, a: EngineMut<'_, Kv>, b: EngineMut<'_, Kv>, n: u8) {}
            ),
        );
        assert!(out.contains("compile_error"), "{out}");
        assert!(
            out.contains(
                "RolloutEngine < < __LifecycleBackend as :: lifecycle_core :: __private :: \
                 Reshard > :: Rollout > > , __arg0 : u8)"
            ),
            "{out}"
        );
        // `W` is unknown: any backend.
        assert!(
            out.contains("where __LifecycleBackend : :: lifecycle_core :: __private :: Reshard {"),
            "{out}"
        );
    }

    #[test]
    fn the_stub_boxes_an_impl_trait_return() {
        let out = expand(
            quote!(),
            quote!(
                fn f<'a>(w: RolloutView<'a, Vec<f32>>) -> impl Iterator<Item = &f32> + '_ {
                    w.iter()
                }
            ),
        );
        assert!(
            out.contains(
                "Result < :: std :: boxed :: Box < dyn Iterator < Item = & 'static f32 > + \
                 'static > ,"
            ),
            "{out}"
        );
    }
}
