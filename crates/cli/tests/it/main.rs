//! tidemark's integration tests: one test binary, one module per concern. They run the real
//! `tidemark` binary on real SQLite files; crash tests need the `failpoints` feature
//! (`cargo test --workspace --all-features`) and say so when it is missing.

mod pg_cluster;
mod pg_tls;
mod server_fixture;
mod server_support;
mod support;

mod arrival_orders;
mod bench_postgres;
mod chaos;
mod cli_contract;
mod concurrency;
mod crash;
mod experiment;
mod flow_order;
mod io_faults;
mod model_check;
mod outbox_transaction;
mod pg_workers;
mod server_api;
mod server_cli;
mod server_dashboard;
mod server_hostile;
mod server_load;
mod server_openapi;
mod server_remote;
mod server_tenancy;
mod workflow_cli;
mod workflow_features;
mod workflow_inbox;
mod workflow_long_lived;
mod workflow_model;
mod workflow_runtime;
mod workflow_store;
