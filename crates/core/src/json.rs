//! JSON from outside the process: the numbers the canonical encoding keeps exactly.
//!
//! A payload, an input or an envelope read from JSON text is parsed into a `serde_json::Value`,
//! whose numbers are `u64`, `i64` or `f64`; the canonical encoding
//! ([`Envelope::canonical_bytes`](crate::Envelope::canonical_bytes)) and the content hash are
//! computed from that value. A number the value cannot hold exactly would be changed without a
//! word: `18446744073709551616` (2^64) becomes the float `1.8446744073709552e19`, and
//! `0.10000000000000000001` becomes `0.1`. So every number of JSON text from outside is checked
//! ([`check_numbers`]): it is accepted only when the number the canonical encoding writes for it
//! has the same decimal value as the number given. That is every integer in
//! `-2^63..=2^64-1`, and every other number that is exactly the shortest decimal of the double
//! nearest to it (`1.5`, `0.1`, `1e300`, `100.0`, `-0.0`); anything else is the typed error
//! `inexact_number` and nothing is written.
//!
//! The form of a number may change, never its value: `1e2` is written `100.0` and `-0` is `0`.
//!
//! Bodies and envelopes are read with [`from_slice`]: as `serde_json::from_slice`, except that a
//! struct is read only from a JSON object, never from an array of its fields.

use crate::error::{codes, Error, Result};

mod objects;

pub use objects::from_slice;

/// A JSON number's decimal value: `digits × 10^exponent`, with neither leading nor trailing
/// zeros in `digits` (so two equal values have equal forms), or zero.
#[derive(Debug, PartialEq, Eq)]
enum Decimal {
    Zero,
    NonZero { negative: bool, digits: Vec<u8>, exponent: i64 },
}

/// The decimal value of a JSON number token (`-?int(.frac)?([eE][+-]?exp)?`), or None when the
/// token is not one.
fn decimal_of(token: &[u8]) -> Option<Decimal> {
    let (negative, rest) = match token.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, token),
    };
    let mantissa_end = rest.iter().position(|b| matches!(b, b'e' | b'E')).unwrap_or(rest.len());
    let (mantissa, exponent_part) = rest.split_at(mantissa_end);
    let (integer, fraction) = match mantissa.iter().position(|&b| b == b'.') {
        Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
        None => (mantissa, &mantissa[..0]),
    };
    if integer.is_empty() || !integer.iter().chain(fraction).all(u8::is_ascii_digit) {
        return None;
    }
    let mut exponent: i64 = 0;
    if let Some((_, exponent_text)) = exponent_part.split_first() {
        let (sign, digits) = match exponent_text.split_first() {
            Some((b'-', digits)) => (-1, digits),
            Some((b'+', digits)) => (1, digits),
            _ => (1, exponent_text),
        };
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        // Saturating: an exponent beyond ±10^17 is far outside any double, and compares
        // unequal to every canonical number, which is what matters here.
        for &digit in digits {
            exponent = exponent.saturating_mul(10).saturating_add(i64::from(digit - b'0'));
        }
        exponent = exponent.saturating_mul(sign);
    }
    let all: Vec<u8> = integer.iter().chain(fraction).map(|b| b - b'0').collect();
    let first = all.iter().position(|&d| d != 0);
    let Some(first) = first else { return Some(Decimal::Zero) };
    let last = all.iter().rposition(|&d| d != 0).expect("a non-zero digit exists");
    let trailing_zeros = (all.len() - 1 - last) as i64;
    let exponent = exponent.saturating_sub(fraction.len() as i64).saturating_add(trailing_zeros);
    Some(Decimal::NonZero { negative, digits: all[first..=last].to_vec(), exponent })
}

