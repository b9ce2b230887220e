//! `tidemark serve`, `tidemark config check` and `tidemark token create|list|revoke`.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tidemark_core::tenancy::ControlStore;
use tidemark_core::tenancy::{Scope, TokenText};
use tidemark_core::{Error, Result};
use tidemark_server::{Config, Overrides, CONTROL_FILE};
use tidemark_store_sqlite::SqliteControl;

use crate::Context;

#[derive(Args)]
pub struct ServeArgs {
    /// A TOML configuration file (see docs/operations.md); `TIDEMARK_*` variables override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The data folder (created on first start, never reset). Overrides `data_dir`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:7400 (port 0 picks a free one). Overrides `listen`.
    #[arg(long)]
    listen: Option<String>,
    /// Where tenants' data lives: a `postgres://user@host/db?schema=<prefix>` URL (every process
    /// given the same URL serves the same tenants); absent: SQLite files in the data folder.
    /// Overrides `store`.
    #[arg(long)]
    store: Option<String>,
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Validate a configuration file (with the environment applied) and print the result.
    Check {
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Create a token bound to a tenant (created if new) and a scope. The token is printed once;
    /// only its hash is stored.
    Create {
        #[command(flatten)]
        control: ControlArgs,
        #[arg(long)]
        tenant: String,
        /// read, operate or admin.
        #[arg(long)]
        scope: String,
        #[arg(long, default_value = "")]
        label: String,
    },
    /// List tokens (never their secrets).
    List {
        #[command(flatten)]
        control: ControlArgs,
    },
    /// Revoke a token by id; a running server refuses it from its next request.
    Revoke {
        #[command(flatten)]
        control: ControlArgs,
        #[arg(long)]
        token_id: String,
    },
}

/// Where a token command finds the service's control store: its data folder (SQLite), or the
/// PostgreSQL URL the service was started with (`--store`).
#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct ControlArgs {
    /// The service's data folder (its `server.db`).
    #[arg(long)]
    data: Option<PathBuf>,
    /// The service's PostgreSQL store (`postgres://user@host/db?schema=<prefix>`, as given to
    /// `serve --store`).
    #[arg(long)]
    store: Option<String>,
}

fn durability_word(ctx: &Context) -> String {
    match ctx.durability {
        tidemark_store_sqlite::Durability::Full => "full".into(),
        tidemark_store_sqlite::Durability::Normal => "normal".into(),
    }
}

pub fn serve(ctx: &Context, args: ServeArgs) -> Result<Value> {
    let normal = ctx.durability == tidemark_store_sqlite::Durability::Normal;
    let overrides = Overrides {
        data_dir: args.data,
        listen: args.listen,
        // Only an explicit `--durability normal` overrides the file.
        durability: normal.then(|| durability_word(ctx)),
        store: args.store,
    };
    let config = Config::load(args.config.as_deref(), &overrides)?;
    tidemark_builtins::serve(config)?.serve_blocking()
}

pub fn config(command: ConfigCommand) -> Result<Value> {
    match command {
        ConfigCommand::Check { config } => {
            let loaded = Config::load(Some(&config), &Overrides::default())?;
            let mut loaded = serde_json::to_value(&loaded).map_err(|e| Error::Invariant(e.to_string()))?;
            // Tokens and AMQP credentials written in the file are secrets: shown masked (an
            // `env:NAME` is shown as is), and so are PostgreSQL endpoints' passwords (below).
            for secrets in ["/relay/tokens", "/relay/amqp_credentials"] {
                if let Some(values) = loaded.pointer_mut(secrets).and_then(Value::as_object_mut) {
                    for value in values.values_mut() {
                        if !value.as_str().is_some_and(|t| t.starts_with("env:")) {
                            *value = json!("***");
                        }
                    }
                }
            }
            if let Some(entries) = loaded.pointer_mut("/relay/postgres").and_then(Value::as_object_mut) {
                for entry in entries.values_mut() {
                    if entry["password"].as_str().is_some_and(|p| !p.starts_with("env:")) {
                        entry["password"] = json!("***");
                    }
                }
            }
            Ok(json!({"outcome": "valid", "file": config, "config": loaded}))
        }
    }
}

fn open_control(args: &ControlArgs, ctx: &Context, create: bool) -> Result<Box<dyn ControlStore>> {
    if let Some(store) = &args.store {
        let backend = tidemark_server::Postgres::from_url(store)?;
        return Ok(Box::new(tidemark_store_postgres::PgControl::open(
            backend.conn(),
            &backend.control_schema(),
            create,
        )?));
    }
    let data = args.data.as_deref().expect("clap requires --data or --store");
    if create {
        std::fs::create_dir_all(data)
            .map_err(|e| tidemark_core::Error::io(format!("cannot create {}: {e}", data.display())))?;
    }
    Ok(Box::new(SqliteControl::open(&data.join(CONTROL_FILE), create, ctx.durability)?))
}

pub fn token(ctx: &Context, command: TokenCommand) -> Result<Value> {
    match command {
        TokenCommand::Create { control, tenant, scope, label } => {
            // Validate before touching the folder.
            tidemark_core::tenancy::validate_tenant_id(&tenant)?;
            let scope = Scope::parse(&scope)?;
            tidemark_core::tenancy::validate_label(&label)?;
            let token = TokenText::from_random(rand::random(), rand::random());
            let mut control = open_control(&control, ctx, true)?;
            let record = control.create_token(&token, &tenant, scope, &label, ctx.now_ms())?;
            Ok(json!({"outcome": "created", "token": token.text(), "record": record}))
        }
        TokenCommand::List { control } => {
            let control = open_control(&control, ctx, false)?;
            Ok(json!({"outcome": "listed", "tokens": control.tokens()?}))
        }
        TokenCommand::Revoke { control, token_id } => {
            tidemark_core::id::validate_id("token_id", &token_id)?;
            let mut control = open_control(&control, ctx, false)?;
            Ok(json!({"outcome": "revoked", "record": control.revoke_token(&token_id, ctx.now_ms())?}))
        }
    }
}
