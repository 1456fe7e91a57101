//! Seeded generation of shop task panels, the expert planner, the committed
//! default panels and the random-policy baseline.
//!
//! A task's goal is drawn WebShop-style from a product of the (fixed)
//! catalog: its type, 1–3 of its attributes, 0–3 of its option values and a
//! price cap just above its price. The expert buys the first product of the
//! goal query's results that satisfies the goal, so its length is
//! `search + next pages + click + options + buy` = 3–8 steps; each task first
//! draws the length it wants (results page 1–3, 0–3 options) and then draws
//! goals until one lands there.
//!
//! Every task draws from its own ChaCha8 streams keyed by (seed, split,
//! purpose, index, attempt). Train and test are disjoint by construction: a
//! goal belongs to the test side iff a fixed hash of its canonical key says
//! so, whatever the seed. Within a split, goals are kept unique by retrying
//! (in index order), so a task's goal depends on (seed, split, index) and on
//! the split's earlier goals only, never on worker or hashing order.

use std::collections::{BTreeMap, BTreeSet};

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::catalog::{catalog, product_type, subset, Product, CATALOG_ID, PAGE_SIZE, TYPES};
use super::sim::{BUY, NEXT};
use super::world::{Goal, World};
use super::ShopEnv;
use crate::env::panel::{SPLIT_TEST, SPLIT_TRAIN};
use crate::env::{Env, EnvError, GenerateError, Task};

pub use crate::env::panel::{DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN};

/// Stream purposes: the wanted difficulty, then the goal attempts.
const TAG_WANT: u8 = 0;
const TAG_GOAL: u8 = 1;

/// Chance of the expert's product being on results page 1, 2, 3.
const PAGE_WEIGHTS: [f64; 3] = [0.45, 0.3, 0.25];
/// Goal attempts at the wanted difficulty before any page is accepted.
const STRICT_ATTEMPTS: u32 = 200;
const MAX_ATTEMPTS: u32 = 2_000;
/// One goal in `TEST_EVERY` (by key hash) belongs to the test side.
const TEST_EVERY: u64 = 4;
/// Distractor queries next to the goal's own on the search page.
const N_DISTRACTORS: usize = 3;

