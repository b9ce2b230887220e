//! Fuzz target `endpoint`: see `tidemark_core::fuzz::endpoint` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzz::endpoint(data));
