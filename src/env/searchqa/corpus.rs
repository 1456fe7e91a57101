//! The searchqa corpus: a fixed, generated encyclopedia of entity documents
//! (people, companies, cities, works) whose facts link entities to one
//! another, so questions can chain facts over several documents.
//!
//! The corpus is built from its own fixed seed ([`CORPUS_SEED`]), never from
//! a panel seed: every panel and every task shares the same documents, and a
//! task only names the corpus version ([`CORPUS_ID`]). Changing the word
//! lists, the sizes or the generation order changes the corpus, so bump
//! [`CORPUS_ID`] with it (old panels are then rejected at reset instead of
//! silently pointing at different documents).
//!
//! Every relation is a function (one object per subject), so composing
//! relations from a start entity always yields a unique answer.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::bm25::Bm25;

/// Version tag of the corpus that tasks name in their world.
pub const CORPUS_ID: &str = "searchqa-corpus-v1";
/// Seed of the corpus generator (independent of any panel seed).
pub const CORPUS_SEED: u64 = 0x5EA2_C0A7;

const N_PERSONS: usize = 80;
const N_COMPANIES: usize = 36;
const N_WORKS: usize = 40;
/// Share of people with a mentor, and of companies with an owner (optional
/// facts, so documents carry 2–3 facts).
const P_MENTOR: f64 = 0.5;
const P_OWNER: f64 = 0.35;

// Name parts. Every word is distinct across lists and none is a stop word
// or an article, so names survive BM25 tokenisation and answer
// normalisation intact; the lists are small because the tiny model's token
// set is the env's whole vocabulary.
const FIRST_NAMES: [&str; 12] = [
    "Ada", "Bram", "Cora", "Dario", "Elin", "Felix", "Greta", "Hugo", "Ines", "Joran", "Kira",
    "Lev",
];
const LAST_NAMES: [&str; 12] = [
    "Ashby", "Brandt", "Calder", "Dunmore", "Ellery", "Fenwick", "Garrow", "Hollis", "Ivers",
    "Jessop", "Kestrel", "Lorne",
];
const CITIES: [&str; 24] = [
    "Tarsk",
    "Velmora",
    "Quinport",
    "Ostwick",
    "Brindle",
    "Carrowmere",
    "Dunhallow",
    "Eskara",
    "Fallowby",
    "Greymarsh",
    "Harlowe",
    "Islin",
    "Jadeport",
    "Korvath",
    "Lunmere",
    "Marisco",
    "Norhaven",
    "Pellam",
    "Ravensby",
    "Saltcombe",
    "Thornwick",
    "Umberly",
    "Westmarch",
    "Yarrow",
];
const COUNTRIES: [&str; 6] = [
    "Aldoria",
    "Brevania",
    "Castellan",
    "Dravonia",
    "Estmark",
    "Valdera",
];
const COMPANY_STEMS: [&str; 12] = [
    "Apex", "Beacon", "Cobalt", "Summit", "Ember", "Falcon", "Granite", "Harbor", "Iris",
    "Juniper", "Keystone", "Lumen",
];
const COMPANY_SUFFIXES: [&str; 6] = ["Labs", "Works", "Group", "Systems", "Motors", "Press"];
const WORK_ADJECTIVES: [&str; 10] = [
    "Silent",
    "Crimson",
    "Hollow",
    "Golden",
    "Distant",
    "Broken",
    "Quiet",
    "Burning",
    "Frozen",
    "Wandering",
];
const WORK_NOUNS: [&str; 10] = [
    "River", "Lantern", "Orchard", "Tower", "Garden", "Compass", "Mirror", "Voyage", "Harvest",
    "Meadow",
];

/// Every word any entity name is made of (for the vocabulary).
pub(crate) fn name_words() -> impl Iterator<Item = &'static str> {
    FIRST_NAMES
        .iter()
        .chain(&LAST_NAMES)
        .chain(&CITIES)
        .chain(&COUNTRIES)
        .chain(&COMPANY_STEMS)
        .chain(&COMPANY_SUFFIXES)
        .chain(&WORK_ADJECTIVES)
        .chain(&WORK_NOUNS)
        .copied()
}

/// Entity kinds. Countries are answer values only: they have no document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Person,
    Company,
    City,
    Work,
    Country,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Person,
        Kind::Company,
        Kind::City,
        Kind::Work,
        Kind::Country,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Person => "person",
            Kind::Company => "company",
            Kind::City => "city",
            Kind::Work => "work",
            Kind::Country => "country",
        }
    }
}

