//! Native chat-template renderers against minijinja, byte for byte.
//!
//! For every template with a native renderer (sources in `tests/templates`,
//! Qwen3's in `shared/data`), the same conversations are rendered natively
//! and by minijinja ([`ChatTemplate::with_jinja_renderer`]); the prompts
//! must be equal, and where minijinja fails the native renderer must fail.
//! The conversations:
//!
//! * real: every prefix of an HH-RLHF dialogue that ends with a user turn,
//!   without and with a system message, and for one dialogue in four a copy
//!   whose assistant turns carry a `<think>` block (skipped, with a
//!   `SKIPPED` line, when `shared/data/prompts` is absent);
//! * edge cases: empty conversations and contents, system messages not
//!   first or repeated, `tool` runs, unknown roles, reasoning blocks in odd
//!   places, whitespace that `trim` strips or keeps, Unicode;
//! * generated: random role sequences and contents built from whitespace,
//!   markers and Unicode fragments, from a fixed seed.
//!
//! Qwen3's own template is read from `shared/data/tokenizers`; without it
//! that test is skipped, but the Qwen3 renderer is still compared through the
//! later revision of the template kept in `tests/templates`.

mod chat_support;
use chat_support as support;

use std::sync::OnceLock;

use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
use semlb_tokenizer::test_data;
use support::{Rng, Turn};

/// The system message added to the real dialogues.
const SYSTEM: &str = "You are a helpful assistant.";

/// Random conversations compared per template.
const GENERATED: usize = 3_000;

/// A conversation as owned turns.
type Conversation = Vec<Turn>;

fn turn(role: &str, content: &str) -> Turn {
    (role.to_owned(), content.to_owned())
}

/// [`read_real_conversations`], read once for all the tests.
fn real_conversations() -> &'static [Conversation] {
    static REAL: OnceLock<Vec<Conversation>> = OnceLock::new();
    REAL.get_or_init(read_real_conversations)
}

/// Every prefix of every HH-RLHF dialogue that ends with a user turn,
/// without and with a system message, plus reasoning variants.
fn read_real_conversations() -> Vec<Conversation> {
    let Some(dialogues) = support::hh_rlhf_dialogues() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (d, dialogue) in dialogues.iter().enumerate() {
        let with_reasoning: Conversation = dialogue
            .iter()
            .map(|(role, content)| match role.as_str() {
                "assistant" => (
                    role.clone(),
                    format!("<think>\nThe user asked; answer.\n</think>\n\n{content}"),
                ),
                _ => (role.clone(), content.clone()),
            })
            .collect();
        for (end, (role, _)) in dialogue.iter().enumerate() {
            if role != "user" {
                continue;
            }
            let prefix = &dialogue[..=end];
            out.push(prefix.to_vec());
            let mut with_system = vec![turn("system", SYSTEM)];
            with_system.extend_from_slice(prefix);
            out.push(with_system);
            if d % 4 == 0 {
                out.push(with_reasoning[..=end].to_vec());
            }
        }
    }
    out
}

