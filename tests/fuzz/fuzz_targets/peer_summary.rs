//! `cargo fuzz` target: [`semlb::fuzzing::peer_summary`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::peer_summary(data));