/// Check one number token: what `serde_json` makes of it, written back canonically, must have
/// the same decimal value.
fn check_number(token: &[u8]) -> Result<()> {
    let text = std::str::from_utf8(token).unwrap_or_default();
    let Some(given) = decimal_of(token) else { return Ok(()) };
    let inexact = |kept: &str| {
        let shown: String = text.chars().take(60).collect();
        let shown = if shown.len() < text.len() { format!("{shown}...") } else { shown };
        Error::invalid(
            codes::INEXACT_NUMBER,
            format!(
                "the number {shown} would be stored as {kept}: JSON numbers are kept as 64-bit integers \
                 (-2^63..=2^64-1) or doubles, and this one is neither exactly; send it as a string"
            ),
        )
    };
    // A number serde_json refuses (out of a double's range) is the caller's JSON error already.
    let Ok(number) = serde_json::from_str::<serde_json::Number>(text) else { return Ok(()) };
    let kept = number.to_string();
    if decimal_of(kept.as_bytes()).as_ref() != Some(&given) {
        return Err(inexact(&kept));
    }
    Ok(())
}

/// Check every number of JSON `text` (bytes `serde_json` accepted as JSON): each must be kept
/// exactly by the canonical encoding (see the module's documentation); `inexact_number` names the
/// first that is not. Strings are skipped, whatever they hold.
pub fn check_numbers(text: &[u8]) -> Result<()> {
    let mut index = 0;
    while index < text.len() {
        match text[index] {
            b'"' => {
                // Skip the string: up to the next quote not escaped by a backslash.
                index += 1;
                while index < text.len() && text[index] != b'"' {
                    index += if text[index] == b'\\' { 2 } else { 1 };
                }
                index += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = index;
                while index < text.len() && matches!(text[index], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                    index += 1;
                }
                check_number(&text[start..index])?;
            }
            _ => index += 1,
        }
    }
    Ok(())
}

/// Integer fields of bodies read from JSON, as JSON Schema's `integer` has them: any number
/// whose fraction is zero, so `344.0` and `3.44e2` are the integer 344 (a plain `i64` field
/// refuses them). Use with `#[serde(deserialize_with = "tidemark_core::json::integer")]`, or
/// [`optional_integer`] for an `Option` (with `#[serde(default)]`). A number outside the field's
/// type is refused as serde refuses it; whether the text kept its value exactly is
/// [`check_numbers`]'s question.
pub fn integer<'de, D, T>(deserializer: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    deserializer.deserialize_any(IntegerVisitor(std::marker::PhantomData))
}

/// [`integer`] for an optional field: `null` (or, with `#[serde(default)]`, an absent field)
/// is `None`.
pub fn optional_integer<'de, D, T>(deserializer: D) -> std::result::Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    struct Integral<T>(T);
    impl<'de, T: TryFrom<i64> + TryFrom<u64>> serde::Deserialize<'de> for Integral<T> {
        fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
            integer(deserializer).map(Integral)
        }
    }
    let value: Option<Integral<T>> = serde::Deserialize::deserialize(deserializer)?;
    Ok(value.map(|Integral(value)| value))
}