/// A fact type: a function from a subject of one kind to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Relation {
    BornIn,
    Employer,
    Mentor,
    Founder,
    BasedIn,
    Owner,
    Author,
    Publisher,
    Setting,
    Country,
    Mayor,
}

impl Relation {
    pub const ALL: [Relation; 11] = [
        Relation::BornIn,
        Relation::Employer,
        Relation::Mentor,
        Relation::Founder,
        Relation::BasedIn,
        Relation::Owner,
        Relation::Author,
        Relation::Publisher,
        Relation::Setting,
        Relation::Country,
        Relation::Mayor,
    ];

    /// Serialized name (also the task type of questions ending in it).
    pub fn name(self) -> &'static str {
        match self {
            Relation::BornIn => "born_in",
            Relation::Employer => "employer",
            Relation::Mentor => "mentor",
            Relation::Founder => "founder",
            Relation::BasedIn => "based_in",
            Relation::Owner => "owner",
            Relation::Author => "author",
            Relation::Publisher => "publisher",
            Relation::Setting => "setting",
            Relation::Country => "country",
            Relation::Mayor => "mayor",
        }
    }

    /// Kind of the subject.
    pub fn subject(self) -> Kind {
        match self {
            Relation::BornIn | Relation::Employer | Relation::Mentor => Kind::Person,
            Relation::Founder | Relation::BasedIn | Relation::Owner => Kind::Company,
            Relation::Author | Relation::Publisher | Relation::Setting => Kind::Work,
            Relation::Country | Relation::Mayor => Kind::City,
        }
    }

    /// Kind of the object.
    pub fn object(self) -> Kind {
        match self {
            Relation::BornIn | Relation::BasedIn | Relation::Setting => Kind::City,
            Relation::Employer | Relation::Owner | Relation::Publisher => Kind::Company,
            Relation::Mentor | Relation::Founder | Relation::Author | Relation::Mayor => {
                Kind::Person
            }
            Relation::Country => Kind::Country,
        }
    }

    /// The document sentence stating `s R o`.
    pub fn sentence(self, s: &str, o: &str) -> String {
        match self {
            Relation::BornIn => format!("{s} was born in {o}."),
            Relation::Employer => format!("{s} worked for {o}."),
            Relation::Mentor => format!("{s} was a student of {o}."),
            Relation::Founder => format!("{s} was founded by {o}."),
            Relation::BasedIn => format!("{s} is based in {o}."),
            Relation::Owner => format!("{s} is owned by {o}."),
            Relation::Author => format!("{s} was written by {o}."),
            Relation::Publisher => format!("{s} was published by {o}."),
            Relation::Setting => format!("{s} is set in {o}."),
            Relation::Country => format!("{s} is a city in {o}."),
            Relation::Mayor => format!("The mayor of {s} is {o}."),
        }
    }

    /// A noun phrase for "the object of `x`", used for the inner hops of a
    /// question. (Country objects have no relations, so `Country` is never
    /// an inner hop; its phrase exists for completeness.)
    pub fn noun_phrase(self, x: &str) -> String {
        match self {
            Relation::BornIn => format!("the birthplace of {x}"),
            Relation::Employer => format!("the employer of {x}"),
            Relation::Mentor => format!("the mentor of {x}"),
            Relation::Founder => format!("the founder of {x}"),
            Relation::BasedIn => format!("the home city of {x}"),
            Relation::Owner => format!("the owner of {x}"),
            Relation::Author => format!("the author of {x}"),
            Relation::Publisher => format!("the publisher of {x}"),
            Relation::Setting => format!("the setting of {x}"),
            Relation::Country => format!("the country of {x}"),
            Relation::Mayor => format!("the mayor of {x}"),
        }
    }

    /// The question asking for the object of `x` (the last hop).
    pub fn question(self, x: &str) -> String {
        match self {
            Relation::BornIn => format!("Where was {x} born?"),
            Relation::Employer => format!("Which company did {x} work for?"),
            Relation::Mentor => format!("Whose student was {x}?"),
            Relation::Founder => format!("Who founded {x}?"),
            Relation::BasedIn => format!("In which city is {x} based?"),
            Relation::Owner => format!("Which company owns {x}?"),
            Relation::Author => format!("Who wrote {x}?"),
            Relation::Publisher => format!("Which company published {x}?"),
            Relation::Setting => format!("In which city is {x} set?"),
            Relation::Country => format!("In which country is {x}?"),
            Relation::Mayor => format!("Who is the mayor of {x}?"),
        }
    }
}

