//! Rules tests on hand-made worlds over the real catalog (every page, its
//! clickables and transitions, invalid input, the step limit, the episode
//! protocol), the WebShop reward on hand-worked cases, and bad task data.

use std::collections::BTreeMap;

use serde_json::json;

use super::sim::{BACK, BUY, NEXT, PREV};
use super::*;
use crate::env::EnvError;

/// The first product of `goal.query()`'s results that satisfies `goal`.
fn first_fit(goal: &Goal) -> usize {
    let cat = catalog();
    cat.search(&goal.query())
        .into_iter()
        .find(|&id| goal.satisfied_by(&cat.products[id]))
        .expect("some product satisfies the goal")
}

fn world_for(goal: Goal) -> World {
    World {
        catalog: CATALOG_ID.into(),
        target: first_fit(&goal),
        queries: vec!["speaker wireless".into(), goal.query()],
        goal,
    }
}

fn task(world: serde_json::Value) -> Task {
    let goal = serde_json::from_value::<World>(world.clone())
        .map(|w| w.goal.instruction())
        .unwrap_or_default();
    Task {
        id: "shop-t".into(),
        task_type: "shop".into(),
        goal,
        world,
        expert: vec![],
        difficulty: 0,
    }
}

/// A shirt goal: the first shirt's first attribute and first color, any
/// price. `shirt <attr>` has more than a page of results.
fn shirt_goal() -> Goal {
    let shirt = catalog()
        .products
        .iter()
        .find(|p| p.product_type == "shirt")
        .unwrap();
    let (kind, values) = &shirt.options[0];
    Goal {
        product: "shirt".into(),
        attributes: vec![shirt.attributes[0].clone()],
        options: BTreeMap::from([(kind.clone(), values[0].clone())]),
        price_cap: 100,
    }
}

/// An env on `world` with room for long walks.
fn start(world: &World) -> (ShopEnv, Observation) {
    let mut env = ShopEnv::new(100);
    let obs = env
        .reset(&task(serde_json::to_value(world).unwrap()))
        .unwrap();
    (env, obs)
}

fn step(env: &mut ShopEnv, action: &str) -> Observation {
    let obs = env.step(action).unwrap();
    assert!(obs.valid, "{action:?}: {}", obs.text);
    obs
}

