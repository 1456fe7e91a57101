//! Task panel files: JSON Lines, one [`Task`] per line.
//!
//! Panels are committed, so writing is canonical (fixed field order
//! id, type, goal, world, expert, difficulty; object keys inside `world`
//! sorted; compact) and byte-identical for the same tasks, whatever serde_json
//! features other crates switch on. Reading reports the file and 1-based line
//! of any bad line and rejects duplicate ids.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Task;

#[derive(Debug, thiserror::Error)]
pub enum PanelError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {msg}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{}:{line}: duplicate task id {id:?} (first on line {first})", path.display())]
    DuplicateId {
        path: PathBuf,
        line: usize,
        id: String,
        first: usize,
    },
    /// `set_world_key` on a task whose world is not a JSON object.
    #[error("task {task:?}: its world is not a JSON object, so it has no keys to set")]
    WorldNotObject { task: String },
    /// A panel with no task: nothing to train or evaluate on.
    #[error("{}: the panel has no tasks (one JSON task per line)", path.display())]
    Empty { path: PathBuf },
    /// A file or a line past what a panel may hold: refused before it is
    /// parsed, since every task's text is tokenised and rendered into
    /// prompts many times over.
    #[error("{}{}: {what} is {size} bytes, over the limit of {limit} bytes", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    TooLarge {
        path: PathBuf,
        line: Option<usize>,
        what: &'static str,
        size: u64,
        limit: u64,
    },
}

/// The largest task line a panel may hold (about a thousand times the
/// longest task of the built-in envs).
pub const MAX_LINE_BYTES: u64 = 1 << 20;
/// The largest panel file.
pub const MAX_PANEL_BYTES: u64 = 256 << 20;

/// Seed of every built-in env's committed panels
/// `envs/<env>/{train,test}.jsonl`.
pub const DEFAULT_SEED: u64 = 2026;
/// Size of a committed train panel.
pub const DEFAULT_TRAIN: usize = 256;
/// Size of a committed test panel.
pub const DEFAULT_TEST: usize = 64;
/// The split a generator's seed streams are drawn for (train and test
/// never share a stream).
pub(crate) const SPLIT_TRAIN: u8 = 0;
pub(crate) const SPLIT_TEST: u8 = 1;

/// Read a panel. Blank lines are skipped; line numbers in errors are
/// 1-based; a panel without tasks is an error.
pub fn read_jsonl(path: &Path) -> Result<Vec<Task>, PanelError> {
    let io = |source| PanelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let size = std::fs::metadata(path).map_err(io)?.len();
    if size > MAX_PANEL_BYTES {
        return Err(PanelError::TooLarge {
            path: path.to_path_buf(),
            line: None,
            what: "the panel",
            size,
            limit: MAX_PANEL_BYTES,
        });
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    let mut tasks = Vec::new();
    let mut first_line: BTreeMap<String, usize> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        if line.len() as u64 > MAX_LINE_BYTES {
            return Err(PanelError::TooLarge {
                path: path.to_path_buf(),
                line: Some(line_no),
                what: "a task line",
                size: line.len() as u64,
                limit: MAX_LINE_BYTES,
            });
        }
        let task: Task = serde_json::from_str(line).map_err(|e| PanelError::Parse {
            path: path.to_path_buf(),
            line: line_no,
            msg: e.to_string(),
        })?;
        if let Some(&first) = first_line.get(&task.id) {
            return Err(PanelError::DuplicateId {
                path: path.to_path_buf(),
                line: line_no,
                id: task.id,
                first,
            });
        }
        first_line.insert(task.id.clone(), line_no);
        tasks.push(task);
    }
    if tasks.is_empty() {
        return Err(PanelError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(tasks)
}

/// The canonical JSON Lines text of `tasks` (what [`write_jsonl`] writes).
pub fn to_jsonl(tasks: &[Task]) -> String {
    let mut out = String::new();
    for t in tasks {
        out.push_str("{\"id\":");
        out.push_str(&Value::from(t.id.as_str()).to_string());
        out.push_str(",\"type\":");
        out.push_str(&Value::from(t.task_type.as_str()).to_string());
        out.push_str(",\"goal\":");
        out.push_str(&Value::from(t.goal.as_str()).to_string());
        out.push_str(",\"world\":");
        canonical(&t.world, &mut out);
        out.push_str(",\"expert\":[");
        for (i, a) in t.expert.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&Value::from(a.as_str()).to_string());
        }
        out.push_str("],\"difficulty\":");
        out.push_str(&t.difficulty.to_string());
        out.push_str("}\n");
    }
    out
}

