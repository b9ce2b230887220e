//! The rules every backend keeps for the user's own schema migrations (their business tables,
//! projections): named, appended only, each applied once and recorded with its position. The
//! stores run them (`tidemark_store_sqlite::apply_migrations`,
//! `tidemark_store_postgres::apply_migrations`); these are the checks they share.

use crate::error::codes;
use crate::id::validate_id;
use crate::{Error, Result};

/// The code of a database that records a migration this build does not list.
pub const UNKNOWN_MIGRATION: &str = "unknown_migration";

/// Check a list of migration names before it runs anywhere: identifiers, each listed once.
pub fn validate_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for name in names {
        validate_id("migration", name)?;
        if !seen.insert(name) {
            return Err(Error::invalid(codes::ALREADY_EXISTS, format!("migration {name:?} is listed twice")));
        }
    }
    Ok(())
}

/// Check what a database records (`(position, name)`, by position) against the names the code
/// lists: every recorded migration must be listed at its position (migrations are only ever
/// appended), else `unknown_migration` and nothing may run.
pub fn check_recorded(recorded: &[(i64, String)], listed: &[&str]) -> Result<()> {
    for (at, name) in recorded {
        let listed_there = usize::try_from(*at).ok().and_then(|i| listed.get(i));
        if listed_there != Some(&name.as_str()) {
            return Err(Error::invalid(
                UNKNOWN_MIGRATION,
                format!(
                    "this database records user migration {name:?} at position {at}, which this build does not list \
                     there; migrations are only ever appended"
                ),
            ));
        }
    }
    Ok(())
}
