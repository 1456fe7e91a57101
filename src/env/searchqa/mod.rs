//! The built-in searchqa environment: the search-agent setting of
//! ActGuide-RL, re-created over a generated corpus.
//!
//! This module owns everything searchqa: the fixed corpus of entity
//! documents (people, companies, cities, works; [`corpus`]), its BM25 index
//! ([`bm25`]), answer scoring ([`normalize_answer`], [`f1`]), the tool
//! protocol (search / open / answer, feedback, admissible list, status),
//! the seeded panel generator with the expert action data
//! ([`generate_panels`], with the default seed and sizes) and the env's word
//! list ([`vocabulary`]). Writing the default panels and the random-policy
//! baseline are the same for every built-in env: [`crate::env::kind`].
//!
//! # Tasks
//!
//! A task asks a question that chains 1–4 facts from one named start entity
//! ("Where was the founder of the employer of Ada Ashby born?"). Every
//! relation is a function, so the gold answer is unique. The task's
//! **difficulty is the number of hops** (1–4), which defines the clusters
//! and the in-region / out-region split: a uniformly random admissible
//! policy solves about 3% of 1-hop tasks and well under 1% of 2–4-hop ones
//! (only lucky guesses among the names on screen). The expert takes
//! `2·hops + 1` actions (3, 5, 7, 9), all within the 10-step limit. The task type is the question's last relation (`born_in`,
//! `founder`, …). The task's `world` is a [`World`]: corpus version,
//! question, gold answer, start entity and relation chain; reset rebuilds
//! the (fixed) corpus and checks that the chain really leads to the answer.
//!
//! # Tools
//!
//! - `search[query]`: the top 3 documents by BM25 over title and text, one
//!   line each, `dNNN: title — first sentence`.
//! - `open[dNNN]`: the whole document.
//! - `answer[text]`: ends the episode; reward 1 and success iff the answer
//!   equals the gold one after SQuAD normalisation. The token F1 is kept
//!   too ([`SearchQaEnv::answer_f1`]).
//!
//! Tool names are case-insensitive and spaces around the brackets are
//! allowed (so decoded model text such as `search [ apex labs ]` works).
//! Text that is not one of the three tools, an empty argument, or an unknown
//! doc id is a no-op with `valid = false`. The episode ends on an answer or
//! after `max_steps` actions (default [`DEFAULT_MAX_STEPS`]).
//!
//! # The admissible list
//!
//! Free-text search cannot be enumerated, so the list offers the natural
//! next moves and nothing more: `search[name]` for the entity named in the
//! question and the entities mentioned in the current observation (in
//! order of mention, at most 6); `open[dNNN]` for every hit of the latest
//! search; `answer[name]` for the same (at most 6) entity names. Actions
//! outside the list still run when well-formed (search any text, open any
//! id, answer anything). The expert only ever uses listed actions.

mod answer;
mod bm25;
mod corpus;
mod generate;
#[cfg(test)]
mod tests;
mod vocab;

pub use answer::{exact_match, f1, normalize_answer};
pub use corpus::{question_text, Kind, NoFact, Relation, CORPUS_ID, CORPUS_SEED};
pub use generate::{
    expert_actions, generate_panels, DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN, MAX_HOPS,
};
pub use vocab::vocabulary;

use serde::{Deserialize, Serialize};

use super::{Env, EnvError, Observation, Task};
use corpus::corpus;

/// Default episode limit (enough for the 9-action expert of a 4-hop task).
pub const DEFAULT_MAX_STEPS: usize = 10;
/// Search hits shown per query.
pub const TOP_K: usize = 3;
/// Cap on the entity names offered for `search[...]` and `answer[...]`
/// (question entity + a document's title and up to 3 facts fit).
const MAX_CANDIDATES: usize = 6;

/// What is wrong with a searchqa world (the message a bad task shows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorldError {
    #[error("world is for corpus {0:?}, this build has {CORPUS_ID:?}")]
    Corpus(String),
    #[error("empty question")]
    EmptyQuestion,
    #[error("no relations: a question needs at least one hop")]
    NoRelations,
    #[error("unknown start entity {0:?}")]
    UnknownStart(String),
    #[error(transparent)]
    NoFact(#[from] NoFact),
    #[error("answer {answer:?} does not match the chain's answer {gold:?}")]
    WrongAnswer { answer: String, gold: String },
}

/// A task's world: what reset needs, checked against the corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct World {
    /// Corpus version ([`CORPUS_ID`]).
    pub corpus: String,
    /// The question shown to the agent.
    pub question: String,
    /// The gold answer (an entity name).
    pub answer: String,
    /// Name of the entity the question starts from.
    pub start: String,
    /// The relations to follow from `start`, in order; its length is the
    /// number of hops.
    pub relations: Vec<Relation>,
}

