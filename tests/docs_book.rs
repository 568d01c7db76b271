//! The book (`docs/`, an mdBook) and the README against the repository and
//! the binary: what a reader follows or looks up there exists.
//!
//! * **The summary**: every page `docs/SUMMARY.md` lists exists, and every
//!   `.md` file under `docs/` is listed (a page nobody can reach from the
//!   book's table of contents is a page nobody reads).
//! * **Links**: every relative Markdown link in `README.md` and
//!   `docs/**/*.md` (inline `[text](target)`, images, reference
//!   definitions) points to a file or directory that exists; a `#anchor`
//!   into a Markdown file (or into the page itself) names one of its
//!   headings, slugged as GitHub and mdBook slug them. Links inside code
//!   (fenced blocks, inline code) are text, not links, and are left alone.
//! * **The CLI reference** (`docs/reference/cli.md`): the built `semlb`
//!   binary's `--help`, and every subcommand's, recursively (the
//!   subcommands read from each `Commands:` list), gives each command's
//!   `--long` flags; each command must have a section in the reference
//!   whose heading names it (`` `semlb shm create` ``), every flag must
//!   have a row in that section's table, and every flag the table lists
//!   must exist. `semlb bench` hands its arguments to the `semlb-bench`
//!   binary: its reports are checked the same way when that binary is next
//!   to `semlb` (as after `cargo test --workspace`, which builds it), and
//!   otherwise the test says `SKIPPED` for them.
//! * **The configuration reference** (`docs/reference/configuration.md`):
//!   every key `semlb serve`'s TOML file accepts, enumerated from the
//!   library's own `Deserialize` implementation of
//!   [`semlb::config::ServeConfig`] (see [`config_keys`]), is documented
//!   there, and every key documented there exists.
//! * **The testing page** (`docs/development/testing.md`) names every test
//!   file under `tests/`.
//!
//! Each check reports everything it finds wrong at once, not only the
//! first problem.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Fails with every problem found, one per line.
fn assert_none(problems: &[String], what: &str) {
    assert!(
        problems.is_empty(),
        "{what}: {} problem(s):\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

/// Every `.md` file under `dir`, sorted.
fn markdown_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// `path` with `.` and `..` resolved lexically (the file need not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Markdown: the text outside code, links, headings and their slugs.

/// The lines of `text` that are not inside a fenced code block, with their
/// line numbers (from 1). A fence is a line starting (after up to three
/// spaces, or the indentation of a list item) with three or more backticks
/// or tildes; it ends at a line with at least as many of the same.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |c| trimmed.chars().take_while(|x| *x == c).count());
        match fence {
            Some((c, n)) => {
                if marker == Some(c) && run >= n && trimmed[run..].trim().is_empty() {
                    fence = None;
                }
            }
            None if run >= 3 => fence = Some((marker.unwrap(), run)),
            None => out.push((i + 1, line)),
        }
    }
    out
}

