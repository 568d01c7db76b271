//! scratch profile of the segment cache on a multi-turn replay
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
fn main() {
    let text = std::fs::read_to_string("/work/shared/data/prompts/hh-rlhf-helpful-base-test.jsonl").unwrap();
    let tmpl = ChatTemplate::from_tokenizer_config(std::path::Path::new(
        "/work/shared/data/tokenizers/qwen3-tokenizer_config.json",
    ))
    .unwrap();
    let tok = Tokenizer::from_file(std::path::Path::new(
        "/work/shared/data/tokenizers/qwen3-tokenizer.json",
    ))
    .unwrap();
    let mut prompts = Vec::new();
    for l in text.lines().take(600) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let c = v["chosen"].as_str().unwrap();
        let mut msgs: Vec<ChatMessage> = Vec::new();
        for part in c.split("\n\nHuman: ").skip(1) {
            let mut p = part.splitn(2, "\n\nAssistant: ");
            msgs.push(ChatMessage::new("user", p.next().unwrap().to_owned()));
            prompts.push(tmpl.render(&msgs).unwrap());
            if let Some(a) = p.next() {
                msgs.push(ChatMessage::new("assistant", a.to_owned()));
            }
        }
    }
    let mode = std::env::args().nth(1).unwrap_or_default();
    let t = if mode == "cached" {
        tok.with_segment_cache(32 << 20)
    } else {
        tok.with_segment_cache(0)
    };
    let start = std::time::Instant::now();
    for _ in 0..20 {
        let t = t
            .clone()
            .with_segment_cache(if mode == "cached" { 32 << 20 } else { 0 });
        for p in &prompts {
            std::hint::black_box(t.encode(p));
        }
    }
    println!(
        "{mode}: {:?} per request",
        start.elapsed() / (20 * prompts.len() as u32)
    );
}
