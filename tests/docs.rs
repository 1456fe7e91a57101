//! The docs stay true to the tree: every relative Markdown link and every
//! backticked repository path in README.md and docs/*.md names something
//! that exists, the README stays an entry page (at most 400 lines), and its
//! Layout section names every top-level directory, every entry of `src/`
//! and every file of `docs/`.

use std::fs;
use std::path::{Path, PathBuf};

/// Backticked tokens starting with one of these are checked as paths.
const PREFIXES: &str = "src/ docs/ scripts/ examples/ envs/ models/ tests/";

/// What the README's Layout section must name.
const TOP_LEVEL: &str =
    "Cargo.toml src/ scripts/ models/ envs/ tests/ examples/ docs/ vendor/ .ci/";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md and every docs/*.md, relative to the repository root.
fn doc_files() -> Vec<String> {
    let mut docs: Vec<String> = fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| {
            e.expect("docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    docs.insert(0, "README.md".to_string());
    docs
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn without_anchor(target: &str) -> &str {
    target.split('#').next().unwrap_or("")
}

/// The relative link targets (outside code spans) and the backticked
/// repository paths of one Markdown file, without `#anchor` parts.
fn references(text: &str) -> (Vec<String>, Vec<String>) {
    let (mut links, mut paths) = (Vec::new(), Vec::new());
    for (i, segment) in prose(text).split('`').enumerate() {
        if i % 2 == 1 {
            let is_path = PREFIXES.split(' ').any(|p| segment.starts_with(p))
                && !segment.contains(|c: char| "<*{ ".contains(c));
            let path = without_anchor(segment);
            if is_path && !path.is_empty() {
                paths.push(path.to_string());
            }
            continue;
        }
        let mut rest = segment;
        while let Some(k) = rest.find("](") {
            rest = &rest[k + 2..];
            let end = rest
                .find(|c: char| c == ')' || c.is_whitespace())
                .unwrap_or(rest.len());
            let target = &rest[..end];
            let external = ["http://", "https://", "mailto:"]
                .into_iter()
                .any(|s| target.starts_with(s));
            let target = without_anchor(target);
            if !external && !target.is_empty() {
                links.push(target.to_string());
            }
        }
    }
    (links, paths)
}

#[test]
fn doc_paths_exist() {
    let root = root();
    let mut missing = Vec::new();
    for file in doc_files() {
        let folder = root.join(Path::new(&file).parent().unwrap_or(Path::new("")));
        let (links, paths) = references(&read(&root.join(&file)));
        for link in links {
            if !folder.join(&link).exists() {
                missing.push(format!("{file}: link {link}"));
            }
        }
        for path in paths {
            if !root.join(&path).exists() {
                missing.push(format!("{file}: path `{path}`"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "doc references to nothing:\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn readme_is_an_entry_page() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines (at most 400): move reference material to docs/"
    );
}

#[test]
fn layout_names_every_directory_and_doc() {
    let readme = read(&root().join("README.md"));
    let start = readme
        .find("\n## Layout")
        .expect("README.md has a ## Layout section")
        + 1;
    let layout = &readme[start..];
    let layout = &layout[..layout.find("\n## ").unwrap_or(layout.len())];
    let mut missing: Vec<String> = TOP_LEVEL
        .split(' ')
        .filter(|name| !layout.contains(*name))
        .map(|name| name.to_string())
        .collect();
    for dir in ["src", "docs"] {
        for entry in fs::read_dir(root().join(dir)).expect(dir) {
            let entry = entry.expect("directory entry");
            let mut name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() {
                name.push('/');
            }
            if !layout.contains(&name) {
                missing.push(format!("{dir}/{name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README.md's Layout section does not name:\n  {}",
        missing.join("\n  ")
    );
}
