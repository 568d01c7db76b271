//! Tools, tool calls and tool results rendered by minijinja exactly as
//! Python's jinja2 renders them in `transformers`' environment, given what
//! vLLM gives a template (`tests/tools/render.py` says how).
//!
//! `tests/tools/cases.json` holds the conversations (an agent's first
//! turn, a tool call and its result, two calls in one turn with Unicode,
//! floats and nested arguments, no system message, tool calls without
//! tools, reasoning, a tool with no description) and the templates
//! (Qwen2.5, Llama 3.1, Hermes 3's `tool_use`, and Qwen3's from
//! `shared/data` when it is there); `tests/tools/expected.json` what
//! jinja2 3.1 rendered for each, or that it failed. CI runs `render.py
//! --check` against the same file, so the file is what jinja2 renders
//! today, and this test holds minijinja to it byte for byte.

use std::borrow::Cow;
use std::path::Path;

use semlb_tokenizer::chat::{ChatMessage, ChatTemplate, RenderInputs, TemplateValue};
use semlb_tokenizer::test_data;

fn read(path: &str) -> TemplateValue<'static> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    TemplateValue::parse(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn items(v: &TemplateValue<'static>) -> Vec<TemplateValue<'static>> {
    match v {
        TemplateValue::Array(items) => items.clone(),
        other => panic!("not a list: {other:?}"),
    }
}

/// A message of the cases file as the gateway hands it to the renderer:
/// role and content, every other field as it is.
fn message(v: &TemplateValue<'static>) -> ChatMessage<'static> {
    let TemplateValue::Object(pairs) = v else {
        panic!("not a message: {v:?}")
    };
    let mut m = ChatMessage::new(
        v.get("role").and_then(TemplateValue::as_str).unwrap().to_owned(),
        v.get("content").and_then(TemplateValue::as_str).unwrap().to_owned(),
    );
    for (k, field) in pairs.iter().filter(|(k, _)| k != "role" && k != "content") {
        m = m.with(k.clone(), field.clone());
    }
    m
}

fn template(entry: &TemplateValue<'static>) -> Option<(String, ChatTemplate)> {
    if let Some(file) = entry.get("file").and_then(TemplateValue::as_str) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
        let source = std::fs::read_to_string(dir.join(file)).unwrap();
        let token = |name| entry.get(name).and_then(TemplateValue::as_str);
        let t = ChatTemplate::from_source(&source, token("bos_token"), token("eos_token")).unwrap();
        return Some((file.to_owned(), t));
    }
    let name = entry.get("shared").and_then(TemplateValue::as_str).unwrap();
    let path = test_data::tokenizer_file(name)?;
    Some((name.to_owned(), ChatTemplate::from_tokenizer_config(&path).unwrap()))
}

#[test]
fn tool_conversations_render_as_jinja2_renders_them() {
    let spec = read("tests/tools/cases.json");
    let expected = items(&read("tests/tools/expected.json"));
    let mut compared = 0;
    for entry in items(spec.get("templates").unwrap()) {
        let Some((name, template)) = template(&entry) else {
            continue;
        };
        assert_eq!(template.renderer_name().starts_with("native"), name.starts_with("qwen"));
        for case in items(spec.get("cases").unwrap()) {
            let case_name = case
                .get("case")
                .or(case.get("name"))
                .and_then(TemplateValue::as_str)
                .unwrap();
            let Some(want) = expected.iter().find(|e| {
                e.get("template").and_then(TemplateValue::as_str) == Some(&name)
                    && e.get("case").and_then(TemplateValue::as_str) == Some(case_name)
            }) else {
                // jinja2 did not render it for this template (qwen_only).
                continue;
            };
            let messages: Vec<ChatMessage<'static>> =
                items(case.get("messages").unwrap()).iter().map(message).collect();
            let tools = case
                .get("tools")
                .and_then(TemplateValue::as_str)
                .map(|set| items(spec.get("tool_sets").unwrap().get(set).unwrap()));
            let inputs = RenderInputs {
                tools: tools.as_deref(),
                variables: Vec::<(Cow<'static, str>, TemplateValue<'static>)>::new(),
            };
            let mut got = String::new();
            let rendered = template.render_with(&messages, &inputs, &mut got);
            match want.get("text").and_then(TemplateValue::as_str) {
                Some(text) => {
                    assert!(rendered.is_ok(), "{name} / {case_name}: {rendered:?}");
                    assert_eq!(got, text, "{name} / {case_name}");
                }
                None => assert!(
                    rendered.is_err(),
                    "{name} / {case_name}: jinja2 failed, minijinja rendered {got:?}"
                ),
            }
            compared += 1;
        }
    }
    assert!(compared >= 20, "{compared} renderings compared");
}

/// An agent's turn N+1 begins with its turn N's prompt: tools, the tool
/// call and its result appended after the generation prompt, so the
/// engine's cached blocks of turn N match.
#[test]
fn an_agents_next_turn_extends_its_previous_prompt() {
    let spec = read("tests/tools/cases.json");
    let case = items(spec.get("cases").unwrap())
        .into_iter()
        .find(|c| c.get("name").and_then(TemplateValue::as_str) == Some("tool call and result"))
        .unwrap();
    let messages: Vec<ChatMessage<'static>> = items(case.get("messages").unwrap()).iter().map(message).collect();
    let tools = items(spec.get("tool_sets").unwrap().get("main").unwrap());
    let inputs = RenderInputs {
        tools: Some(&tools),
        variables: Vec::new(),
    };
    let mut templates = vec![("canonical".to_owned(), ChatTemplate::canonical())];
    templates.extend(items(spec.get("templates").unwrap()).iter().filter_map(template));
    for (name, t) in templates {
        let mut turn1 = String::new();
        t.render_with(&messages[..2], &inputs, &mut turn1).unwrap();
        let mut turn2 = String::new();
        t.render_with(&messages, &inputs, &mut turn2).unwrap();
        // Qwen3 and Qwen2.5 end turn 1 with the generation prompt, which
        // turn 2 repeats as the assistant turn's opening.
        assert!(turn2.starts_with(&turn1), "{name}:\n{turn1}\n---\n{turn2}");
    }
}
