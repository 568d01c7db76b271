//! `cargo fuzz` target: [`semlb::fuzzing::event_stream`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::event_stream(data));
