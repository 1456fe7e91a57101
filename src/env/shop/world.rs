//! A shop task's serialized world (the goal, the expert's target product and
//! the candidate search queries), its validation, the instruction text and
//! the WebShop reward.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::catalog::{catalog, product_type, word_set, Product, CATALOG_ID};

/// Most candidate queries a world may list.
pub const MAX_QUERIES: usize = 8;
/// Largest accepted price cap, in dollars.
pub const MAX_CAP: u32 = 1000;

/// What the instruction asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Goal {
    /// Product type name ("shirt").
    pub product: String,
    /// Required attributes (at least one), in the type's pool order.
    pub attributes: Vec<String>,
    /// Required option values by option kind (0–3 of them).
    pub options: BTreeMap<String, String>,
    /// Highest acceptable price, in whole dollars.
    pub price_cap: u32,
}

impl Goal {
    /// The WebShop-style instruction: "i need a shirt with cotton and machine
    /// wash, and color is navy, and price lower than 30 dollars".
    pub fn instruction(&self) -> String {
        let mut s = format!(
            "i need a {} with {}",
            self.product,
            self.attributes.join(" and ")
        );
        for (kind, value) in &self.options {
            s.push_str(&format!(", and {kind} is {value}"));
        }
        s.push_str(&format!(
            ", and price lower than {} dollars",
            self.price_cap
        ));
        s
    }

    /// The goal's own search query: the product type, then its attributes.
    pub fn query(&self) -> String {
        let mut q = self.product.clone();
        for a in &self.attributes {
            q.push(' ');
            q.push_str(a);
        }
        q
    }

    /// A canonical text of the goal (attributes as a set), used to keep
    /// panels free of repeats and train/test disjoint.
    pub fn key(&self) -> String {
        let attrs: BTreeSet<&str> = self.attributes.iter().map(String::as_str).collect();
        let attrs: Vec<&str> = attrs.into_iter().collect();
        let opts: Vec<String> = self
            .options
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "{}|{}|{}|{}",
            self.product,
            attrs.join(","),
            opts.join(","),
            self.price_cap
        )
    }

    /// Does `p` meet every constraint (type, attributes, options offered,
    /// price)? Buying it with the goal's options selected scores 1.0.
    pub fn satisfied_by(&self, p: &Product) -> bool {
        p.product_type == self.product
            && self
                .attributes
                .iter()
                .all(|a| p.attributes.iter().any(|b| b == a))
            && self.options.iter().all(|(k, v)| p.offers(k, v))
            && p.price <= self.price_cap
    }
}

/// Lower-case with single spaces: the form attributes and option values are
/// compared in.
fn norm(s: &str) -> String {
    s.split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Product-type factor of the reward: 1 for the goal's type, 0.5 for a type
/// under the same parent category ("tops": shirt vs hoodie), 0.1 for one
/// under the same top category ("clothing": shirt vs boot), else 0. Unknown
/// type names score 1 only when equal.
pub fn r_type(goal_type: &str, bought_type: &str) -> f64 {
    if goal_type == bought_type {
        return 1.0;
    }
    match (product_type(goal_type), product_type(bought_type)) {
        (Some(g), Some(b)) if g.top == b.top && g.parent == b.parent => 0.5,
        (Some(g), Some(b)) if g.top == b.top => 0.1,
        _ => 0.0,
    }
}

/// The WebShop reward of buying `bought` with options `chosen` (kind →
/// value) selected:
///
/// `r_type · (n_attr + n_opt + 1[price ≤ cap]) / (|attrs| + |opts| + 1)`
///
/// where `n_attr` counts goal attributes that the product has and `n_opt`
/// goal option values among the chosen values. WebShop matches these with a
/// fuzzy string matcher; here a match is equality after lower-casing and
/// collapsing spaces (the catalog is closed, so exact matching loses
/// nothing). [`r_type`] gives the type factor.
pub fn reward(goal: &Goal, bought: &Product, chosen: &BTreeMap<String, String>) -> f64 {
    let rt = r_type(&goal.product, &bought.product_type);
    let n_attr = goal
        .attributes
        .iter()
        .filter(|a| bought.attributes.iter().any(|b| norm(b) == norm(a)))
        .count();
    let n_opt = goal
        .options
        .values()
        .filter(|v| chosen.values().any(|c| norm(c) == norm(v)))
        .count();
    let n_price = usize::from(bought.price <= goal.price_cap);
    let total = goal.attributes.len() + goal.options.len() + 1;
    rt * (n_attr + n_opt + n_price) as f64 / total as f64
}

/// What is wrong with a shop world (the message a bad task shows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorldError {
    #[error("unknown catalog {0:?} (this build has {CATALOG_ID:?})")]
    Catalog(String),
    #[error("unknown product type {0:?}")]
    ProductType(String),
    #[error("goal has no attributes")]
    NoAttributes,
    #[error("{attribute:?} is not a {product} attribute")]
    Attribute {
        attribute: String,
        product: &'static str,
    },
    #[error("attribute {0:?} repeated")]
    RepeatedAttribute(String),
    #[error("{kind:?} is not a {product} option")]
    OptionKind { kind: String, product: &'static str },
    #[error("{value:?} is not a {product} {kind}")]
    OptionValue {
        value: String,
        kind: String,
        product: &'static str,
    },
    #[error("price cap {0} outside 1..={MAX_CAP}")]
    PriceCap(u32),
    #[error("target {target} outside the catalog (0..{products})")]
    TargetOutside { target: usize, products: usize },
    #[error("target {target} ({title}) does not satisfy the goal")]
    TargetMisses { target: usize, title: String },
    #[error("{0} queries (need 1..={MAX_QUERIES})")]
    QueryCount(usize),
    #[error("query {0:?} must be lower-case words separated by single spaces")]
    QueryForm(String),
    #[error("query {query:?}: word {word:?} is not in the catalog")]
    QueryWord { query: String, word: String },
    #[error("query {0:?} repeated")]
    RepeatedQuery(String),
    #[error("the goal's query {0:?} is not offered")]
    OwnQueryMissing(String),
    #[error("target {target} is not among the results of {query:?}")]
    TargetNotFound { target: usize, query: String },
}

/// A shop task's world: everything reset needs besides the catalog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct World {
    /// The catalog the task was made for (must be [`CATALOG_ID`]).
    pub catalog: String,
    pub goal: Goal,
    /// Catalog id of the product the expert buys: the first product of the
    /// goal query's results that satisfies the goal.
    pub target: usize,
    /// Queries offered on the search page (the admissible `search[..]`
    /// actions): the goal's own query and distractors, in display order.
    pub queries: Vec<String>,
}

