//! `cargo fuzz` target: [`semlb::fuzzing::prometheus`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::prometheus(data));