/// Compact JSON with object keys sorted (serde_json's own escaping).
fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(k.as_str()).to_string());
                out.push(':');
                canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// Which tasks of a panel to keep (`actguide tasks select`). Every given
/// condition must hold; `first` applies last, in file order, so a
/// selection of a committed panel is reproducible.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// Keep tasks with at least this many expert actions.
    pub min_expert: Option<usize>,
    /// Keep tasks with at most this many expert actions.
    pub max_expert: Option<usize>,
    /// Keep these task types (empty: every type).
    pub types: Vec<String>,
    /// Then keep the first this many.
    pub first: Option<usize>,
}

/// The tasks of `tasks` that `s` keeps, in their order.
pub fn select(tasks: &[Task], s: &Selection) -> Vec<Task> {
    tasks
        .iter()
        .filter(|t| s.min_expert.is_none_or(|m| t.expert.len() >= m))
        .filter(|t| s.max_expert.is_none_or(|m| t.expert.len() <= m))
        .filter(|t| s.types.is_empty() || s.types.contains(&t.task_type))
        .take(s.first.unwrap_or(usize::MAX))
        .cloned()
        .collect()
}

/// Set `key` in every task's world to `value` (a regime knob such as
/// household's `reveal`); a world that is not a JSON object is refused
/// with its task.
pub fn set_world_key(
    tasks: &mut [Task],
    key: &str,
    value: &serde_json::Value,
) -> Result<(), PanelError> {
    for t in tasks {
        match t.world.as_object_mut() {
            Some(m) => {
                m.insert(key.to_string(), value.clone());
            }
            None => {
                return Err(PanelError::WorldNotObject { task: t.id.clone() });
            }
        }
    }
    Ok(())
}

/// Keep the expert actions of a seeded share of the tasks and clear the
/// rest (their `difficulty` stays): a scarce-data panel, on which behaviour
/// cloning sees only the kept trajectories and guidance has none for the
/// other tasks, while RL still trains on every task. `round(share · N)`
/// tasks keep theirs, drawn by `seed`. Returns how many kept them.
pub fn keep_expert_share(tasks: &mut [Task], share: f64, seed: u64) -> usize {
    use rand::seq::SliceRandom;
    let n = tasks.len();
    let keep = ((share.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut crate::seed::rng(
        seed,
        &[crate::seed::label("expert-share")],
    ));
    let kept: std::collections::BTreeSet<usize> = order[..keep].iter().copied().collect();
    for (i, t) in tasks.iter_mut().enumerate() {
        if !kept.contains(&i) {
            t.expert.clear();
        }
    }
    keep
}

/// Write a panel (creating the parent directory if needed).
pub fn write_jsonl(path: &Path, tasks: &[Task]) -> Result<(), PanelError> {
    let io = |source| PanelError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::write(path, to_jsonl(tasks)).map_err(io)
}

/// Write a train/test pair as `dir/train.jsonl` and `dir/test.jsonl`.
pub fn write_panels(dir: &Path, train: &[Task], test: &[Task]) -> Result<(), PanelError> {
    write_jsonl(&dir.join("train.jsonl"), train)?;
    write_jsonl(&dir.join("test.jsonl"), test)
}

/// Success rate of a uniformly random admissible-action policy in `env`,
/// per difficulty: `(difficulty, tasks, success rate)` sorted by
/// difficulty. Rollouts the env failed count as failures here;
/// [`random_policy_stats`] also says which.
pub fn random_policy_success(
    env: &mut dyn crate::env::Env,
    tasks: &[Task],
    rollouts: usize,
    seed: u64,
) -> Vec<(usize, usize, f64)> {
    random_policy_stats(env, tasks, rollouts, seed).table
}

/// What [`random_policy_stats`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomPolicyStats {
    /// `(difficulty, tasks, success rate)` sorted by difficulty.
    pub table: Vec<(usize, usize, f64)>,
    /// Rollouts the env failed (reset or step), with the task and reason;
    /// they count as failures in `table`.
    pub env_errors: Vec<(String, String)>,
}

