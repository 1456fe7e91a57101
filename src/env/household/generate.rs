//! Seeded generation of household task panels, the committed default panels,
//! and the random-policy baseline that shows where the panel's in-region
//! (reachable by chance) and out-region (not) lie.
//!
//! Every task draws from its own ChaCha8 stream keyed by (seed, split, index,
//! attempt), so train and test never share a world seed and no collection's
//! iteration order leaks into the output.

use std::collections::BTreeSet;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::catalog::TaskType;
use super::expert::expert_plan;
use super::room::gen_world;
use super::sim::{Sim, SimError};
use super::world::World;
use crate::env::panel::{SPLIT_TEST, SPLIT_TRAIN};
use crate::env::{GenerateError, Task};

pub use crate::env::panel::{DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN};

/// Share of tasks that start part-way along the expert trajectory, 1–3 steps
/// from the goal (with the few short tasks from the room's middle this gives
/// about 40% of tasks of expert length ≤ 3).
const P_IN_REGION: f64 = 0.4;

/// Stream purposes, so the panel shuffle never reuses a task's stream.
const TAG_TASK: u8 = 0;
const TAG_SHUFFLE: u8 = 1;

fn stream(seed: u64, split: u8, tag: u8, index: u64, attempt: u32) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8] = split;
    key[9] = tag;
    key[10..18].copy_from_slice(&index.to_le_bytes());
    key[18..22].copy_from_slice(&attempt.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// Why an expert plan does not solve its world.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum ExpertError {
    #[error(transparent)]
    World(#[from] SimError),
    #[error("empty plan")]
    Empty,
    #[error("step {step}: {action:?} not admissible")]
    NotAdmissible { step: usize, action: String },
    #[error("step {step}: {action:?} -> {feedback}")]
    Invalid {
        step: usize,
        action: String,
        feedback: String,
    },
    #[error("step {step}: success flag wrong after {action:?}")]
    SuccessFlag { step: usize, action: String },
}

/// Run `plan` from `world`: every step must be admissible when issued and
/// valid, and the goal must be met after the last step and not before.
pub(crate) fn check_expert(world: &World, plan: &[String]) -> Result<(), ExpertError> {
    let mut sim = Sim::new(world.clone())?;
    if plan.is_empty() {
        return Err(ExpertError::Empty);
    }
    for (step, a) in plan.iter().enumerate() {
        let action = a.clone();
        if !sim.admissible().contains(a) {
            return Err(ExpertError::NotAdmissible { step, action });
        }
        let (feedback, valid) = sim.exec(a);
        if !valid {
            return Err(ExpertError::Invalid {
                step,
                action,
                feedback,
            });
        }
        if sim.satisfied() != (step + 1 == plan.len()) {
            return Err(ExpertError::SuccessFlag { step, action });
        }
    }
    Ok(())
}

/// One task's goal, world and expert; `taken` holds the (goal, world) keys
/// already used anywhere in this generation, so panels never repeat one.
fn make_task(
    seed: u64,
    split: u8,
    index: u64,
    tt: TaskType,
    taken: &mut BTreeSet<String>,
) -> Result<(String, World, Vec<String>), GenerateError> {
    for attempt in 0..10_000 {
        let mut rng = stream(seed, split, TAG_TASK, index, attempt);
        let Some(mut world) = gen_world(&mut rng, tt) else {
            continue;
        };
        let mut plan = expert_plan(&world);
        if check_expert(&world, &plan).is_err() {
            continue;
        }
        // In-region: replay all but the last k expert steps and start there.
        if rng.random_bool(P_IN_REGION) {
            let k = rng.random_range(1..=3);
            if plan.len() > k {
                let Ok(mut sim) = Sim::new(world.clone()) else {
                    continue;
                };
                for action in &plan[..plan.len() - k] {
                    sim.exec(action);
                }
                world = sim.world;
                plan = expert_plan(&world);
                if check_expert(&world, &plan).is_err() {
                    continue;
                }
            }
        }
        let goal = tt.goal_text(
            rng.random_range(0..2),
            &world.goal.object,
            &world.goal.target,
        );
        let key = format!("{goal}\n{}", world_json(&world));
        if taken.insert(key) {
            return Ok((goal, world, plan));
        }
    }
    Err(GenerateError::NoHouseholdWorld {
        task_type: tt.name(),
        index,
    })
}

fn world_json(world: &World) -> serde_json::Value {
    // Plain structs with string keys: serialization cannot fail.
    serde_json::to_value(world).expect("household World serializes")
}

fn panel(
    seed: u64,
    split: u8,
    n: usize,
    taken: &mut BTreeSet<String>,
) -> Result<Vec<Task>, GenerateError> {
    let name = if split == SPLIT_TRAIN {
        "train"
    } else {
        "test"
    };
    let mut tasks: Vec<Task> = (0..n)
        .map(|i| {
            let tt = TaskType::ALL[i % TaskType::ALL.len()];
            let (goal, world, expert) = make_task(seed, split, i as u64, tt, taken)?;
            Ok(Task {
                id: String::new(),
                task_type: tt.name().to_string(),
                goal,
                world: world_json(&world),
                difficulty: expert.len(),
                expert,
            })
        })
        .collect::<Result<_, _>>()?;
    tasks.shuffle(&mut stream(seed, split, TAG_SHUFFLE, 0, 0));
    for (i, t) in tasks.iter_mut().enumerate() {
        t.id = format!("household-{name}-{i:04}");
    }
    Ok(tasks)
}

/// Generate disjoint train and test panels from `seed` (deterministic).
/// Task types cycle through all six, so each panel of ≥ 6 tasks has them all.
pub fn generate_panels(
    seed: u64,
    n_train: usize,
    n_test: usize,
) -> Result<(Vec<Task>, Vec<Task>), GenerateError> {
    let mut taken = BTreeSet::new();
    let train = panel(seed, SPLIT_TRAIN, n_train, &mut taken)?;
    let test = panel(seed, SPLIT_TEST, n_test, &mut taken)?;
    Ok((train, test))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::household::HouseholdEnv;
    use crate::env::household::{expert_plan, split_words, vocabulary, DEFAULT_MAX_STEPS};
    use crate::env::panel::{read_jsonl, to_jsonl};
    use crate::env::Env;
    use crate::env::{random_policy_success, write_default_panels, BuiltinEnv};
    use std::collections::BTreeMap;
    use std::path::Path;

    fn histogram(tasks: &[Task]) -> BTreeMap<usize, usize> {
        let mut h = BTreeMap::new();
        for t in tasks {
            *h.entry(t.difficulty).or_insert(0) += 1;
        }
        h
    }

    /// The committed panels, read back through the panel reader.
    fn committed() -> (Vec<Task>, Vec<Task>) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("envs/household");
        (
            read_jsonl(&dir.join("train.jsonl")).unwrap(),
            read_jsonl(&dir.join("test.jsonl")).unwrap(),
        )
    }

    #[test]
    fn committed_panels_are_regenerated_byte_for_byte() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("envs/household");
        let (train, test) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
        for (file, tasks) in [("train.jsonl", &train), ("test.jsonl", &test)] {
            let on_disk = std::fs::read_to_string(dir.join(file)).unwrap();
            assert!(
                on_disk == to_jsonl(tasks),
                "{file} differs from seed {DEFAULT_SEED}; run write_default_panels"
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        write_default_panels(BuiltinEnv::Household, tmp.path()).unwrap();
        let again = std::fs::read(tmp.path().join("train.jsonl")).unwrap();
        assert_eq!(again, std::fs::read(dir.join("train.jsonl")).unwrap());
    }

    #[test]
    fn generation_is_deterministic_and_seed_dependent() {
        let a = generate_panels(7, 24, 12).unwrap();
        let b = generate_panels(7, 24, 12).unwrap();
        assert_eq!(a, b);
        assert_eq!(to_jsonl(&a.0), to_jsonl(&b.0));
        let c = generate_panels(8, 24, 12).unwrap();
        assert_ne!(a.0, c.0);
    }

    fn check_panel_shape(train: &[Task], test: &[Task]) {
        let key = |t: &Task| format!("{}\n{}", t.goal, t.world);
        let train_keys: BTreeSet<String> = train.iter().map(key).collect();
        assert_eq!(train_keys.len(), train.len(), "duplicate tasks in train");
        assert!(
            test.iter().all(|t| !train_keys.contains(&key(t))),
            "train/test overlap"
        );
        for (panel, name) in [(train, "train"), (test, "test")] {
            let types: BTreeSet<&str> = panel.iter().map(|t| t.task_type.as_str()).collect();
            assert_eq!(types.len(), 6, "{name}: {types:?}");
            for (i, t) in panel.iter().enumerate() {
                assert_eq!(t.id, format!("household-{name}-{i:04}"));
                assert_eq!(t.difficulty, t.expert.len());
                assert!((1..=14).contains(&t.difficulty), "{}", t.id);
                let world = HouseholdEnv::parse_world(t).unwrap();
                assert_eq!(world.goal.task_type.name(), t.task_type);
                let size = world.receptacles.len();
                assert!((6..=12).contains(&size), "{}: {size} receptacles", t.id);
            }
        }
        let short = train.iter().filter(|t| t.difficulty <= 3).count() as f64 / train.len() as f64;
        assert!((0.3..=0.5).contains(&short), "in-region share {short}");
        assert!(train.iter().any(|t| t.difficulty >= 8), "no long tasks");
        // Long tasks start from the middle of the room, as in ALFWorld.
        for t in train.iter().filter(|t| t.difficulty >= 5) {
            let w = HouseholdEnv::parse_world(t).unwrap();
            assert!(
                w.agent.at.is_none() && w.agent.holding.is_none(),
                "{}",
                t.id
            );
        }
    }

    /// The expert through the public env: every action admissible when
    /// issued, success on the last action and not before.
    fn check_experts(tasks: &[Task]) {
        let mut env = HouseholdEnv::new(DEFAULT_MAX_STEPS);
        for t in tasks {
            let mut obs = env.reset(t).unwrap();
            for (i, a) in t.expert.iter().enumerate() {
                assert!(obs.admissible.contains(a), "{}: {a:?} not admissible", t.id);
                obs = env.step(a).unwrap();
                assert!(obs.valid, "{}: {a:?} -> {}", t.id, obs.text);
                assert_eq!(obs.success, i + 1 == t.expert.len(), "{} step {i}", t.id);
            }
            assert_eq!(
                expert_plan(&HouseholdEnv::parse_world(t).unwrap()),
                t.expert,
                "{}: expert is not reproducible",
                t.id
            );
        }
    }

    #[test]
    fn committed_panels_have_the_right_shape_and_experts_succeed() {
        let (train, test) = committed();
        assert_eq!((train.len(), test.len()), (DEFAULT_TRAIN, DEFAULT_TEST));
        check_panel_shape(&train, &test);
        check_experts(&train);
        check_experts(&test);
    }

    #[test]
    fn other_seeds_also_give_sound_panels() {
        let (train, test) = generate_panels(11, 120, 30).unwrap();
        check_panel_shape(&train, &test);
        check_experts(&train);
        check_experts(&test);
    }

    #[test]
    fn random_policy_solves_short_tasks_only() {
        let (train, _) = committed();
        let table = random_policy_success(BuiltinEnv::Household, &train, 40, 20, 3);
        let rate = |pred: &dyn Fn(usize) -> bool| {
            let (n, wins) = table
                .iter()
                .filter(|(d, _, _)| pred(*d))
                .fold((0.0, 0.0), |(n, w), (_, k, r)| {
                    (n + *k as f64, w + *k as f64 * r)
                });
            wins / n
        };
        let short = rate(&|d| d <= 2);
        let long = rate(&|d| d >= 8);
        assert!(short > 0.05, "random success at difficulty <= 2: {short}");
        assert!(long < 0.005, "random success at difficulty >= 8: {long}");
        // Deterministic for a seed.
        assert_eq!(
            table,
            random_policy_success(BuiltinEnv::Household, &train, 40, 20, 3)
        );
    }

    /// Every word the env emits during expert and random rollouts, and every
    /// word of the panels' goals and experts, is in the vocabulary.
    #[test]
    fn vocabulary_covers_everything_emitted() {
        let vocab: BTreeSet<String> = vocabulary().into_iter().collect();
        let mut missing = BTreeSet::new();
        let mut check = |text: &str| {
            for w in split_words(text) {
                if !vocab.contains(w) {
                    missing.insert(w.to_string());
                }
            }
        };
        let (train, test) = committed();
        let mut env = HouseholdEnv::new(30);
        let tasks: Vec<Task> = train.into_iter().chain(test).collect();
        // One expert rollout, then two random ones, per task.
        crate::env::panel::visit_texts(&mut env, &tasks, 5, &mut check);
        assert!(
            missing.is_empty(),
            "words missing from vocabulary(): {missing:?}"
        );
    }

    /// Rewrite the committed panels:
    /// `cargo test --lib write_committed_panels -- --ignored`
    #[test]
    #[ignore]
    fn write_committed_panels() {
        write_default_panels(
            BuiltinEnv::Household,
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("envs/household"),
        )
        .unwrap();
    }

    /// `cargo test --lib household::generate::tests::print_panel_stats -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn print_panel_stats() {
        let (train, test) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
        println!("train histogram {:?}", histogram(&train));
        let mut by_type: BTreeMap<(String, usize), usize> = BTreeMap::new();
        for t in &train {
            *by_type
                .entry((t.task_type.clone(), t.difficulty))
                .or_default() += 1;
        }
        println!("by type {by_type:?}");
        println!("test histogram {:?}", histogram(&test));
        for steps in [20, 50] {
            println!("random policy, max_steps {steps}:");
            for (d, n, rate) in random_policy_success(BuiltinEnv::Household, &train, 100, steps, 1)
            {
                println!("  difficulty {d:2}: {n:3} tasks, success {rate:.3}");
            }
        }
    }
}