/// `line` with its inline code spans blanked out (a run of N backticks up
/// to the next run of exactly N), so that brackets in code are not links.
fn without_code_spans(line: &str) -> String {
    let bytes = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'`' {
            let n = bytes[i..].iter().take_while(|b| **b == b'`').count();
            let mut j = i + n;
            let mut close = None;
            while j < bytes.len() {
                if bytes[j] == b'`' {
                    let m = bytes[j..].iter().take_while(|b| **b == b'`').count();
                    if m == n {
                        close = Some(j);
                        break;
                    }
                    j += m;
                } else {
                    j += 1;
                }
            }
            if let Some(j) = close {
                out.push_str(&" ".repeat(j + n - i));
                i = j + n;
                continue;
            }
            out.push_str(&line[i..i + n]);
            i += n;
            continue;
        }
        let c = line[i..].chars().next().unwrap();
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// The link targets of one line of prose: `[text](target)`, `![alt](target)`
/// (an optional `"title"` after the target is dropped) and reference
/// definitions `[label]: target`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut out = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(end) = trimmed.find("]:")
        && !trimmed[1..end].contains(']')
    {
        if let Some(target) = trimmed[end + 2..].split_whitespace().next() {
            out.push(target.trim_matches(|c| c == '<' || c == '>').to_owned());
        }
        return out;
    }
    let bytes = line.as_bytes();
    let mut i = 0;
    while let Some(off) = line[i..].find("](") {
        let start = i + off + 2;
        // The target ends at the parenthesis that closes this one.
        let mut depth = 1;
        let mut j = start;
        while j < bytes.len() {
            match bytes[j] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        let target = line[start..j].trim();
        let target = target.split_once(" \"").map_or(target, |(t, _)| t);
        out.push(target.trim_matches(|c| c == '<' || c == '>').to_owned());
        i = j.min(bytes.len());
    }
    out
}

/// A heading's anchor as GitHub and mdBook make it: the text without its
/// Markdown (code ticks, emphasis, link targets), lower-cased; letters,
/// digits, `_` and `-` kept, spaces made `-`, everything else dropped.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    // [text](target) -> text
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](").map(|m| open + m) {
            Some(mid) => {
                let close = rest[mid..].find(')').map_or(rest.len(), |c| mid + c + 1);
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..mid]);
                rest = &rest[close..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's ATX headings (`#` to `######`), with
/// `-1`, `-2`, ... for repeated ones, as GitHub and mdBook number them.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#').trim());
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 { base.clone() } else { format!("{base}-{n}") });
        *n += 1;
    }
    out
}

/// What is wrong with the relative links of one Markdown file; every link
/// must stay under `within`.
fn check_links(file: &Path, within: &Path, problems: &mut Vec<String>) {
    let text = read(file);
    let rel = file.strip_prefix(within).unwrap_or(file).display().to_string();
    for (n, line) in prose_lines(&text) {
        for target in link_targets(line) {
            if target.is_empty() {
                problems.push(format!("{rel}:{n}: an empty link target"));
                continue;
            }
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let dest = if path.is_empty() {
                file.to_path_buf()
            } else if path.starts_with('/') {
                problems.push(format!("{rel}:{n}: {target}: an absolute path; links must be relative"));
                continue;
            } else {
                normalize(&file.parent().unwrap().join(path))
            };
            if !dest.starts_with(within) {
                problems.push(format!("{rel}:{n}: {target}: points outside the repository"));
                continue;
            }
            if !dest.exists() {
                problems.push(format!("{rel}:{n}: {target}: no such file or directory"));
                continue;
            }
            if let Some(anchor) = anchor
                && dest.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&dest)).contains(anchor)
            {
                problems.push(format!(
                    "{rel}:{n}: {target}: {} has no heading with the anchor #{anchor}",
                    dest.strip_prefix(within).unwrap_or(&dest).display()
                ));
            }
        }
    }
}

#[test]
fn the_markdown_helpers_see_links_anchors_and_code() {
    assert_eq!(
        link_targets("see [a](x.md#b) and ![p](img/p.svg \"t\"), not `[c](y.md)`"),
        ["x.md#b", "img/p.svg"]
    );
    assert_eq!(link_targets("[ref]: ../src/lib.rs"), ["../src/lib.rs"]);
    assert_eq!(link_targets("[f](a_(b).md) text"), ["a_(b).md"]);
    assert_eq!(
        slug("Client authentication: `[auth]` and `semlb keys`"),
        "client-authentication-auth-and-semlb-keys"
    );
    assert_eq!(slug("The gateway: `semlb serve`"), "the-gateway-semlb-serve");
    assert_eq!(slug("[Links](x.md) and more"), "links-and-more");
    let text = "# A\n```sh\n# not a heading\n```\n## A\n### B c\n";
    assert_eq!(
        anchors(text),
        ["a", "a-1", "b-c"]
            .into_iter()
            .map(String::from)
            .collect::<BTreeSet<_>>()
    );
    assert_eq!(prose_lines(text).len(), 3);
}

/// A broken link and a missing anchor are found (the check can fail).
#[test]
fn the_link_check_finds_broken_links() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("docs-book-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("page.md");
    std::fs::write(
        &page,
        "# Title\n\n[ok](page.md#title) [gone](missing.md) [bad anchor](#nowhere)\n\n```\n[code](not-checked.md)\n```\n",
    )
    .unwrap();
    let mut problems = Vec::new();
    check_links(&page, &dir, &mut problems);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].contains("missing.md: no such file"), "{problems:?}");
    assert!(problems[1].contains("#nowhere"), "{problems:?}");
}