/// [`random_policy_success`] with the env's failures listed.
pub fn random_policy_stats(
    env: &mut dyn crate::env::Env,
    tasks: &[Task],
    rollouts: usize,
    seed: u64,
) -> RandomPolicyStats {
    use rand::seq::IndexedRandom;
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // difficulty → (tasks, successes)
    let mut by: std::collections::BTreeMap<usize, (usize, usize)> = Default::default();
    let mut env_errors = Vec::new();
    for task in tasks {
        let entry = by.entry(task.difficulty).or_default();
        entry.0 += 1;
        for _ in 0..rollouts {
            let mut obs = match env.reset(task) {
                Ok(o) => o,
                Err(e) => {
                    env_errors.push((task.id.clone(), format!("reset: {e}")));
                    break;
                }
            };
            while !obs.done {
                let Some(action) = obs.admissible.choose(&mut rng).cloned() else {
                    break;
                };
                match env.step(&action) {
                    Ok(next) => obs = next,
                    Err(e) => {
                        env_errors.push((task.id.clone(), format!("step: {e}")));
                        break;
                    }
                }
            }
            entry.1 += usize::from(obs.success);
        }
    }
    RandomPolicyStats {
        table: by
            .into_iter()
            .map(|(d, (n, wins))| (d, n, wins as f64 / (n * rollouts).max(1) as f64))
            .collect(),
        env_errors,
    }
}

/// Feed `check` every text an env shows over `tasks`: each goal and
/// expert action, and per task one expert rollout and two random ones
/// (observations, admissible actions, status lines). The envs' vocabulary
/// tests use it to prove their word lists cover everything emitted.
#[cfg(test)]
pub(crate) fn visit_texts(
    env: &mut dyn crate::env::Env,
    tasks: &[Task],
    seed: u64,
    check: &mut dyn FnMut(&str),
) {
    use rand::seq::IndexedRandom;
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for t in tasks {
        check(&t.goal);
        t.expert.iter().for_each(|a| check(a));
        for rollout in 0..3 {
            let mut obs = env.reset(t).expect("reset");
            check(&env.status());
            let mut i = 0;
            while !obs.done {
                check(&obs.text);
                obs.admissible.iter().for_each(|a| check(a));
                let action = match rollout {
                    0 => t.expert[i].clone(),
                    _ => obs.admissible.choose(&mut rng).expect("an action").clone(),
                };
                i += 1;
                obs = env.step(&action).expect("step");
                check(&env.status());
            }
            check(&obs.text);
        }
    }
}

#[cfg(test)]
mod selection_tests {
    use super::*;

    #[test]
    fn an_expert_share_keeps_a_seeded_subset_and_the_difficulties() {
        let tasks: Vec<Task> = (0..20)
            .map(|i| Task {
                id: format!("t{i}"),
                task_type: "t".into(),
                goal: "g".into(),
                world: Value::Null,
                expert: vec!["a".into(); 1 + i % 4],
                difficulty: 1 + i % 4,
            })
            .collect();
        let kept = |share: f64, seed: u64| {
            let mut t = tasks.clone();
            let n = keep_expert_share(&mut t, share, seed);
            let ids: Vec<String> = t
                .iter()
                .filter(|t| !t.expert.is_empty())
                .map(|t| t.id.clone())
                .collect();
            assert_eq!(ids.len(), n);
            assert!(t
                .iter()
                .zip(&tasks)
                .all(|(a, b)| a.difficulty == b.difficulty));
            ids
        };
        assert_eq!(kept(0.25, 1).len(), 5);
        assert_eq!(kept(0.25, 1), kept(0.25, 1), "same seed, same tasks");
        assert_ne!(kept(0.25, 1), kept(0.25, 2));
        assert_eq!(kept(1.0, 1).len(), 20);
        assert!(kept(0.0, 1).is_empty());
    }