/// Hand-written odd conversations.
fn edge_cases() -> Vec<Conversation> {
    let c = |turns: &[(&str, &str)]| turns.iter().map(|&(r, t)| turn(r, t)).collect::<Conversation>();
    let mut cases = vec![
        c(&[]),
        c(&[("system", "Only a system message.")]),
        c(&[("user", "")]),
        c(&[("system", ""), ("user", "")]),
        c(&[("assistant", "")]),
        c(&[("system", "S"), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")]),
        c(&[("user", "A"), ("system", "Late system"), ("user", "B")]),
        c(&[("system", "One"), ("system", "Two"), ("user", "Q")]),
        c(&[("tool", "first is a tool")]),
        c(&[("tool", "t1"), ("tool", "t2"), ("user", "Q")]),
        c(&[
            ("user", "Q"),
            ("assistant", "calling"),
            ("tool", "r1"),
            ("tool", "r2"),
            ("assistant", "done"),
        ]),
        c(&[("user", "Q"), ("tool", "r1"), ("user", "Q2"), ("tool", "r2")]),
        c(&[("user", "Q"), ("developer", "unknown role"), ("user", "Q2")]),
        c(&[("", "empty role"), ("user", "Q")]),
        c(&[("User", "capitalised"), ("ASSISTANT", "shout"), ("user", "Q")]),
        c(&[("system ", "trailing space in role"), ("user", "Q")]),
        // Qwen3: a user turn that is a tool response is not the last query.
        c(&[("user", "<tool_response>only tool output</tool_response>")]),
        c(&[
            ("user", "What is the weather?"),
            ("assistant", "<think>\nNeed a tool.\n</think>\n\nCalling."),
            ("user", "<tool_response>\nsunny\n</tool_response>"),
            ("assistant", "<think>reasoning two</think>It is sunny."),
        ]),
        c(&[("user", "<tool_response>x"), ("assistant", "<think>r</think>a")]),
        c(&[("user", "y</tool_response>"), ("assistant", "<think>r</think>a")]),
        // Reasoning blocks in odd places.
        c(&[("user", "Q"), ("assistant", "<think>\n\nonly reasoning\n\n</think>")]),
        c(&[("user", "Q"), ("assistant", "no opening</think>\n\nanswer")]),
        c(&[("user", "Q"), ("assistant", "<think>unclosed reasoning")]),
        c(&[
            ("user", "Q"),
            ("assistant", "a<think>b<think>\n\nc\n</think>d</think>\n\ne"),
        ]),
        c(&[
            ("user", "Q"),
            ("assistant", "<think>r</think>a"),
            ("user", "Q2"),
            ("assistant", "plain"),
        ]),
        c(&[
            ("user", "Q"),
            ("assistant", "<think>r</think>a"),
            ("assistant", "<think></think>b"),
        ]),
        c(&[("user", "Q"), ("assistant", "\n\n\nleading newlines")]),
        c(&[("user", "Q"), ("assistant", "<think>\n</think>\n")]),
        c(&[("user", "<think>in a user turn</think>keep")]),
        // Whitespace that trim strips, or does not.
        c(&[("user", " \n\t padded \n\t ")]),
        c(&[("user", "\u{a0}\u{3000}nbsp and ideographic\u{2028}\u{2029}")]),
        c(&[("user", "\u{1c}\u{1d}separators\u{1e}\u{1f}")]),
        c(&[("user", "\u{85}next line\u{85}")]),
        c(&[("user", "\u{200b}zero width\u{feff}")]),
        c(&[("user", "\r\nwindows\r\n")]),
        c(&[("user", "   ")]),
        // Unicode and template-looking text.
        c(&[("system", "Réponds en français 🙂"), ("user", "你好，世界！ Ωμέγα")]),
        c(&[("user", "{{ bos_token }}{% if true %}x{% endif %}{# c #}")]),
        c(&[("user", "<|im_start|>user\nnested<|im_end|><|eot_id|><|end|>")]),
        c(&[("user", "'quotes' \"double\" \\n backslash")]),
    ];
    cases.push(vec![turn("user", &"long content ".repeat(2_000))]);
    cases
}

/// Random conversations: role sequences and contents from pools of the
/// parts the templates react to.
fn generated_conversations(seed: u64, count: usize) -> Vec<Conversation> {
    const ROLES: [&str; 12] = [
        "user",
        "user",
        "user",
        "assistant",
        "assistant",
        "assistant",
        "system",
        "system",
        "tool",
        "tool",
        "developer",
        "",
    ];
    const PARTS: [&str; 28] = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        "\u{a0}",
        "\u{3000}",
        "\u{1c}",
        "\u{85}",
        "\u{200b}",
        "<think>",
        "</think>",
        "<tool_response>",
        "</tool_response>",
        "<|im_start|>",
        "<|im_end|>",
        "hello",
        "What is the capital of France?",
        "Paris.",
        "é",
        "你好",
        "🙂",
        "{{ x }}",
        "'",
        "\\",
        "Well,\nit depends.",
    ];
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|_| {
            let len = rng.below(10);
            (0..len)
                .map(|_| {
                    let role = *rng.pick(&ROLES);
                    let parts = rng.below(7);
                    let content: String = (0..parts).map(|_| *rng.pick(&PARTS)).collect();
                    turn(role, &content)
                })
                .collect()
        })
        .collect()
}