/// The question for the chain `relations` from the entity named `start`:
/// inner hops as nested noun phrases, the last one as the question form
/// ("Where was the founder of Apex Labs born?").
pub fn question_text(start: &str, relations: &[Relation]) -> String {
    let Some((last, inner)) = relations.split_last() else {
        return String::new();
    };
    let x = inner
        .iter()
        .fold(start.to_string(), |x, r| r.noun_phrase(&x));
    last.question(&x)
}

/// A hop of a question's chain that does not apply: its entity has no
/// fact of the relation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hop {hop}: {entity} ({}) has no {} fact", kind.name(), relation.name())]
pub struct NoFact {
    /// 1-based.
    pub hop: usize,
    pub entity: String,
    pub kind: Kind,
    pub relation: Relation,
}

/// One entity. `facts` are in the order its document states them.
#[derive(Debug, Clone)]
pub struct Entity {
    pub name: String,
    pub kind: Kind,
    /// Index into [`Corpus::docs`]; `None` for countries.
    pub doc: Option<usize>,
    pub facts: Vec<(Relation, usize)>,
}

/// One document: the page of one entity.
#[derive(Debug, Clone)]
pub struct Doc {
    /// `d000`, `d001`, … in index order (so id order is index order).
    pub id: String,
    pub entity: usize,
}

/// The whole corpus with its search index.
#[derive(Debug)]
pub struct Corpus {
    pub entities: Vec<Entity>,
    pub docs: Vec<Doc>,
    /// Entity index by exact name.
    by_name: BTreeMap<String, usize>,
    /// Doc index by lower-cased id.
    by_id: BTreeMap<String, usize>,
    pub index: Bm25,
}

/// The corpus, built once per process (it is a pure function of the
/// constants above).
pub fn corpus() -> &'static Corpus {
    static CORPUS: OnceLock<Corpus> = OnceLock::new();
    CORPUS.get_or_init(Corpus::build)
}

/// The entities of each kind (indices into the entity list).
struct Roster {
    persons: Vec<usize>,
    companies: Vec<usize>,
    works: Vec<usize>,
    cities: Vec<usize>,
    countries: Vec<usize>,
}

impl Roster {
    /// Add every entity, without facts: drawn person, company and work
    /// names, then the fixed cities and countries.
    fn draw(rng: &mut ChaCha8Rng, entities: &mut Vec<Entity>) -> Roster {
        let mut add = |names: Vec<String>, kind: Kind| -> Vec<usize> {
            names
                .into_iter()
                .map(|name| {
                    entities.push(Entity {
                        name,
                        kind,
                        doc: None,
                        facts: Vec::new(),
                    });
                    entities.len() - 1
                })
                .collect()
        };
        let combos = |a: &[&str], b: &[&str], n: usize, rng: &mut ChaCha8Rng| {
            let mut all: Vec<String> = a
                .iter()
                .flat_map(|x| b.iter().map(move |y| format!("{x} {y}")))
                .collect();
            all.shuffle(rng);
            all.truncate(n);
            all
        };
        let persons = add(
            combos(&FIRST_NAMES, &LAST_NAMES, N_PERSONS, rng),
            Kind::Person,
        );
        let companies = add(
            combos(&COMPANY_STEMS, &COMPANY_SUFFIXES, N_COMPANIES, rng),
            Kind::Company,
        );
        let works = add(
            combos(&WORK_ADJECTIVES, &WORK_NOUNS, N_WORKS, rng),
            Kind::Work,
        );
        let cities = add(CITIES.iter().map(|s| s.to_string()).collect(), Kind::City);
        let countries = add(
            COUNTRIES.iter().map(|s| s.to_string()).collect(),
            Kind::Country,
        );
        Roster {
            persons,
            companies,
            works,
            cities,
            countries,
        }
    }

    /// Every entity's facts. Mayors and founders are distinct people (one
    /// office each), the rest is drawn freely.
    fn draw_facts(&self, rng: &mut ChaCha8Rng, entities: &mut [Entity]) {
        let mut officials = self.persons.clone();
        officials.shuffle(rng);
        let (mayors, rest) = officials.split_at(self.cities.len());
        let founders = &rest[..self.companies.len()];
        self.person_facts(rng, entities);
        self.company_facts(rng, entities, founders);
        self.work_facts(rng, entities);
        self.city_facts(rng, entities, mayors);
    }

    fn person_facts(&self, rng: &mut ChaCha8Rng, entities: &mut [Entity]) {
        let (persons, companies, cities) = (&self.persons, &self.companies, &self.cities);
        for &p in persons {
            let mut f = vec![
                (Relation::BornIn, *cities.choose(rng).expect("cities")),
                (
                    Relation::Employer,
                    *companies.choose(rng).expect("companies"),
                ),
            ];
            if rng.random_bool(P_MENTOR) {
                f.push((Relation::Mentor, pick_other(persons, p, rng)));
            }
            entities[p].facts = f;
        }
    }

