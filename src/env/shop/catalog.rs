//! The shop's product catalog: the fixed table of product types (category
//! path, attribute pool, option kinds, price range, title words), the
//! products generated from it, and the search engine over them.
//!
//! The catalog is generated from its own fixed seed ([`CATALOG_SEED`]), never
//! from a panel seed, so every panel, worker and run sees the same products
//! under the same ids. Tasks name the catalog they were made for
//! ([`CATALOG_ID`]); changing anything here that moves products must bump
//! that id (and regenerate the committed panels).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::env::household::split_words;

/// Id (and version) of the generated catalog that tasks refer to.
pub const CATALOG_ID: &str = "shop-catalog-v1";
/// Seed of the catalog generator (fixed: the catalog is part of the env).
pub const CATALOG_SEED: u64 = 0x5_4007_2026;
/// Products per product type.
pub const PER_TYPE: usize = 48;
/// Results per results page.
pub const PAGE_SIZE: usize = 10;
/// A search returns at most this many products (WebShop shows the top 50).
pub const MAX_RESULTS: usize = 50;

/// One option kind of a product type ("color") and every value it can take;
/// each product offers a subset of the values.
#[derive(Debug)]
pub struct OptionKind {
    pub name: &'static str,
    pub values: &'static [&'static str],
}

/// A product type with its category path `top > parent > name`.
#[derive(Debug)]
pub struct ProductType {
    /// The type's name, also its last category ("shirt").
    pub name: &'static str,
    /// Top category ("clothing").
    pub top: &'static str,
    /// Parent category ("tops").
    pub parent: &'static str,
    /// Attributes products of this type may have (each has 2–4 of them).
    pub attributes: &'static [&'static str],
    /// Option kinds, in display order.
    pub options: &'static [OptionKind],
    /// Style words for titles ("{brand} {style} {type}").
    pub styles: &'static [&'static str],
    /// Inclusive price range in whole dollars.
    pub price: (u32, u32),
}

