//! Fuzz target `bodies`: see `tidemark_server::fuzz::bodies` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_server::fuzz::bodies(data));