// ---------------------------------------------------------------------------
// The summary and the links.

/// The pages `docs/SUMMARY.md` lists, relative to `docs/`.
fn summary_pages() -> Vec<String> {
    let text = read(&root().join("docs/SUMMARY.md"));
    prose_lines(&text)
        .into_iter()
        .flat_map(|(_, line)| link_targets(line))
        .collect()
}

#[test]
fn every_page_is_in_the_summary_and_exists() {
    let docs = root().join("docs");
    let listed = summary_pages();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for page in &listed {
        if page.is_empty() {
            problems.push("SUMMARY.md lists a draft chapter (an empty link)".to_owned());
        } else if !docs.join(page).is_file() {
            problems.push(format!("SUMMARY.md lists {page}, which does not exist"));
        } else if !seen.insert(normalize(Path::new(page))) {
            problems.push(format!("SUMMARY.md lists {page} twice"));
        }
    }
    for file in markdown_files(&docs) {
        let rel = file.strip_prefix(&docs).unwrap().to_path_buf();
        if rel != Path::new("SUMMARY.md") && !seen.contains(&rel) {
            problems.push(format!("docs/{} is not listed in docs/SUMMARY.md", rel.display()));
        }
    }
    assert!(listed.len() > 20, "SUMMARY.md lists only {} pages", listed.len());
    assert_none(&problems, "docs/SUMMARY.md");
}

#[test]
fn every_relative_link_resolves() {
    let mut files = vec![root().join("README.md")];
    files.extend(markdown_files(&root().join("docs")));
    let mut problems = Vec::new();
    for file in &files {
        check_links(file, &root(), &mut problems);
    }
    assert_none(&problems, "links in README.md and docs/");
}

#[test]
fn every_test_file_is_on_the_testing_page() {
    let page = read(&root().join("docs/development/testing.md"));
    let mut problems = Vec::new();
    for entry in std::fs::read_dir(root().join("tests")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = format!("`tests/{}`", path.file_name().unwrap().to_string_lossy());
            if !page.contains(&name) {
                problems.push(format!("{name} is not on docs/development/testing.md"));
            }
        }
    }
    assert_none(&problems, "docs/development/testing.md");
}

// ---------------------------------------------------------------------------
// The CLI reference.

/// A command's `--help`: its subcommands (from the `Commands:` list, `help`
/// left out) and its long flags (the options' own lines, not flags a
/// description mentions).
fn help_of(exe: &Path, args: &[&str]) -> (Vec<String>, BTreeSet<String>) {
    let out = Command::new(exe)
        .args(args)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} {args:?} --help failed: {}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut commands = Vec::new();
    let mut flags = BTreeSet::new();
    let mut section = "";
    for line in text.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            section = line;
            continue;
        }
        let item = line.trim_start();
        if section == "Commands:" && line.starts_with("  ") && !line.starts_with("   ") {
            let name = item.split_whitespace().next().unwrap_or("");
            if !name.is_empty() && name != "help" {
                commands.push(name.to_owned());
            }
        } else if section == "Options:" && line.len() - item.len() <= 6 {
            // `-h, --help`, `--shm-name <NAME>`, `--demo [<N>]` (a
            // description's lines are indented further).
            let item = item
                .split_once(", ")
                .filter(|(short, _)| short.len() == 2)
                .map_or(item, |(_, long)| long);
            if let Some(flag) = item.strip_prefix("--") {
                let name: String = flag
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                flags.insert(format!("--{name}"));
            }
        }
    }
    (commands, flags)
}

/// Every command under `prefix` (itself included) with its flags.
fn command_tree(exe: &Path, display: &str, prefix: Vec<String>, skip: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![prefix];
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let (commands, flags) = help_of(exe, &args);
        let name = std::iter::once(display)
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        out.insert(name, flags);
        for c in commands {
            if path.is_empty() && skip.contains(&c.as_str()) {
                continue;
            }
            let mut sub = path.clone();
            sub.push(c);
            todo.push(sub);
        }
    }
    out
}

