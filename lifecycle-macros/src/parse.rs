//! Parsing: the attribute arguments and the annotated item, into a small AST.
//!
//! Parsing only checks syntax; every rule about what the macro accepts lives in `validate.rs`, so
//! that all mistakes are reported together.

use proc_macro2::TokenStream;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, Ident, Item, ItemFn, Token};

/// One `key = value` argument of `#[sharded_rollout(...)]`.
pub struct RawArg {
    /// The key; `crate` is accepted although it is a keyword.
    pub key: Ident,
    /// The value, checked by `validate.rs` against what the key expects.
    pub value: Expr,
}

impl Parse for RawArg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let key = Ident::parse_any(input)?;
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(
                input.span(),
                format_args!(
                    "expected `=` after `{key}`: arguments are written `key = value`, e.g. \
                     `switching = \"eager\"`"
                ),
            ));
        }
        input.parse::<Token![=]>()?;
        let value = input.parse()?;
        Ok(RawArg { key, value })
    }
}

/// The attribute arguments, in the order written.
pub struct RawArgs(pub Vec<RawArg>);

impl Parse for RawArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let args = Punctuated::<RawArg, Token![,]>::parse_terminated(input)?;
        Ok(RawArgs(args.into_iter().collect()))
    }
}

/// The annotated item.
pub enum Input {
    /// A free function or a method (syn parses a method of an impl block as a function item).
    Fn(ItemFn),
    /// Any other item: rejected by validation with a message naming its kind.
    Other(Item),
}

/// Parses the annotated item. Fails only when the tokens are not an item at all.
pub fn item(tokens: TokenStream) -> syn::Result<Input> {
    Ok(match syn::parse2::<Item>(tokens)? {
        Item::Fn(f) => Input::Fn(f),
        other => Input::Other(other),
    })
}