fn stream(seed: u64, split: u8, tag: u8, index: u64, attempt: u32) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8] = split;
    key[9] = tag;
    key[10..18].copy_from_slice(&index.to_le_bytes());
    key[18..22].copy_from_slice(&attempt.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// FNV-1a: a hash fixed by definition (std's hashers may change).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The split a goal may appear in.
fn goal_split(goal: &Goal) -> u8 {
    if fnv1a(&goal.key()).is_multiple_of(TEST_EVERY) {
        SPLIT_TEST
    } else {
        SPLIT_TRAIN
    }
}

/// The expert's actions for `world`: search with the goal's query, page
/// forward to the target, open it, click each required option value in page
/// order, buy. Empty when the target is not in the catalog (a valid world's
/// always is).
pub fn expert_plan(world: &World) -> Vec<String> {
    let cat = catalog();
    let Some(target) = cat.products.get(world.target) else {
        return Vec::new();
    };
    let query = world.goal.query();
    let rank = cat
        .search(&query)
        .iter()
        .position(|&id| id == world.target)
        .unwrap_or(0);
    let mut plan = vec![format!("search[{query}]")];
    plan.extend(std::iter::repeat_n(NEXT.to_string(), rank / PAGE_SIZE));
    plan.push(format!("click[{}]", target.title));
    for (kind, _) in &target.options {
        if let Some(v) = world.goal.options.get(kind) {
            plan.push(format!("click[{v}]"));
        }
    }
    plan.push(BUY.to_string());
    plan
}

/// Every way to require `n` of `p`'s option kinds with one offered value
/// each, as kind → value maps (kinds in page order).
fn option_choices(p: &Product, n: usize) -> Vec<BTreeMap<String, String>> {
    fn go(
        p: &Product,
        from: usize,
        n: usize,
        cur: &mut BTreeMap<String, String>,
        out: &mut Vec<BTreeMap<String, String>>,
    ) {
        if cur.len() == n {
            out.push(cur.clone());
            return;
        }
        for i in from..p.options.len() {
            let (kind, values) = &p.options[i];
            for v in values {
                cur.insert(kind.clone(), v.clone());
                go(p, i + 1, n, cur, out);
                cur.remove(kind);
            }
        }
    }
    let mut out = Vec::new();
    go(p, 0, n, &mut BTreeMap::new(), &mut out);
    out
}

/// Draw a goal with `n_opts` required options whose expert target (the
/// first product of the goal query's results that satisfies it) sits on
/// results page `want_page` (0-based; `None`: any page). Returns the goal,
/// the target's id and its page.
///
/// WebShop-style, the goal is read off a product: a random product of a
/// random type gives 1–`max_attr` attributes (fewer attributes, more
/// products tie at the top of the results); a product `t` of those tied on
/// the wanted page becomes the target, the price cap is the next ten above
/// its price (sometimes ten more), and the option values are drawn among
/// those of `t`'s that every product ranked before `t` lacks or cannot
/// meet within the cap.
pub(crate) fn draw_goal(
    rng: &mut ChaCha8Rng,
    n_opts: usize,
    max_attr: usize,
    want_page: Option<usize>,
) -> Option<(Goal, usize, usize)> {
    let cat = catalog();
    let types: Vec<&str> = TYPES
        .iter()
        .filter(|t| t.options.len() >= n_opts)
        .map(|t| t.name)
        .collect();
    let ty = *types.choose(rng)?;
    let products: Vec<&Product> = cat
        .products
        .iter()
        .filter(|p| p.product_type == ty)
        .collect();
    let p = *products.choose(rng)?;
    let n_attr = rng.random_range(1..=p.attributes.len().min(max_attr.max(1)));
    let attributes: Vec<String> = subset(rng, p.attributes.len(), n_attr)
        .into_iter()
        .map(|i| p.attributes[i].clone())
        .collect();
    let mut goal = Goal {
        product: ty.to_string(),
        attributes,
        options: BTreeMap::new(),
        price_cap: 0,
    };
    let results = cat.search(&goal.query());
    // Products meeting type and attributes, by rank: the only ones that
    // can satisfy the goal, so the only ones the target must beat.
    let fits: Vec<(usize, &Product)> = results
        .iter()
        .enumerate()
        .map(|(rank, &id)| (rank, &cat.products[id]))
        .filter(|(_, q)| {
            q.product_type == ty && goal.attributes.iter().all(|a| q.attributes.contains(a))
        })
        .collect();
    let mut picks: Vec<usize> = (0..fits.len())
        .filter(|&i| want_page.is_none_or(|w| fits[i].0 / PAGE_SIZE == w))
        .collect();
    picks.shuffle(rng);
    let loose = rng.random_bool(0.3);
    for i in picks {
        let (rank, t) = fits[i];
        let tight = (t.price / 10 + 1) * 10;
        let caps = if loose && tight < 100 {
            vec![tight + 10, tight]
        } else {
            vec![tight]
        };
        for cap in caps {
            goal.price_cap = cap;
            let mut choices = option_choices(t, n_opts);
            choices.retain(|opts| {
                goal.options.clone_from(opts);
                !fits[..i].iter().any(|(_, q)| goal.satisfied_by(q))
            });
            if let Some(opts) = choices.choose(rng) {
                goal.options = opts.clone();
                return Some((goal, t.id, rank / PAGE_SIZE));
            }
        }
    }
    None
}

/// Search-page queries: the goal's own and [`N_DISTRACTORS`] plausible
/// others (a sibling type with the same attributes, the same type with one
/// attribute swapped, other types with one of their attributes), shuffled.
fn queries(rng: &mut ChaCha8Rng, goal: &Goal) -> Vec<String> {
    let own = goal.query();
    let mut out = vec![own.clone()];
    let push = |q: String, out: &mut Vec<String>| {
        if out.len() <= N_DISTRACTORS && !out.contains(&q) {
            out.push(q);
        }
    };
    let query = |ty: &str, attrs: &[&str]| {
        let mut q = ty.to_string();
        for a in attrs {
            q.push(' ');
            q.push_str(a);
        }
        q
    };
    let attrs: Vec<&str> = goal.attributes.iter().map(String::as_str).collect();
    if let Some(ty) = product_type(&goal.product) {
        let siblings: Vec<&str> = TYPES
            .iter()
            .filter(|t| t.parent == ty.parent && t.name != ty.name)
            .map(|t| t.name)
            .collect();
        if let Some(sib) = siblings.choose(rng) {
            push(query(sib, &attrs), &mut out);
        }
        let others: Vec<&str> = ty
            .attributes
            .iter()
            .copied()
            .filter(|a| !attrs.contains(a))
            .collect();
        if let Some(swap) = others.choose(rng) {
            let mut swapped = attrs.clone();
            let i = rng.random_range(0..swapped.len());
            swapped[i] = swap;
            push(query(ty.name, &swapped), &mut out);
        }
    }
    // Other types fill the rest (bounded: there are far more than needed).
    for _ in 0..100 {
        if out.len() > N_DISTRACTORS {
            break;
        }
        let Some(t) = TYPES.choose(rng) else { break };
        if t.name == goal.product {
            continue;
        }
        if let Some(a) = t.attributes.choose(rng) {
            push(query(t.name, &[a]), &mut out);
        }
    }
    out.shuffle(rng);
    out
}

/// Why an expert does not solve its task.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExpertError {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("step {step}: {action:?} not admissible")]
    NotAdmissible { step: usize, action: String },
    #[error("step {step}: {action:?} invalid")]
    Invalid { step: usize, action: String },
    #[error("step {step}: success {success} reward {reward}")]
    Outcome {
        step: usize,
        success: bool,
        reward: f32,
    },
}

