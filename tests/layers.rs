//! The crate's layering (docs/ARCHITECTURE.md, "Layers"): every top-level
//! module imports only modules of a lower layer, and no source file
//! reaches itself through its `crate::`/`super::` paths (no file-level
//! loop). Test code (`tests.rs`, `tests/` folders, `#[cfg(test)]`
//! modules) is exempt: tests may use anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module with its layer: a module may import modules of
/// lower layers only (the table of docs/ARCHITECTURE.md).
const LAYERS: &[(&str, usize)] = &[
    ("seed", 0),
    ("children", 0),
    ("env", 1),
    ("model", 1),
    ("script", 1),
    ("distributed", 1),
    ("guidance", 2),
    ("inference", 2),
    ("rollout", 3),
    ("train", 4),
    ("rundir", 5),
    ("tiny", 5),
    ("report", 6),
    ("experiment", 7),
    ("dev", 8),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Library source files (relative to src/), test code left out.
fn library_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().unwrap() != "tests" {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs")
                && p.file_name().unwrap() != "tests.rs"
            {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&src(), &mut out);
    let root = src();
    let mut rel: Vec<PathBuf> = out
        .into_iter()
        .map(|p| p.strip_prefix(&root).unwrap().to_path_buf())
        .filter(|p| {
            let top = p.components().next().unwrap().as_os_str();
            top != "main.rs" && top != "lib.rs" && top != "cli"
        })
        .collect();
    rel.sort();
    rel
}

/// The source without comments and without `#[cfg(test)]` items' bodies
/// (everything from the first `#[cfg(test)]`: test modules come last).
fn code(path: &Path) -> String {
    let s = std::fs::read_to_string(src().join(path)).unwrap();
    let s = match s.find("#[cfg(test)]") {
        Some(i) => &s[..i],
        None => &s[..],
    };
    s.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module path (segments) a file defines: `model/llama/mod.rs` →
/// `[model, llama]`.
fn module_of(file: &Path) -> Vec<String> {
    let mut segs: Vec<String> = file
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = segs.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" {
        segs.push(stem.to_string());
    }
    segs
}

/// The file that defines the longest prefix of `path` that is a module.
fn file_of(path: &[String]) -> Option<PathBuf> {
    for n in (1..=path.len()).rev() {
        let p = path[..n].join("/");
        for f in [format!("{p}.rs"), format!("{p}/mod.rs")] {
            if src().join(&f).is_file() {
                return Some(PathBuf::from(f));
            }
        }
    }
    None
}

/// Every path a file names through `crate::` or `super::`, as absolute
/// module paths (`use` groups `a::{b, c::d}` expanded one level deep per
/// brace).
fn imports(file: &Path) -> Vec<Vec<String>> {
    let text = code(file);
    let here = module_of(file);
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let (base, skip) = if rest.starts_with("crate::") && !prev_ident(bytes, i) {
            (Vec::new(), "crate::".len())
        } else if rest.starts_with("super::") && !prev_ident(bytes, i) {
            // `super` of module a::b (file `a/b.rs` or `a/b/mod.rs`) is a.
            let mut b = here.clone();
            let mut skip = 0;
            let mut r = rest;
            while r.starts_with("super::") {
                b.pop();
                skip += "super::".len();
                r = &r["super::".len()..];
            }
            (b, skip)
        } else {
            i += rest.chars().next().unwrap().len_utf8();
            continue;
        };
        i += skip;
        expand(&text[i..], base, &mut out);
    }
    out
}

fn prev_ident(bytes: &[u8], i: usize) -> bool {
    i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':')
}

/// Read a path (`a::b::c` or `a::{b, c::d}`) at the start of `s`.
fn expand(s: &str, base: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut path = base;
    let mut s = s;
    loop {
        let n = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        if n == 0 {
            if let Some(inner) = s.strip_prefix('{') {
                // A group: split its first level at commas.
                let mut depth = 0;
                let mut start = 0;
                for (j, c) in inner.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            expand(inner[start..j].trim(), path.clone(), out);
                            return;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            expand(inner[start..j].trim(), path.clone(), out);
                            start = j + 1;
                        }
                        _ => {}
                    }
                }
            }
            break;
        }
        let seg = &s[..n];
        if seg != "self" {
            path.push(seg.to_string());
        }
        s = &s[n..];
        match s.strip_prefix("::") {
            Some(r) => s = r,
            None => break,
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
}

#[test]
fn every_module_imports_only_lower_layers() {
    let layer: BTreeMap<&str, usize> = LAYERS.iter().copied().collect();
    let mut wrong = Vec::new();
    for f in library_files() {
        let top = module_of(&f)[0].clone();
        let Some(&l) = layer.get(top.as_str()) else {
            wrong.push(format!(
                "{}: module `{top}` has no layer in LAYERS",
                f.display()
            ));
            continue;
        };
        let mut seen = BTreeSet::new();
        for p in imports(&f) {
            let to = &p[0];
            if to == &top || !seen.insert(to.clone()) {
                continue;
            }
            if let Some(&m) = layer.get(to.as_str()) {
                if m >= l {
                    wrong.push(format!(
                        "{}: `{top}` (layer {l}) imports `{}` (layer {m})",
                        f.display(),
                        p.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "upward or sideways imports:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_file_reaches_itself_through_its_imports() {
    let files = library_files();
    let mut graph: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for f in &files {
        let deps = graph.entry(f.clone()).or_default();
        for p in imports(f) {
            if let Some(to) = file_of(&p) {
                // A parent `mod.rs` re-exporting its children is not a
                // use of them by the child: only edges to other files.
                if &to != f {
                    deps.insert(to);
                }
            }
        }
    }
    // A module's root file (`mod.rs`, or `a.rs` beside a folder `a/`)
    // declares its children and re-exports them, and children use what
    // their parent defines: that parent–child pairing is how Rust modules
    // are built, not a loop. A loop is a cycle among the other files.
    let hub =
        |p: &Path| p.file_name().unwrap() == "mod.rs" || src().join(p.with_extension("")).is_dir();
    let mut cycles = Vec::new();
    for start in graph.keys() {
        if hub(start) {
            continue;
        }
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut visited = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for next in graph.get(&at).into_iter().flatten() {
                if next == start {
                    cycles.push(
                        trail
                            .iter()
                            .chain([start])
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(" → "),
                    );
                } else if !hub(next) && visited.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    cycles.sort();
    cycles.dedup();
    assert!(
        cycles.is_empty(),
        "file-level import loops:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_path_reader_expands_groups_and_resolves_super() {
    let mut out = Vec::new();
    expand("a::{b, c::{d, e}, self};", Vec::new(), &mut out);
    let got: Vec<String> = out.iter().map(|p| p.join("::")).collect();
    assert_eq!(got, ["a::b", "a::c::d", "a::c::e", "a"]);
    assert_eq!(
        module_of(Path::new("model/llama/mod.rs")),
        ["model", "llama"]
    );
    assert_eq!(
        module_of(Path::new("model/llama/score.rs")),
        ["model", "llama", "score"]
    );
}
