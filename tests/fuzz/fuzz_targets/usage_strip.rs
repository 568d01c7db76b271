//! `cargo fuzz` target: [`semlb::fuzzing::usage_strip`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::usage_strip(data));
