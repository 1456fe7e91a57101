//! Behaviour tests of the searchqa env: the committed panels, the expert,
//! search, scoring, protocol errors, the random baseline and the vocabulary.

use std::collections::BTreeSet;
use std::path::Path;

use super::corpus::corpus;
use super::*;
use crate::env::household::split_words;
use crate::env::panel::{read_jsonl, to_jsonl};
use crate::env::{random_policy_success, write_default_panels, BuiltinEnv};

fn dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("envs/searchqa")
}

/// The committed panels, read back through the panel reader.
fn committed() -> (Vec<Task>, Vec<Task>) {
    (
        read_jsonl(&dir().join("train.jsonl")).unwrap(),
        read_jsonl(&dir().join("test.jsonl")).unwrap(),
    )
}

#[test]
fn committed_panels_are_regenerated_byte_for_byte() {
    let (train, test) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
    for (file, tasks) in [("train.jsonl", &train), ("test.jsonl", &test)] {
        let on_disk = std::fs::read_to_string(dir().join(file)).unwrap();
        assert!(
            on_disk == to_jsonl(tasks),
            "{file} differs from seed {DEFAULT_SEED}; run write_committed_panels"
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    write_default_panels(BuiltinEnv::SearchQa, tmp.path()).unwrap();
    for file in ["train.jsonl", "test.jsonl"] {
        assert_eq!(
            std::fs::read(tmp.path().join(file)).unwrap(),
            std::fs::read(dir().join(file)).unwrap()
        );
    }
}

#[test]
fn generation_is_deterministic_index_stable_and_seed_dependent() {
    let a = generate_panels(7, 24, 12).unwrap();
    let b = generate_panels(7, 24, 12).unwrap();
    assert_eq!(a, b);
    assert_eq!(to_jsonl(&a.0), to_jsonl(&b.0));
    assert_ne!(a.0, generate_panels(8, 24, 12).unwrap().0);
    // A task depends only on (seed, split, index): a longer panel starts
    // with the shorter one.
    let (long_train, long_test) = generate_panels(7, 40, 20).unwrap();
    assert_eq!(&long_train[..24], &a.0[..]);
    assert_eq!(&long_test[..12], &a.1[..]);
}

fn check_panel_shape(train: &[Task], test: &[Task]) {
    let train_q: BTreeSet<&str> = train.iter().map(|t| t.goal.as_str()).collect();
    assert_eq!(train_q.len(), train.len(), "duplicate questions in train");
    let test_q: BTreeSet<&str> = test.iter().map(|t| t.goal.as_str()).collect();
    assert_eq!(test_q.len(), test.len(), "duplicate questions in test");
    assert!(train_q.is_disjoint(&test_q), "train/test share a question");
    for (panel, name) in [(train, "train"), (test, "test")] {
        for (i, t) in panel.iter().enumerate() {
            assert_eq!(t.id, format!("searchqa-{name}-{i:04}"));
            // Difficulty = hops, cycling 1..=4; the expert takes 2·hops + 1.
            assert_eq!(t.difficulty, 1 + i % MAX_HOPS, "{}", t.id);
            assert_eq!(t.expert.len(), 2 * t.difficulty + 1, "{}", t.id);
            let w = SearchQaEnv::parse_world(t).unwrap();
            assert_eq!(w.relations.len(), t.difficulty);
            assert_eq!(w.question, t.goal);
            assert_eq!(w.question, question_text(&w.start, &w.relations));
            assert_eq!(t.task_type, w.relations.last().unwrap().name());
            assert_eq!(expert_actions(&w).as_ref(), Some(&t.expert));
            // The question names the start entity, never the answer.
            assert!(t.goal.contains(&w.start));
            assert!(!t.goal.contains(&w.answer), "{}", t.id);
        }
    }
}

/// Run the expert through the public env: every action admissible when
/// issued and valid, success (reward 1, F1 1) on the last action only.
fn check_experts(tasks: &[Task]) -> usize {
    let mut env = SearchQaEnv::new(DEFAULT_MAX_STEPS);
    let mut wins = 0;
    for t in tasks {
        let mut obs = env.reset(t).unwrap();
        for (i, a) in t.expert.iter().enumerate() {
            assert!(!obs.done, "{}: done before {a:?}", t.id);
            assert!(
                obs.admissible.contains(a),
                "{}: {a:?} not admissible in {:?}",
                t.id,
                obs.admissible
            );
            obs = env.step(a).unwrap();
            assert!(obs.valid, "{}: {a:?} -> {}", t.id, obs.text);
            assert_eq!(obs.success, i + 1 == t.expert.len(), "{} step {i}", t.id);
        }
        assert!(obs.done && obs.reward == 1.0, "{}", t.id);
        assert_eq!(env.answer_f1(), Some(1.0));
        wins += usize::from(obs.success);
    }
    wins
}

#[test]
fn committed_panels_have_the_right_shape_and_the_expert_always_succeeds() {
    let (train, test) = committed();
    assert_eq!((train.len(), test.len()), (DEFAULT_TRAIN, DEFAULT_TEST));
    check_panel_shape(&train, &test);
    assert_eq!(check_experts(&train), train.len());
    assert_eq!(check_experts(&test), test.len());
    // Balanced across hops: 64 per hop count in train, 16 in test.
    for h in 1..=MAX_HOPS {
        assert_eq!(train.iter().filter(|t| t.difficulty == h).count(), 64);
        assert_eq!(test.iter().filter(|t| t.difficulty == h).count(), 16);
    }
    // Many question types, not one template.
    let types: BTreeSet<&str> = train.iter().map(|t| t.task_type.as_str()).collect();
    assert!(types.len() >= 8, "{types:?}");
}

#[test]
fn other_seeds_also_give_sound_panels() {
    let (train, test) = generate_panels(11, 120, 40).unwrap();
    check_panel_shape(&train, &test);
    assert_eq!(check_experts(&train), train.len());
    assert_eq!(check_experts(&test), test.len());
}

#[test]
fn asking_for_more_questions_than_exist_is_a_clear_error() {
    let err = generate_panels(1, 0, 4 * 200).unwrap_err().to_string();
    assert!(err.contains("distinct 1-hop questions"), "{err}");
}

/// Hand-checked: "Harbor Press" occurs three times (title + two facts) in
/// its own short page, d003, and at most once per term elsewhere, except
/// in pages of other "Harbor …" / "… Press" companies, which match only one
/// of the two terms.
#[test]
fn bm25_ranks_the_entity_page_first() {
    let c = corpus();
    let (page, _) = c.render_doc(3);
    assert_eq!(
        page,
        "Document d003, Harbor Press (company): Harbor Press was founded by Elin Brandt. \
         Harbor Press is based in Fallowby."
    );
    let hits = c.index.search("Harbor Press", TOP_K);
    assert_eq!(hits.len(), TOP_K);
    assert_eq!(hits[0].0, 3);
    assert!(hits[0].1 > hits[1].1 && hits[1].1 >= hits[2].1);
    // Case and punctuation do not matter.
    assert_eq!(c.index.search("harbor, PRESS!", TOP_K), hits);

    // The same holds for every page of the corpus.
    let mut not_first = Vec::new();
    for (d, doc) in c.docs.iter().enumerate() {
        let hits = c.index.search(c.name(doc.entity), TOP_K);
        if hits[0].0 != d {
            not_first.push(c.name(doc.entity).to_string());
        }
    }
    assert!(
        not_first.is_empty(),
        "own page not ranked first: {not_first:?}"
    );
}

#[test]
fn tools_feedback_and_admissible_list() {
    let (train, _) = committed();
    // A 2-hop task.
    let t = train.iter().find(|t| t.difficulty == 2).unwrap();
    let w = SearchQaEnv::parse_world(t).unwrap();
    // Room for the malformed actions below.
    let mut env = SearchQaEnv::new(20);
    let obs = env.reset(t).unwrap();
    assert!(obs.text.starts_with(&format!("Question: {}", w.question)));
    assert_eq!(
        obs.admissible,
        vec![
            format!("search[{}]", w.start),
            format!("answer[{}]", w.start)
        ]
    );
    assert_eq!(
        env.status(),
        format!("Question: {} Opened: none. Last search: none.", w.question)
    );

    // Search: 3 lines "dNNN: title — snippet", hits offered to open.
    let obs = env.step(&t.expert[0]).unwrap();
    assert!(obs.valid && !obs.done);
    let lines: Vec<&str> = obs.text.lines().collect();
    assert_eq!(lines[0], format!("Search results for {}:", w.start));
    assert_eq!(lines.len(), 1 + TOP_K);
    assert!(lines[1].starts_with(&format!("{}: {} — ", &t.expert[1][5..9], w.start)));
    let opens: Vec<&String> = obs
        .admissible
        .iter()
        .filter(|a| a.starts_with("open["))
        .collect();
    assert_eq!(opens.len(), TOP_K);
    assert_eq!(opens[0], &t.expert[1]);
    assert!(obs.admissible.len() <= 6 + TOP_K + 6);

    // Open: the page; the next hop's entity is offered for search, the
    // hits of the latest search stay openable.
    let obs = env.step(&t.expert[1]).unwrap();
    assert!(obs.text.starts_with("Document d"), "{}", obs.text);
    assert!(obs.admissible.contains(&t.expert[2]));
    assert!(
        obs.admissible
            .iter()
            .filter(|a| a.starts_with("open["))
            .count()
            == TOP_K
    );
    let id = &t.expert[1][5..9];
    let status = env.status();
    assert!(status.contains(&format!(" Opened: {id}: ")), "{status}");
    assert!(
        status.contains(&format!("Last search: {}; results {id}, ", w.start)),
        "{status}"
    );

    // Malformed and unknown: no-ops with valid = false; the lists survive.
    let before = env.step("open[d999]").unwrap();
    assert!(!before.valid && !before.done);
    assert_eq!(before.text, "There is no document d999.");
    assert!(before.admissible.contains(&t.expert[2]));
    for bad in [
        "hello",
        "search[]",
        "search[  ]",
        "fly[Tarsk]",
        "open d001",
        "answer[x",
    ] {
        let obs = env.step(bad).unwrap();
        assert!(!obs.valid, "{bad}");
        assert!(obs.text.starts_with("Nothing happens."), "{bad}");
    }
    // Free text outside the list still runs, with decoded-model spacing.
    let obs = env.step("Search [ the mayor of tarsk ] .").unwrap();
    assert!(obs.valid && !obs.done);
    assert!(obs
        .text
        .starts_with("Search results for the mayor of tarsk:"));

    // A partly right answer: episode over, reward 0, F1 kept.
    let gold = w.answer.clone();
    let obs = env.step(&format!("answer[{gold} Ashby]")).unwrap();
    assert!(obs.done && !obs.success && obs.reward == 0.0 && obs.valid);
    assert_eq!(obs.text, "Your answer is wrong.");
    assert!(obs.admissible.is_empty());
    let f = env.answer_f1().unwrap();
    assert!(f > 0.0 && f < 1.0, "{f}");
    assert!(env.step(&t.expert[4]).is_err());

    // Normalised exact match: case, articles and punctuation do not matter.
    env.reset(t).unwrap();
    let obs = env
        .step(&format!("ANSWER[ The {}. ]", gold.to_uppercase()))
        .unwrap();
    assert!(obs.success && obs.reward == 1.0 && obs.done);
    assert_eq!(obs.text, "Your answer is correct.");
}

#[test]
fn step_limit_ends_the_episode() {
    let (train, _) = committed();
    let mut env = SearchQaEnv::new(3);
    let t = &train[3];
    let mut obs = env.reset(t).unwrap();
    for i in 0..3 {
        assert!(!obs.done);
        obs = env.step(&t.expert[i]).unwrap();
    }
    assert!(obs.done && !obs.success && obs.reward == 0.0);
    assert!(env.step("answer[x]").is_err());
    // Reset starts over.
    assert!(!env.reset(t).unwrap().done);
}

#[test]
fn protocol_errors_never_panic() {
    let mut env = SearchQaEnv::default();
    assert!(matches!(env.step("search[x]"), Err(EnvError::Other(_))));
    assert_eq!(env.status(), "No task loaded.");
    let (train, _) = committed();
    let good = train[5].clone();
    let bad_world = |world: serde_json::Value| Task {
        world,
        ..good.clone()
    };
    let with = |edits: &[(&str, serde_json::Value)]| {
        let mut w = good.world.clone();
        for (k, v) in edits {
            w[*k] = v.clone();
        }
        w
    };
    use serde_json::json;
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (json!("not an object"), "bad searchqa world"),
        (json!({"question": "q"}), "missing field"),
        (with(&[("corpus", json!("other-corpus"))]), "corpus"),
        (
            with(&[("relations", json!(["born_in", "flies_to"]))]),
            "flies_to",
        ),
        (with(&[("relations", json!([]))]), "no relations"),
        (
            with(&[("start", json!("Nobody Atall"))]),
            "unknown start entity",
        ),
        (with(&[("answer", json!("Atlantis"))]), "does not match"),
        (with(&[("extra", json!(1))]), "unknown field"),
        // A relation that does not apply to the start's kind.
        (
            with(&[("start", json!("Tarsk")), ("relations", json!(["author"]))]),
            "has no author fact",
        ),
    ];
    for (world, want) in cases {
        // A failed reset leaves no episode to step.
        env.reset(&good).unwrap();
        let err = env.reset(&bad_world(world.clone())).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, EnvError::BadTask { task, .. } if *task == good.id),
            "{msg}"
        );
        assert!(msg.contains(want), "{world}: {msg}");
        assert!(env.step("search[Tarsk]").is_err());
        assert_eq!(env.status(), "No task loaded.");
    }
}

