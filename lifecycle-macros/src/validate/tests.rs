//! Validation's rules, each mistake reported on its tokens.

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