const fn ok(name: &'static str, values: &'static [&'static str]) -> OptionKind {
    OptionKind { name, values }
}

const SIZES: &[&str] = &["small", "medium", "large", "xlarge"];
const SHOE_SIZES: &[&str] = &["7", "8", "9", "10", "11"];
const PACKS: &[&str] = &["1 pack", "2 pack", "4 pack"];
const CLOTHING_STYLES: &[&str] = &["classic", "casual", "sport", "vintage", "urban", "basic"];
const HOME_STYLES: &[&str] = &["modern", "rustic", "classic", "cozy", "simple", "deluxe"];
const CARE_STYLES: &[&str] = &["pure", "daily", "fresh", "gentle", "classic", "herbal"];
const AUDIO_STYLES: &[&str] = &["pro", "mini", "smart", "classic", "studio", "active"];

/// Title brands, shared by all types.
pub const BRANDS: &[&str] = &[
    "acme", "nova", "zenith", "orbit", "maple", "summit", "lumen", "harbor",
];

/// The product types. Within a type, option values are unique across kinds
/// (so a clicked value names its kind); the catalog test checks this.
pub const TYPES: &[ProductType] = &[
    ProductType {
        name: "shirt",
        top: "clothing",
        parent: "tops",
        attributes: &[
            "cotton",
            "machine wash",
            "slim fit",
            "long sleeve",
            "breathable",
            "quick dry",
        ],
        options: &[
            ok("color", &["black", "white", "navy", "gray", "red", "green"]),
            ok("size", SIZES),
            ok("neck", &["crew neck", "v neck"]),
        ],
        styles: CLOTHING_STYLES,
        price: (8, 40),
    },
    ProductType {
        name: "hoodie",
        top: "clothing",
        parent: "tops",
        attributes: &[
            "cotton",
            "machine wash",
            "fleece lined",
            "relaxed fit",
            "breathable",
            "zip up",
        ],
        options: &[
            ok("color", &["black", "gray", "navy", "green", "beige"]),
            ok("size", SIZES),
        ],
        styles: CLOTHING_STYLES,
        price: (20, 60),
    },
    ProductType {
        name: "sneaker",
        top: "clothing",
        parent: "shoes",
        attributes: &[
            "non slip",
            "breathable",
            "lightweight",
            "memory foam",
            "rubber sole",
            "water resistant",
        ],
        options: &[
            ok("color", &["black", "white", "gray", "blue"]),
            ok("size", SHOE_SIZES),
            ok("width", &["regular", "wide"]),
        ],
        styles: CLOTHING_STYLES,
        price: (30, 90),
    },
    ProductType {
        name: "boot",
        top: "clothing",
        parent: "shoes",
        attributes: &[
            "leather",
            "water resistant",
            "non slip",
            "rubber sole",
            "memory foam",
            "warm lining",
        ],
        options: &[
            ok("color", &["black", "brown", "tan"]),
            ok("size", SHOE_SIZES),
        ],
        styles: CLOTHING_STYLES,
        price: (40, 99),
    },
    ProductType {
        name: "mug",
        top: "home",
        parent: "kitchen",
        attributes: &[
            "ceramic",
            "dishwasher safe",
            "microwave safe",
            "insulated",
            "stainless steel",
            "bpa free",
        ],
        options: &[
            ok("color", &["black", "white", "blue", "red"]),
            ok("capacity", &["12 oz", "16 oz", "20 oz"]),
            ok("pack", PACKS),
        ],
        styles: HOME_STYLES,
        price: (6, 30),
    },
    ProductType {
        name: "kettle",
        top: "home",
        parent: "kitchen",
        attributes: &[
            "stainless steel",
            "bpa free",
            "cordless",
            "fast boil",
            "auto shut off",
            "glass",
        ],
        options: &[
            ok("color", &["black", "white", "silver"]),
            ok("capacity", &["1 liter", "2 liter"]),
        ],
        styles: HOME_STYLES,
        price: (20, 70),
    },
    ProductType {
        name: "pillow",
        top: "home",
        parent: "bedroom",
        attributes: &[
            "memory foam",
            "hypoallergenic",
            "machine wash",
            "cooling",
            "soft",
            "down alternative",
        ],
        options: &[
            ok("size", &["standard", "queen", "king"]),
            ok("pack", PACKS),
            ok("firmness", &["plush", "medium", "firm"]),
        ],
        styles: HOME_STYLES,
        price: (15, 60),
    },
    ProductType {
        name: "blanket",
        top: "home",
        parent: "bedroom",
        attributes: &[
            "soft",
            "machine wash",
            "lightweight",
            "fleece lined",
            "cooling",
            "hypoallergenic",
        ],
        options: &[
            ok("color", &["gray", "navy", "beige", "white"]),
            ok("size", &["twin", "queen", "king"]),
        ],
        styles: HOME_STYLES,
        price: (20, 80),
    },
    ProductType {
        name: "shampoo",
        top: "beauty",
        parent: "care",
        attributes: &[
            "paraben free",
            "sulfate free",
            "natural",
            "long lasting",
            "travel size",
            "color safe",
        ],
        options: &[
            ok("scent", &["lavender", "mint", "coconut", "citrus"]),
            ok("size", &["8 oz", "12 oz", "16 oz"]),
            ok("pack", PACKS),
        ],
        styles: CARE_STYLES,
        price: (5, 30),
    },
    ProductType {
        name: "lotion",
        top: "beauty",
        parent: "care",
        attributes: &[
            "paraben free",
            "fragrance free",
            "natural",
            "long lasting",
            "sensitive skin",
            "non greasy",
        ],
        options: &[
            ok("scent", &["lavender", "coconut", "vanilla", "unscented"]),
            ok("size", &["4 oz", "8 oz", "12 oz"]),
        ],
        styles: CARE_STYLES,
        price: (5, 35),
    },
    ProductType {
        name: "headset",
        top: "electronics",
        parent: "audio",
        attributes: &[
            "wireless",
            "noise cancelling",
            "long battery",
            "foldable",
            "water resistant",
            "lightweight",
        ],
        options: &[
            ok("color", &["black", "white", "blue"]),
            ok("style", &["over ear", "in ear"]),
        ],
        styles: AUDIO_STYLES,
        price: (20, 99),
    },
    ProductType {
        name: "speaker",
        top: "electronics",
        parent: "audio",
        attributes: &[
            "wireless",
            "water resistant",
            "long battery",
            "portable",
            "bass boost",
            "voice control",
        ],
        options: &[
            ok("color", &["black", "blue", "red", "gray"]),
            ok("pack", &["1 pack", "2 pack"]),
        ],
        styles: AUDIO_STYLES,
        price: (25, 99),
    },
];

/// The product type called `name`.
pub fn product_type(name: &str) -> Option<&'static ProductType> {
    TYPES.iter().find(|t| t.name == name)
}

/// One product of the catalog.
#[derive(Debug, Clone, PartialEq)]
pub struct Product {
    /// Index in the catalog (breaks search ties).
    pub id: usize,
    /// Name of its [`ProductType`].
    pub product_type: String,
    /// Unique, lower-case title "{brand} {style} {type}"; clicking it opens
    /// the item page.
    pub title: String,
    pub brand: String,
    pub style: String,
    /// Its attributes, in the type's pool order.
    pub attributes: Vec<String>,
    /// (option kind, values offered), in the type's kind order.
    pub options: Vec<(String, Vec<String>)>,
    /// Price in whole dollars.
    pub price: u32,
    /// Rating in half stars (9 = 4.5).
    pub rating: u8,
}

