//! `cargo fuzz` target: [`semlb::fuzzing::admin_body`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::admin_body(data));
