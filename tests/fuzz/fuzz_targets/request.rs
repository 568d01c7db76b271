//! `cargo fuzz` target: [`semlb::fuzzing::request`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::request(data));
