//! `cargo fuzz` target: [`semlb::fuzzing::config`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::config(data));
