//! Command-line helpers shared by the programs' `clap` definitions: value parsers, and the
//! checks their tests run on the documented invocations.

use std::error::Error;
use std::process::ExitCode;
use std::str::FromStr;

use clap::Parser;

/// Parses a positive integer (`value_parser = positive::<usize>`): zero is refused.
pub fn positive<T: FromStr + Default + PartialEq>(s: &str) -> Result<T, String> {
    match s.parse::<T>() {
        Ok(n) if n != T::default() => Ok(n),
        _ => Err(format!("`{s}` is not a positive integer")),
    }
}

/// The exit status of a program whose run says whether its checks passed: success when they
/// did, failure when they did not or the run failed (its error printed as `error: …`).
pub fn exit_code(outcome: Result<bool, Box<dyn Error>>) -> ExitCode {
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `args` (the arguments after the program's name, separated by white space) as the
/// command line of `C`.
pub fn parse_from<C: Parser>(args: &str) -> Result<C, clap::Error> {
    let name = C::command().get_name().to_string();
    C::try_parse_from(std::iter::once(name.as_str()).chain(args.split_whitespace()))
}

/// For tests: checks the definition of `C` (`clap::Command::debug_assert`), that `--help`
/// prints the help, and that each of `invocations` (as [`parse_from`] takes them) parses;
/// returns what they parse to.
///
/// # Panics
/// On an invalid definition, or naming the first invocation that does not parse.
pub fn assert_parses<C: Parser, const N: usize>(invocations: [&str; N]) -> [C; N] {
    C::command().debug_assert();
    match parse_from::<C>("--help") {
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {}
        _ => panic!("`--help` does not print the help"),
    }
    invocations.map(|args| {
        parse_from::<C>(args).unwrap_or_else(|e| panic!("`{args}` does not parse: {e}"))
    })
}

/// For tests: checks that each of `invocations` (as [`parse_from`] takes them) is refused.
///
/// # Panics
/// Naming the first invocation that parses.
pub fn assert_refused<C: Parser>(invocations: &[&str]) {
    for args in invocations {
        assert!(parse_from::<C>(args).is_err(), "`{args}` parses");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test program.
    #[derive(Debug, Parser)]
    #[command(name = "probe")]
    struct Cli {
        /// A count.
        #[arg(long, default_value_t = 3, value_parser = positive::<usize>)]
        n: usize,
        /// A switch.
        #[arg(long)]
        quick: bool,
    }

    #[test]
    fn positive_refuses_zero_and_non_numbers() {
        assert_eq!(positive::<usize>("3"), Ok(3));
        assert_eq!(positive::<u64>("7"), Ok(7));
        assert!(positive::<usize>("0").is_err());
        assert!(positive::<usize>("-1").is_err());
        assert!(positive::<usize>("x").is_err());
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(Ok(true)), ExitCode::SUCCESS);
        assert_eq!(exit_code(Ok(false)), ExitCode::FAILURE);
        assert_eq!(exit_code(Err("broken".into())), ExitCode::FAILURE);
    }

    #[test]
    fn invocations_parse_or_are_refused() {
        let [d, c] = assert_parses::<Cli, 2>(["", "--n 5  --quick"]);
        assert_eq!((d.n, d.quick), (3, false));
        assert_eq!((c.n, c.quick), (5, true));
        assert_refused::<Cli>(&["--n 0", "--bogus", "--n"]);
        assert!(std::panic::catch_unwind(|| assert_parses::<Cli, 1>(["--n 0"])).is_err());
        assert!(std::panic::catch_unwind(|| assert_refused::<Cli>(&["--quick"])).is_err());
    }
}
