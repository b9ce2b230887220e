//! Times on the dashboard: milliseconds since the epoch shown as UTC, and the runs filter's
//! `datetime-local` fields (read as UTC) parsed back. Civil-date arithmetic from Howard
//! Hinnant's `days_from_civil` / `civil_from_days`.

use tidemark_core::error::codes;
use tidemark_core::Error;

const MS_PER_DAY: i64 = 86_400_000;

fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `2026-11-30 10:15:36` (UTC).
pub fn format_utc(ms: i64) -> String {
    let (days, in_day) = (ms.div_euclid(MS_PER_DAY), ms.rem_euclid(MS_PER_DAY) / 1000);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", in_day / 3600, in_day / 60 % 60, in_day % 60)
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
    let (date, clock) = text.trim().split_once(['T', ' ']).ok_or_else(bad)?;
    let number = |s: &str, len: usize| -> Result<i64, Error> {
        if s.len() != len || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        s.parse().map_err(|_| bad())
    };
    let mut date_parts = date.split('-');
    let (year, month, day) = match (date_parts.next(), date_parts.next(), date_parts.next(), date_parts.next()) {
        (Some(y), Some(m), Some(d), None) => (number(y, 4)?, number(m, 2)?, number(d, 2)?),
        _ => return Err(bad()),
    };
    let mut clock_parts = clock.split(':');
    let (hour, minute, second) = match (clock_parts.next(), clock_parts.next(), clock_parts.next(), clock_parts.next())
    {
        (Some(h), Some(m), None, None) => (number(h, 2)?, number(m, 2)?, 0),
        (Some(h), Some(m), Some(s), None) => (number(h, 2)?, number(m, 2)?, number(s, 2)?),
        _ => return Err(bad()),
    };
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => return Err(bad()),
    };
    if !(1..=days_in_month).contains(&day) || hour > 23 || minute > 59 || second > 59 {
        return Err(bad());
    }
    let days = days_from_civil(year, month as u32, day as u32);
    Ok(days * MS_PER_DAY + (hour * 3600 + minute * 60 + second) * 1000)
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
