//! Policies: relay retries with exponential backoff and jitter, and consumer retention.

use serde::{Deserialize, Serialize};

use crate::error::{codes, Error, Result};
use crate::limits::{RELAY_ATTEMPTS_MAX, RELAY_BACKOFF_MS_MAX};

/// How the relay retries a delivery that failed (conflict, expired, consumer unreachable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayPolicy {
    /// After this many failed attempts the delivery is quarantined (never acked).
    pub max_attempts: u32,
    /// Delay before the second attempt; doubles per attempt.
    pub backoff_base_ms: i64,
    /// Upper bound of one delay.
    pub backoff_max_ms: i64,
}

impl Default for RelayPolicy {
    fn default() -> Self {
        RelayPolicy { max_attempts: 8, backoff_base_ms: 200, backoff_max_ms: 60_000 }
    }
}

impl RelayPolicy {
    /// Check the policy's bounds: `max_attempts` 1..=1,000 and both backoffs 0..=24 h
    /// (`invalid_argument` otherwise).
    pub fn validate(&self) -> Result<()> {
        if self.max_attempts == 0 || self.max_attempts > RELAY_ATTEMPTS_MAX {
            return Err(Error::invalid(
                codes::INVALID_ARGUMENT,
                format!("max_attempts must be 1..={RELAY_ATTEMPTS_MAX}"),
            ));
        }
        for (name, value) in [("backoff_base_ms", self.backoff_base_ms), ("backoff_max_ms", self.backoff_max_ms)] {
            if !(0..=RELAY_BACKOFF_MS_MAX).contains(&value) {
                return Err(Error::invalid(
                    codes::INVALID_ARGUMENT,
                    format!("{name} must be 0..={RELAY_BACKOFF_MS_MAX}"),
                ));
            }
        }
        Ok(())
    }

    /// Delay after the `failed_attempts`-th failure (1-based): exponential, capped, with "equal
    /// jitter" (half fixed, half uniform random) so that failing events do not retry in lockstep.
    /// `unit` is a uniform random number in [0, 1).
    pub fn backoff_ms(&self, failed_attempts: u32, unit: f64) -> i64 {
        let exponent = failed_attempts.saturating_sub(1).min(40);
        let ceiling = self.backoff_base_ms.saturating_mul(1_i64 << exponent).min(self.backoff_max_ms);
        let half = ceiling / 2;
        half + ((ceiling - half) as f64 * unit.clamp(0.0, 1.0)) as i64
    }
}

/// How long a consumer keeps what. See `docs/protocol.md#retention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionPolicy {
    /// Events created longer ago than this are rejected as `expired`, and receipts older than
    /// this are deleted. Must exceed the longest redelivery delay (backlog, restore, replay).
    pub horizon_ms: i64,
}

/// One day in milliseconds.
pub const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// Whether a retention walk stops at a row stamped `stamp_ms`. `prune` reads rows in the order
/// they were written (the outbox by position, the inbox by record) and stops at the first one
/// too young to go, stamped at or after `young_from_ms`: rows written after it are younger,
/// unless the clock stepped back (then they wait for it). A row stamped later than `now_ms` (a
/// clock that ran ahead) does not stop the walk, so it cannot hold retention up until that time
/// comes; the walk passes over it. See `docs/protocol.md#retention`.
pub fn retention_walk_stops_at(stamp_ms: i64, young_from_ms: i64, now_ms: i64) -> bool {
    (young_from_ms..=now_ms).contains(&stamp_ms)
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { horizon_ms: 30 * DAY_MS }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retention_walk_stops_at_the_first_young_row_but_not_at_one_stamped_ahead_of_now() {
        assert!(!retention_walk_stops_at(999, 1_000, 2_000), "old: taken or passed over");
        assert!(retention_walk_stops_at(1_000, 1_000, 2_000));
        assert!(retention_walk_stops_at(2_000, 1_000, 2_000));
        assert!(!retention_walk_stops_at(2_001, 1_000, 2_000), "stamped ahead of now: passed over");
    }

    #[test]
    fn backoff_doubles_is_capped_and_jittered() {
        let p = RelayPolicy { max_attempts: 10, backoff_base_ms: 100, backoff_max_ms: 1_000 };
        assert_eq!(p.backoff_ms(1, 0.0), 50);
        assert_eq!(p.backoff_ms(1, 1.0), 100);
        assert_eq!(p.backoff_ms(3, 1.0), 400);
        assert_eq!(p.backoff_ms(30, 1.0), 1_000);
        assert!((500..=1_000).contains(&p.backoff_ms(30, 0.5)));
    }
}
