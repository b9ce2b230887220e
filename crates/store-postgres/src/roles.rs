//! A role per tenant (docs/postgres.md, "Tenants"): a `NOLOGIN` role that owns a tenant's
//! schemas and everything in them, which the service's connections for that tenant take on at
//! connect (`options=-c role=...`). A statement of tenant A, whatever schema it names, runs with
//! A's privileges only: B's schemas and the control schema answer "permission denied". The
//! connecting (login) role creates the roles, is a member of each (so it can take them on and
//! reads every tenant, as operators and the metrics do), and needs `CREATEROLE` (or to be a
//! superuser).

use postgres::GenericClient;
use tidemark_core::error::codes;
use tidemark_core::{Error, Result};

use crate::schema::{connect, validate_schema_name, LOCK_ROLES};
use crate::{col, PgResult};

/// Make `role` (created `NOLOGIN` when missing, the connecting role made a member of it) the
/// owner of each of `schemas`: a missing schema is created owned by it; a schema owned by
/// another role (made before tenant roles, or by hand) is handed over with its tables, views,
/// sequences, routines and types. Idempotent; serialised across processes by an advisory lock;
/// one transaction. A role name that is not a strict lower-case identifier is
/// `invalid_argument`; a connecting role that may not create roles is a `store` error saying so.
pub fn ensure_owner_role(conn: &str, role: &str, schemas: &[String]) -> Result<()> {
    validate_schema_name(role)
        .map_err(|_| Error::invalid(codes::INVALID_ARGUMENT, format!("not a role name tidemark makes: {role:?}")))?;
    for schema in schemas {
        validate_schema_name(schema)?;
    }
    let mut client = connect(conn)?;
    let mut tx = client.transaction().db()?;
    tx.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", &[&LOCK_ROLES, &role]).db()?;
    let exists: bool =
        col(&tx.query_one("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)", &[&role]).db()?, 0)?;
    if !exists {
        tx.batch_execute(&format!("CREATE ROLE \"{role}\" NOLOGIN")).map_err(|e| {
            Error::store(format!(
                "cannot create the tenant role {role} (the service's PostgreSQL role needs CREATEROLE): {e}"
            ))
        })?;
    }
    let member: bool = col(&tx.query_one("SELECT pg_has_role(current_user, $1, 'MEMBER')", &[&role]).db()?, 0)?;
    if !member {
        tx.batch_execute(&format!("GRANT \"{role}\" TO CURRENT_USER")).db()?;
    }
    for schema in schemas {
        let owner: Option<String> = col(
            &tx.query_one("SELECT (SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = $1)", &[schema])
                .db()?,
            0,
        )?;
        match owner {
            None => tx.batch_execute(&format!("CREATE SCHEMA \"{schema}\" AUTHORIZATION \"{role}\"")).db()?,
            Some(owner) if owner.trim_matches('"') == role => {}
            Some(_) => hand_over(&mut tx, schema, role)?,
        }
    }
    tx.commit().db()
}

/// `ALTER ... OWNER TO role` for `schema` and every object in it that another role owns.
fn hand_over(tx: &mut impl GenericClient, schema: &str, role: &str) -> Result<()> {
    let mut statements = vec![format!("ALTER SCHEMA \"{schema}\" OWNER TO \"{role}\"")];
    // Relations; a sequence that belongs to a column follows its table.
    let relations = tx
        .query(
            "SELECT c.oid::regclass::text, c.relkind::text FROM pg_class c
              WHERE c.relnamespace = to_regnamespace($1) AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
                AND c.relowner <> to_regrole($2)
                AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d
                          WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype IN ('a', 'i')))
              ORDER BY 1",
            &[&schema, &role],
        )
        .db()?;
    for row in &relations {
        let (name, kind): (String, String) = (col(row, 0)?, col(row, 1)?);
        let what = match kind.as_str() {
            "v" => "VIEW",
            "m" => "MATERIALIZED VIEW",
            "S" => "SEQUENCE",
            "f" => "FOREIGN TABLE",
            _ => "TABLE",
        };
        statements.push(format!("ALTER {what} {name} OWNER TO \"{role}\""));
    }
    let routines = tx
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p
              WHERE p.pronamespace = to_regnamespace($1) AND p.proowner <> to_regrole($2) ORDER BY 1",
            &[&schema, &role],
        )
        .db()?;
    for row in &routines {
        let name: String = col(row, 0)?;
        statements.push(format!("ALTER ROUTINE {name} OWNER TO \"{role}\""));
    }
    // Types of their own (enums, domains, ranges, standalone composites); a table's row type
    // follows its table.
    let types = tx
        .query(
            "SELECT t.oid::regtype::text FROM pg_type t
              WHERE t.typnamespace = to_regnamespace($1) AND t.typowner <> to_regrole($2)
                AND (t.typtype IN ('e', 'd', 'r')
                     OR (t.typtype = 'c' AND (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c'))
              ORDER BY 1",
            &[&schema, &role],
        )
        .db()?;
    for row in &types {
        let name: String = col(row, 0)?;
        statements.push(format!("ALTER TYPE {name} OWNER TO \"{role}\""));
    }
    for statement in statements {
        tx.batch_execute(&statement).db()?;
    }
    Ok(())
}

/// `conn` (a `postgres://` URL) with `-c role=<role>` added to its `options`: a connection made
/// with it acts as `role` from its first statement.
pub fn conn_as_role(conn: &str, role: &str) -> Result<String> {
    validate_schema_name(role)?;
    let mut url = url::Url::parse(conn)
        .map_err(|e| Error::invalid(codes::INVALID_ARGUMENT, format!("not a PostgreSQL URL: {e}")))?;
    let mut pairs: Vec<(String, String)> = url.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    let set = format!("-c role={role}");
    match pairs.iter_mut().find(|(k, _)| k == "options") {
        Some((_, options)) => *options = format!("{options} {set}"),
        None => pairs.push(("options".into(), set)),
    }
    crate::tls::set_query(&mut url, &pairs);
    Ok(url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_role_joins_the_url_s_options_with_spaces_the_driver_reads() {
        let conn = conn_as_role("postgres://u@h:5432/db", "svc_alpha_0123").unwrap();
        assert_eq!(conn, "postgres://u@h:5432/db?options=-c%20role%3Dsvc_alpha_0123");
        let conn =
            conn_as_role("postgres://u@h/db?options=-c%20statement_timeout%3D5s&connect_timeout=3", "r").unwrap();
        assert_eq!(conn, "postgres://u@h/db?options=-c%20statement_timeout%3D5s%20-c%20role%3Dr&connect_timeout=3");
        let config: postgres::Config = conn.parse().unwrap();
        assert_eq!(config.get_options(), Some("-c statement_timeout=5s -c role=r"));
        assert!(conn_as_role("postgres://u@h/db", "Bad-Role").is_err());
    }
}