/// Run the expert through the env: every action admissible and valid,
/// success (reward 1.0) exactly at the last one.
pub(crate) fn check_expert(task: &Task) -> Result<(), ExpertError> {
    let mut env = ShopEnv::new(task.expert.len().max(1));
    let mut obs = env.reset(task)?;
    for (step, a) in task.expert.iter().enumerate() {
        if !obs.admissible.contains(a) {
            let action = a.clone();
            return Err(ExpertError::NotAdmissible { step, action });
        }
        obs = env.step(a)?;
        if !obs.valid {
            let action = a.clone();
            return Err(ExpertError::Invalid { step, action });
        }
        let last = step + 1 == task.expert.len();
        if obs.success != last || (last && obs.reward != 1.0) {
            return Err(ExpertError::Outcome {
                step,
                success: obs.success,
                reward: obs.reward,
            });
        }
    }
    Ok(())
}

fn world_json(world: &World) -> serde_json::Value {
    // Plain structs with string keys: serialization cannot fail.
    serde_json::to_value(world).expect("shop World serializes")
}

/// Task `index` of a split; `taken` holds the split's earlier goal keys.
fn make_task(
    seed: u64,
    split: u8,
    name: &'static str,
    index: usize,
    taken: &mut BTreeSet<String>,
) -> Result<Task, GenerateError> {
    let mut want = stream(seed, split, TAG_WANT, index as u64, 0);
    let u: f64 = want.random();
    let want_page = if u < PAGE_WEIGHTS[0] {
        0
    } else if u < PAGE_WEIGHTS[0] + PAGE_WEIGHTS[1] {
        1
    } else {
        2
    };
    let want_opts = want.random_range(0..=3);
    for attempt in 0..MAX_ATTEMPTS {
        let mut rng = stream(seed, split, TAG_GOAL, index as u64, attempt);
        // Fewer attributes mean more products tie with the goal's at the
        // top of the results, which is what pushes it to later pages.
        let max_attr = 3 - want_page.min(2);
        let want = (attempt < STRICT_ATTEMPTS).then_some(want_page);
        let Some((goal, target, _)) = draw_goal(&mut rng, want_opts, max_attr, want) else {
            continue;
        };
        if goal_split(&goal) != split || taken.contains(&goal.key()) {
            continue;
        }
        let world = World {
            catalog: CATALOG_ID.to_string(),
            queries: queries(&mut rng, &goal),
            goal,
            target,
        };
        if world.validate().is_err() {
            continue;
        }
        let expert = expert_plan(&world);
        let task = Task {
            id: format!("shop-{name}-{index:04}"),
            task_type: world.goal.product.clone(),
            goal: world.goal.instruction(),
            world: world_json(&world),
            difficulty: expert.len(),
            expert,
        };
        if check_expert(&task).is_ok() {
            taken.insert(world.goal.key());
            return Ok(task);
        }
    }
    Err(GenerateError::NoShopGoal { split: name, index })
}

fn panel(seed: u64, split: u8, n: usize) -> Result<Vec<Task>, GenerateError> {
    let name = if split == SPLIT_TRAIN {
        "train"
    } else {
        "test"
    };
    let mut taken = BTreeSet::new();
    (0..n)
        .map(|i| make_task(seed, split, name, i, &mut taken))
        .collect()
}

