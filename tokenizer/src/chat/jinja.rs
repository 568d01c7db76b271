//! A Jinja chat template rendered with minijinja, set up the way
//! `transformers` renders chat templates: `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`strip`, `split`,
//! `startswith`, …, through `minijinja_contrib::pycompat`) and a
//! `raise_exception(message)` function that fails the rendering.
//!
//! The template is given `messages` (a list of `{role, content}`),
//! `add_generation_prompt = true`, and `bos_token` / `eos_token` when the
//! tokenizer config defines them (an undefined token prints as nothing and
//! fails in `+`, as in Python Jinja).

use std::collections::BTreeMap;

use super::{ChatMessage, SpecialTokens, TemplateError};

/// Name of the one template in a compiled environment.
const TEMPLATE_NAME: &str = "chat_template";

/// What a message looks like to a Jinja template.
#[derive(serde::Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: &'a str,
}

/// A compiled Jinja chat template and the special tokens it is given.
#[derive(Debug)]
pub(super) struct JinjaTemplate {
    env: minijinja::Environment<'static>,
    special: SpecialTokens,
}

impl JinjaTemplate {
    /// Compiles `source` in an environment set up like `transformers`'.
    /// The error says why the template does not compile.
    pub(super) fn compile(source: String, special: SpecialTokens) -> Result<Self, String> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| format!("the template does not compile: {e:#}"))?;
        Ok(Self { env, special })
    }

    /// The special tokens the template is given.
    pub(super) fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// Renders `messages` with the generation prompt, plus one `extra`
    /// variable (such as `enable_thinking`) if given.
    pub(super) fn render(
        &self,
        messages: &[ChatMessage<'_>],
        extra: Option<(&str, minijinja::Value)>,
    ) -> Result<String, TemplateError> {
        let messages: Vec<TemplateMessage<'_>> = messages
            .iter()
            .map(|m| TemplateMessage {
                role: &m.role,
                content: &m.content,
            })
            .collect();
        let mut vars = BTreeMap::new();
        vars.insert("messages", minijinja::Value::from_serialize(&messages));
        vars.insert("add_generation_prompt", minijinja::Value::from(true));
        if let Some(bos) = &self.special.bos_token {
            vars.insert("bos_token", minijinja::Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.special.eos_token {
            vars.insert("eos_token", minijinja::Value::from(eos.as_str()));
        }
        if let Some((name, value)) = extra {
            vars.insert(name, value);
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(format!("{e:#}")))?;
        template
            .render(&vars)
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }
}
