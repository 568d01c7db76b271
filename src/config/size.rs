//! Human byte sizes for the command line: `--shm-size 256MiB`.
//!
//! # The rule
//!
//! A size is a number, an optional space, and an optional unit; units are
//! case-insensitive.
//!
//! | unit | factor |
//! | --- | --- |
//! | none, `B` | 1 |
//! | `K`, `KiB` / `M`, `MiB` / `G`, `GiB` / `T`, `TiB` | 2^10 / 2^20 / 2^30 / 2^40 (binary) |
//! | `KB` / `MB` / `GB` / `TB` | 10^3 / 10^6 / 10^9 / 10^12 (decimal, as SI says) |
//!
//! The bare letters are binary because that is what memory sizes mean in
//! practice (`ulimit`, `dd`, `mount -o size=`); only the explicit `…B`
//! spellings are decimal. The number may have a fractional part
//! (`1.5GiB`) as long as the result is a whole number of bytes; it is
//! computed exactly, never through floating point.

use std::fmt;
use std::str::FromStr;

/// A size in bytes, parsed from and printed as a human size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// Why a string is not a byte size. Every message names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing (or only spaces) was given.
    #[error("invalid size {input:?}: it is empty (expected e.g. 256MiB)")]
    Empty {
        /// The input as given.
        input: String,
    },
    /// The number part is not a plain decimal number.
    #[error("invalid size {input:?}: {number:?} is not a number (expected digits, optionally with a fraction: 1.5GiB)")]
    BadNumber {
        /// The input as given.
        input: String,
        /// The part that should have been a number.
        number: String,
    },
    /// The unit is not one of the accepted ones.
    #[error("invalid size {input:?}: unknown unit {unit:?} (use B, K/KiB, M/MiB, G/GiB, T/TiB, or KB/MB/GB/TB)")]
    UnknownUnit {
        /// The input as given.
        input: String,
        /// The unit found.
        unit: String,
    },
    /// The fraction does not come out to whole bytes (`1.5B`, `0.1KiB`).
    #[error("invalid size {input:?}: it is not a whole number of bytes")]
    NotWhole {
        /// The input as given.
        input: String,
    },
    /// The size does not fit in 64 bits.
    #[error("invalid size {input:?}: it is larger than {} bytes", u64::MAX)]
    Overflow {
        /// The input as given.
        input: String,
    },
}

/// Longest fractional part accepted (keeps the exact arithmetic in `u128`).
const MAX_FRACTION_DIGITS: usize = 18;

fn unit_factor(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    })
}

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(input: &str) -> Result<Self, SizeError> {
        let owned = || input.to_owned();
        let s = input.trim();
        if s.is_empty() {
            return Err(SizeError::Empty { input: owned() });
        }
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (number, unit) = (&s[..split], s[split..].trim_start());
        let bad_number = || SizeError::BadNumber {
            input: owned(),
            number: number.to_owned(),
        };
        let (whole, fraction) = match number.split_once('.') {
            Some((w, f)) => (w, f),
            None => (number, ""),
        };
        let has_dot = number.contains('.');
        if whole.is_empty()
            || (has_dot && fraction.is_empty())
            || fraction.contains('.')
            || fraction.len() > MAX_FRACTION_DIGITS
        {
            return Err(bad_number());
        }
        let factor = unit_factor(unit).ok_or_else(|| SizeError::UnknownUnit {
            input: owned(),
            unit: unit.to_owned(),
        })?;
        let overflow = || SizeError::Overflow { input: owned() };
        // Digits only from here on, so the parses fail only on overflow.
        let whole: u64 = whole.parse().map_err(|_| overflow())?;
        let whole_bytes = u128::from(whole) * u128::from(factor);
        let fraction_bytes = if fraction.is_empty() {
            0
        } else {
            let digits: u128 = fraction.parse().map_err(|_| bad_number())?;
            let scale = 10u128.pow(fraction.len() as u32);
            let scaled = digits * u128::from(factor);
            if !scaled.is_multiple_of(scale) {
                return Err(SizeError::NotWhole { input: owned() });
            }
            scaled / scale
        };
        u64::try_from(whole_bytes + fraction_bytes)
            .map(ByteSize)
            .map_err(|_| overflow())
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit the size reaches: `256 MiB`, `1.5 GiB`,
    /// `4095 B`; fractions are shown to at most two decimals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 5] = [
            ("PiB", 1 << 50),
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        let Some((name, factor)) = UNITS.into_iter().find(|(_, factor)| self.0 >= *factor) else {
            return write!(f, "{} B", self.0);
        };
        if self.0.is_multiple_of(factor) {
            return write!(f, "{} {name}", self.0 / factor);
        }
        let shown = format!("{:.2}", self.0 as f64 / factor as f64);
        write!(f, "{} {name}", shown.trim_end_matches('0').trim_end_matches('.'))
    }
}