#[test]
fn pages_clickables_and_transitions() {
    let world = world_for(shirt_goal());
    let goal = world.goal.clone();
    let (mut env, obs) = start(&world);
    // Search page: the instruction, and the task's queries as actions.
    assert_eq!(
        obs.text,
        format!(
            "WebShop [SEP] Instruction: [SEP] {} [SEP] Search",
            goal.instruction()
        )
    );
    assert_eq!(
        obs.admissible,
        vec![
            "search[speaker wireless]".to_string(),
            format!("search[{}]", goal.query())
        ]
    );
    assert!(env.status().starts_with("Page: search. Need: shirt;"));

    // Results page 1, matched case-insensitively and trimmed.
    let q = goal.query();
    let obs = step(&mut env, &format!("  SEARCH[{}] ", q.to_uppercase()));
    let results = catalog().search(&q);
    assert_eq!(results.len(), MAX_RESULTS);
    let first = &catalog().products[results[0]];
    assert!(obs.text.starts_with(&format!(
        "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] {} [SEP] ${}",
        first.title, first.price
    )));
    assert!(!obs.text.contains("< Prev"));
    assert_eq!(obs.admissible[..2], [BACK.to_string(), NEXT.to_string()]);
    assert_eq!(obs.admissible.len(), 2 + PAGE_SIZE);
    assert_eq!(obs.admissible[2], format!("click[{}]", first.title));
    assert_eq!(
        env.status().split(" Need").next().unwrap(),
        format!("Page: results 1 of 5 for {q}.")
    );

    // Next and back.
    let obs = step(&mut env, NEXT);
    assert!(obs
        .text
        .contains("Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >"));
    assert_eq!(
        obs.admissible[..3],
        [BACK.to_string(), PREV.to_string(), NEXT.to_string()]
    );
    let second = &catalog().products[results[PAGE_SIZE]];
    assert!(obs.admissible.contains(&format!("click[{}]", second.title)));
    let last = (0..3).fold(obs, |_, _| step(&mut env, NEXT));
    assert!(last
        .text
        .contains("Page 5 (Total results: 50) [SEP] < Prev [SEP] "));
    assert!(!last.admissible.contains(&NEXT.to_string()));
    let obs = step(&mut env, PREV);
    assert!(obs.text.contains("Page 4 "));
    for _ in 0..3 {
        step(&mut env, PREV);
    }

    // Item page: options, price, rating, sub-pages, buy.
    let obs = step(&mut env, &format!("click[{}]", first.title));
    let mut expect = vec!["Back to Search".to_string(), "< Prev".to_string()];
    let mut clicks = vec![BACK.to_string(), PREV.to_string()];
    for (kind, values) in &first.options {
        expect.push(kind.clone());
        expect.extend(values.iter().cloned());
        clicks.extend(values.iter().map(|v| format!("click[{v}]")));
    }
    expect.push(first.title.clone());
    expect.push(format!("Price: ${}", first.price));
    expect.push(format!("Rating: {}", first.rating_text()));
    expect.extend(["Description", "Features", "Reviews", "Buy Now"].map(String::from));
    clicks.extend(["description", "features", "reviews", "buy now"].map(|c| format!("click[{c}]")));
    assert_eq!(obs.text, expect.join(" [SEP] "));
    assert_eq!(obs.admissible, clicks);
    assert!(env
        .status()
        .starts_with(&format!("Page: item {}. Selected: none.", first.title)));

    // Options are remembered across sub-pages, a later click of the same
    // kind replaces the earlier one.
    let (kind, values) = &first.options[0];
    step(&mut env, &format!("click[{}]", values[0]));
    if values.len() > 1 {
        step(&mut env, &format!("click[{}]", values[1]));
    }
    let chosen = values[values.len().min(2) - 1].clone();
    let obs = step(&mut env, "click[features]");
    assert!(obs.text.starts_with("Back to Search [SEP] < Prev [SEP] "));
    assert!(obs.text.contains(&first.attributes[0]));
    assert_eq!(obs.admissible, vec![BACK.to_string(), PREV.to_string()]);
    assert!(env.status().starts_with(&format!(
        "Page: features of {}. Selected: {kind} {chosen}.",
        first.title
    )));
    step(&mut env, PREV);
    let obs = step(&mut env, "click[description]");
    assert!(obs.text.contains("category: clothing > tops > shirt"));
    step(&mut env, PREV);
    let obs = step(&mut env, "click[reviews]");
    assert!(obs.text.contains(" stars [SEP] "));
    let obs = step(&mut env, PREV);
    assert_eq!(obs.text, expect.join(" [SEP] "));

    // < Prev from the item goes back to its results page and forgets the
    // options; Back to Search forgets the query.
    let obs = step(&mut env, PREV);
    assert!(obs.text.contains("Page 1 (Total results: 50)"));
    step(&mut env, &format!("click[{}]", first.title));
    assert!(env.status().contains("Selected: none."));
    let obs = step(&mut env, BACK);
    assert!(obs.text.starts_with("WebShop [SEP] Instruction:"));
    assert_eq!(env.status().split(" Need").next().unwrap(), "Page: search.");
}

#[test]
fn invalid_actions_change_nothing() {
    let world = world_for(shirt_goal());
    let (mut env, obs) = start(&world);
    for bad in [
        "click[buy now]",
        "search[shirt]",
        "search[]",
        "look",
        "",
        "click[next >]",
    ] {
        let again = env.step(bad).unwrap();
        assert!(!again.valid, "{bad:?}");
        assert_eq!(
            (&again.text, &again.admissible),
            (&obs.text, &obs.admissible)
        );
        assert!(!again.done && again.reward == 0.0);
    }
    let results = step(&mut env, &format!("search[{}]", world.goal.query()));
    for bad in [
        "click[description]",
        "search[shirt]",
        "click[< prev]",
        "click[nova]",
    ] {
        let again = env.step(bad).unwrap();
        assert!(!again.valid, "{bad:?}");
        assert_eq!(again.text, results.text);
    }
}

#[test]
fn expert_buys_with_reward_one_and_the_episode_ends() {
    let world = world_for(shirt_goal());
    let plan = expert_plan(&world);
    let (mut env, mut obs) = start(&world);
    for (i, a) in plan.iter().enumerate() {
        assert!(obs.admissible.contains(a), "{a:?}");
        obs = step(&mut env, a);
        assert_eq!(obs.done, i + 1 == plan.len());
    }
    assert!(obs.success && obs.reward == 1.0);
    let title = &catalog().products[world.target].title;
    assert_eq!(
        obs.text,
        format!("Thank you for shopping with us! [SEP] Purchased [SEP] {title} [SEP] Your score (min 0.0, max 1.0) [SEP] 1.00")
    );
    assert!(obs.admissible.is_empty());
    assert!(env.status().starts_with(&format!("Bought {title}.")));
    let err = env.step(BUY).unwrap_err();
    assert!(err.to_string().contains("after the episode ended"), "{err}");
    // Reset starts over.
    let (_, first) = start(&world);
    assert_eq!(
        env.reset(&task(serde_json::to_value(&world).unwrap()))
            .unwrap(),
        first
    );
}