impl World {
    /// Check the world against the corpus; the entities along the chain,
    /// start first, answer last.
    pub fn validate(&self) -> Result<Vec<usize>, WorldError> {
        let c = corpus();
        if self.corpus != CORPUS_ID {
            return Err(WorldError::Corpus(self.corpus.clone()));
        }
        if self.question.trim().is_empty() {
            return Err(WorldError::EmptyQuestion);
        }
        if self.relations.is_empty() {
            return Err(WorldError::NoRelations);
        }
        let start = c
            .entity_named(&self.start)
            .ok_or_else(|| WorldError::UnknownStart(self.start.clone()))?;
        let path = c.follow(start, &self.relations)?;
        let gold = c.name(*path.last().expect("path is non-empty"));
        if gold != self.answer {
            return Err(WorldError::WrongAnswer {
                answer: self.answer.clone(),
                gold: gold.to_string(),
            });
        }
        Ok(path)
    }
}

/// The searchqa env: one episode at a time over a task's [`World`].
#[derive(Debug, Clone)]
pub struct SearchQaEnv {
    max_steps: usize,
    episode: Option<Episode>,
}

#[derive(Debug, Clone)]
struct Episode {
    world: World,
    /// Entities along the question's chain (start first).
    path: Vec<usize>,
    steps: usize,
    done: bool,
    /// The latest search: its query and hits (doc indices, best first).
    last_search: Option<(String, Vec<usize>)>,
    /// Docs opened so far, in first-open order.
    opened: Vec<usize>,
    /// Entities mentioned by the current observation (kept across invalid
    /// actions, so a typo does not empty the admissible list).
    mentions: Vec<usize>,
    answer_f1: Option<f64>,
}

impl Default for SearchQaEnv {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_STEPS)
    }
}

impl SearchQaEnv {
    /// An env whose episodes end after `max_steps` actions (at least 1).
    pub fn new(max_steps: usize) -> Self {
        SearchQaEnv {
            max_steps: max_steps.max(1),
            episode: None,
        }
    }

    /// Parse and validate a task's world (the same check `reset` does).
    pub fn parse_world(task: &Task) -> Result<World, EnvError> {
        Self::load(task).map(|(w, _)| w)
    }

    fn load(task: &Task) -> Result<(World, Vec<usize>), EnvError> {
        let bad = |msg: String| EnvError::BadTask {
            task: task.id.clone(),
            msg,
        };
        let world: World = serde_json::from_value(task.world.clone())
            .map_err(|e| bad(format!("bad searchqa world: {e}")))?;
        let path = world
            .validate()
            .map_err(|e| bad(format!("bad searchqa world: {e}")))?;
        Ok((world, path))
    }

    /// Token F1 of the episode's answer against the gold one (`None` until
    /// the agent answers).
    pub fn answer_f1(&self) -> Option<f64> {
        self.episode.as_ref().and_then(|ep| ep.answer_f1)
    }
}

