//! Procedural macros of `lifecycle-core`; use them through that crate.
use proc_macro::TokenStream;

/// Placeholder until the macro lands.
#[proc_macro_attribute]
pub fn sharded_rollout(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
