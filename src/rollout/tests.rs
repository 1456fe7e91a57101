//! Tests of the rollout driver (formats, prefixes, env limits).

use super::chat::{self, PromptFormat};
use super::encode::Fmt;
use super::prompt::{self, project};
use super::*;
use crate::env::{Env, Task};
use crate::guidance::ResolvedSpec;
use crate::model::{Policy, Tok};

fn opts(max_steps: usize, step_slack: Option<usize>) -> RolloutOptions {
    RolloutOptions {
        temperature: 1.0,
        top_p: 1.0,
        greedy: false,
        constrained: true,
        history: 1,
        conversation: false,
        invalid_penalty: 0.0,
        max_action_tokens: 8,
        show_actions: true,
        record_prefix: false,
        max_steps,
        step_slack,
        format: PromptFormat::Plain,
        env_concurrency: 1,
        engine: None,
    }
}

/// A tiny random policy whose word-level tokenizer has the ChatML
/// specials (and the tag pieces `<`, `</`, `>`, `action`, `think`).
fn chat_setup() -> (Policy, Tok, Vec<Task>) {
    let mut words: Vec<String> = crate::env::household::vocabulary()
        .iter()
        .map(|w| w.to_lowercase())
        .collect();
    words.extend(["<", "</", ">", "action", "think"].map(String::from));
    words.sort();
    words.dedup();
    let tok =
        Tok::build_word_level(&words, &["[PAD]", "<|im_start|>", "<|im_end|>", "[EOS]"]).unwrap();
    let cfg = crate::tiny::tiny_config(tok.vocab_size());
    let policy = Policy::new_random(
        &cfg,
        &mut crate::seed::rng(7, &[1]),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tasks = crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap();
    (policy, tok, tasks[..2].to_vec())
}

fn household(limit: usize) -> Box<dyn Env> {
    crate::env::make_env(
        &crate::env::EnvSpec::builtin(crate::env::BuiltinEnv::Household),
        limit,
    )
}

/// One request per task, each with `spec`.
fn requests(tasks: &[Task], spec: ResolvedSpec) -> Vec<EpisodeRequest<'_>> {
    tasks
        .iter()
        .map(|t| EpisodeRequest { task: t, spec })
        .collect()
}

