//! Fuzz target `config`: see `tidemark_server::fuzz::config` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_server::fuzz::config(data));