/// The reference's sections by the command their heading names: a heading
/// whose text is exactly `` `semlb …` ``, up to the next heading of the
/// same level or above, less the sections of subcommands nested in it.
fn command_sections(page: &str) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut open: Vec<(usize, String)> = Vec::new();
    for (_, line) in prose_lines(page) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            open.retain(|(level, _)| *level < hashes);
            let title = line[hashes..].trim();
            if let Some(name) = title.strip_prefix('`').and_then(|t| t.strip_suffix('`'))
                && name.starts_with("semlb")
            {
                open.push((hashes, name.to_owned()));
                out.entry(name.to_owned()).or_default();
            }
            continue;
        }
        if let Some((_, name)) = open.last() {
            let text = out.get_mut(name).unwrap();
            text.push_str(line);
            text.push('\n');
        }
    }
    out
}

/// The flags a section's tables list: the first cell of every row, when it
/// is a code span of a long flag (`` `--shm-name NAME` ``).
fn documented_flags(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `--"))
        .map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            format!("--{name}")
        })
        .collect()
}

/// What is wrong between the binary's commands and the reference.
fn check_cli(commands: &BTreeMap<String, BTreeSet<String>>, sections: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    for (command, flags) in commands {
        let Some(section) = sections.get(command) else {
            problems.push(format!(
                "`{command}` has no section (a heading `{command}`) in docs/reference/cli.md"
            ));
            continue;
        };
        let documented = documented_flags(section);
        for flag in flags.difference(&documented) {
            problems.push(format!(
                "`{command}`: {flag} has no row in its section of docs/reference/cli.md"
            ));
        }
        for flag in documented.difference(flags) {
            problems.push(format!(
                "`{command}`: docs/reference/cli.md lists {flag}, which it does not take"
            ));
        }
    }
    problems
}

#[test]
fn every_cli_flag_is_in_the_cli_reference() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_semlb"));
    // `semlb bench` takes no flags of its own: it hands everything to
    // `semlb-bench` (`--help` included), whose reports are below.
    let mut commands = command_tree(&exe, "semlb", Vec::new(), &["bench"]);
    commands.insert("semlb bench".to_owned(), BTreeSet::new());
    assert!(
        commands.len() >= 12,
        "only {} commands found: {commands:?}",
        commands.len()
    );
    assert!(commands["semlb serve"].contains("--shm-size"), "{commands:?}");
    assert!(
        commands["semlb keys limit"].contains("--isolate-prefixes"),
        "{commands:?}"
    );
    let bench = exe.with_file_name("semlb-bench");
    if bench.is_file() {
        let reports = command_tree(&bench, "semlb bench", Vec::new(), &[]);
        assert!(
            reports.len() >= 10,
            "only {} bench reports found: {reports:?}",
            reports.len()
        );
        commands.extend(reports.into_iter().filter(|(name, _)| name != "semlb bench"));
    } else {
        println!(
            "SKIPPED: the `semlb bench` reports' flags ({} is not built)",
            bench.display()
        );
    }
    let page = read(&root().join("docs/reference/cli.md"));
    assert_none(&check_cli(&commands, &command_sections(&page)), "docs/reference/cli.md");
}

/// A flag missing from its section, a flag the command does not take, and
/// a command without a section are all found (the check can fail).
#[test]
fn the_cli_check_finds_missing_and_stale_flags() {
    let commands: BTreeMap<String, BTreeSet<String>> = [
        ("semlb x", vec!["--shm-name", "--shm-size"]),
        ("semlb y", vec!["--once"]),
    ]
    .into_iter()
    .map(|(c, f)| (c.to_owned(), f.into_iter().map(String::from).collect()))
    .collect();
    let page = "## `semlb x`\n\n| flag | meaning |\n| --- | --- |\n| `--shm-name NAME` | the name |\n| `--old` | gone |\n\n## Other\n\n`--shm-size`\n";
    let problems = check_cli(&commands, &command_sections(page));
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(
        problems.iter().any(|p| p.contains("--shm-size has no row")),
        "{problems:?}"
    );
    assert!(problems.iter().any(|p| p.contains("lists --old")), "{problems:?}");
    assert!(
        problems.iter().any(|p| p.contains("`semlb y` has no section")),
        "{problems:?}"
    );
}

// ---------------------------------------------------------------------------
// The configuration reference.
//
// How the keys are enumerated: serde's derived `Deserialize` of a struct
// calls `Deserializer::deserialize_struct(name, FIELDS, visitor)`, where
// FIELDS is every field name the struct accepts (renames and aliases
// applied). `Probe` is a deserializer that, led down a route of keys,
// hands the struct visitors a map of just the next key, and at the end of
// the route records what it finds: a struct's FIELDS (a table) or anything
// else (a value). Options, arrays of tables (`[[backend]]`) and newtypes
// are passed through. Walking every route from the root of `ServeConfig`
// gives every key the file may set, from the same code that parses it.
//
// What this proves: no key that `semlb serve` accepts is missing from the
// reference, and no key the reference lists is one it does not accept
// (the configuration refuses unknown keys, see
// `the_configuration_refuses_unknown_keys`, so FIELDS is exactly what a
// file may say). What it does not prove: that a key's type, default and
// meaning as written are right, and a table parsed by hand-written code
// that does not call `deserialize_struct` (a `#[serde(flatten)]`, a map
// with free keys) would look like a single value; the known keys asserted
// in `every_config_key_is_in_the_configuration_reference` fail if the
// walk stops reaching the nested tables.

/// What the probe found at the end of its route.
#[derive(Debug, Clone, PartialEq)]
enum Found {
    /// A table: its keys.
    Table(&'static [&'static str]),
    /// A value (string, number, array of values, enum...).
    Value,
}