#[test]
fn chat_format_violations_are_invalid_with_the_penalty() {
    let (policy, tok, tasks) = chat_setup();
    let stop = tok.token_id("<|im_end|>").unwrap();
    let o = RolloutOptions {
        constrained: false,
        // Too short for `< action > … </ action >`: every answer is a
        // format violation.
        max_action_tokens: 4,
        invalid_penalty: -0.25,
        format: PromptFormat::Chat(None),
        ..opts(3, None)
    };
    let reqs = requests(
        &tasks,
        ResolvedSpec {
            plan: 2,
            ..Default::default()
        },
    );
    let mut rng = crate::seed::rng(7, &[2]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    for ep in &eps {
        assert!(ep.error.is_none(), "{:?}", ep.error);
        assert_eq!(ep.policy_turns, 3);
        assert_eq!(ep.invalid, 3);
        assert!(!ep.success);
        assert!((ep.reward - 3.0 * -0.25).abs() < 1e-12, "{}", ep.reward);
        for t in &ep.turns {
            assert!(!t.valid);
            // The prompt is the rendered template: it starts with
            // `<|im_start|>` and ends with the assistant header.
            assert_eq!(t.prompt_ids[0], tok.token_id("<|im_start|>").unwrap());
            assert!(t.unguided_prompt_ids.is_some());
            assert!(t.action_ids.len() <= 4);
            assert!(t.action_ids[..t.action_ids.len() - 1]
                .iter()
                .all(|&x| x != stop));
        }
    }
    // A bare admissible action without tags is a violation too, and is
    // not executed.
    let fmt = Fmt::new(&policy, &tok, &o).unwrap();
    assert_eq!(fmt.stop, stop);
    let adm = vec!["look".to_string()];
    let (valid, action) = fmt.read("look", &adm);
    assert!(!valid);
    assert!(project(&action, &adm).is_none(), "{action}");
    assert_eq!(
        fmt.read("< action > look </ action >", &adm),
        (true, "look".to_string())
    );
    assert_eq!(
        fmt.read("<action>jump</action>", &adm),
        (false, "jump".to_string())
    );
}

#[test]
fn chat_format_constrained_actions_are_executed() {
    let (policy, tok, tasks) = chat_setup();
    let stop = tok.token_id("<|im_end|>").unwrap();
    let o = RolloutOptions {
        max_action_tokens: 40,
        invalid_penalty: -0.25,
        record_prefix: true,
        format: PromptFormat::Chat(None),
        ..opts(3, None)
    };
    let reqs = requests(
        &tasks,
        ResolvedSpec {
            prefix: 1,
            ..Default::default()
        },
    );
    let mut rng = crate::seed::rng(7, &[3]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    for (ep, task) in eps.iter().zip(&tasks) {
        assert!(ep.error.is_none(), "{:?}", ep.error);
        assert_eq!(ep.invalid, 0);
        assert!(ep.policy_turns >= 1);
        // The executed prefix turn is recorded in the chat format.
        let first = &ep.turns[0];
        assert!(first.prefix);
        let mut want = tok
            .encode(&format!("<action>{}</action>", task.expert[0]))
            .unwrap();
        want.push(stop);
        assert_eq!(first.action_ids, want);
        for (t, a) in ep.turns.iter().zip(&ep.actions) {
            assert!(t.valid);
            assert_eq!(&t.action, a);
            assert_eq!(t.action_ids.last(), Some(&stop));
            let text = tok.decode(&t.action_ids).unwrap();
            assert_eq!(normalize_action(&text), prompt::normalize(a), "{text}");
        }
    }
    // No chat specials: a clear error.
    let plain = crate::tiny::tiny_tokenizer().unwrap();
    let e = run(&policy, &plain, &household, &reqs, &o, &mut rng, None).unwrap_err();
    assert!(e.to_string().contains("chat special tokens"), "{e}");
}

/// In the conversation layout every turn's prompt and answer are a prefix
/// of the next turn's prompt (guided and unguided alike), the first prompt
/// is the window layout's, and the packed scorer runs an episode's turns
/// through the trunk once: as many tokens as its longest turn.
#[test]
fn conversation_turns_extend_each_other_and_score_in_one_pass() {
    let (policy, tok, tasks) = chat_setup();
    let o = RolloutOptions {
        max_action_tokens: 40,
        format: PromptFormat::Chat(None),
        conversation: true,
        ..opts(4, None)
    };
    let reqs = requests(
        &tasks,
        ResolvedSpec {
            plan: 2,
            ..Default::default()
        },
    );
    let mut rng = crate::seed::rng(7, &[4]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    let window = RolloutOptions {
        conversation: false,
        ..o.clone()
    };
    let mut rng = crate::seed::rng(7, &[4]);
    let (flat, _) = run(&policy, &tok, &household, &reqs, &window, &mut rng, None).unwrap();
    for (ep, flat) in eps.iter().zip(&flat) {
        assert!(ep.error.is_none(), "{:?}", ep.error);
        assert!(ep.turns.len() >= 3, "{}", ep.turns.len());
        assert_eq!(ep.turns[0].prompt_ids, flat.turns[0].prompt_ids);
        for w in ep.turns.windows(2) {
            let mut seq = w[0].prompt_ids.clone();
            seq.extend(&w[0].action_ids);
            assert!(
                w[1].prompt_ids.starts_with(&seq),
                "turn prompt does not extend the last"
            );
            let unguided = |t: &Turn| t.unguided_prompt_ids.clone().unwrap();
            let mut seq = unguided(&w[0]);
            seq.extend(&w[0].action_ids);
            assert!(unguided(&w[1]).starts_with(&seq));
        }
        let seqs: Vec<Vec<u32>> = ep
            .turns
            .iter()
            .map(|t| [t.prompt_ids.clone(), t.action_ids.clone()].concat())
            .collect();
        let score = |share: bool| {
            let batch = crate::model::ScoreBatch {
                targets: seqs.iter().map(|s| vec![s.len() - 1]).collect(),
                seqs: seqs.clone(),
                temperature: 1.0,
                share_prefixes: share,
            };
            let out = policy.score(&batch).unwrap();
            (out.trunk_tokens, out.logp.to_vec1::<f32>().unwrap())
        };
        let (packed, lp) = score(true);
        let (padded, lp_flat) = score(false);
        // The trunk runs each sequence up to its last target (its last
        // token is only scored): the longest turn less one token.
        assert_eq!(packed, seqs.iter().map(Vec::len).max().unwrap() - 1);
        // Unpacked, every turn runs whole (and padded).
        let whole: usize = seqs.iter().map(|s| s.len() - 1).sum();
        assert!(
            padded >= whole && whole >= 2 * packed,
            "{padded} {whole} {packed}"
        );
        for (a, b) in lp.iter().zip(&lp_flat) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

fn normalize_action(text: &str) -> String {
    prompt::normalize(&chat::parse_action(text).unwrap())
}

#[test]
fn env_limit_counts_policy_actions_on_top_of_the_prefix() {
    assert_eq!(opts(8, None).env_limit(6, 0), 8);
    assert_eq!(opts(8, None).env_limit(6, 4), 12);
    // With slack: expert actions left + slack, capped by max_steps.
    assert_eq!(opts(8, Some(2)).env_limit(6, 4), 4 + 4);
    assert_eq!(opts(8, Some(2)).env_limit(10, 0), 8);
    assert_eq!(opts(8, Some(0)).env_limit(3, 3), 3 + 1);
}

/// One episode of household test task 0, with its expert action `bogus`
/// replaced by one the env does not know, under a planned prefix of 3.
fn episode_with_inadmissible_expert(bogus: usize) -> (Task, Episode) {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut task =
        crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap()[0].clone();
    assert!(task.expert.len() >= 3);
    task.expert[bogus] = "teleport to the moon".into();
    let tok = crate::tiny::tiny_tokenizer().unwrap();
    let cfg = crate::tiny::tiny_config(tok.vocab_size());
    let policy = Policy::new_random(
        &cfg,
        &mut crate::seed::rng(7, &[1]),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let o = RolloutOptions {
        record_prefix: true,
        ..opts(4, None)
    };
    let reqs = [EpisodeRequest {
        task: &task,
        spec: ResolvedSpec {
            prefix: 3,
            ..Default::default()
        },
    }];
    let mut rng = crate::seed::rng(7, &[3]);
    let (mut eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    let ep = eps.pop().unwrap();
    (task, ep)
}

#[test]
fn an_inadmissible_expert_action_is_neither_executed_nor_recorded() {
    // The second expert action is one the env does not know.
    let (task, ep) = episode_with_inadmissible_expert(1);
    assert_eq!(
        ep.expert_inadmissible.as_deref(),
        Some("teleport to the moon")
    );
    assert!(ep.error.is_none(), "{:?}", ep.error);
    // Only the first expert action ran and was recorded as a prefix turn.
    assert_eq!(ep.actions[0], task.expert[0]);
    assert!(!ep.actions.iter().any(|a| a == "teleport to the moon"));
    let prefix: Vec<&Turn> = ep.turns.iter().filter(|t| t.prefix).collect();
    assert_eq!(prefix.len(), 1);
    assert_eq!(prefix[0].action, task.expert[0]);
    assert_eq!((ep.spec.prefix, ep.prefix_executed), (3, 1));
}

#[test]
fn a_prefix_stopped_at_its_first_expert_action_executed_nothing() {
    let (_, ep) = episode_with_inadmissible_expert(0);
    assert_eq!(
        ep.expert_inadmissible.as_deref(),
        Some("teleport to the moon")
    );
    // Planned 3, executed none: the policy acted from the start.
    assert_eq!((ep.spec.prefix, ep.prefix_executed), (3, 0));
    assert!(!ep.turns.iter().any(|t| t.prefix));
    assert!(ep.policy_turns > 0);
}

#[test]
fn the_plain_format_needs_an_eos_token() {
    let tok = crate::tiny::tiny_tokenizer().unwrap();
    let mut cfg = crate::tiny::tiny_config(tok.vocab_size());
    cfg.eos_token_id = None;
    let policy = Policy::new_random(
        &cfg,
        &mut crate::seed::rng(7, &[1]),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let task =
        crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap()[0].clone();
    let reqs = [EpisodeRequest {
        task: &task,
        spec: ResolvedSpec::default(),
    }];
    let mut rng = crate::seed::rng(7, &[3]);
    let e = run(
        &policy,
        &tok,
        &household,
        &reqs,
        &opts(4, None),
        &mut rng,
        None,
    )
    .unwrap_err();
    assert!(matches!(e, RolloutError::NoEos), "{e}");
    assert!(e.to_string().contains("no eos_token_id"), "{e}");
}

/// A tiny random policy whose tokenizer lacks the household word `word`.
fn setup_without(word: &str) -> (Policy, Tok) {
    let words: Vec<String> = crate::env::household::vocabulary()
        .iter()
        .map(|w| w.to_lowercase())
        .filter(|w| w != word)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let tok = Tok::build_word_level(&words, &["[PAD]", "[EOS]"]).unwrap();
    let mut cfg = crate::tiny::tiny_config(tok.vocab_size());
    cfg.eos_token_id = tok.token_id("[EOS]");
    let policy = Policy::new_random(
        &cfg,
        &mut crate::seed::rng(7, &[1]),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    (policy, tok)
}

#[test]
fn unencodable_expert_actions_run_but_are_recorded_for_no_loss() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let task =
        crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap()[0].clone();
    assert!(task.expert.len() >= 3);
    // A word of the second expert action only (not of the first or third).
    let word = task.expert[1]
        .split_whitespace()
        .find(|w| {
            w.chars().all(char::is_alphabetic)
                && !task.expert[0].contains(*w)
                && !task.expert[2].contains(*w)
        })
        .expect("a word only the second action has")
        .to_string();
    let (policy, tok) = setup_without(&word);
    let o = RolloutOptions {
        record_prefix: true,
        ..opts(4, None)
    };
    let reqs = [EpisodeRequest {
        task: &task,
        spec: ResolvedSpec {
            prefix: 3,
            ..Default::default()
        },
    }];
    let mut rng = crate::seed::rng(7, &[3]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    let ep = &eps[0];
    assert!(ep.error.is_none(), "{:?}", ep.error);
    // The env got all three actions as written…
    assert_eq!(ep.actions[..3], task.expert[..3]);
    // …the second is reported with its word, and only the others became
    // (trainable) prefix turns.
    assert_eq!(ep.unencodable, vec![(task.expert[1].clone(), vec![word])]);
    let prefix: Vec<&str> = ep
        .turns
        .iter()
        .filter(|t| t.prefix)
        .map(|t| t.action.as_str())
        .collect();
    assert_eq!(prefix, [task.expert[0].as_str(), task.expert[2].as_str()]);
}

#[test]
fn answers_holding_the_unknown_token_are_counted_and_never_trained() {
    let (policy, tok) = setup_without("cabinet");
    let unk = tok.token_id("[UNK]").unwrap();
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tasks = crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap();
    // Free decoding from a random policy: some answers hold [UNK].
    let o = RolloutOptions {
        constrained: false,
        ..opts(4, None)
    };
    let reqs: Vec<EpisodeRequest> = tasks[..8]
        .iter()
        .map(|t| EpisodeRequest {
            task: t,
            spec: ResolvedSpec::default(),
        })
        .collect();
    let mut rng = crate::seed::rng(7, &[4]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    let mut with_unk = 0;
    for ep in &eps {
        let marked: Vec<&Turn> = ep.turns.iter().filter(|t| t.unencodable).collect();
        for t in &ep.turns {
            assert_eq!(t.unencodable, t.action_ids.contains(&unk));
        }
        assert_eq!(ep.unencodable.len(), marked.len());
        for ((a, words), t) in ep.unencodable.iter().zip(&marked) {
            assert_eq!(a, &t.action);
            assert_eq!(words, &["[UNK]"]);
        }
        with_unk += marked.len();
    }
    assert!(
        with_unk > 0,
        "no answer held [UNK]: the test proves nothing"
    );
    // No sample trains on them.
    let advantages: crate::train::Advantages = vec![1.0; eps.len()].into();
    let samples =
        crate::train::build_samples(&eps, &advantages, &crate::train::SampleOptions::default());
    let trained: usize = eps
        .iter()
        .map(|e| e.turns.iter().filter(|t| !t.unencodable).count())
        .sum();
    assert_eq!(samples.len(), trained);
    assert!(samples
        .iter()
        .all(|s| !s.seq.contains(&unk) || s.targets.iter().all(|&i| s.seq[i] != unk)));
}

#[test]
fn turns_record_their_state_and_their_share_of_the_reward() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let task =
        crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap()[0].clone();
    let tok = crate::tiny::tiny_tokenizer().unwrap();
    let cfg = crate::tiny::tiny_config(tok.vocab_size());
    let policy = Policy::new_random(
        &cfg,
        &mut crate::seed::rng(7, &[1]),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    // Unconstrained: the untrained policy's actions are mostly invalid.
    let o = RolloutOptions {
        constrained: false,
        max_action_tokens: 4,
        invalid_penalty: -0.25,
        record_prefix: true,
        ..opts(3, None)
    };
    let spec = |prefix| ResolvedSpec {
        prefix,
        ..Default::default()
    };
    let reqs = [0, 0, 1].map(|p| EpisodeRequest {
        task: &task,
        spec: spec(p),
    });
    let mut rng = crate::seed::rng(7, &[4]);
    let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
    // The states by hand: the start, and after the first expert action.
    let mut env = household(10);
    let first = env.reset(&task).unwrap();
    let start = state_text(&env.status(), &first.text);
    let after = env.step(&task.expert[0]).unwrap();
    let next = state_text(&env.status(), &after.text);
    assert_eq!(eps[0].turns[0].state, start);
    assert_eq!(eps[1].turns[0].state, start);
    assert!(eps[2].turns[0].prefix);
    assert_eq!(eps[2].turns[0].state, start);
    assert_eq!(eps[2].turns[1].state, next);
    let invalid = eps.iter().map(|e| e.invalid).sum::<usize>();
    assert!(invalid > 0, "no invalid action to test the penalty with");
    for ep in &eps {
        assert!(ep.error.is_none(), "{:?}", ep.error);
        let sum: f64 = ep.turns.iter().map(|t| t.reward).sum();
        assert!((sum - ep.reward).abs() < 1e-12, "{sum} vs {}", ep.reward);
        for t in ep.turns.iter().filter(|t| t.is_policy() && !t.valid) {
            assert!(t.reward <= -0.25, "{}", t.reward);
        }
        assert!(ep.turns.iter().all(|t| !t.state.is_empty()));
    }
}