impl World {
    /// Check the world against the catalog; the error says what is wrong.
    pub fn validate(&self) -> Result<(), WorldError> {
        if self.catalog != CATALOG_ID {
            return Err(WorldError::Catalog(self.catalog.clone()));
        }
        self.validate_goal()?;
        let cat = catalog();
        let g = &self.goal;
        let target = cat
            .products
            .get(self.target)
            .ok_or(WorldError::TargetOutside {
                target: self.target,
                products: cat.products.len(),
            })?;
        if !g.satisfied_by(target) {
            return Err(WorldError::TargetMisses {
                target: self.target,
                title: target.title.clone(),
            });
        }
        self.validate_queries()
    }

    /// The goal against its product type's attributes and options, and the
    /// price cap.
    fn validate_goal(&self) -> Result<(), WorldError> {
        let g = &self.goal;
        let ty =
            product_type(&g.product).ok_or_else(|| WorldError::ProductType(g.product.clone()))?;
        if g.attributes.is_empty() {
            return Err(WorldError::NoAttributes);
        }
        let mut seen = BTreeSet::new();
        for a in &g.attributes {
            if !ty.attributes.contains(&a.as_str()) {
                return Err(WorldError::Attribute {
                    attribute: a.clone(),
                    product: ty.name,
                });
            }
            if !seen.insert(a) {
                return Err(WorldError::RepeatedAttribute(a.clone()));
            }
        }
        for (kind, value) in &g.options {
            let k = ty.options.iter().find(|k| k.name == kind).ok_or_else(|| {
                WorldError::OptionKind {
                    kind: kind.clone(),
                    product: ty.name,
                }
            })?;
            if !k.values.contains(&value.as_str()) {
                return Err(WorldError::OptionValue {
                    value: value.clone(),
                    kind: kind.clone(),
                    product: ty.name,
                });
            }
        }
        if g.price_cap == 0 || g.price_cap > MAX_CAP {
            return Err(WorldError::PriceCap(g.price_cap));
        }
        Ok(())
    }

    /// The offered queries: well-formed, known words, no repeats, the
    /// goal's own among them and finding the target.
    fn validate_queries(&self) -> Result<(), WorldError> {
        let cat = catalog();
        if self.queries.is_empty() || self.queries.len() > MAX_QUERIES {
            return Err(WorldError::QueryCount(self.queries.len()));
        }
        let mut seen = BTreeSet::new();
        for q in &self.queries {
            let words: Vec<&str> = q.split(' ').collect();
            if q.is_empty() || words.iter().any(|w| !word_set(w).contains(*w)) {
                return Err(WorldError::QueryForm(q.clone()));
            }
            if let Some(w) = words.iter().find(|w| !cat.knows_token(w)) {
                return Err(WorldError::QueryWord {
                    query: q.clone(),
                    word: w.to_string(),
                });
            }
            if !seen.insert(q) {
                return Err(WorldError::RepeatedQuery(q.clone()));
            }
        }
        let own = self.goal.query();
        if !self.queries.contains(&own) {
            return Err(WorldError::OwnQueryMissing(own));
        }
        if !cat.search(&own).contains(&self.target) {
            return Err(WorldError::TargetNotFound {
                target: self.target,
                query: own,
            });
        }
        Ok(())
    }
}
