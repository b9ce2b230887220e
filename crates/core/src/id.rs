//! Identifier validation: 1..=100 ASCII identifier characters (`A-Z a-z 0-9 _ - . :`).

use crate::error::{codes, Error, Result};
use crate::limits::ID_BYTES_MAX;

fn is_id_char(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.' | b':')
}

/// Validate the two consumer ids of a rename (or retirement): both valid, and different.
pub fn validate_rename(from: &str, to: &str) -> Result<()> {
    validate_id("from", from)?;
    validate_id("to", to)?;
    if from == to {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, "from and to are the same consumer id"));
    }
    Ok(())
}

/// Validate one identifier; `field` names it in the error ("flow_id", "consumer_id", ...).
pub fn validate_id(field: &str, value: &str) -> Result<()> {
    if value.is_empty() || value.len() > ID_BYTES_MAX {
        return Err(Error::invalid(
            codes::INVALID_ID,
            format!("{field} must be 1..={ID_BYTES_MAX} characters, got {}", value.len()),
        ));
    }
    if let Some(bad) = value.bytes().find(|b| !is_id_char(*b)) {
        return Err(Error::invalid(
            codes::INVALID_ID,
            format!("{field} may contain only ASCII letters, digits, '_', '-', '.', ':' (found byte 0x{bad:02x})"),
        ));
    }
    Ok(())
}

/// Validate a free-text operator reason.
pub fn validate_reason(value: &str) -> Result<()> {
    if value.trim().is_empty() || value.len() > crate::limits::REASON_BYTES_MAX {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!("reason must be 1..={} bytes of text", crate::limits::REASON_BYTES_MAX),
        ));
    }
    Ok(())
}

/// Validate a page size or batch limit against its maximum.
pub fn validate_limit(field: &str, value: usize, max: usize) -> Result<()> {
    if value == 0 || value > max {
        return Err(Error::invalid(codes::LIMIT_EXCEEDED, format!("{field} must be 1..={max}, got {value}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_identifier_characters_up_to_the_limit() {
        validate_id("flow_id", "order-1.a:B_2").unwrap();
        validate_id("flow_id", &"a".repeat(ID_BYTES_MAX)).unwrap();
    }

    #[test]
    fn rejects_empty_long_and_non_ascii() {
        for bad in ["", "has space", "é", "a/b", "x\n"] {
            assert_eq!(validate_id("flow_id", bad).unwrap_err().code(), codes::INVALID_ID, "{bad:?}");
        }
        let long = "a".repeat(ID_BYTES_MAX + 1);
        assert_eq!(validate_id("flow_id", &long).unwrap_err().code(), codes::INVALID_ID);
    }
}