/// A parsed tool call.
#[derive(Debug, PartialEq)]
enum Action<'a> {
    Search(&'a str),
    Open(&'a str),
    Answer(&'a str),
}

/// `tool[arg]` with a known tool and a non-empty argument; `None` otherwise.
fn parse_action(text: &str) -> Option<Action<'_>> {
    // A trailing full stop after the bracket is tolerated (models add one).
    let text = text.trim().trim_end_matches('.').trim_end();
    let open = text.find('[')?;
    let arg = text[open + 1..].strip_suffix(']')?.trim();
    if arg.is_empty() {
        return None;
    }
    match text[..open].trim().to_lowercase().as_str() {
        "search" => Some(Action::Search(arg)),
        "open" => Some(Action::Open(arg)),
        "answer" => Some(Action::Answer(arg)),
        _ => None,
    }
}

// Feedback texts. `vocab` renders these same functions, so a change here
// shows up in the vocabulary automatically.

pub(crate) fn intro_text(question: &str) -> String {
    format!(
        "Question: {question}\nUse search[query] to find documents, open[doc id] to read one, \
         and answer[text] to give the final answer."
    )
}

pub(crate) const NOTHING_HAPPENS: &str =
    "Nothing happens. Use search[query], open[doc id] or answer[text].";
pub(crate) const CORRECT: &str = "Your answer is correct.";
pub(crate) const WRONG: &str = "Your answer is wrong.";

pub(crate) fn no_doc_text(id: &str) -> String {
    format!("There is no document {id}.")
}

pub(crate) fn results_text(query: &str, lines: &[String]) -> String {
    if lines.is_empty() {
        format!("No results for {query}.")
    } else {
        format!("Search results for {query}:\n{}", lines.join("\n"))
    }
}

/// The status line: question, each opened doc with its key fact, and the
/// latest search with its hit ids.
pub(crate) fn status_text(
    question: &str,
    opened: &[(String, String)],
    last_search: Option<(&str, Vec<&str>)>,
) -> String {
    let opened = if opened.is_empty() {
        "none.".to_string()
    } else {
        opened
            .iter()
            .map(|(id, fact)| format!("{id}: {fact}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let search = match last_search {
        None => "none.".to_string(),
        Some((q, ids)) if ids.is_empty() => format!("{q}; no results."),
        Some((q, ids)) => format!("{q}; results {}.", ids.join(", ")),
    };
    format!("Question: {question} Opened: {opened} Last search: {search}")
}

impl Episode {
    /// Run one action: feedback, validity, and `Some(correct)` if it was an
    /// answer.
    fn exec(&mut self, action: &str) -> (String, bool, Option<bool>) {
        let c = corpus();
        match parse_action(action) {
            None => (NOTHING_HAPPENS.to_string(), false, None),
            Some(Action::Search(q)) => {
                let hits: Vec<usize> = c.index.search(q, TOP_K).iter().map(|h| h.0).collect();
                self.mentions.clear();
                let mut lines = Vec::new();
                for &d in &hits {
                    let (line, mentions) = c.render_hit(d);
                    lines.push(line);
                    self.mentions.extend(mentions);
                }
                self.last_search = Some((q.to_string(), hits));
                (results_text(q, &lines), true, None)
            }
            Some(Action::Open(id)) => match c.doc_by_id(id) {
                None => (no_doc_text(id), false, None),
                Some(d) => {
                    let (text, mentions) = c.render_doc(d);
                    self.mentions = mentions;
                    if !self.opened.contains(&d) {
                        self.opened.push(d);
                    }
                    (text, true, None)
                }
            },
            Some(Action::Answer(a)) => {
                let ok = exact_match(a, &self.world.answer);
                self.answer_f1 = Some(f1(a, &self.world.answer));
                let text = if ok { CORRECT } else { WRONG };
                (text.to_string(), true, Some(ok))
            }
        }
    }

    fn admissible(&self) -> Vec<String> {
        let c = corpus();
        let mut names: Vec<usize> = Vec::new();
        for e in std::iter::once(self.path[0]).chain(self.mentions.iter().copied()) {
            if !names.contains(&e) {
                names.push(e);
            }
        }
        names.truncate(MAX_CANDIDATES);
        let mut out: Vec<String> = names
            .iter()
            .map(|&e| format!("search[{}]", c.name(e)))
            .collect();
        if let Some((_, hits)) = &self.last_search {
            out.extend(hits.iter().map(|&d| format!("open[{}]", c.docs[d].id)));
        }
        out.extend(names.iter().map(|&e| format!("answer[{}]", c.name(e))));
        out
    }

    /// The fact of an opened doc worth remembering: the one the question's
    /// chain uses if the doc is on the chain, else one of a relation the
    /// question asks about, else the first.
    fn key_fact(&self, doc: usize) -> String {
        let c = corpus();
        let e = c.docs[doc].entity;
        let rels = &self.world.relations;
        let want = match self.path.iter().position(|&p| p == e) {
            Some(i) if i < rels.len() => &rels[i..=i],
            _ => &rels[..],
        };
        let facts = &c.entities[e].facts;
        facts
            .iter()
            .find(|(r, _)| want.contains(r))
            .or(facts.first())
            .map(|&(r, o)| r.sentence(c.name(e), c.name(o)))
            .unwrap_or_default()
    }

    fn status(&self) -> String {
        let c = corpus();
        let opened: Vec<(String, String)> = self
            .opened
            .iter()
            .map(|&d| (c.docs[d].id.clone(), self.key_fact(d)))
            .collect();
        let search = self.last_search.as_ref().map(|(q, hits)| {
            (
                q.as_str(),
                hits.iter().map(|&d| c.docs[d].id.as_str()).collect(),
            )
        });
        status_text(&self.world.question, &opened, search)
    }
}

impl Env for SearchQaEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        // A failed reset leaves no episode behind to step by mistake.
        self.episode = None;
        let (world, path) = Self::load(task)?;
        let ep = Episode {
            path,
            steps: 0,
            done: false,
            last_search: None,
            opened: Vec::new(),
            mentions: Vec::new(),
            answer_f1: None,
            world,
        };
        let obs = Observation {
            text: intro_text(&ep.world.question),
            admissible: ep.admissible(),
            done: false,
            reward: 0.0,
            success: false,
            valid: true,
            info: Default::default(),
        };
        self.episode = Some(ep);
        Ok(obs)
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        let ep = match &mut self.episode {
            Some(ep) if !ep.done => ep,
            Some(_) => {
                return Err(EnvError::Other(
                    "searchqa: step after the episode ended; call reset".into(),
                ))
            }
            None => return Err(EnvError::Other("searchqa: step before reset".into())),
        };
        let (text, valid, answered) = ep.exec(action);
        ep.steps += 1;
        let success = answered == Some(true);
        ep.done = answered.is_some() || ep.steps >= self.max_steps;
        Ok(Observation {
            text,
            // Nothing more to do once the episode is over.
            admissible: if ep.done { Vec::new() } else { ep.admissible() },
            done: ep.done,
            reward: if success { 1.0 } else { 0.0 },
            success,
            valid,
            // The answer's token F1 (SQuAD-style), logged by the run.
            info: ep
                .answer_f1
                .map(|f| [("f1".to_string(), f)].into_iter().collect())
                .unwrap_or_default(),
        })
    }

    fn status(&self) -> String {
        match &self.episode {
            Some(ep) => ep.status(),
            None => "No task loaded.".to_string(),
        }
    }
}
