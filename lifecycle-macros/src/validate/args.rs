//! The attribute's arguments: `crate`, `weights`, `engine`, `switching`.

use syn::{Expr, ExprLit, ExprPath, Ident, Lit, Path};

use super::errors::Errors;
use super::model::Switching;
use crate::parse::{RawArg, RawArgs};

/// The known attribute arguments, for the "unknown argument" message.
const KNOWN_ARGS: &str = "`crate = \"path\"`, `weights = ident`, `engine = ident` or \
                          `switching = \"eager\" | \"lazy\" | \"inherit\"`";

/// The attribute arguments, checked.
#[derive(Default)]
pub(super) struct Args {
    pub(super) krate: Option<Path>,
    pub(super) weights: Option<Ident>,
    pub(super) engine: Option<Ident>,
    pub(super) switching: Switching,
}

pub(super) fn check_args(raw: RawArgs, errors: &mut Errors) -> Args {
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

pub(super) fn string(value: &Expr) -> Option<&syn::LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s),
        _ => None,
    }
}
