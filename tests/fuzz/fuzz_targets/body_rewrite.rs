//! `cargo fuzz` target: [`semlb::fuzzing::body_rewrite`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::body_rewrite(data));
