//! Fuzz target `canonical`: see `tidemark_core::fuzz::canonical` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzz::canonical(data));
