//! Where a key stands in an experiment file's source: the line:col every
//! positioned config error points at (the loader's and the range table's).

/// The line:col of the last `#{` at the start of a line or after `=` /
/// `return`, else of the last `#{`: where the file's map begins. (1, 1)
/// when there is none.
pub(super) fn map_start(source: &str) -> (usize, usize) {
    let Some(i) = source
        .rfind("\n#{")
        .map(|i| i + 1)
        .or_else(|| source.find("#{"))
    else {
        return (1, 1);
    };
    let before = &source[..i];
    let line = before.matches('\n').count() + 1;
    let col = i - before.rfind('\n').map_or(0, |p| p + 1) + 1;
    (line, col)
}

/// Find `a: … b: … c:` (the path of keys) in the source: the 1-based line
/// and column of the last key. Best effort: (0, 0) when not found.
pub(super) fn locate_key(source: &str, keys: &[String]) -> (usize, usize) {
    let mut from = 0usize;
    let mut found = None;
    for key in keys {
        if key.parse::<usize>().is_ok() {
            continue; // array index: no key in the source
        }
        match find_key_from(source, key, from) {
            Some(i) => {
                found = Some(i);
                from = i + key.len();
            }
            None => break,
        }
    }
    match found {
        Some(i) => {
            let before = &source[..i];
            let line = before.matches('\n').count() + 1;
            let col = i - before.rfind('\n').map(|p| p + 1).unwrap_or(0) + 1;
            (line, col)
        }
        None => (0, 0),
    }
}

fn find_key_from(source: &str, key: &str, from: usize) -> Option<usize> {
    let bytes = source.as_bytes();
    let mut start = from;
    while let Some(off) = source[start..].find(key) {
        let i = start + off;
        let before_ok = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let rest = source[i + key.len()..].trim_start();
        let quoted = i > 0 && bytes[i - 1] == b'"' && rest.starts_with('"');
        let rest = if quoted { rest[1..].trim_start() } else { rest };
        if (before_ok || quoted) && rest.starts_with(':') && !rest.starts_with("::") {
            return Some(if quoted { i - 1 } else { i });
        }
        start = i + key.len();
    }
    None
}