#[test]
fn buying_without_the_options_scores_partially() {
    let world = world_for(shirt_goal());
    let (mut env, _) = start(&world);
    let target = &catalog().products[world.target];
    step(&mut env, &format!("search[{}]", world.goal.query()));
    for _ in 0..world_rank_page(&world) {
        step(&mut env, NEXT);
    }
    step(&mut env, &format!("click[{}]", target.title));
    let obs = step(&mut env, BUY);
    // 1 attribute + 1 option + price: the option is missing.
    assert!(obs.done && !obs.success);
    assert!((obs.reward - 2.0 / 3.0).abs() < 1e-6, "{}", obs.reward);
    assert!(obs.text.ends_with("[SEP] 0.67"));
}

fn world_rank_page(world: &World) -> usize {
    let r = catalog().search(&world.goal.query());
    r.iter().position(|&id| id == world.target).unwrap() / PAGE_SIZE
}

#[test]
fn step_limit_ends_the_episode_without_reward() {
    let world = world_for(shirt_goal());
    let mut env = ShopEnv::new(3);
    env.reset(&task(serde_json::to_value(&world).unwrap()))
        .unwrap();
    assert!(!env.step("nonsense").unwrap().done);
    assert!(
        !env.step(&format!("search[{}]", world.goal.query()))
            .unwrap()
            .done
    );
    let obs = env.step(NEXT).unwrap();
    assert!(obs.done && obs.valid && !obs.success && obs.reward == 0.0);
    assert!(obs.admissible.is_empty());
    assert!(env.step(BACK).is_err());
}

#[test]
fn protocol_errors_are_errors() {
    let mut env = ShopEnv::default();
    let err = env.step("click[buy now]").unwrap_err();
    assert!(err.to_string().contains("before reset"), "{err}");
    assert_eq!(env.status(), "No task loaded.");
}

/// A product for hand-worked reward cases.
fn product(ty: &str, attrs: &[&str], price: u32) -> Product {
    Product {
        id: 0,
        product_type: ty.into(),
        title: format!("acme classic {ty}"),
        brand: "acme".into(),
        style: "classic".into(),
        attributes: attrs.iter().map(|a| a.to_string()).collect(),
        options: vec![
            ("color".into(), vec!["navy".into(), "red".into()]),
            ("size".into(), vec!["small".into(), "large".into()]),
        ],
        price,
        rating: 8,
    }
}

