//! The shop's rules engine: pages (search, results, item, item sub-pages),
//! what each shows, its clickables (the admissible list), page transitions,
//! the purchase and the status line.
//!
//! Observations are the visible page text joined by " [SEP] ", with buttons
//! capitalised as in WebShop ("Back to Search", "Next >", "Buy Now"); the
//! matching actions are lower-cased: `click[back to search]`.

use std::collections::BTreeMap;

use super::catalog::{catalog, Catalog, Product, PAGE_SIZE};
use super::world::{reward, World};

pub(crate) const SEP: &str = " [SEP] ";
pub(crate) const BACK: &str = "click[back to search]";
pub(crate) const NEXT: &str = "click[next >]";
pub(crate) const PREV: &str = "click[< prev]";
pub(crate) const BUY: &str = "click[buy now]";

/// An item's sub-pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sub {
    Description,
    Features,
    Reviews,
}

impl Sub {
    const ALL: [Sub; 3] = [Sub::Description, Sub::Features, Sub::Reviews];

    fn name(self) -> &'static str {
        match self {
            Sub::Description => "description",
            Sub::Features => "features",
            Sub::Reviews => "reviews",
        }
    }

    fn button(self) -> &'static str {
        match self {
            Sub::Description => "Description",
            Sub::Features => "Features",
            Sub::Reviews => "Reviews",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Page {
    Search,
    /// Results page `n` (0-based) of the current query.
    Results(usize),
    /// An item opened from results page `from`.
    Item {
        product: usize,
        from: usize,
    },
    /// A sub-page of an item opened from results page `from`.
    Sub {
        product: usize,
        from: usize,
        sub: Sub,
    },
    /// Bought: the episode is over.
    Bought {
        product: usize,
    },
}

/// One episode's shop state.
#[derive(Debug, Clone)]
pub(crate) struct Sim {
    pub world: World,
    /// The instruction as shown (the task's goal text).
    instruction: String,
    cat: &'static Catalog,
    page: Page,
    query: String,
    results: Vec<usize>,
    /// Option kind → value clicked on the current item.
    selected: BTreeMap<String, String>,
    /// Reward of the purchase, once bought.
    pub bought: Option<f64>,
}

/// Lower-case, trimmed, single-spaced: how actions are compared.
pub(crate) fn normalize(action: &str) -> String {
    action
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

fn click(text: &str) -> String {
    format!("click[{text}]")
}

impl Sim {
    /// A shop at the search page; `world` must already be valid.
    pub fn new(world: World, instruction: &str) -> Sim {
        Sim {
            world,
            instruction: instruction.to_string(),
            cat: catalog(),
            page: Page::Search,
            query: String::new(),
            results: Vec::new(),
            selected: BTreeMap::new(),
            bought: None,
        }
    }

    fn product(&self, id: usize) -> &'static Product {
        &self.cat.products[id]
    }

    fn pages(&self) -> usize {
        self.results.len().div_ceil(PAGE_SIZE).max(1)
    }

    fn on_page(&self, n: usize) -> &[usize] {
        let start = (n * PAGE_SIZE).min(self.results.len());
        let end = (start + PAGE_SIZE).min(self.results.len());
        &self.results[start..end]
    }

    /// The current page's text.
    pub fn render(&self) -> String {
        let parts: Vec<String> = match self.page {
            Page::Search => vec![
                "WebShop".into(),
                "Instruction:".into(),
                self.instruction.clone(),
                "Search".into(),
            ],
            Page::Results(n) => {
                let mut v = vec![
                    "Back to Search".to_string(),
                    format!("Page {} (Total results: {})", n + 1, self.results.len()),
                ];
                if n > 0 {
                    v.push("< Prev".into());
                }
                if n + 1 < self.pages() {
                    v.push("Next >".into());
                }
                for &id in self.on_page(n) {
                    let p = self.product(id);
                    v.push(p.title.clone());
                    v.push(p.price_text());
                }
                v
            }
            Page::Item { product, .. } => {
                let p = self.product(product);
                let mut v = vec!["Back to Search".to_string(), "< Prev".to_string()];
                for (kind, values) in &p.options {
                    v.push(kind.clone());
                    v.extend(values.iter().cloned());
                }
                v.push(p.title.clone());
                v.push(format!("Price: {}", p.price_text()));
                v.push(format!("Rating: {}", p.rating_text()));
                v.extend(Sub::ALL.iter().map(|s| s.button().to_string()));
                v.push("Buy Now".into());
                v
            }
            Page::Sub { product, sub, .. } => {
                let p = self.product(product);
                let mut v = vec!["Back to Search".to_string(), "< Prev".to_string()];
                v.extend(match sub {
                    Sub::Description => p.description(),
                    Sub::Features => p.features(),
                    Sub::Reviews => p.reviews(),
                });
                v
            }
            Page::Bought { product } => vec![
                "Thank you for shopping with us!".into(),
                "Purchased".into(),
                self.product(product).title.clone(),
                "Your score (min 0.0, max 1.0)".into(),
                format!("{:.2}", self.bought.unwrap_or(0.0)),
            ],
        };
        parts.join(SEP)
    }

    /// Every action possible now, in page order.
    pub fn admissible(&self) -> Vec<String> {
        match self.page {
            Page::Search => self
                .world
                .queries
                .iter()
                .map(|q| format!("search[{q}]"))
                .collect(),
            Page::Results(n) => {
                let mut v = vec![BACK.to_string()];
                if n > 0 {
                    v.push(PREV.into());
                }
                if n + 1 < self.pages() {
                    v.push(NEXT.into());
                }
                v.extend(
                    self.on_page(n)
                        .iter()
                        .map(|&id| click(&self.product(id).title)),
                );
                v
            }
            Page::Item { product, .. } => {
                let p = self.product(product);
                let mut v = vec![BACK.to_string(), PREV.to_string()];
                for (_, values) in &p.options {
                    v.extend(values.iter().map(|x| click(x)));
                }
                v.extend(Sub::ALL.iter().map(|s| click(s.name())));
                v.push(BUY.into());
                v
            }
            Page::Sub { .. } => vec![BACK.to_string(), PREV.to_string()],
            Page::Bought { .. } => Vec::new(),
        }
    }

    /// Apply one action: `(observation, valid)`. An action outside the
    /// admissible list changes nothing and returns the page unchanged.
    pub fn exec(&mut self, action: &str) -> (String, bool) {
        let a = normalize(action);
        if !self.admissible().contains(&a) {
            return (self.render(), false);
        }
        if let Some(q) = a.strip_prefix("search[").and_then(|s| s.strip_suffix(']')) {
            self.query = q.to_string();
            self.results = self.cat.search(q);
            self.page = Page::Results(0);
            return (self.render(), true);
        }
        let Some(target) = a.strip_prefix("click[").and_then(|s| s.strip_suffix(']')) else {
            return (self.render(), false);
        };
        if a == BACK {
            self.page = Page::Search;
            self.query.clear();
            self.results.clear();
            self.selected.clear();
            return (self.render(), true);
        }
        self.page = match self.page {
            Page::Results(n) if a == NEXT => Page::Results(n + 1),
            Page::Results(n) if a == PREV => Page::Results(n.saturating_sub(1)),
            Page::Results(n) => match self.cat.by_title(target) {
                Some(product) => {
                    self.selected.clear();
                    Page::Item { product, from: n }
                }
                None => return (self.render(), false),
            },
            Page::Item { from, .. } if a == PREV => {
                self.selected.clear();
                Page::Results(from)
            }
            Page::Item { product, from } => {
                let p = self.product(product);
                if a == BUY {
                    self.bought = Some(reward(&self.world.goal, p, &self.selected));
                    Page::Bought { product }
                } else if let Some(sub) = Sub::ALL.into_iter().find(|s| s.name() == target) {
                    Page::Sub { product, from, sub }
                } else if let Some(kind) = p.option_kind(target) {
                    self.selected.insert(kind.to_string(), target.to_string());
                    self.page
                } else {
                    return (self.render(), false);
                }
            }
            Page::Sub { product, from, .. } => Page::Item { product, from },
            Page::Search | Page::Bought { .. } => return (self.render(), false),
        };
        (self.render(), true)
    }

    /// "Page: item acme classic shirt. Selected: color navy. Need: shirt;
    /// cotton, machine wash; color navy; price under 30 dollars."
    pub fn status(&self) -> String {
        let selected = || {
            if self.selected.is_empty() {
                "none".to_string()
            } else {
                self.selected
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let page = match self.page {
            Page::Search => "Page: search.".to_string(),
            Page::Results(n) => format!(
                "Page: results {} of {} for {}.",
                n + 1,
                self.pages(),
                self.query
            ),
            Page::Item { product, .. } => format!(
                "Page: item {}. Selected: {}.",
                self.product(product).title,
                selected()
            ),
            Page::Sub { product, sub, .. } => format!(
                "Page: {} of {}. Selected: {}.",
                sub.name(),
                self.product(product).title,
                selected()
            ),
            Page::Bought { product } => format!("Bought {}.", self.product(product).title),
        };
        let g = &self.world.goal;
        let opts = if g.options.is_empty() {
            "no options".to_string()
        } else {
            g.options
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "{page} Need: {}; {}; {opts}; price under {} dollars.",
            g.product,
            g.attributes.join(", "),
            g.price_cap
        )
    }
}