#[test]
fn random_policy_success_falls_with_hops() {
    let (train, _) = committed();
    let table = random_policy_success(BuiltinEnv::SearchQa, &train, 16, DEFAULT_MAX_STEPS, 3);
    eprintln!("random admissible policy over the default train panel (16 rollouts each):");
    eprintln!("  hops  tasks  success");
    for (d, n, rate) in &table {
        eprintln!("  {d:4}  {n:5}  {rate:.4}");
    }
    let rate = |h: usize| table.iter().find(|r| r.0 == h).unwrap().2;
    assert_eq!(table.len(), MAX_HOPS);
    // One hop is sometimes solved by chance; from two hops on only lucky
    // guesses among the names on screen remain (a country question has 6
    // possible answers), so success is near 0 and far below one hop's.
    assert!(rate(1) > 0.01, "1-hop random success {}", rate(1));
    for h in 2..=MAX_HOPS {
        assert!(rate(1) > 3.0 * rate(h), "{h}-hop vs 1-hop: {table:?}");
    }
    assert!(rate(4) < 0.01, "4-hop random success {}", rate(4));
    // Deterministic for a seed.
    assert_eq!(
        table,
        random_policy_success(BuiltinEnv::SearchQa, &train, 16, DEFAULT_MAX_STEPS, 3)
    );
}