/// What serde's derived code reports to the probe (never a real failure).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ProbeError(String);

impl de::Error for ProbeError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

#[derive(Clone, Copy)]
struct Probe<'a> {
    route: &'a [&'static str],
    found: &'a RefCell<Option<Found>>,
}

impl Probe<'_> {
    /// The end of the route is a value; a route that goes on past a value
    /// is a key that does not exist.
    fn value(self) -> ProbeError {
        if self.route.is_empty() {
            *self.found.borrow_mut() = Some(Found::Value);
        }
        ProbeError("probed".to_owned())
    }
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ProbeError> {
        Err(self.value())
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        match self.route.split_first() {
            None => {
                *self.found.borrow_mut() = Some(Found::Table(fields));
                Err(ProbeError("probed".to_owned()))
            }
            Some((key, rest)) => visitor.visit_map(OneEntry {
                key: Some(key),
                value: Probe {
                    route: rest,
                    found: self.found,
                },
            }),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value, ProbeError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        visitor.visit_seq(OneElement(Some(self)))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf unit
        unit_struct tuple tuple_struct map enum identifier ignored_any
    }
}

/// A map of one key, whose value is probed further.
struct OneEntry<'a> {
    key: Option<&'static str>,
    value: Probe<'a>,
}

impl<'de> MapAccess<'de> for OneEntry<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, ProbeError> {
        self.key
            .take()
            .map(|k| seed.deserialize(k.into_deserializer()))
            .transpose()
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, ProbeError> {
        seed.deserialize(self.value)
    }
}

/// An array of one element, probed further (`[[backend]]`).
struct OneElement<'a>(Option<Probe<'a>>);

impl<'de> SeqAccess<'de> for OneElement<'_> {
    type Error = ProbeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, ProbeError> {
        self.0.take().map(|p| seed.deserialize(p)).transpose()
    }
}

