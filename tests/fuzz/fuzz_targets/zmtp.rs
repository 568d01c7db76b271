//! `cargo fuzz` target: [`semlb::fuzzing::zmtp`], which bounds what its
//! parser allocates, so it counts allocations.
#![no_main]

#[global_allocator]
static ALLOCATOR: semlb::fuzzing::CountingAlloc = semlb::fuzzing::CountingAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| semlb::fuzzing::zmtp(data));
