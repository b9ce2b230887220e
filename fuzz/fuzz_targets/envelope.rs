//! Fuzz target `envelope`: see `tidemark_core::fuzz::envelope` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tidemark_core::fuzz::envelope(data));
