//! Times on the dashboard: milliseconds since the epoch shown as UTC, and the runs filter's
//! `datetime-local` fields (read as UTC) parsed back. The calendar is the `time` crate's.

use tidemark_core::error::codes;
use tidemark_core::Error;
use time::format_description::FormatItem;
use time::macros::format_description;
use time::{OffsetDateTime, PrimitiveDateTime};

const SHOWN: &[FormatItem<'static>] = format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
const FIELD_SECONDS: &[FormatItem<'static>] = format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]");
const FIELD_MINUTES: &[FormatItem<'static>] = format_description!("[year]-[month]-[day]T[hour]:[minute]");

fn utc(ms: i64) -> Option<OffsetDateTime> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()
}

/// `2026-11-30 10:15:36` (UTC).
pub fn format_utc(ms: i64) -> String {
    utc(ms).and_then(|t| t.format(SHOWN).ok()).unwrap_or_else(|| format!("{ms} ms"))
}

/// `12 s ago`, `in 3 min`.
pub fn relative(ms: i64, now_ms: i64) -> String {
    let delta = (now_ms - ms) / 1000;
    let span = |s: i64| match s {
        0..=59 => format!("{s} s"),
        60..=3_599 => format!("{} min", s / 60),
        3_600..=86_399 => format!("{} h", s / 3_600),
        _ => format!("{} d", s / 86_400),
    };
    if delta >= 0 {
        format!("{} ago", span(delta))
    } else {
        format!("in {}", span(-delta))
    }
}

/// The value of a `datetime-local` field, `YYYY-MM-DDTHH:MM` or `YYYY-MM-DDTHH:MM:SS`, read as
/// UTC.
pub fn parse_utc(field: &str, text: &str) -> Result<i64, Error> {
    let bad = || {
        Error::invalid(
            codes::INVALID_ARGUMENT,
            format!(
                "{field} must be a UTC time like 2026-01-31T12:00 (got {:?})",
                text.chars().take(40).collect::<String>()
            ),
        )
    };
    // A field may separate date and time with a space; a year is four digits, no sign.
    let text_t = text.trim().replacen(' ', "T", 1);
    if !text_t.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(bad());
    }
    let parsed = PrimitiveDateTime::parse(&text_t, FIELD_SECONDS)
        .or_else(|_| PrimitiveDateTime::parse(&text_t, FIELD_MINUTES))
        .map_err(|_| bad())?;
    Ok((parsed.assume_utc().unix_timestamp_nanos() / 1_000_000) as i64)
}

/// The `datetime-local` value of a time (the inverse of [`parse_utc`]).
#[cfg(test)]
fn to_field(ms: i64) -> String {
    format_utc(ms).replacen(' ', "T", 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_utc_round_trip() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(format_utc(1_796_033_736_000), "2026-11-30 10:15:36");
        for ms in [0, 951_782_400_000, 1_796_033_736_000, 4_102_444_799_000] {
            assert_eq!(parse_utc("t", &to_field(ms)).unwrap(), ms);
        }
        assert_eq!(parse_utc("t", "2026-11-30T10:15").unwrap(), 1_796_033_700_000);
    }

    #[test]
    fn rejects_what_is_not_a_time() {
        for bad in [
            "",
            "yesterday",
            "2026-13-01T00:00",
            "2026-02-29T00:00",
            "2026-01-01T24:00",
            "2026-1-1T1:1",
            "+026-01-01T00:00",
        ] {
            assert_eq!(parse_utc("t", bad).unwrap_err().code(), codes::INVALID_ARGUMENT, "{bad}");
        }
    }

    #[test]
    fn says_how_long_ago() {
        assert_eq!(relative(0, 12_000), "12 s ago");
        assert_eq!(relative(200_000, 20_000), "in 3 min");
    }
}