/// Which conversations a template fails on (in minijinja and natively).
type FailsOn = fn(&[Turn]) -> bool;

/// ChatML, Phi-3, and Llama-3 with a `bos_token` render anything.
fn never(_: &[Turn]) -> bool {
    false
}

/// Qwen's templates read `messages[0]`.
fn empty(conversation: &[Turn]) -> bool {
    conversation.is_empty()
}

/// Llama-3 without a `bos_token` fails on `bos_token + content`.
fn not_empty(conversation: &[Turn]) -> bool {
    !conversation.is_empty()
}

/// How many conversations were compared, and how many failed on both sides.
#[derive(Debug, Default)]
struct Tally {
    compared: usize,
    both_failed: usize,
}

/// Renders every conversation natively and with minijinja and asserts the
/// same prompt, or an error from both exactly where `fails_on` says.
fn compare(
    name: &str,
    native: &ChatTemplate,
    expected_renderer: &str,
    fails_on: FailsOn,
    corpus: &[Conversation],
) -> Tally {
    assert_eq!(
        native.renderer_name(),
        expected_renderer,
        "{name}: the template is not rendered natively"
    );
    let jinja = native.with_jinja_renderer();
    assert_eq!(jinja.renderer_name(), "jinja");
    let mut tally = Tally::default();
    for conversation in corpus {
        // Borrowed messages: the strings stay in the corpus.
        let messages: Vec<ChatMessage<'_>> = conversation
            .iter()
            .map(|(role, content)| ChatMessage::new(role.as_str(), content.as_str()))
            .collect();
        match (native.render(&messages), jinja.render(&messages)) {
            (Ok(native_prompt), Ok(jinja_prompt)) => {
                assert!(
                    native_prompt == jinja_prompt,
                    "{name}: native and Jinja differ for {conversation:?}\nnative: {native_prompt:?}\njinja:  {jinja_prompt:?}"
                );
                assert!(
                    !fails_on(conversation),
                    "{name}: expected a failure for {conversation:?}"
                );
            }
            (Err(_), Err(_)) => {
                assert!(fails_on(conversation), "{name}: both failed on {conversation:?}");
                tally.both_failed += 1;
            }
            (native_result, jinja_result) => {
                panic!("{name}: {conversation:?}\nnative: {native_result:?}\njinja: {jinja_result:?}")
            }
        }
        tally.compared += 1;
    }
    tally
}

/// The three corpora for one template, with a count printed per family.
fn compare_all(name: &str, native: &ChatTemplate, expected_renderer: &str, fails_on: FailsOn, seed: u64) {
    let real = real_conversations();
    let edge = edge_cases();
    let generated = generated_conversations(seed, GENERATED);
    let mut total = Tally::default();
    for corpus in [real, &edge, &generated] {
        let tally = compare(name, native, expected_renderer, fails_on, corpus);
        total.compared += tally.compared;
        total.both_failed += tally.both_failed;
    }
    println!(
        "{name}: {} conversations compared ({} real, {} edge cases, {} generated); {} failed on both sides",
        total.compared,
        real.len(),
        edge.len(),
        generated.len(),
        total.both_failed
    );
}

fn from_file(file: &str, bos: Option<&str>, eos: Option<&str>) -> ChatTemplate {
    ChatTemplate::from_source(&support::template_source(file), bos, eos).expect("the template compiles")
}

#[test]
fn chatml_native_matches_jinja() {
    let template = from_file("chatml.jinja", Some("<s>"), Some("<|im_end|>"));
    compare_all("chatml", &template, "native chatml", never, 1);
}

