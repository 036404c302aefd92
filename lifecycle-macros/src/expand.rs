//! Expansion: the hidden body, the lifecycle-taking entry point and the explicit enter / exit.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{
    Attribute, CapturedParam, FnArg, GenericParam, Ident, ItemFn, ReturnType, Type, TypeParamBound,
    Visibility,
};

use crate::validate::{EngineParam, Model, Switching};

/// Name of the generic parameter standing for the backend.
pub const BACKEND: &str = "__LifecycleBackend";

/// Name of the generic parameter standing for the lifecycle's engine where the function takes
/// none and its return type lists what it captures.
const ENGINE: &str = "__LifecycleEngine";

/// Adds `params` to every precise-capture list (`use<..>`) of the `impl Trait`s in `ty`;
/// whether there was one. (Edition 2024 captures every lifetime in scope, the view's included,
/// unless the return type says `+ use<..>`; the list must then name every type parameter in
/// scope, so the entry point's own are added to it.)
fn add_captures(ty: &mut Type, params: &[&Ident]) -> bool {
    struct Captures<'a> {
        params: &'a [&'a Ident],
        found: bool,
    }
    impl VisitMut for Captures<'_> {
        fn visit_type_impl_trait_mut(&mut self, it: &mut syn::TypeImplTrait) {
            for bound in &mut it.bounds {
                if let TypeParamBound::PreciseCapture(list) = bound {
                    self.found = true;
                    for p in self.params {
                        list.params.push(CapturedParam::Ident((*p).clone()));
                    }
                }
            }
            visit_mut::visit_type_impl_trait_mut(self, it);
        }
    }
    let mut v = Captures {
        params,
        found: false,
    };
    v.visit_type_mut(ty);
    v.found
}

/// Attributes of the user's function that also apply to the generated entry point.
fn forwarded_to_entry(attr: &Attribute) -> bool {
    [
        "doc",
        "cfg",
        "allow",
        "warn",
        "deny",
        "forbid",
        "expect",
        "deprecated",
    ]
    .iter()
    .any(|name| attr.path().is_ident(name))
}

