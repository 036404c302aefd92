//! `docs/compiler-errors.md` quotes the compiler: every `text` block of the page must appear, line
//! for line, in the expected output of a compile-fail case (`ui/fail/*.stderr`), so the page
//! changes when the compiler's text does; and every error code a case pins has its section. (The
//! page's Rust examples run with `lifecycle-core`'s doctests.)

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn page() -> String {
    fs::read_to_string(root().join("../../docs/compiler-errors.md"))
        .unwrap_or_else(|e| panic!("docs/compiler-errors.md: {e}"))
}

/// The expected output of every compile-fail case, with its path.
fn expected_outputs() -> Vec<(PathBuf, String)> {
    let dir = root().join("ui/fail");
    let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    entries
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "stderr"))
        .map(|path| {
            let text = fs::read_to_string(&path).expect("a readable .stderr");
            (path, text)
        })
        .collect()
}

/// The `text` blocks of a markdown page, without a closing `...` line (an excerpt mark).
fn text_blocks(page: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in page.lines() {
        match &mut current {
            None if line == "```text" => current = Some(Vec::new()),
            None => {}
            Some(lines) if line == "```" => {
                if lines.last() == Some(&"...") {
                    lines.pop();
                }
                blocks.push(lines.join("\n"));
                current = None;
            }
            Some(lines) => lines.push(line),
        }
    }
    blocks
}

#[test]
fn every_quotation_is_the_compilers_text() {
    let expected = expected_outputs();
    let blocks = text_blocks(&page());
    assert!(
        blocks.len() >= 10,
        "the page quotes {} outputs",
        blocks.len()
    );
    for block in blocks {
        assert!(
            expected.iter().any(|(_, stderr)| stderr.contains(&block)),
            "docs/compiler-errors.md quotes output that no ui/fail/*.stderr contains:\n{block}"
        );
    }
}

#[test]
fn every_error_code_pinned_by_a_case_is_on_the_page() {
    let page = page();
    for (path, stderr) in expected_outputs() {
        for code in stderr.lines().filter_map(|l| l.strip_prefix("error[")) {
            let code = &code[..code.find(']').unwrap_or(code.len())];
            assert!(
                page.contains(&format!("## {code}")),
                "{} pins {code}, which docs/compiler-errors.md does not explain",
                path.display()
            );
        }
    }
}