#[test]
fn llama3_native_matches_jinja() {
    for file in ["llama3.jinja", "llama3-original.jinja"] {
        let template = from_file(file, Some("<|begin_of_text|>"), Some("<|eot_id|>"));
        compare_all(file, &template, "native llama3", never, 2);
        // Without a bos_token `bos_token + content` fails, in both.
        let template = from_file(file, None, None);
        compare_all(
            &format!("{file} without bos_token"),
            &template,
            "native llama3",
            not_empty,
            3,
        );
    }
}

#[test]
fn phi3_native_matches_jinja() {
    for (file, renderer) in [
        ("phi3.jinja", "native phi3"),
        ("phi3-original.jinja", "native phi3-original"),
    ] {
        let template = from_file(file, Some("<s>"), Some("<|endoftext|>"));
        compare_all(file, &template, renderer, never, 4);
        // An undefined bos_token prints as nothing.
        let template = from_file(file, None, None);
        compare_all(&format!("{file} without special tokens"), &template, renderer, never, 5);
    }
}

#[test]
fn qwen2_5_native_matches_jinja() {
    let template = from_file("qwen2.5.jinja", None, Some("<|im_end|>"));
    compare_all("qwen2.5", &template, "native qwen2.5", empty, 6);
}

#[test]
fn qwen3_revision_native_matches_jinja() {
    let template = from_file("qwen3-ortx.jinja", None, Some("<|im_end|>"));
    compare_all("qwen3 (revision)", &template, "native qwen3", empty, 7);
}

#[test]
fn qwen3_native_matches_jinja() {
    let Some(path) = test_data::tokenizer_file("qwen3-tokenizer_config.json") else {
        return;
    };
    let template = ChatTemplate::from_tokenizer_config(&path).expect("Qwen3 chat template loads");
    compare_all("qwen3", &template, "native qwen3", empty, 8);
}

/// The source of Qwen3's template in the shared tokenizer config.
fn qwen3_source() -> Option<String> {
    let path = test_data::tokenizer_file("qwen3-tokenizer_config.json")?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reads")).expect("is JSON");
    Some(
        config["chat_template"]
            .as_str()
            .expect("has a chat_template")
            .to_owned(),
    )
}

/// Every byte matters: a known source edited anywhere, by one character,
/// or with whitespace added, is rendered by minijinja.
#[test]
fn edited_sources_are_rendered_by_jinja() {
    let mut sources: Vec<(String, String)> = [
        ("chatml.jinja", "native chatml"),
        ("llama3.jinja", "native llama3"),
        ("llama3-original.jinja", "native llama3"),
        ("phi3.jinja", "native phi3"),
        ("phi3-original.jinja", "native phi3-original"),
        ("qwen2.5.jinja", "native qwen2.5"),
        ("qwen3-ortx.jinja", "native qwen3"),
    ]
    .into_iter()
    .map(|(file, renderer)| (support::template_source(file), renderer.to_owned()))
    .collect();
    if let Some(source) = qwen3_source() {
        sources.push((source, "native qwen3".to_owned()));
    }
    let mut rng = Rng::new(9);
    for (source, renderer) in &sources {
        let named = |src: &str| ChatTemplate::from_source(src, Some("<s>"), None).map(|t| t.renderer_name());
        assert_eq!(named(source).unwrap(), renderer);
        let mut edits = vec![
            format!("{source}\n"),
            format!(" {source}"),
            source.replacen(' ', "  ", 1),
        ];
        for _ in 0..20 {
            // Change one ASCII character (the sources are ASCII where it matters).
            let at = rng.below(source.len());
            if !source.is_char_boundary(at) || !source.is_char_boundary(at + 1) {
                continue;
            }
            let old = source.as_bytes()[at];
            let new = if old == b'x' { 'y' } else { 'x' };
            edits.push(format!("{}{new}{}", &source[..at], &source[at + 1..]));
        }
        for edited in &edits {
            // An edit may break the template; one that compiles is Jinja's.
            if let Ok(name) = named(edited) {
                assert_eq!(name, "jinja", "an edited {renderer} source is still recognised");
            }
        }
    }
}