    fn company_facts(&self, rng: &mut ChaCha8Rng, entities: &mut [Entity], founders: &[usize]) {
        let (companies, cities) = (&self.companies, &self.cities);
        for (i, &c) in companies.iter().enumerate() {
            let mut f = vec![
                (Relation::Founder, founders[i]),
                (Relation::BasedIn, *cities.choose(rng).expect("cities")),
            ];
            if rng.random_bool(P_OWNER) {
                f.push((Relation::Owner, pick_other(companies, c, rng)));
            }
            entities[c].facts = f;
        }
    }

    fn work_facts(&self, rng: &mut ChaCha8Rng, entities: &mut [Entity]) {
        let (persons, companies, cities) = (&self.persons, &self.companies, &self.cities);
        for &w in &self.works {
            entities[w].facts = vec![
                (Relation::Author, *persons.choose(rng).expect("persons")),
                (
                    Relation::Publisher,
                    *companies.choose(rng).expect("companies"),
                ),
                (Relation::Setting, *cities.choose(rng).expect("cities")),
            ];
        }
    }

    fn city_facts(&self, rng: &mut ChaCha8Rng, entities: &mut [Entity], mayors: &[usize]) {
        for (i, &c) in self.cities.iter().enumerate() {
            entities[c].facts = vec![
                (
                    Relation::Country,
                    *self.countries.choose(rng).expect("countries"),
                ),
                (Relation::Mayor, mayors[i]),
            ];
        }
    }
}

/// A random member of `pool` other than `not`.
fn pick_other(pool: &[usize], not: usize, rng: &mut ChaCha8Rng) -> usize {
    loop {
        // Pools have ≥ 2 members, so this ends.
        let x = *pool.choose(rng).expect("non-empty pool");
        if x != not {
            return x;
        }
    }
}

/// Documents for every entity but the countries, in a shuffled order so
/// ids do not reveal the kind; links each entity to its document.
fn draw_docs(rng: &mut ChaCha8Rng, entities: &mut [Entity]) -> Vec<Doc> {
    let mut with_doc: Vec<usize> = (0..entities.len())
        .filter(|&e| entities[e].kind != Kind::Country)
        .collect();
    with_doc.shuffle(rng);
    let docs: Vec<Doc> = with_doc
        .iter()
        .enumerate()
        .map(|(i, &e)| Doc {
            id: format!("d{i:03}"),
            entity: e,
        })
        .collect();
    for (i, d) in docs.iter().enumerate() {
        entities[d.entity].doc = Some(i);
    }
    docs
}

impl Corpus {
    /// The corpus from [`CORPUS_SEED`]. The steps draw from one stream in
    /// a fixed order (names, officials, facts, fact order, document order):
    /// changing that order changes the corpus, so bump [`CORPUS_ID`] with it.
    fn build() -> Corpus {
        let mut rng = ChaCha8Rng::seed_from_u64(CORPUS_SEED);
        let mut entities: Vec<Entity> = Vec::new();
        let roster = Roster::draw(&mut rng, &mut entities);
        roster.draw_facts(&mut rng, &mut entities);
        // Vary the fact order, so the first sentence (the search snippet)
        // is not always the same relation.
        for e in entities.iter_mut() {
            e.facts.shuffle(&mut rng);
        }
        let docs = draw_docs(&mut rng, &mut entities);
        Corpus::assemble(entities, docs)
    }

    /// The lookup tables and the search index over drawn entities and docs.
    fn assemble(entities: Vec<Entity>, docs: Vec<Doc>) -> Corpus {
        let by_name = entities
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        let by_id = docs
            .iter()
            .enumerate()
            .map(|(i, d)| (d.id.clone(), i))
            .collect();
        let mut corpus = Corpus {
            entities,
            docs,
            by_name,
            by_id,
            index: Bm25::default(),
        };
        let texts: Vec<String> = (0..corpus.docs.len())
            .map(|d| corpus.index_text(d))
            .collect();
        corpus.index = Bm25::new(&texts);
        corpus
    }