impl Product {
    /// The kind of option value `value`, if this product offers it.
    pub fn option_kind(&self, value: &str) -> Option<&str> {
        self.options
            .iter()
            .find(|(_, vs)| vs.iter().any(|v| v == value))
            .map(|(k, _)| k.as_str())
    }

    /// Offers `value` under option kind `kind`.
    pub fn offers(&self, kind: &str, value: &str) -> bool {
        self.options
            .iter()
            .any(|(k, vs)| k == kind && vs.iter().any(|v| v == value))
    }

    /// "4.5"
    pub fn rating_text(&self) -> String {
        format!(
            "{}.{}",
            self.rating / 2,
            if self.rating % 2 == 1 { 5 } else { 0 }
        )
    }

    /// "$24"
    pub fn price_text(&self) -> String {
        format!("${}", self.price)
    }

    /// The description sub-page's text parts.
    pub fn description(&self) -> Vec<String> {
        let cat = product_type(&self.product_type)
            .map(|t| format!("category: {} > {} > {}", t.top, t.parent, t.name))
            .unwrap_or_default();
        vec![
            format!(
                "a {} {} by {} that is {}.",
                self.style,
                self.product_type,
                self.brand,
                and_list(&self.attributes)
            ),
            cat,
        ]
    }

    /// The features sub-page's text parts: its attributes, then the option
    /// kinds it comes in.
    pub fn features(&self) -> Vec<String> {
        let mut out = self.attributes.clone();
        for (kind, values) in &self.options {
            let plural = if values.len() == 1 { "" } else { "s" };
            out.push(format!("{} {kind} choice{plural}", values.len()));
        }
        out
    }

    /// The reviews sub-page's text parts: two short reviews whose stars sit
    /// around the product's rating.
    pub fn reviews(&self) -> Vec<String> {
        let first = self.rating.min(10);
        let second = self.rating.saturating_sub(2).max(2);
        let attr = |i: usize| self.attributes.get(i).map_or("", String::as_str);
        let verdict = |r: u8| match r {
            9.. => "love this",
            7..=8 => "good",
            5..=6 => "okay",
            _ => "not great",
        };
        let stars = |r: u8| format!("{}.{} stars", r / 2, if r % 2 == 1 { 5 } else { 0 });
        vec![
            stars(first),
            format!(
                "{} {}, really {}.",
                verdict(first),
                self.product_type,
                attr(0)
            ),
            stars(second),
            format!(
                "{}, {} as described.",
                verdict(second),
                attr(self.attributes.len().saturating_sub(1))
            ),
        ]
    }
}

/// "a", "a and b", "a, b and c"
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// Lower-cased word tokens of `text` (punctuation dropped), as a set: the
/// unit of search scoring.
pub fn word_set(text: &str) -> BTreeSet<String> {
    split_words(text)
        .into_iter()
        .filter(|w| w.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .map(str::to_lowercase)
        .collect()
}

/// The generated catalog (see [`catalog`]).
#[derive(Debug)]
pub struct Catalog {
    pub products: Vec<Product>,
    by_title: BTreeMap<String, usize>,
    /// Search tokens of each product: title, attribute and type words.
    tokens: Vec<BTreeSet<String>>,
    /// Every search token of the catalog (queries may use only these).
    all_tokens: BTreeSet<String>,
}

/// The catalog, built once per process from [`CATALOG_SEED`].
pub fn catalog() -> &'static Catalog {
    static CATALOG: OnceLock<Catalog> = OnceLock::new();
    CATALOG.get_or_init(build)
}