/// A size in a configuration file: a string in the syntax above
/// (`"256MiB"`), or a non-negative integer number of bytes (`268435456`).
/// Errors name the input and say why (see [`SizeError`]); the TOML parser
/// adds the key and line.
impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"256MiB\" or a number of bytes")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                s.parse().map_err(E::custom)
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(n))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format_args!("invalid size {n}: a size cannot be negative")))
            }
        }

        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<u64, SizeError> {
        s.parse::<ByteSize>().map(ByteSize::bytes)
    }

    #[test]
    fn parses_binary_decimal_and_bare_units() {
        let cases: &[(&str, u64)] = &[
            ("256MiB", 256 << 20),
            ("1GiB", 1 << 30),
            ("64M", 64 << 20),
            ("512k", 512 << 10),
            ("1048576", 1 << 20),
            ("1.5GiB", 3 << 29),
            ("100MB", 100_000_000),
            ("2 TiB", 2 << 40),
            ("3kb", 3_000),
            ("7 b", 7),
            ("  8 mib  ", 8 << 20),
            ("1.25K", 1280),
            ("0", 0),
            ("2.000G", 2 << 30),
            ("5tb", 5_000_000_000_000),
            ("16gb", 16_000_000_000),
        ];
        for (s, want) in cases {
            assert_eq!(parse(s), Ok(*want), "{s}");
        }
    }

    #[test]
    fn rejects_bad_input_naming_it() {
        assert!(matches!(parse(""), Err(SizeError::Empty { .. })));
        assert!(matches!(parse("   "), Err(SizeError::Empty { .. })));
        for s in ["MiB", ".5G", "1.", "1.2.3M", "-5M", "1e3"] {
            let err = parse(s).unwrap_err();
            assert!(
                matches!(err, SizeError::BadNumber { .. } | SizeError::UnknownUnit { .. }),
                "{s}: {err:?}"
            );
            assert!(err.to_string().contains(&format!("{s:?}")), "{s}: {err}");
        }
        let err = parse("12XB").unwrap_err();
        assert_eq!(
            err,
            SizeError::UnknownUnit {
                input: "12XB".into(),
                unit: "XB".into()
            }
        );
        assert!(err.to_string().contains("\"12XB\"") && err.to_string().contains("\"XB\""));
        assert!(matches!(parse("12 M B"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(parse("1.5"), Err(SizeError::NotWhole { .. })));
        assert!(matches!(parse("0.1KiB"), Err(SizeError::NotWhole { .. })));
        assert!(matches!(
            parse("1.0000000000000000001G"),
            Err(SizeError::BadNumber { .. })
        ));
    }

    #[test]
    fn rejects_overflow() {
        assert_eq!(parse("18446744073709551615"), Ok(u64::MAX));
        for s in [
            "18446744073709551616",
            "16777216TiB",
            "99999999999999999999999999G",
            "18446744073709551615.5K",
        ] {
            assert!(matches!(parse(s), Err(SizeError::Overflow { .. })), "{s}");
        }
        assert_eq!(parse("16777215.5TiB"), Ok((16_777_215 << 40) + (1 << 39)));
    }

    #[test]
    fn displays_in_the_largest_binary_unit() {
        let cases: &[(u64, &str)] = &[
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1 KiB"),
            (256 << 20, "256 MiB"),
            (3 << 29, "1.5 GiB"),
            ((1 << 30) + 1, "1 GiB"),
            (100_000_000, "95.37 MiB"),
            (2 << 40, "2 TiB"),
        ];
        for (n, want) in cases {
            assert_eq!(ByteSize(*n).to_string(), *want, "{n}");
        }
    }

    #[test]
    fn display_round_trips_exact_sizes() {
        for n in [1u64 << 10, 64 << 20, 256 << 20, 3 << 29, 5 << 40] {
            assert_eq!(parse(&ByteSize(n).to_string()), Ok(n));
        }
    }
}