    #[test]
    fn oversized_lines_are_refused_with_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        let ok = r#"{"id":"a","type":"t","goal":"g","world":{},"expert":["x"],"difficulty":1}"#;
        let big = format!(
            r#"{{"id":"b","type":"t","goal":"{}","world":{{}},"expert":["x"],"difficulty":1}}"#,
            "w ".repeat(MAX_LINE_BYTES as usize)
        );
        std::fs::write(&p, format!("{ok}\n\n{big}\n")).unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:3: a task line is "), "{e}");
        assert!(e.contains("over the limit of 1048576 bytes"), "{e}");
        std::fs::write(&p, format!("{ok}\n")).unwrap();
        assert_eq!(read_jsonl(&p).unwrap().len(), 1);
    }

    fn committed(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("envs/household")
            .join(name)
    }

    #[test]
    fn selections_keep_order_and_every_condition() {
        let train = read_jsonl(&committed("train.jsonl")).unwrap();
        let long = select(
            &train,
            &Selection {
                min_expert: Some(5),
                ..Default::default()
            },
        );
        assert!(!long.is_empty() && long.iter().all(|t| t.expert.len() >= 5));
        let n_long = train.iter().filter(|t| t.expert.len() >= 5).count();
        assert_eq!(long.len(), n_long);
        // File order is kept.
        let pos = |id: &str| train.iter().position(|t| t.id == id).unwrap();
        assert!(long.windows(2).all(|w| pos(&w[0].id) < pos(&w[1].id)));
        let some = select(
            &train,
            &Selection {
                max_expert: Some(4),
                types: vec!["pick_clean_then_place".into()],
                first: Some(3),
                ..Default::default()
            },
        );
        assert_eq!(some.len(), 3);
        assert!(some
            .iter()
            .all(|t| t.expert.len() <= 4 && t.task_type == "pick_clean_then_place"));
    }

    /// The barrier benchmark's panels are selections of the committed
    /// household panels (`actguide tasks select … --min-expert 5`), and
    /// selecting again gives the committed files byte for byte.
    #[test]
    fn the_barrier_panels_are_reproducible_selections() {
        let long = |src: &str, first: Option<usize>| {
            to_jsonl(&select(
                &read_jsonl(&committed(src)).unwrap(),
                &Selection {
                    min_expert: Some(5),
                    first,
                    ..Default::default()
                },
            ))
        };
        let train = std::fs::read_to_string(committed("long24.jsonl")).unwrap();
        let test = std::fs::read_to_string(committed("long_test.jsonl")).unwrap();
        assert_eq!(long("train.jsonl", Some(24)), train);
        assert_eq!(long("test.jsonl", None), test);
        assert_eq!(train.lines().count(), 24);
        assert_eq!(test.lines().count(), 32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str) -> Task {
        Task {
            id: id.into(),
            task_type: "pick_and_place".into(),
            goal: "put a \"mug\" in cabinet".into(),
            world: serde_json::json!({"z": 1, "a": {"y": [1, 2], "b": null}}),
            expert: vec!["go to cabinet 1".into(), "move mug 1 to cabinet 1".into()],
            difficulty: 2,
        }
    }

    #[test]
    fn roundtrip_is_canonical_and_byte_identical() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/panel.jsonl");
        let tasks = vec![task("a"), task("b")];
        write_jsonl(&path, &tasks).unwrap();
        let first = std::fs::read(&path).unwrap();
        assert_eq!(read_jsonl(&path).unwrap(), tasks);
        write_jsonl(&path, &read_jsonl(&path).unwrap()).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), first);
        let text = String::from_utf8(first).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            r#"{"id":"a","type":"pick_and_place","goal":"put a \"mug\" in cabinet","world":{"a":{"b":null,"y":[1,2]},"z":1},"expert":["go to cabinet 1","move mug 1 to cabinet 1"],"difficulty":2}"#
        );
    }

    #[test]
    fn malformed_line_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.jsonl");
        let good = to_jsonl(&[task("a")]);
        std::fs::write(&path, format!("{good}\n{{\"id\": \"b\", oops\n")).unwrap();
        let err = read_jsonl(&path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, PanelError::Parse { line: 3, .. }), "{msg}");
        assert!(msg.contains("bad.jsonl:3:"), "{msg}");
        // A well-formed object missing fields is also a parse error.
        std::fs::write(&path, "{\"id\":\"x\"}\n").unwrap();
        let msg = read_jsonl(&path).unwrap_err().to_string();
        assert!(
            msg.contains(":1:") && msg.contains("missing field"),
            "{msg}"
        );
    }

    #[test]
    fn duplicate_ids_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dup.jsonl");
        std::fs::write(&path, to_jsonl(&[task("a"), task("b"), task("a")])).unwrap();
        let err = read_jsonl(&path).unwrap_err();
        assert!(
            matches!(&err, PanelError::DuplicateId { line: 3, first: 1, id, .. } if id == "a"),
            "{err}"
        );
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let err = read_jsonl(Path::new("/nonexistent/panel.jsonl")).unwrap_err();
        assert!(matches!(err, PanelError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/panel.jsonl"));
    }

    #[test]
    fn an_empty_panel_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("empty.jsonl");
        for text in ["", "\n  \n"] {
            std::fs::write(&path, text).unwrap();
            let err = read_jsonl(&path).unwrap_err();
            assert!(matches!(err, PanelError::Empty { .. }), "{err}");
            assert!(err
                .to_string()
                .contains("empty.jsonl: the panel has no tasks"));
        }
    }
}
