//! `cargo fuzz` target: [`semlb::fuzzing::completion`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::completion(data));