struct IntegerVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: TryFrom<i64> + TryFrom<u64>> serde::de::Visitor<'de> for IntegerVisitor<T> {
    type Value = T;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(formatter, "an integer in the range of {}", std::any::type_name::<T>())
    }

    fn visit_i64<E: serde::de::Error>(self, value: i64) -> std::result::Result<T, E> {
        T::try_from(value).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(value), &self))
    }

    fn visit_u64<E: serde::de::Error>(self, value: u64) -> std::result::Result<T, E> {
        T::try_from(value).map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(value), &self))
    }

    fn visit_f64<E: serde::de::Error>(self, value: f64) -> std::result::Result<T, E> {
        // 2^63 and 2^64 are exact doubles; a double with a zero fraction below them in magnitude
        // is exactly one i64 (or u64).
        const TWO_63: f64 = 9_223_372_036_854_775_808.0;
        if value.fract() != 0.0 || !value.is_finite() {
            return Err(E::invalid_type(serde::de::Unexpected::Float(value), &self));
        }
        if (-TWO_63..TWO_63).contains(&value) {
            self.visit_i64(value as i64)
        } else if (0.0..2.0 * TWO_63).contains(&value) {
            self.visit_u64(value as u64)
        } else {
            Err(E::invalid_value(serde::de::Unexpected::Float(value), &self))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(text: &str) -> Option<&'static str> {
        check_numbers(text.as_bytes()).err().map(|e| e.code())
    }

    #[test]
    fn numbers_kept_exactly_are_accepted() {
        for text in [
            "0",
            "-0",
            "-0.0",
            "1",
            "-1",
            "18446744073709551615",
            "-9223372036854775808",
            "1.5",
            "0.1",
            "1e2",
            "100.0",
            "1E+2",
            "1.8446744073709552e19",
            "1e300",
            "2.2250738585072014e-308",
            "5e-324",
            "123456789.125",
            "0e99999999999999999999999",
        ] {
            assert_eq!(code(text), None, "{text}");
            assert_eq!(code(&format!(r#"{{"a":[{text}],"b":"{text}"}}"#)), None, "{text}");
        }
    }

    #[test]
    fn numbers_the_canonical_encoding_would_change_are_inexact_number() {
        for text in [
            // 2^64 and beyond: not a u64, and stored as a float they would lose digits.
            "18446744073709551616",
            "-9223372036854775809",
            "100000000000000000001",
            "0.10000000000000000001",
            "1.00000000000000000001",
            "9007199254740993.0",
            "1e-400",
            "123456789012345678901234567890",
        ] {
            assert_eq!(code(&format!(r#"{{"payload":{{"n":{text}}}}}"#)), Some(codes::INEXACT_NUMBER), "{text}");
        }
        let message = check_numbers(b"[18446744073709551616]").unwrap_err().to_string();
        assert!(message.contains("18446744073709551616") && message.contains("1.8446744073709552e+19"), "{message}");
    }

    #[test]
    fn integer_fields_take_integers_written_with_a_zero_fraction() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Body {
            #[serde(deserialize_with = "super::integer")]
            seq: i64,
            #[serde(default, deserialize_with = "super::optional_integer")]
            step: Option<u32>,
        }
        let body = |text: &str| serde_json::from_str::<Body>(text);
        assert_eq!(body(r#"{"seq": 344.0, "step": 3.0}"#).unwrap(), Body { seq: 344, step: Some(3) });
        assert_eq!(body(r#"{"seq": -3.44e2}"#).unwrap(), Body { seq: -344, step: None });
        assert_eq!(body(r#"{"seq": 9223372036854775807, "step": null}"#).unwrap().seq, i64::MAX);
        for bad in [
            r#"{"seq": 344.5}"#,
            r#"{"seq": "344"}"#,
            r#"{"seq": 9223372036854775808}"#,
            r#"{"seq": 1e300}"#,
            r#"{"seq": 1, "step": -1}"#,
            r#"{"seq": 1, "step": 4294967296.0}"#,
        ] {
            assert!(body(bad).is_err(), "{bad}");
        }
    }

    /// serde_json's default float parser reads some doubles back one ULP off (so a stored
    /// payload's canonical bytes would change each time they are read and written again); the
    /// workspace enables its `float_roundtrip` feature.
    #[test]
    fn a_double_reads_back_as_the_double_that_was_written() {
        for text in ["1.5777777777770001", "117.63331139400017", "0.09144338512092887", "10587.436593658975"] {
            let written: f64 = text.parse().expect("a double");
            let read: serde_json::Value = serde_json::from_str(text).expect("JSON");
            assert_eq!(read.as_f64(), Some(written), "{text}");
            assert_eq!(serde_json::to_string(&read).expect("serialises"), text);
            assert_eq!(check_numbers(text.as_bytes()), Ok(()), "{text}");
        }
    }

    #[test]
    fn strings_are_never_read_as_numbers() {
        assert_eq!(code(r#"["18446744073709551616", "a\"18446744073709551616", "\\"]"#), None);
        assert_eq!(code(r#"{"18446744073709551616": 1}"#), None);
    }
}