/// Generate disjoint train and test panels from `seed` (deterministic; the
/// catalog is the same for every seed).
pub fn generate_panels(
    seed: u64,
    n_train: usize,
    n_test: usize,
) -> Result<(Vec<Task>, Vec<Task>), GenerateError> {
    Ok((
        panel(seed, SPLIT_TRAIN, n_train)?,
        panel(seed, SPLIT_TEST, n_test)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::household::split_words;
    use crate::env::panel::{read_jsonl, to_jsonl};
    use crate::env::shop::{vocabulary, DEFAULT_MAX_STEPS};
    use crate::env::{random_policy_success, write_default_panels, BuiltinEnv};
    use std::path::Path;

    fn dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("envs/shop")
    }

    /// The committed panels, read back through the panel reader.
    fn committed() -> (Vec<Task>, Vec<Task>) {
        (
            read_jsonl(&dir().join("train.jsonl")).unwrap(),
            read_jsonl(&dir().join("test.jsonl")).unwrap(),
        )
    }

    fn histogram(tasks: &[Task]) -> BTreeMap<usize, usize> {
        let mut h = BTreeMap::new();
        for t in tasks {
            *h.entry(t.difficulty).or_insert(0) += 1;
        }
        h
    }

    #[test]
    fn committed_panels_are_regenerated_byte_for_byte() {
        let (train, test) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
        for (file, tasks) in [("train.jsonl", &train), ("test.jsonl", &test)] {
            let on_disk = std::fs::read_to_string(dir().join(file)).unwrap();
            assert!(
                on_disk == to_jsonl(tasks),
                "{file} differs from seed {DEFAULT_SEED}; run write_default_panels"
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        write_default_panels(BuiltinEnv::Shop, tmp.path()).unwrap();
        for file in ["train.jsonl", "test.jsonl"] {
            let again = std::fs::read(tmp.path().join(file)).unwrap();
            assert_eq!(again, std::fs::read(dir().join(file)).unwrap());
        }
    }

    #[test]
    fn generation_is_deterministic_prefix_stable_and_seed_dependent() {
        let a = generate_panels(7, 40, 12).unwrap();
        let b = generate_panels(7, 40, 12).unwrap();
        assert_eq!(to_jsonl(&a.0), to_jsonl(&b.0));
        assert_eq!(to_jsonl(&a.1), to_jsonl(&b.1));
        // A task is the same whatever the panel sizes: its goal and cap
        // come from (seed, split, index) and its split's earlier goals.
        let small = generate_panels(7, 10, 3).unwrap();
        assert_eq!(small.0[..], a.0[..10]);
        assert_eq!(small.1[..], a.1[..3]);
        let c = generate_panels(8, 40, 12).unwrap();
        assert_ne!(a.0, c.0);
    }

    fn goal_of(t: &Task) -> Goal {
        ShopEnv::parse_world(t).unwrap().goal
    }

    fn check_panel_shape(train: &[Task], test: &[Task]) {
        let train_keys: BTreeSet<String> = train.iter().map(|t| goal_of(t).key()).collect();
        let test_keys: BTreeSet<String> = test.iter().map(|t| goal_of(t).key()).collect();
        assert_eq!(train_keys.len(), train.len(), "repeated goals in train");
        assert_eq!(test_keys.len(), test.len(), "repeated goals in test");
        assert!(
            train_keys.is_disjoint(&test_keys),
            "train/test goals overlap"
        );
        for (panel, name) in [(train, "train"), (test, "test")] {
            for (i, t) in panel.iter().enumerate() {
                assert_eq!(t.id, format!("shop-{name}-{i:04}"));
                assert_eq!(t.difficulty, t.expert.len());
                assert!((3..=8).contains(&t.difficulty), "{}", t.id);
                let world = ShopEnv::parse_world(t).unwrap();
                assert_eq!(t.goal, world.goal.instruction());
                assert_eq!(t.task_type, world.goal.product);
                assert_eq!(world.queries.len(), 1 + N_DISTRACTORS, "{}", t.id);
                assert_eq!(
                    expert_plan(&world),
                    t.expert,
                    "{}: expert not reproducible",
                    t.id
                );
            }
        }
        // The goal's own query is not always listed first.
        let firsts = train
            .iter()
            .filter(|t| {
                let w = ShopEnv::parse_world(t).unwrap();
                w.queries[0] == w.goal.query()
            })
            .count();
        assert!(firsts < train.len() / 2, "{firsts}");
    }

    /// The expert through the public env: every action admissible and
    /// valid when issued, reward 1.0 and success on the last action only.
    fn check_experts(tasks: &[Task]) {
        let mut env = ShopEnv::new(DEFAULT_MAX_STEPS);
        for t in tasks {
            let mut obs = env.reset(t).unwrap();
            for (i, a) in t.expert.iter().enumerate() {
                assert!(obs.admissible.contains(a), "{}: {a:?} not admissible", t.id);
                obs = env.step(a).unwrap();
                assert!(obs.valid, "{}: {a:?}", t.id);
                let last = i + 1 == t.expert.len();
                assert_eq!((obs.success, obs.done), (last, last), "{} step {i}", t.id);
            }
            assert_eq!(obs.reward, 1.0, "{}", t.id);
        }
    }

    #[test]
    fn committed_panels_have_the_right_shape_and_experts_always_succeed() {
        let (train, test) = committed();
        assert_eq!((train.len(), test.len()), (DEFAULT_TRAIN, DEFAULT_TEST));
        check_panel_shape(&train, &test);
        check_experts(&train);
        check_experts(&test);
        // Expert lengths span 3–8, each well represented in train.
        let h = histogram(&train);
        assert_eq!(
            h.keys().copied().collect::<Vec<_>>(),
            (3..=8).collect::<Vec<_>>()
        );
        assert!(h.values().all(|&n| n >= 10), "{h:?}");
        assert_eq!(histogram(&test).len(), 6, "{:?}", histogram(&test));
    }

    #[test]
    fn other_seeds_also_give_sound_panels() {
        let (train, test) = generate_panels(11, 120, 30).unwrap();
        check_panel_shape(&train, &test);
        check_experts(&train);
        check_experts(&test);
    }

    #[test]
    fn random_policy_success_falls_with_difficulty() {
        let (train, _) = committed();
        let table = random_policy_success(BuiltinEnv::Shop, &train, 16, DEFAULT_MAX_STEPS, 3);
        eprintln!("random policy, {DEFAULT_MAX_STEPS} steps, 16 rollouts per task:");
        for (d, n, rate) in &table {
            eprintln!("  difficulty {d}: {n:3} tasks, success {rate:.3}");
        }
        let rate = |pred: &dyn Fn(usize) -> bool| {
            let (n, wins) = table
                .iter()
                .filter(|(d, _, _)| pred(*d))
                .fold((0.0, 0.0), |(n, w), (_, k, r)| {
                    (n + *k as f64, w + *k as f64 * r)
                });
            wins / n
        };
        let short = rate(&|d| d == 3);
        let long = rate(&|d| d >= 6);
        assert!(short > 0.03, "random success at difficulty 3: {short}");
        assert!(long < 0.005, "random success at difficulty >= 6: {long}");
        assert!(rate(&|d| d == 4) < short && rate(&|d| d == 5) <= rate(&|d| d == 4));
        // Deterministic for a seed.
        assert_eq!(
            table,
            random_policy_success(BuiltinEnv::Shop, &train, 16, DEFAULT_MAX_STEPS, 3)
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
        let mut env = ShopEnv::new(DEFAULT_MAX_STEPS);
        check(&env.status());
        let tasks: Vec<Task> = train.into_iter().chain(test).collect();
        // One expert rollout, then two random ones, per task.
        crate::env::panel::visit_texts(&mut env, &tasks, 5, &mut check);
        // Every sub-page of every product too (random walks miss some).
        for p in &catalog().products {
            for part in p
                .description()
                .iter()
                .chain(&p.features())
                .chain(&p.reviews())
            {
                check(part);
            }
        }
        assert!(
            missing.is_empty(),
            "words missing from vocabulary(): {missing:?}"
        );
    }

    /// Rewrite the committed panels:
    /// `cargo test --lib env::shop::generate::tests::write_committed_panels -- --ignored`
    #[test]
    #[ignore]
    fn write_committed_panels() {
        write_default_panels(BuiltinEnv::Shop, &dir()).unwrap();
    }

    /// `cargo test --lib env::shop::generate::tests::print_panel_stats -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn print_panel_stats() {
        let (train, test) = generate_panels(DEFAULT_SEED, DEFAULT_TRAIN, DEFAULT_TEST).unwrap();
        println!("train histogram {:?}", histogram(&train));
        println!("test histogram {:?}", histogram(&test));
        let vocab = vocabulary();
        println!("vocabulary: {} words", vocab.len());
        for (d, n, rate) in
            random_policy_success(BuiltinEnv::Shop, &train, 100, DEFAULT_MAX_STEPS, 1)
        {
            println!("  difficulty {d}: {n:3} tasks, success {rate:.3}");
        }
    }
}
