//! Replays the fuzz corpus and the inputs that once crashed a target
//! (`tests/fuzz/corpus/<target>/`, `tests/fuzz/regressions/<target>/`)
//! through the targets' bodies ([`semlb::fuzzing`]) on every `cargo test`,
//! on the stable toolchain: a fixed crash stays fixed, and the properties
//! the targets check hold on every input fuzzing kept. `.ci/run` fuzzes
//! for new inputs with `cargo fuzz` on nightly.

use std::path::Path;

/// Counts allocations, for the targets that bound what their parser
/// allocates ([`semlb::fuzzing::peak_allocation`]).
#[global_allocator]
static ALLOCATOR: semlb::fuzzing::CountingAlloc = semlb::fuzzing::CountingAlloc;

/// Runs every file of the target's corpus and regressions through `body`;
/// panics naming the file that fails.
fn replay(target: &str, body: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        if let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) {
            files.extend(entries.map(|e| e.expect("a corpus entry").path()));
        }
    }
    files.sort();
    assert!(!files.is_empty(), "no corpus for {target}");
    for file in &files {
        let data = std::fs::read(file).expect("read a corpus file");
        if let Err(panic) = std::panic::catch_unwind(|| body(&data)) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!("{target}: {} fails: {message}", file.display());
        }
    }
    eprintln!("{target}: {} inputs", files.len());
}

#[test]
fn request() {
    replay("request", semlb::fuzzing::request);
}

#[test]
fn event_stream() {
    replay("event_stream", semlb::fuzzing::event_stream);
}

#[test]
fn config() {
    replay("config", semlb::fuzzing::config);
}

#[test]
fn segment_file() {
    replay("segment_file", semlb::fuzzing::segment_file);
    semlb::fuzzing::remove_shm_files("segment_file");
}

#[test]
fn segment_scan() {
    replay("segment_scan", semlb::fuzzing::segment_scan);
    semlb::fuzzing::remove_shm_files("segment_scan");
}

#[test]
fn completion() {
    replay("completion", semlb::fuzzing::completion);
}

#[test]
fn response_log() {
    replay("response_log", semlb::fuzzing::response_log);
    semlb::fuzzing::remove_shm_files("response_log");
}

#[test]
fn zmtp() {
    replay("zmtp", semlb::fuzzing::zmtp);
}

#[test]
fn kv_batch() {
    replay("kv_batch", semlb::fuzzing::kv_batch);
}

#[test]
fn prometheus() {
    replay("prometheus", semlb::fuzzing::prometheus);
}

#[test]
fn redis_reply() {
    replay("redis_reply", semlb::fuzzing::redis_reply);
}

#[test]
fn peer_summary() {
    replay("peer_summary", semlb::fuzzing::peer_summary);
}

#[test]
fn admin_body() {
    replay("admin_body", semlb::fuzzing::admin_body);
}

#[test]
fn key_headers() {
    replay("key_headers", semlb::fuzzing::key_headers);
}

#[test]
fn body_rewrite() {
    replay("body_rewrite", semlb::fuzzing::body_rewrite);
}

#[test]
fn usage_strip() {
    replay("usage_strip", semlb::fuzzing::usage_strip);
}
