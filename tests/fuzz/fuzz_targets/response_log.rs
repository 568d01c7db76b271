//! `cargo fuzz` target: [`semlb::fuzzing::response_log`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::response_log(data));
