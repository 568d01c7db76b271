//! A Jinja chat template rendered with minijinja, set up the way
//! `transformers` renders chat templates: `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`strip`, `split`,
//! `startswith`, …, through `minijinja_contrib::pycompat`) and a
//! `raise_exception(message)` function that fails the rendering.
//!
//! The template is given `messages` (a list of `{role, content}` and
//! each message's other fields: tool calls, tool call ids, reasoning),
//! `tools` when the request has any, `add_generation_prompt = true`, the
//! request's template variables, and `bos_token` / `eos_token` when the
//! tokenizer config defines them (an undefined token prints as nothing and
//! fails in `+`, as in Python Jinja). `tojson` is `transformers`' own
//! (Python's `json.dumps`, see [`super::value`]), and `strftime_now`
//! formats the current UTC time as Python's `strftime` does for the
//! directives templates use (Llama 3.1's `%d %b %Y`).

use std::collections::BTreeMap;

use super::value::python_tojson;
use super::{ChatMessage, RenderInputs, SpecialTokens, TemplateError};

/// Name of the one template in a compiled environment.
const TEMPLATE_NAME: &str = "chat_template";

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
        env.add_filter("tojson", python_tojson);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| format!("the template does not compile: {e:#}"))?;
        Ok(Self { env, special })
    }

    /// The special tokens the template is given.
    pub(super) fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// Renders `messages` with the generation prompt and `inputs`.
    pub(super) fn render(
        &self,
        messages: &[ChatMessage<'_>],
        inputs: &RenderInputs<'_>,
    ) -> Result<String, TemplateError> {
        let messages: minijinja::Value = messages
            .iter()
            .map(|m| {
                let head = [
                    ("role", minijinja::Value::from(&*m.role)),
                    ("content", minijinja::Value::from(&*m.content)),
                ];
                let fields = m.fields.iter().map(|(k, v)| (&**k, v.to_template()));
                head.into_iter().chain(fields).collect::<minijinja::Value>()
            })
            .collect();
        let mut vars = BTreeMap::new();
        vars.insert("messages", messages);
        if let Some(tools) = &inputs.tools {
            vars.insert("tools", tools.iter().map(|t| t.to_template()).collect());
        }
        vars.insert("add_generation_prompt", minijinja::Value::from(true));
        if let Some(bos) = &self.special.bos_token {
            vars.insert("bos_token", minijinja::Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.special.eos_token {
            vars.insert("eos_token", minijinja::Value::from(eos.as_str()));
        }
        for (name, value) in &inputs.variables {
            vars.insert(name, value.to_template());
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

/// `strftime_now(format)`: the current UTC date in `format`, for the
/// directives chat templates use (`%d`, `%b`, `%B`, `%Y`, `%m`, `%H`,
/// `%M`, `%S`, `%%`; any other is kept as written).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs, &format)
}

/// [`strftime_now`] at `secs` since the epoch.
fn format_utc(secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs / 86_400;
    let (hour, minute, second) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_formatted_as_strftime_formats_them() {
        // 2024-07-26 13:25:09 UTC.
        assert_eq!(format_utc(1_722_000_309, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format_utc(1_722_000_309, "%Y-%m-%d %H:%M:%S %B %% %q"),
            "2024-07-26 13:25:09 July % %q"
        );
        assert_eq!(format_utc(951_782_400, "%d %b %Y"), "29 Feb 2000");
    }
}