/// What `T`'s `Deserialize` finds at the end of `route`.
fn probe<T: for<'de> Deserialize<'de>>(route: &[&'static str]) -> Option<Found> {
    let found = RefCell::new(None);
    let _ = T::deserialize(Probe { route, found: &found });
    found.into_inner()
}

/// Every key `T` accepts, dotted (`policy.cache_aware.cache_threshold`,
/// `backend.url` for the `[[backend]]` tables), tables included.
fn config_keys<T: for<'de> Deserialize<'de>>() -> BTreeMap<String, Found> {
    let mut out = BTreeMap::new();
    let mut todo: Vec<Vec<&'static str>> = vec![Vec::new()];
    while let Some(route) = todo.pop() {
        let found = probe::<T>(&route).unwrap_or_else(|| panic!("the probe did not reach {route:?}"));
        if let Found::Table(fields) = found {
            for field in fields {
                let mut next = route.clone();
                next.push(field);
                todo.push(next);
            }
        }
        if !route.is_empty() {
            out.insert(route.join("."), found);
        }
    }
    out
}

/// The keys a configuration reference documents: the first cell of every
/// table row, when it is one code span (`` `store.redis.url` ``).
fn documented_keys(page: &str) -> BTreeSet<String> {
    prose_lines(page)
        .into_iter()
        .filter_map(|(_, line)| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once("` |").map(|(key, _)| key.to_owned()))
        .filter(|key| !key.contains('`') && !key.contains(' '))
        .collect()
}

/// A `[model.policy]` table is a whole `[policy]` table, and a
/// `[model.resume]` a whole `[resume]` table: their keys are documented
/// once, as `policy.*` and `resume.*`, and the tables themselves.
const SAME_AS: [(&str, &str); 2] = [("model.policy.", "policy."), ("model.resume.", "resume.")];

/// What is wrong between the keys and the reference.
fn check_config(keys: &BTreeMap<String, Found>, documented: &BTreeSet<String>) -> Vec<String> {
    let mut problems = BTreeSet::new();
    for key in keys.keys() {
        let key = SAME_AS
            .iter()
            .find_map(|(from, to)| key.strip_prefix(from).map(|rest| format!("{to}{rest}")))
            .unwrap_or_else(|| key.clone());
        if !documented.contains(&key) {
            problems.insert(format!("`{key}` is not in docs/reference/configuration.md"));
        }
    }
    for key in documented {
        if !keys.contains_key(key) {
            problems.insert(format!(
                "docs/reference/configuration.md lists `{key}`, which semlb serve does not accept"
            ));
        }
    }
    problems.into_iter().collect()
}

#[test]
fn every_config_key_is_in_the_configuration_reference() {
    let keys = config_keys::<semlb::config::ServeConfig>();
    // The walk reaches top-level keys, arrays of tables, optional tables,
    // nested tables and a table inside an array of tables.
    for known in [
        "listen",
        "backend.url",
        "tls.cert_file",
        "policy.cache_aware.cache_threshold",
        "store.redis.url",
        "model.policy.kind",
        "peer.ca_file",
    ] {
        assert!(keys.contains_key(known), "the walk did not find `{known}`: {keys:?}");
    }
    assert!(keys.len() > 100, "only {} keys found", keys.len());
    let page = read(&root().join("docs/reference/configuration.md"));
    assert_none(
        &check_config(&keys, &documented_keys(&page)),
        "docs/reference/configuration.md",
    );
}

/// The premise of the key walk: a key the configuration does not know is
/// refused, at the top and in a nested table, so the keys the walk finds
/// are all a file may set.
#[test]
fn the_configuration_refuses_unknown_keys() {
    use semlb::config::ServeConfig;
    let path = Path::new("/etc/semlb/semlb.toml");
    assert!(ServeConfig::from_toml("listen = \"127.0.0.1:8080\"\n", path).is_ok());
    for text in [
        "no_such_key = 1\n",
        "[store.redis]\nno_such_key = 1\n",
        "[[backend]]\nurl = \"http://a:1\"\nnope = 1\n",
    ] {
        let err = ServeConfig::from_toml(text, path).expect_err(text);
        assert!(err.to_string().contains("unknown field"), "{text}: {err}");
    }
}

/// A key missing from the reference and a documented key that does not
/// exist are both found (the check can fail).
#[test]
fn the_config_check_finds_missing_and_stale_keys() {
    let keys = config_keys::<semlb::config::ServeConfig>();
    let page = read(&root().join("docs/reference/configuration.md"));
    let mut documented = documented_keys(&page);
    assert!(documented.remove("store.redis.url"));
    documented.insert("store.redis.no_such_key".to_owned());
    let problems = check_config(&keys, &documented);
    assert_eq!(
        problems,
        [
            "`store.redis.url` is not in docs/reference/configuration.md",
            "docs/reference/configuration.md lists `store.redis.no_such_key`, which semlb serve does not accept",
        ]
    );
}