/// The generated items of a validated function.
///
/// Long by design: the expansion is the generated code itself, one `quote!` per item (the
/// rollout function, its `_enter` and `_exit` companions) in the order they are emitted.
pub fn expand(model: Model) -> TokenStream {
    let Model {
        krate,
        switching,
        func,
        weights_index,
        view_ty,
        weights_ty,
        engine,
    } = model;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    let name = &sig.ident;
    let body_name = format_ident!("__{}_body", name);
    let enter_name = format_ident!("{}_enter", name);
    let exit_name = format_ident!("{}_exit", name);
    // Locals of the entry point. Nothing written by the user is in scope there (its parameters
    // are renamed), so plain names are safe; each use is located where a borrow error is best
    // explained when the return type borrows the view through a hidden lifetime (`Iter<f32>`): the
    // session at the view's type, its end and the returned value at the return type.
    let name_span = sig.ident.span();
    let (view_span, ret_span) = (
        view_ty.span(),
        match &sig.output {
            ReturnType::Default => name_span,
            ReturnType::Type(_, ty) => ty.span(),
        },
    );
    let session_at = |span: Span| Ident::new("__session", Span::mixed_site().located_at(span));
    let session = session_at(view_span);
    let out = Ident::new("__out", Span::mixed_site().located_at(ret_span));
    let backend = Ident::new(BACKEND, Span::call_site());
    let private = quote!(#krate::__private);
    let error_ty = quote!(#private::LifecycleError<<#backend as #private::Reshard>::Error>);
    let rollout_bound =
        quote_spanned!(view_span=> #backend: #private::Reshard<Rollout = #weights_ty>);
    // The return type's precise-capture lists (`impl Trait + use<..>`) name the entry point's
    // own parameters too: such a list must name every type parameter in scope.
    let mut output_ty = match &sig.output {
        ReturnType::Default => None,
        ReturnType::Type(_, ty) => Some((**ty).clone()),
    };
    let engine_param = Ident::new(ENGINE, Span::call_site());
    let own: &[&Ident] = if engine.is_none() {
        &[&backend, &engine_param]
    } else {
        &[&backend]
    };
    let precise = output_ty.as_mut().is_some_and(|ty| add_captures(ty, own));
    // With an engine parameter the lifecycle's engine is its type; without one, any engine: an
    // `impl Trait` argument, or (where the return type lists its captures, which cannot name
    // one) a parameter of its own.
    let (lifecycle_engine, engine_bound) = match &engine {
        Some(EngineParam { engine_ty, .. }) => {
            let span = engine_ty.span();
            (
                engine_ty.to_token_stream(),
                Some(quote_spanned!(span=> #engine_ty: #private::RolloutEngine<#weights_ty>)),
            )
        }
        None if precise => (
            engine_param.to_token_stream(),
            Some(quote!(#engine_param: #private::RolloutEngine<#weights_ty>)),
        ),
        None => (quote!(impl #private::RolloutEngine<#weights_ty>), None),
    };
    let weights_local = Ident::new("__weights", Span::mixed_site().located_at(view_span));
    let engine_span = engine.as_ref().map_or(view_span, |e| e.param_ty.span());
    let engine_local = Ident::new("__engine", Span::mixed_site().located_at(engine_span));
    let is_method = matches!(sig.inputs.first(), Some(FnArg::Receiver(_)));

    // The hidden body: the user's function as written, renamed. `deprecated` stays on the entry
    // point only, or calling the body would warn.
    let body_attrs = attrs.iter().filter(|a| !a.path().is_ident("deprecated"));
    let mut body_sig = sig.clone();
    body_sig.ident = body_name.clone();
    let body = quote! {
        #(#body_attrs)*
        #[doc(hidden)]
        #body_sig #block
    };

    // The entry point's parameters and the body call's arguments.
    let mut params = Vec::new();
    let mut call_args = Vec::new();
    let mut receiver = None;
    for (index, input) in sig.inputs.iter().enumerate() {
        match input {
            FnArg::Receiver(r) => {
                receiver = Some(r);
                call_args.push(r.self_token.to_token_stream());
            }
            FnArg::Typed(_) if index == weights_index && engine.is_some() => {
                call_args.push(weights_local.to_token_stream());
            }
            FnArg::Typed(_) if index == weights_index => {
                let session = session_at(view_span);
                call_args.push(quote_spanned!(view_span=> #session.weights()));
            }
            FnArg::Typed(_) if engine.as_ref().is_some_and(|e| e.index == index) => {
                let by_reference = engine.as_ref().is_some_and(|e| e.by_reference);
                call_args.push(if by_reference {
                    quote_spanned!(engine_span=> #engine_local.into_inner())
                } else {
                    engine_local.to_token_stream()
                });
            }
            FnArg::Typed(param) => {
                let arg = format_ident!("__arg{}", params.len());
                let ty = &param.ty;
                params.push(quote!(#arg: #ty));
                call_args.push(arg.into_token_stream());
            }
        }
    }
    let receiver = receiver.map(|r| quote!(#r,));

    let mut generics = sig.generics.clone();
    generics.params.push(syn::parse_quote!(#backend));
    if precise && engine.is_none() {
        generics.params.push(syn::parse_quote!(#engine_param));
    }
    let predicates = &mut generics.make_where_clause().predicates;
    predicates.push(syn::parse2(rollout_bound.clone()).expect("a where predicate"));
    if let Some(bound) = &engine_bound {
        predicates.push(syn::parse2(bound.clone()).expect("a where predicate"));
    }
    let (_, _, where_clause) = generics.split_for_impl();
    let generic_params = &generics.params;

    // Type and const parameters are passed explicitly (some may appear only in the return type);
    // lifetimes are left to inference (late-bound ones cannot be given).
    let explicit: Vec<&Ident> = sig
        .generics
        .params
        .iter()
        .filter_map(|p| match p {
            GenericParam::Type(t) => Some(&t.ident),
            GenericParam::Const(c) => Some(&c.ident),
            GenericParam::Lifetime(_) => None,
        })
        .collect();
    let turbofish = (!explicit.is_empty()).then(|| quote!(::<#(#explicit),*>));
    let callee = if is_method {
        quote!(Self::#body_name)
    } else {
        quote!(#body_name)
    };
    let dot_await = sig.asyncness.map(|_| quote!(.await));
    let call = quote_spanned!(name_span=> #callee #turbofish (#(#call_args),*) #dot_await);

    let output = match &output_ty {
        None => quote!(()),
        Some(ty) => ty.to_token_stream(),
    };
    let finish = {
        let session = session_at(ret_span);
        match switching {
            Switching::Inherit => quote_spanned!(ret_span=> #session.finish()?;),
            Switching::Eager => quote_spanned!(ret_span=> #session.exit()?;),
            Switching::Lazy => quote_spanned!(ret_span=> #private::finish_lazy(#session)?;),
        }
    };

    let entry_attrs = attrs.iter().filter(|a| forwarded_to_entry(a));
    let cfg_attrs: Vec<&Attribute> = attrs.iter().filter(|a| a.path().is_ident("cfg")).collect();
    let policy = match switching {
        Switching::Inherit => {
            "then applies the lifecycle's switching policy: under `Switching::Lazy` the weights \
             stay resident, so calls in a row between two training updates switch once; under \
             `Switching::Eager` the lifecycle leaves rollout mode before returning"
        }
        Switching::Eager => {
            "then leaves rollout mode before returning, whatever the lifecycle's switching policy \
             (`switching = \"eager\"`)"
        }
        Switching::Lazy => {
            "then keeps the weights resident, whatever the lifecycle's switching policy \
             (`switching = \"lazy\"`): calls in a row between two training updates switch once"
        }
    };
    let (instead_of, runs_with) = if engine.is_some() {
        (
            "the rollout weights view and the engine",
            "the weights view and the engine (woken after the switch)",
        )
    } else {
        ("the rollout weights view", "the weights view")
    };
    let generated_doc = format!(
        " Generated by `#[sharded_rollout]`: takes the lifecycle (`lifecycle: &mut Lifecycle<_>`) \
         instead of {instead_of}. Each call opens a rollout session, entering rollout \
         mode only when needed (when the resident rollout weights are missing or older than the \
         training weights), runs the body with {runs_with}, {policy}. {} and {} switch \
         explicitly.",
        link(&enter_name, is_method),
        link(&exit_name, is_method),
    );
    let errors_doc = " A `LifecycleError` when planning, entering, refreshing or leaving rollout \
                      mode fails. The body's own return value, whatever it is, comes back in `Ok`.";
    let lifecycle = Ident::new("lifecycle", Span::call_site());
    let rollout = quote_spanned!(view_span=> #lifecycle.rollout()?);
    let ok = respan(quote!(#private::Result::Ok), ret_span);
    // The block at the return type: it is what a borrowing return value fails to outlive.
    let entry_block = if engine.is_some() {
        quote_spanned! {ret_span=> {
            let mut #session = #rollout;
            let #out = {
                let (#weights_local, #engine_local) = #session.parts();
                #call
            };
            #finish
            #ok(#out)
        }}
    } else {
        quote_spanned! {ret_span=> {
            let #session = #rollout;
            let #out = #call;
            #finish
            #ok(#out)
        }}
    };
    let asyncness = &sig.asyncness;
    let fn_token = &sig.fn_token;
    let entry = quote! {
        #(#entry_attrs)*
        #[doc = ""]
        #[doc = " # Lifecycle"]
        #[doc = ""]
        #[doc = #generated_doc]
        #[doc = ""]
        #[doc = " # Errors"]
        #[doc = ""]
        #[doc = #errors_doc]
        #[allow(clippy::too_many_arguments)]
        #vis #asyncness #fn_token #name <#generic_params> (
            #receiver
            lifecycle: &mut #private::Lifecycle<#backend, #lifecycle_engine>,
            #(#params),*
        ) -> #private::Result<#output, #error_ty>
        #where_clause
        #entry_block
    };

    // Explicit switches. They name `W` when it does not depend on the function's own generics.
    let switch_bound = if mentions(weights_ty.to_token_stream(), &own_generics(&sig)) {
        quote!(#backend: #private::Reshard)
    } else {
        rollout_bound
    };
    let switches = switches(&private, &vis, &sig, &cfg_attrs, switch_bound, is_method);

    quote! {
        #body
        #entry
        #switches
    }
}

/// Names of the function's own generic parameters (type, const, lifetime).
pub fn own_generics(sig: &syn::Signature) -> Vec<String> {
    sig.generics
        .params
        .iter()
        .map(|p| match p {
            GenericParam::Type(t) => t.ident.to_string(),
            GenericParam::Const(c) => c.ident.to_string(),
            GenericParam::Lifetime(l) => l.lifetime.ident.to_string(),
        })
        .collect()
}

/// How the generated docs link to an item generated next to the function.
fn link(target: &Ident, is_method: bool) -> String {
    if is_method {
        format!("[`{target}`](Self::{target})")
    } else {
        format!("[`{target}`]")
    }
}

/// The explicit switches `name_enter` and `name_exit`, bounded by `switch_bound`.
pub fn switches(
    private: &TokenStream,
    vis: &Visibility,
    sig: &syn::Signature,
    cfg_attrs: &[&Attribute],
    switch_bound: TokenStream,
    is_method: bool,
) -> TokenStream {
    let name = &sig.ident;
    let name_span = name.span();
    let enter_name = format_ident!("{}_enter", name);
    let exit_name = format_ident!("{}_exit", name);
    let backend = Ident::new(BACKEND, Span::call_site());
    let error_ty = quote!(#private::LifecycleError<<#backend as #private::Reshard>::Error>);
    let enter_doc = format!(
        " Enters rollout mode now for {}: builds the rollout weights unless weights of the current \
         version are resident (then it moves nothing), then wakes the engine unless it frees its \
         memory after each call. Generated by `#[sharded_rollout]`.",
        link(name, is_method)
    );
    let any_engine = quote!(impl #private::RolloutEngine<<#backend as #private::Reshard>::Rollout>);
    let exit_doc = format!(
        " Leaves rollout mode now, after {}: puts the engine to sleep, releases the rollout weights \
         and brings offloaded training state back (no-op in train mode with nothing resident). \
         Generated by `#[sharded_rollout]`.",
        link(name, is_method)
    );
    quote_spanned! {name_span=>
        #(#cfg_attrs)*
        #[doc = #enter_doc]
        #[doc = ""]
        #[doc = " # Errors"]
        #[doc = ""]
        #[doc = " A `LifecycleError` when planning, entering or refreshing fails."]
        #[allow(dead_code)]
        #vis fn #enter_name<#switch_bound>(
            lifecycle: &mut #private::Lifecycle<#backend, #any_engine>,
        ) -> #private::Result<(), #error_ty> {
            lifecycle.enter()
        }

        #(#cfg_attrs)*
        #[doc = #exit_doc]
        #[doc = ""]
        #[doc = " # Errors"]
        #[doc = ""]
        #[doc = " `LifecycleError::Exit` when the backend fails to leave (the lifecycle is then faulted)."]
        #[allow(dead_code)]
        #vis fn #exit_name<#switch_bound>(
            lifecycle: &mut #private::Lifecycle<#backend, #any_engine>,
        ) -> #private::Result<(), #error_ty> {
            lifecycle.exit()
        }
    }
}

/// `tokens` with every span located at `span` (hygiene unchanged).
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tt| {
            if let TokenTree::Group(g) = &tt {
                let mut group = Group::new(g.delimiter(), respan(g.stream(), span));
                group.set_span(g.span().located_at(span));
                tt = TokenTree::Group(group);
            } else {
                tt.set_span(tt.span().located_at(span));
            }
            tt
        })
        .collect()
}

/// Whether `tokens` contain one of `idents` (a type or const parameter, or a lifetime's name).
pub fn mentions(tokens: TokenStream, idents: &[String]) -> bool {
    tokens.into_iter().any(|tt| match tt {
        TokenTree::Ident(i) => idents.iter().any(|n| i == n),
        TokenTree::Group(g) => mentions(g.stream(), idents),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use quote::quote;

    /// The expansion of a function the attribute accepts.
    fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        let input = crate::parse::item(item).expect("an item");
        match crate::validate::validate(syn::parse2(args), input) {
            Ok(model) => super::expand(model).to_string(),
            Err(rejected) => panic!("rejected: {}", rejected.errors),
        }
    }

    #[test]
    fn the_switching_argument_picks_how_the_session_ends() {
        let item = quote!(
            fn f(w: RolloutView<'_, Vec<f32>>) -> f32 {
                w[0]
            }
        );
        let inherit = expand(quote!(), item.clone());
        let eager = expand(quote!(switching = "eager"), item.clone());
        let lazy = expand(quote!(switching = "lazy"), item);
        assert!(inherit.contains("__session . finish () ?"), "{inherit}");
        assert!(eager.contains("__session . exit () ?"), "{eager}");
        assert!(lazy.contains("finish_lazy (__session)"), "{lazy}");
    }

    #[test]
    fn methods_call_the_body_through_self_with_explicit_generics() {
        let out = expand(
            quote!(),
            quote!(
                fn f<'a, T, const N: usize>(
                    &self,
                    x: &'a [T; N],
                    w: RolloutView<'_, Vec<f32>>,
                ) -> T {
                    todo!()
                }
            ),
        );
        assert!(
            out.contains("Self :: __f_body :: < T , N > (self , __arg0 , __session . weights ())"),
            "{out}"
        );
    }

    #[test]
    fn switches_name_the_weights_type_unless_it_uses_the_functions_generics() {
        let fixed = expand(
            quote!(),
            quote!(
                fn f(w: RolloutView<'_, Vec<f32>>) {}
            ),
        );
        assert!(fixed.contains("fn f_exit < __LifecycleBackend : :: lifecycle_core :: __private :: Reshard < Rollout = Vec < f32 > >"), "{fixed}");
        let generic = expand(
            quote!(),
            quote!(
                fn f<W>(w: RolloutView<'_, W>) {}
            ),
        );
        assert!(
            generic.contains(
                "fn f_exit < __LifecycleBackend : :: lifecycle_core :: __private :: Reshard >"
            ),
            "{generic}"
        );
    }

    #[test]
    fn an_engine_parameter_takes_the_session_parts_and_names_the_engine_type() {
        let out = expand(
            quote!(),
            quote!(
                fn f(w: RolloutView<'_, Vec<f32>>, #[engine] kv: &mut Kv, n: usize) -> f32 {
                    todo!()
                }
            ),
        );
        assert!(out.contains("let mut __session"), "{out}");
        assert!(
            out.contains("let (__weights , __engine) = __session . parts ()"),
            "{out}"
        );
        assert!(
            out.contains("__f_body (__weights , __engine . into_inner () , __arg0)"),
            "{out}"
        );
        assert!(
            out.contains("Lifecycle < __LifecycleBackend , Kv >"),
            "{out}"
        );
        assert!(
            out.contains("Kv : :: lifecycle_core :: __private :: RolloutEngine < Vec < f32 > >"),
            "{out}"
        );
        assert!(!out.contains("# [engine]"), "{out}");
    }

    #[test]
    fn without_an_engine_parameter_any_engine_is_accepted() {
        let out = expand(
            quote!(),
            quote!(
                fn f(w: RolloutView<'_, Vec<f32>>) {}
            ),
        );
        assert!(
            out.contains(
                "Lifecycle < __LifecycleBackend , impl :: lifecycle_core :: __private :: RolloutEngine < Vec < f32 > > >"
            ),
            "{out}"
        );
        assert!(!out.contains("parts ()"), "{out}");
    }

    #[test]
    fn the_crate_argument_moves_every_runtime_path() {
        let out = expand(
            quote!(crate = "my::rt"),
            quote!(
                fn f(w: RolloutView<'_, Vec<f32>>) {}
            ),
        );
        assert!(!out.contains("lifecycle_core"), "{out}");
        assert!(out.contains("my :: rt :: __private :: Lifecycle"), "{out}");
    }
}