/// Every word of the questions, observations, admissible actions and status
/// met during expert and random rollouts over both panels is in the
/// vocabulary (compared lower-cased, as the tiny tokenizer does).
#[test]
fn vocabulary_covers_everything_emitted() {
    let vocab = vocabulary();
    assert!(vocab.windows(2).all(|w| w[0] < w[1]), "not sorted/unique");
    assert!(vocab.iter().all(|w| *w == w.to_lowercase()));
    assert!(vocab.len() < 500, "{} words", vocab.len());
    let vocab: BTreeSet<String> = vocab.into_iter().collect();
    let mut missing = BTreeSet::new();
    let mut check = |text: &str| {
        for w in split_words(text) {
            let w = w.to_lowercase();
            if !vocab.contains(&w) {
                missing.insert(w);
            }
        }
    };
    let (train, test) = committed();
    let mut env = SearchQaEnv::default();
    let tasks: Vec<Task> = train.into_iter().chain(test).collect();
    // One expert rollout, then two random ones, per task.
    crate::env::panel::visit_texts(&mut env, &tasks, 5, &mut check);
    // The fixed messages, including the ones rollouts above rarely reach.
    check(NOTHING_HAPPENS);
    check("There is no document d179. No results for Tarsk.");
    // Plan step numbers of the prompt (up to the 9 actions of 4 hops).
    check("1 2 3 4 5 6 7 8 9");
    assert!(
        missing.is_empty(),
        "words missing from vocabulary(): {missing:?}"
    );
}

/// Rewrite the committed panels:
/// `cargo test --lib searchqa::tests::write_committed_panels -- --ignored`
#[test]
#[ignore]
fn write_committed_panels() {
    write_default_panels(BuiltinEnv::SearchQa, &dir()).unwrap();
}

/// `cargo test --lib searchqa::tests::print_panel_stats -- --ignored --nocapture`
#[test]
#[ignore]
fn print_panel_stats() {
    println!(
        "pool sizes (hops, train, test): {:?}",
        generate::pool_sizes(DEFAULT_SEED)
    );
    println!("vocabulary: {} words", vocabulary().len());
    let (train, _) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
    for t in train.iter().take(8) {
        println!("{} [{}] {} -> {:?}", t.id, t.task_type, t.goal, t.expert);
    }
    for (d, n, rate) in
        random_policy_success(BuiltinEnv::SearchQa, &train, 100, DEFAULT_MAX_STEPS, 1)
    {
        println!("  hops {d}: {n:3} tasks, success {rate:.4}");
    }
}
