//! What an engine says about itself once: llama.cpp's `GET /props`.
//!
//! `llama-server` runs at most `--parallel` requests at once, one per
//! *slot*, and defers the rest until a slot frees. Its `/props` answer
//! says how many slots it has (`total_slots`), always, with or without
//! `--metrics`:
//!
//! ```json
//! {"default_generation_settings": {…, "n_ctx": 4096}, "total_slots": 2,
//!  "model_path": "…", "build_info": "b11434-b11434", …}
//! ```
//!
//! That number is exact where the learned admission limit
//! ([`crate::capacity`]) is an estimate, so the health checker reads it
//! once per registration (again after the engine restarted) and stores it
//! in the server table ([`shm_layout::ServerTable::set_engine_slots`]).
//! Other engines answer `/props` with a 404 (vLLM, SGLang) or with
//! something that is not this JSON: they have no slots to report.

/// The most slots believed: llama.cpp's own bound on `--parallel` is far
/// lower; anything above is not a slot count.
pub const MAX_SLOTS: u32 = 4096;

/// The slot count in a `/props` answer's body: `total_slots`, if it is an
/// integer in `1..=MAX_SLOTS`.
pub fn total_slots(body: &[u8]) -> Option<u32> {
    #[derive(serde::Deserialize)]
    struct Props {
        total_slots: u64,
    }
    let props: Props = serde_json::from_slice(body).ok()?;
    u32::try_from(props.total_slots)
        .ok()
        .filter(|n| (1..=MAX_SLOTS).contains(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_total_slots_of_a_real_answer_and_nothing_else() {
        // Trimmed from a b11434 `llama-server -np 2` answer.
        let real = br#"{"default_generation_settings":{"n_ctx":4096,"params":{"seed":4294967295}},"total_slots":2,"model_alias":"m.gguf","model_path":"m.gguf","modalities":{"vision":false},"endpoint_slots":true,"endpoint_props":false,"endpoint_metrics":true,"build_info":"b11434-b11434","is_sleeping":false}"#;
        assert_eq!(total_slots(real), Some(2));
        for not_slots in [
            &br#"{"total_slots":0}"#[..],
            br#"{"total_slots":-1}"#,
            br#"{"total_slots":2.5}"#,
            br#"{"total_slots":"2"}"#,
            br#"{"total_slots":4097}"#,
            br#"{"model_path":"m.gguf"}"#,
            br#"{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}"#,
            b"<html>not found</html>",
            b"",
        ] {
            assert_eq!(total_slots(not_slots), None, "{}", String::from_utf8_lossy(not_slots));
        }
        assert_eq!(total_slots(br#"{"total_slots":4096}"#), Some(4096));
    }
}