fn chosen(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn reward_matches_hand_worked_cases() {
    // 2 attributes + 2 options + price: five parts.
    let goal = Goal {
        product: "shirt".into(),
        attributes: vec!["cotton".into(), "machine wash".into()],
        options: BTreeMap::from([
            ("color".into(), "navy".into()),
            ("size".into(), "large".into()),
        ]),
        price_cap: 30,
    };
    let both = chosen(&[("color", "navy"), ("size", "large")]);
    let good = product("shirt", &["cotton", "machine wash", "slim fit"], 25);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    // All correct, including a price exactly at the cap.
    assert_eq!(reward(&goal, &good, &both), 1.0);
    assert_eq!(
        reward(
            &goal,
            &product("shirt", &["machine wash", "cotton"], 30),
            &both
        ),
        1.0
    );
    // Partial attributes: 1 of 2 → 4/5.
    assert!(close(
        reward(&goal, &product("shirt", &["cotton"], 25), &both),
        0.8
    ));
    assert!(close(
        reward(&goal, &product("shirt", &["slim fit"], 25), &both),
        0.6
    ));
    // Partial options: a wrong size → 4/5; none chosen → 3/5.
    assert!(close(
        reward(
            &goal,
            &good,
            &chosen(&[("color", "navy"), ("size", "small")])
        ),
        0.8
    ));
    assert!(close(reward(&goal, &good, &BTreeMap::new()), 0.6));
    // Matching ignores case and spacing.
    assert!(close(
        reward(
            &goal,
            &good,
            &chosen(&[("color", " Navy"), ("size", "LARGE ")])
        ),
        1.0
    ));
    // Price over the cap → 4/5.
    assert!(close(
        reward(
            &goal,
            &product("shirt", &["cotton", "machine wash"], 31),
            &both
        ),
        0.8
    ));
    // Product type: same parent (tops) 0.5, same top (clothing) 0.1, else 0.
    let hoodie = product("hoodie", &["cotton", "machine wash"], 25);
    assert!(close(reward(&goal, &hoodie, &both), 0.5));
    assert!(close(
        reward(
            &goal,
            &product("boot", &["cotton", "machine wash"], 25),
            &both
        ),
        0.1
    ));
    assert_eq!(
        reward(
            &goal,
            &product("mug", &["cotton", "machine wash"], 25),
            &both
        ),
        0.0
    );
    assert_eq!(
        reward(
            &goal,
            &product("toaster", &["cotton", "machine wash"], 25),
            &both
        ),
        0.0
    );
    // Mixed: hoodie, 1 attribute, 1 option, over the cap → 0.5 · 2/5.
    let poor = product("hoodie", &["cotton"], 45);
    assert!(close(
        reward(&goal, &poor, &chosen(&[("color", "navy")])),
        0.2
    ));
    // No options: attribute + price → halves.
    let simple = Goal {
        product: "shirt".into(),
        attributes: vec!["cotton".into()],
        options: BTreeMap::new(),
        price_cap: 20,
    };
    assert!(close(reward(&simple, &good, &both), 0.5));
    assert_eq!(
        reward(
            &simple,
            &product("shirt", &["cotton"], 20),
            &BTreeMap::new()
        ),
        1.0
    );
    assert_eq!(r_type("shirt", "shirt"), 1.0);
    assert_eq!(r_type("lotion", "shampoo"), 0.5);
    assert_eq!(r_type("pillow", "mug"), 0.1);
    assert_eq!(r_type("speaker", "shirt"), 0.0);
}

#[test]
fn instruction_query_and_status_formats() {
    let goal = Goal {
        product: "shirt".into(),
        attributes: vec!["cotton".into(), "machine wash".into()],
        options: BTreeMap::from([
            ("color".into(), "navy".into()),
            ("size".into(), "large".into()),
        ]),
        price_cap: 30,
    };
    assert_eq!(
        goal.instruction(),
        "i need a shirt with cotton and machine wash, and color is navy, and size is large, and price lower than 30 dollars"
    );
    assert_eq!(goal.query(), "shirt cotton machine wash");
    let world = world_for(goal);
    let (env, _) = start(&world);
    assert_eq!(
        env.status(),
        "Page: search. Need: shirt; cotton, machine wash; color navy, size large; price under 30 dollars."
    );
}

#[test]
fn bad_worlds_are_task_errors() {
    let good = serde_json::to_value(world_for(shirt_goal())).unwrap();
    let mut env = ShopEnv::default();
    assert!(env.reset(&task(good.clone())).is_ok());
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut w = good.clone();
        f(&mut w);
        w
    };
    let other_type = catalog()
        .products
        .iter()
        .find(|p| p.product_type == "mug")
        .unwrap()
        .id;
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (json!(null), "bad shop world"),
        (json!([1, 2]), "bad shop world"),
        (json!({"goal": 3}), "bad shop world"),
        (edit(&|w| w["extra"] = json!(1)), "unknown field"),
        (
            edit(&|w| w["catalog"] = json!("shop-catalog-v0")),
            "unknown catalog",
        ),
        (
            edit(&|w| w["goal"]["product"] = json!("toaster")),
            "unknown product type",
        ),
        (
            edit(&|w| w["goal"]["attributes"] = json!([])),
            "no attributes",
        ),
        (
            edit(&|w| w["goal"]["attributes"] = json!(["wireless"])),
            "not a shirt attribute",
        ),
        (
            edit(&|w| w["goal"]["options"] = json!({"scent": "mint"})),
            "not a shirt option",
        ),
        (
            edit(&|w| w["goal"]["options"] = json!({"color": "gold"})),
            "not a shirt color",
        ),
        (
            edit(&|w| w["goal"]["options"] = json!({"color": 3})),
            "bad shop world",
        ),
        (edit(&|w| w["goal"]["price_cap"] = json!(0)), "price cap"),
        (
            edit(&|w| w["goal"]["price_cap"] = json!(-5)),
            "bad shop world",
        ),
        (
            edit(&|w| w["target"] = json!(100_000)),
            "outside the catalog",
        ),
        (
            edit(&|w| w["target"] = json!(other_type)),
            "does not satisfy",
        ),
        (edit(&|w| w["queries"] = json!([])), "0 queries"),
        (
            edit(&|w| w["queries"] = json!(["speaker wireless"])),
            "is not offered",
        ),
        (
            edit(&|w| w["queries"][0] = json!("Speaker")),
            "lower-case words",
        ),
        (
            edit(&|w| w["queries"][0] = json!("speaker  wireless")),
            "lower-case words",
        ),
        (
            edit(&|w| w["queries"][0] = json!("speaker zzz")),
            "not in the catalog",
        ),
        (
            edit(&|w| w["queries"][0] = w["queries"][1].clone()),
            "repeated",
        ),
    ];
    for (w, msg) in cases {
        match env.reset(&task(w.clone())) {
            Err(e @ EnvError::BadTask { .. }) => {
                assert!(e.to_string().contains(msg), "{w}: {e} (want {msg:?})")
            }
            other => panic!("{w}: {other:?}"),
        }
        assert!(env.step(BUY).is_err(), "no episode after a failed reset");
    }
}
