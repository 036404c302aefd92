//! Command-line value parsers shared by the programs' `clap` definitions.

use std::str::FromStr;

/// Parses a positive integer (`value_parser = positive::<usize>`): zero is refused.
pub fn positive<T: FromStr + Default + PartialEq>(s: &str) -> Result<T, String> {
    match s.parse::<T>() {
        Ok(n) if n != T::default() => Ok(n),
        _ => Err(format!("`{s}` is not a positive integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positive_refuses_zero_and_non_numbers() {
        assert_eq!(positive::<usize>("3"), Ok(3));
        assert_eq!(positive::<u64>("7"), Ok(7));
        assert!(positive::<usize>("0").is_err());
        assert!(positive::<usize>("-1").is_err());
        assert!(positive::<usize>("x").is_err());
    }
}
