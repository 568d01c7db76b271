//! The workspace's shape, checked from its source: no import cycle between
//! the files of a crate, and no source file too long to find one's way in.
//!
//! It also keeps the house's plan visible: `src/` shows few entries, the
//! subsystems lower down (`metrics`, `store`) name nothing that uses them,
//! no function or file grows past what a reader can hold, and the
//! library's public functions fail with typed errors, not strings.
//!
//! A file's edges are the modules its code names through `crate::…` and
//! `super::…` paths (use declarations, and paths in code), resolved to the
//! longest module prefix that exists. A module naming its own descendants
//! is composition (it declares, re-exports and wires its children) and is
//! not an edge; everything else is: a child naming its parent, siblings
//! naming each other, any module naming another subtree. Test code (files
//! named `tests.rs` or `test_support.rs`, and inline `mod tests { … }`
//! blocks, which sit at the end of a file) is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A non-test source file longer than this (every line before its inline
/// tests, comments included) is to be split.
const MAX_LINES: usize = 900;

/// A function longer than this (from its `fn` line to its closing brace)
/// is to be split into named steps.
const MAX_FN_LINES: usize = 150;

/// `src/` holds at most this many entries: the library's concerns, its
/// root and the binary's folder.
const MAX_TOP_LEVEL: usize = 20;

/// Subsystems the others build on: none may name a module that names it.
const LOWER_LAYERS: [&str; 2] = ["metrics", "store"];

/// The library crates (their public functions fail with typed errors).
const LIBRARIES: [&str; 4] = ["src", "shm-layout/src", "tokenizer/src", "workers/src"];

/// Every crate of the workspace: its source directory (from the
/// workspace root) and its crate roots there.
const CRATES: [(&str, &[&str]); 7] = [
    ("src", &["lib.rs"]),
    ("src/bin/semlb", &["main.rs"]),
    ("benches/semlb-bench/src", &["main.rs"]),
    ("shm-layout/src", &["lib.rs"]),
    ("tokenizer/src", &["lib.rs"]),
    ("workers/src", &["lib.rs"]),
    ("tests/support/src", &["lib.rs"]),
];

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`dispatcher/mod.rs` →
/// `["dispatcher"]`, `store/redis/client.rs` → `["store", "redis", "client"]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn is_test_file(file: &Path) -> bool {
    matches!(
        file.file_name().and_then(|n| n.to_str()),
        Some("tests.rs" | "test_support.rs")
    )
}

/// `text` without comments and without its inline test module.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        // A `//` not preceded by `:` starts a comment (`http://` does not).
        let bytes = line.as_bytes();
        let cut = (0..bytes.len().saturating_sub(1))
            .find(|&i| bytes[i] == b'/' && bytes[i + 1] == b'/' && (i == 0 || bytes[i - 1] != b':'))
            .unwrap_or(line.len());
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The paths of a use tree starting at `text[at..]` (after `crate::` or
/// `super::`), each as its segments; `{a, b::{c, d}}` expands.
fn use_tree(text: &[u8], mut at: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    loop {
        while at < text.len() && text[at].is_ascii_whitespace() {
            at += 1;
        }
        if at < text.len() && text[at] == b'{' {
            at += 1;
            loop {
                at = use_tree(text, at, path.clone(), out);
                while at < text.len() && text[at].is_ascii_whitespace() {
                    at += 1;
                }
                match text.get(at) {
                    Some(b',') => at += 1,
                    Some(b'}') => return at + 1,
                    _ => return at,
                }
                while at < text.len() && text[at].is_ascii_whitespace() {
                    at += 1;
                }
                if text.get(at) == Some(&b'}') {
                    return at + 1;
                }
            }
        }
        let start = at;
        while at < text.len() && is_ident(text[at]) {
            at += 1;
        }
        if at > start {
            path.push(String::from_utf8_lossy(&text[start..at]).into_owned());
        }
        if text[at..].starts_with(b"::") {
            at += 2;
            continue;
        }
        out.push(path);
        return at;
    }
}

/// The module paths `code` (of module `module`) names.
fn named_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let word_start = i == 0 || !is_ident(bytes[i - 1]) && bytes[i - 1] != b':';
        let rest = &bytes[i..];
        if word_start && rest.starts_with(b"crate::") {
            i = use_tree(bytes, i + 7, Vec::new(), &mut out);
        } else if word_start && rest.starts_with(b"super::") {
            let mut base = module[..module.len().saturating_sub(1)].to_vec();
            let mut at = i + 7;
            while bytes[at..].starts_with(b"super::") {
                base.pop();
                at += 7;
            }
            i = use_tree(bytes, at, base, &mut out);
        } else {
            i += 1;
        }
    }
    out
}

