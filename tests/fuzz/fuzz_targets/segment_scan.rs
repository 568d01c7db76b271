//! `cargo fuzz` target: [`semlb::fuzzing::segment_scan`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::segment_scan(data));
