//! `cargo fuzz` target: [`semlb::fuzzing::key_headers`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::key_headers(data));