    /// Entity by exact name.
    pub fn entity_named(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Doc by id (case-insensitive, `D007` = `d007`).
    pub fn doc_by_id(&self, id: &str) -> Option<usize> {
        self.by_id.get(&id.to_lowercase()).copied()
    }

    pub fn name(&self, entity: usize) -> &str {
        &self.entities[entity].name
    }

    /// The fact sentences of an entity's document, in order.
    pub fn sentences(&self, entity: usize) -> Vec<String> {
        let e = &self.entities[entity];
        e.facts
            .iter()
            .map(|&(r, o)| r.sentence(&e.name, self.name(o)))
            .collect()
    }

    /// What BM25 indexes: title and body.
    fn index_text(&self, doc: usize) -> String {
        let e = self.docs[doc].entity;
        format!("{} {}", self.name(e), self.sentences(e).join(" "))
    }

    /// The opened document as shown to the agent, and the entities it
    /// mentions (its own, then its facts' objects).
    pub fn render_doc(&self, doc: usize) -> (String, Vec<usize>) {
        let d = &self.docs[doc];
        let e = &self.entities[d.entity];
        let text = format!(
            "Document {}, {} ({}): {}",
            d.id,
            e.name,
            e.kind.name(),
            self.sentences(d.entity).join(" ")
        );
        let mut mentions = vec![d.entity];
        mentions.extend(e.facts.iter().map(|&(_, o)| o));
        (text, mentions)
    }

    /// A search result line "dNNN: title — first sentence", and the
    /// entities it mentions (the doc's own, then the snippet fact's object).
    pub fn render_hit(&self, doc: usize) -> (String, Vec<usize>) {
        let d = &self.docs[doc];
        let e = &self.entities[d.entity];
        let snippet = self
            .sentences(d.entity)
            .into_iter()
            .next()
            .unwrap_or_default();
        let mut mentions = vec![d.entity];
        mentions.extend(e.facts.first().map(|&(_, o)| o));
        (format!("{}: {} — {}", d.id, e.name, snippet), mentions)
    }

    /// Follow `relations` from `start`: the entities visited, start first.
    /// `Err` names the first hop that does not apply.
    pub fn follow(&self, start: usize, relations: &[Relation]) -> Result<Vec<usize>, NoFact> {
        let mut path = vec![start];
        for (i, &r) in relations.iter().enumerate() {
            let cur = *path.last().expect("path starts non-empty");
            let e = &self.entities[cur];
            let Some(&(_, o)) = e.facts.iter().find(|(fr, _)| *fr == r) else {
                return Err(NoFact {
                    hop: i + 1,
                    entity: e.name.clone(),
                    kind: e.kind,
                    relation: r,
                });
            };
            path.push(o);
        }
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn name_words_are_distinct_and_not_stop_words() {
        let words: Vec<&str> = name_words().collect();
        let set: BTreeSet<String> = words.iter().map(|w| w.to_lowercase()).collect();
        assert_eq!(set.len(), words.len(), "a word is reused across name lists");
        for w in &set {
            assert!(
                !super::super::bm25::is_stop_word(w) && !["a", "an", "the"].contains(&w.as_str()),
                "{w}"
            );
        }
    }

    #[test]
    fn corpus_shape() {
        let c = corpus();
        assert_eq!(
            c.docs.len(),
            N_PERSONS + N_COMPANIES + N_WORKS + CITIES.len()
        );
        assert_eq!(c.by_name.len(), c.entities.len(), "entity names not unique");
        for (i, d) in c.docs.iter().enumerate() {
            assert_eq!(d.id, format!("d{i:03}"));
            let e = &c.entities[d.entity];
            assert_eq!(e.doc, Some(i));
            assert!((2..=4).contains(&e.facts.len()), "{}", e.name);
            for &(r, o) in &e.facts {
                assert_eq!(r.subject(), e.kind);
                assert_eq!(r.object(), c.entities[o].kind);
                assert_ne!(o, d.entity, "{} links to itself", e.name);
            }
            let rels: BTreeSet<Relation> = e.facts.iter().map(|f| f.0).collect();
            assert_eq!(rels.len(), e.facts.len(), "{}: relation twice", e.name);
        }
        // Built once, the same every time.
        assert!(std::ptr::eq(c, corpus()));
        let again = Corpus::build();
        for (a, b) in c.entities.iter().zip(&again.entities) {
            assert_eq!((&a.name, &a.facts, a.doc), (&b.name, &b.facts, b.doc));
        }
    }

    #[test]
    fn questions_compose_relations() {
        assert_eq!(
            question_text("Apex Labs", &[Relation::Founder, Relation::BornIn]),
            "Where was the founder of Apex Labs born?"
        );
        assert_eq!(
            question_text(
                "Silent River",
                &[
                    Relation::Author,
                    Relation::Employer,
                    Relation::Founder,
                    Relation::BornIn
                ]
            ),
            "Where was the founder of the employer of the author of Silent River born?"
        );
        assert_eq!(question_text("x", &[]), "");
    }
}