/// `k` distinct indices of `0..n`, in increasing order.
pub(crate) fn subset(rng: &mut ChaCha8Rng, n: usize, k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(rng);
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

fn build() -> Catalog {
    let mut rng = ChaCha8Rng::seed_from_u64(CATALOG_SEED);
    let mut products = Vec::new();
    for t in TYPES {
        // Distinct (brand, style) pairs, so titles are unique.
        let mut pairs: Vec<(&str, &str)> = BRANDS
            .iter()
            .flat_map(|b| t.styles.iter().map(move |s| (*b, *s)))
            .collect();
        pairs.shuffle(&mut rng);
        for &(brand, style) in pairs.iter().take(PER_TYPE) {
            let n_attr = rng.random_range(2..=4);
            let attributes = subset(&mut rng, t.attributes.len(), n_attr)
                .into_iter()
                .map(|i| t.attributes[i].to_string())
                .collect();
            let options = t
                .options
                .iter()
                .map(|k| {
                    // Sparse offers (1 to all-but-two values), so many
                    // products of a type miss a wanted value.
                    let n = rng.random_range(1..=k.values.len().saturating_sub(2).max(2));
                    let values = subset(&mut rng, k.values.len(), n)
                        .into_iter()
                        .map(|i| k.values[i].to_string())
                        .collect();
                    (k.name.to_string(), values)
                })
                .collect();
            products.push(Product {
                id: 0,
                product_type: t.name.to_string(),
                title: format!("{brand} {style} {}", t.name),
                brand: brand.to_string(),
                style: style.to_string(),
                attributes,
                options,
                price: rng.random_range(t.price.0..=t.price.1),
                rating: *[4u8, 5, 6, 7, 7, 8, 8, 9, 9, 10]
                    .choose(&mut rng)
                    .unwrap_or(&8),
            });
        }
    }
    // Interleave the types, so search ties (broken by id) do not follow
    // the type table.
    products.shuffle(&mut rng);
    for (i, p) in products.iter_mut().enumerate() {
        p.id = i;
    }
    let tokens: Vec<BTreeSet<String>> = products
        .iter()
        .map(|p| {
            let mut s = word_set(&p.title);
            for a in &p.attributes {
                s.extend(word_set(a));
            }
            s.extend(word_set(&p.product_type));
            s
        })
        .collect();
    let all_tokens = tokens.iter().flatten().cloned().collect();
    let by_title = products.iter().map(|p| (p.title.clone(), p.id)).collect();
    Catalog {
        products,
        by_title,
        tokens,
        all_tokens,
    }
}

impl Catalog {
    /// The product titled `title` (exact, lower-case).
    pub fn by_title(&self, title: &str) -> Option<usize> {
        self.by_title.get(title).copied()
    }

    /// Is `word` a search token of some product?
    pub fn knows_token(&self, word: &str) -> bool {
        self.all_tokens.contains(word)
    }

    /// Rank products for `query`: score = number of distinct query words
    /// among the product's title, attribute and type words; products scoring
    /// 0 are left out; higher score first, ties by lower id; at most
    /// [`MAX_RESULTS`].
    pub fn search(&self, query: &str) -> Vec<usize> {
        let q = word_set(query);
        let mut scored: Vec<(usize, usize)> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(id, toks)| (q.intersection(toks).count(), id))
            .filter(|&(score, _)| score > 0)
            .collect();
        scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.truncate(MAX_RESULTS);
        scored.into_iter().map(|(_, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_is_sound() {
        let c = catalog();
        assert_eq!(c.products.len(), TYPES.len() * PER_TYPE);
        let titles: BTreeSet<&str> = c.products.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(titles.len(), c.products.len(), "titles must be unique");
        for t in TYPES {
            let values: Vec<&str> = t.options.iter().flat_map(|k| k.values.to_vec()).collect();
            let unique: BTreeSet<&&str> = values.iter().collect();
            assert_eq!(
                unique.len(),
                values.len(),
                "{}: option values collide",
                t.name
            );
            assert!(BRANDS.len() * t.styles.len() >= PER_TYPE);
            assert!(t.price.1 <= 99, "caps stay within 100 dollars");
        }
        for (i, p) in c.products.iter().enumerate() {
            assert_eq!(p.id, i);
            assert_eq!(c.by_title(&p.title), Some(i));
            assert!((2..=4).contains(&p.attributes.len()));
            assert!(p.options.iter().all(|(_, v)| !v.is_empty()));
            assert_eq!(p.title, p.title.to_lowercase());
        }
    }

    #[test]
    fn catalog_build_is_deterministic() {
        // (The committed panels pin the catalog itself: their targets and
        // expert clicks name products by id and title.)
        assert_eq!(build().products, catalog().products);
    }

    #[test]
    fn search_ranks_by_overlap_then_id() {
        let c = catalog();
        let r = c.search("shirt cotton machine wash");
        assert!(!r.is_empty() && r.len() <= MAX_RESULTS);
        let score = |id: usize| {
            let q = word_set("shirt cotton machine wash");
            q.intersection(&c.tokens[id]).count()
        };
        for w in r.windows(2) {
            let (a, b) = (score(w[0]), score(w[1]));
            assert!(a > b || (a == b && w[0] < w[1]), "{w:?}");
        }
        let top = &c.products[r[0]];
        assert_eq!(top.product_type, "shirt");
        assert!(top.attributes.iter().any(|a| a == "cotton"));
        assert!(c.search("nothing matches zzz").is_empty());
        assert_eq!(c.search("Shirt, COTTON"), c.search("shirt cotton"));
    }
}
