//! Errors collected and combined, so one expansion reports every mistake at once.

use std::fmt::Display;

use quote::ToTokens;

/// Collects errors so they can be reported together.
#[derive(Default)]
pub(super) struct Errors(Option<syn::Error>);

impl Errors {
    pub(super) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(super) fn at<T: ToTokens, D: Display>(&mut self, tokens: T, message: D) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub(super) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}
