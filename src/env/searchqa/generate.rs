//! Seeded generation of searchqa task panels, the committed default panels,
//! the expert action data, and the random-policy baseline.
//!
//! The question space is enumerated, not sampled: for each hop count, every
//! chain of distinct entities over the fixed corpus whose steps the expert
//! can take with admissible actions. A ChaCha8 stream keyed by (seed, hops)
//! shuffles each pool; every fifth chain of the shuffled pool belongs to the
//! test split, the rest to train. Task `i` of a split asks `1 + i % 4` hops
//! and takes chain `i / 4` of that split's pool, so a task depends only on
//! (seed, split, index), the hop counts are balanced, and train and test
//! never share a question (no retry loop, no shared "taken" set).

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::corpus::{corpus, question_text, Corpus, Relation, CORPUS_ID};
use super::{World, TOP_K};
use crate::env::panel::{SPLIT_TEST, SPLIT_TRAIN};
use crate::env::{GenerateError, Task};

pub use crate::env::panel::{DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN};
/// Questions have 1 to `MAX_HOPS` hops.
pub const MAX_HOPS: usize = 4;
/// One chain in `TEST_EVERY` of a shuffled pool goes to the test split.
const TEST_EVERY: usize = 5;

/// Stream purpose of the pool shuffles (kept apart from any future use).
const TAG_POOL: u8 = 0;

fn stream(seed: u64, tag: u8, hops: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8] = tag;
    key[9..17].copy_from_slice(&hops.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// A question's chain: start entity, relations, entities visited.
#[derive(Debug, Clone)]
struct Chain {
    relations: Vec<Relation>,
    path: Vec<usize>,
}

/// Entities whose own document comes up in the top [`TOP_K`] when searching
/// their name: the only ones the expert can reach by searching.
fn searchable(c: &Corpus) -> Vec<bool> {
    c.entities
        .iter()
        .map(|e| {
            e.doc.is_some_and(|d| {
                c.index
                    .search(&e.name, TOP_K)
                    .iter()
                    .any(|&(hit, _)| hit == d)
            })
        })
        .collect()
}

/// Every `hops`-hop chain over distinct entities whose non-final entities are
/// searchable, in corpus order (docs by id, facts in document order).
fn chains(c: &Corpus, hops: usize) -> Vec<Chain> {
    fn extend(c: &Corpus, ok: &[bool], hops: usize, chain: &mut Chain, out: &mut Vec<Chain>) {
        if chain.relations.len() == hops {
            out.push(chain.clone());
            return;
        }
        let cur = *chain.path.last().expect("chains start non-empty");
        if !ok[cur] {
            return;
        }
        for &(r, o) in &c.entities[cur].facts {
            if chain.path.contains(&o) {
                continue;
            }
            chain.relations.push(r);
            chain.path.push(o);
            extend(c, ok, hops, chain, out);
            chain.relations.pop();
            chain.path.pop();
        }
    }
    let ok = searchable(c);
    let mut out = Vec::new();
    for d in &c.docs {
        let mut chain = Chain {
            relations: Vec::new(),
            path: vec![d.entity],
        };
        extend(c, &ok, hops, &mut chain, &mut out);
    }
    out
}

/// The split's share of the `hops`-hop question pool, in panel order.
fn pool(c: &Corpus, seed: u64, split: u8, hops: usize) -> Vec<Chain> {
    let mut all = chains(c, hops);
    all.shuffle(&mut stream(seed, TAG_POOL, hops as u64));
    all.into_iter()
        .enumerate()
        .filter(|(j, _)| j.is_multiple_of(TEST_EVERY) == (split == SPLIT_TEST))
        .map(|(_, ch)| ch)
        .collect()
}

/// The expert action data for a world: for each hop, search the current
/// entity's name and open its document; then answer. `None` if the world
/// does not validate.
pub fn expert_actions(world: &World) -> Option<Vec<String>> {
    let c = corpus();
    let path = world.validate().ok()?;
    let (gold, hops) = path.split_last()?;
    let mut plan = Vec::with_capacity(2 * hops.len() + 1);
    for &e in hops {
        plan.push(format!("search[{}]", c.name(e)));
        plan.push(format!("open[{}]", c.docs[c.entities[e].doc?].id));
    }
    plan.push(format!("answer[{}]", c.name(*gold)));
    Some(plan)
}

fn task(c: &Corpus, split_name: &str, index: usize, chain: &Chain) -> Task {
    let start = c.name(chain.path[0]).to_string();
    let world = World {
        corpus: CORPUS_ID.to_string(),
        question: question_text(&start, &chain.relations),
        answer: c.name(*chain.path.last().expect("non-empty")).to_string(),
        start,
        relations: chain.relations.clone(),
    };
    let expert = expert_actions(&world).expect("generated worlds validate");
    Task {
        id: format!("searchqa-{split_name}-{index:04}"),
        task_type: chain
            .relations
            .last()
            .expect("at least one hop")
            .name()
            .to_string(),
        goal: world.question.clone(),
        // Plain struct with string fields: serialization cannot fail.
        world: serde_json::to_value(&world).expect("searchqa World serializes"),
        expert,
        difficulty: chain.relations.len(),
    }
}

fn panel(seed: u64, split: u8, n: usize) -> Result<Vec<Task>, GenerateError> {
    let c = corpus();
    let name = if split == SPLIT_TRAIN {
        "train"
    } else {
        "test"
    };
    let need = |h: usize| (n + MAX_HOPS - h) / MAX_HOPS;
    let pools: Vec<Vec<Chain>> = (1..=MAX_HOPS)
        .map(|h| {
            if need(h) > 0 {
                pool(c, seed, split, h)
            } else {
                Vec::new()
            }
        })
        .collect();
    for (h, p) in (1..=MAX_HOPS).zip(&pools) {
        if p.len() < need(h) {
            return Err(GenerateError::TooFewQuestions {
                split: name,
                have: p.len(),
                hops: h,
                asked: need(h),
            });
        }
    }
    Ok((0..n)
        .map(|i| task(c, name, i, &pools[i % MAX_HOPS][i / MAX_HOPS]))
        .collect())
}

/// Generate disjoint train and test panels from `seed` (deterministic).
/// Hop counts cycle 1, 2, 3, 4, so a panel is balanced across difficulties.
/// A panel that asks for more distinct questions of a hop count than the
/// corpus has (about 370 one-hop questions for train, 90 for test) is an
/// error.
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
pub(crate) fn pool_sizes(seed: u64) -> Vec<(usize, usize, usize)> {
    let c = corpus();
    (1..=MAX_HOPS)
        .map(|h| {
            (
                h,
                pool(c, seed, SPLIT_TRAIN, h).len(),
                pool(c, seed, SPLIT_TEST, h).len(),
            )
        })
        .collect()
}