/// The modules of one crate root under `src` and the modules each names.
fn graph(src: &Path, root: &str) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let root_text = std::fs::read_to_string(src.join(root)).unwrap();
    // The root's own top-level modules (`mod x;` / `pub mod x;`).
    let top: BTreeSet<String> = root_text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect();
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter(|f| !is_test_file(f))
        .map(|f| (module_of(src, f), f))
        .filter(|(m, _)| m.first().is_some_and(|t| top.contains(t)))
        .map(|(m, f)| (m, code_of(&std::fs::read_to_string(f).unwrap())))
        .collect();
    let mut edges = BTreeMap::new();
    for (module, code) in &modules {
        let mut to = BTreeSet::new();
        for path in named_paths(code, module) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|k| path[..k].to_vec())
                .find(|p| modules.contains_key(p))
            else {
                continue;
            };
            // Itself, or its own descendants: composition, not an edge.
            if !target.starts_with(module) {
                to.insert(target);
            }
        }
        edges.insert(module.clone(), to);
    }
    edges
}

/// A cycle of `edges`, as its modules in order, if there is one.
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit<'a>(
        node: &'a Vec<String>,
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        marks: &mut BTreeMap<&'a Vec<String>, Mark>,
        stack: &mut Vec<&'a Vec<String>>,
    ) -> Option<Vec<String>> {
        marks.insert(node, Mark::Open);
        stack.push(node);
        for next in &edges[node] {
            match marks.get(next).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let from = stack.iter().position(|n| *n == next).unwrap();
                    let mut cycle: Vec<String> = stack[from..].iter().map(|m| m.join("::")).collect();
                    cycle.push(next.join("::"));
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(next, edges, marks, stack) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        marks.insert(node, Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in edges.keys() {
        if marks.get(node).copied().unwrap_or(Mark::New) == Mark::New {
            let mut stack = Vec::new();
            if let Some(c) = visit(node, edges, &mut marks, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_import_cycle_between_files() {
    let mut cycles = Vec::new();
    for (dir, roots) in CRATES {
        for root in roots {
            let edges = graph(&workspace().join(dir), root);
            assert!(!edges.is_empty(), "{dir}/{root}: no modules found");
            if let Some(cycle) = find_cycle(&edges) {
                cycles.push(format!("{dir}/{root}: {}", cycle.join(" -> ")));
            }
        }
    }
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
}

#[test]
fn the_checker_sees_paths_and_cycles() {
    let module = vec!["dispatcher".to_owned(), "proxy".to_owned()];
    let code = code_of(
        "use super::{Dispatcher, queue::{Waiting, wait}};\nuse crate::store::Lookup; // crate::ignored\n\
         let u = \"http://x\"; crate::dispatcher::failure::Failure::Body;\n#[cfg(test)]\nmod tests {\n use crate::config;\n}\n",
    );
    let mut named: Vec<String> = named_paths(&code, &module).iter().map(|p| p.join("::")).collect();
    named.sort();
    assert_eq!(
        named,
        [
            "dispatcher::Dispatcher",
            "dispatcher::failure::Failure::Body",
            "dispatcher::queue::Waiting",
            "dispatcher::queue::wait",
            "store::Lookup"
        ]
    );
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    let mut edges = BTreeMap::new();
    edges.insert(m("a"), BTreeSet::from([m("b")]));
    edges.insert(m("b"), BTreeSet::from([m("c")]));
    edges.insert(m("c"), BTreeSet::new());
    assert_eq!(find_cycle(&edges), None);
    edges.get_mut(&m("c")).unwrap().insert(m("a"));
    assert_eq!(find_cycle(&edges).unwrap(), ["a", "b", "c", "a"]);
}

#[test]
fn no_source_file_is_too_long() {
    let long: Vec<String> = all_source_files()
        .iter()
        .filter(|f| !is_test_file(f))
        .filter_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            // Inline unit tests (at the end of a file) do not count.
            let lines = before_tests(&text).lines().count();
            (lines > MAX_LINES).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these: {long:?}");
}

/// Every non-test source file of the workspace's crates, once.
fn all_source_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for (dir, _) in CRATES {
        rust_files(&workspace().join(dir), &mut files);
    }
    files.sort();
    files.dedup();
    files.retain(|f| !is_test_file(f));
    files
}

/// `text` before its inline tests.
fn before_tests(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod tests {").map_or(text, |i| &text[..i])
}

/// The functions of `code` longer than `max` lines: `(name, lines)`. A
/// function is a line whose first word after visibility and qualifiers is
/// `fn`; its end is the first later line at its indentation that closes a
/// brace (rustfmt's layout, which CI enforces). Declarations without a
/// body (`;`) are skipped.
fn long_functions(code: &str, max: usize) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let mut rest = trimmed;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
            "extern \"C\" ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        if rest.starts_with("pub(in ") {
            rest = rest.split_once(") ").map_or(rest, |(_, r)| r);
        }
        let Some(sig) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = sig.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let indent = line.len() - trimmed.len();
        // The signature ends at the first line ending in `{` or `;`.
        let Some(open) = (i..lines.len()).find(|&j| {
            let l = lines[j].trim_end();
            l.ends_with('{') || l.ends_with(';')
        }) else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') {
            continue;
        }
        let close = (open + 1..lines.len()).find(|&j| {
            let l = lines[j];
            l.len() - l.trim_start().len() == indent && l.trim_start().starts_with('}')
        });
        if let Some(close) = close
            && close - i + 1 > max
        {
            out.push((name, close - i + 1));
        }
    }
    out
}

#[test]
fn no_function_is_too_long() {
    let long: Vec<String> = all_source_files()
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            long_functions(before_tests(&text), MAX_FN_LINES)
                .into_iter()
                .map(|(name, n)| format!("{}: fn {name} ({n} lines)", f.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(long.is_empty(), "split these into named steps: {long:#?}");
}

#[test]
fn the_function_measure_sees_a_long_function() {
    let body = "        x += 1;\n".repeat(4);
    let code = format!(
        "impl A {{\n    pub(crate) async fn grow(\n        a: u8,\n    ) -> u8 {{\n{body}    }}\n    fn decl();\n}}\n"
    );
    assert_eq!(long_functions(&code, 7), [("grow".to_owned(), 8)]);
    assert_eq!(long_functions(&code, 8), []);
}

#[test]
fn src_shows_few_entries() {
    let entries: Vec<String> = std::fs::read_dir(workspace().join("src"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        entries.len() <= MAX_TOP_LEVEL,
        "src/ has {} entries (at most {MAX_TOP_LEVEL}): group them by concern: {entries:?}",
        entries.len()
    );
    assert!(
        workspace().join("src/bin/semlb/main.rs").is_file() && !workspace().join("src/main.rs").exists(),
        "the binary lives in src/bin/semlb/"
    );
}

/// The top-level modules of the library that name `lower` in code, and
/// those `lower` names.
fn users_and_used(
    edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
    lower: &str,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut users, mut used) = (BTreeSet::new(), BTreeSet::new());
    for (from, to) in edges {
        for target in to {
            if from[0] != lower && target[0] == lower {
                users.insert(from[0].clone());
            }
            if from[0] == lower && target[0] != lower {
                used.insert(target[0].clone());
            }
        }
    }
    (users, used)
}

#[test]
fn lower_layers_name_nothing_that_uses_them() {
    let edges = graph(&workspace().join("src"), "lib.rs");
    for lower in LOWER_LAYERS {
        let (users, used) = users_and_used(&edges, lower);
        assert!(
            !users.is_empty(),
            "{lower}: nothing uses it? (the checker lost its edges)"
        );
        let up: Vec<&String> = used.intersection(&users).collect();
        assert!(
            up.is_empty(),
            "{lower} names {up:?}, which use {lower}: pass it plain values instead"
        );
    }
}

/// Public functions in `code` whose result is `Result<_, String>`.
fn string_errors(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("pub fn ") {
        let sig_end = rest[i..].find(['{', ';']).map_or(rest.len(), |e| i + e);
        let sig: String = rest[i..sig_end].split_whitespace().collect::<Vec<_>>().join(" ");
        if let Some(ret) = sig.split("->").nth(1)
            && ret.contains("Result<")
            && ret
                .trim_end()
                .trim_end_matches(|c: char| c == '>' || c.is_whitespace())
                .ends_with("String")
        {
            out.push(sig);
        }
        rest = &rest[sig_end..];
    }
    out
}

#[test]
fn public_library_functions_fail_with_typed_errors() {
    let mut found = Vec::new();
    for lib in LIBRARIES {
        let mut files = Vec::new();
        rust_files(&workspace().join(lib), &mut files);
        for f in files.iter().filter(|f| !is_test_file(f)) {
            let rel = f.strip_prefix(workspace()).unwrap();
            // Binaries: `src/bin/`, and `main.rs` of a library's package.
            if rel.starts_with("src/bin") || rel.file_name().is_some_and(|n| n == "main.rs") {
                continue;
            }
            let text = std::fs::read_to_string(f).unwrap();
            found.extend(
                string_errors(&code_of(&text))
                    .into_iter()
                    .map(|s| format!("{}: {s}", rel.display())),
            );
        }
    }
    assert!(found.is_empty(), "public functions failing with a String: {found:#?}");
}

#[test]
fn the_string_error_check_sees_one() {
    assert_eq!(
        string_errors(
            "pub fn a(x: u8)\n -> Result<Vec<u8>, String> {\n}\npub fn b() -> Result<String, E> {}\nfn c() -> Result<(), String> {}"
        ),
        ["pub fn a(x: u8) -> Result<Vec<u8>, String>"]
    );
}

#[test]
fn the_crate_tours_list_every_module() {
    // The table at the top of a crate root names each of its modules as
    // [`module`]: the tour a reader starts from.
    for root in [
        "src/lib.rs",
        "src/bin/semlb/main.rs",
        "src/bin/semlb/commands/mod.rs",
        "src/bin/semlb/supervisor/mod.rs",
        "src/openai/mod.rs",
        "src/tenancy/mod.rs",
        "src/prefix/mod.rs",
        "benches/semlb-bench/src/main.rs",
    ] {
        let text = std::fs::read_to_string(workspace().join(root)).unwrap();
        let missing: Vec<&str> = text
            .lines()
            .filter_map(|l| {
                let l = l.trim();
                let l = l.strip_prefix("pub ").unwrap_or(l);
                l.strip_prefix("mod ")?.strip_suffix(';')
            })
            .filter(|m| !text.contains(&format!("[`{m}`]")))
            .collect();
        assert!(missing.is_empty(), "{root}: the tour leaves out {missing:?}");
    }
}
