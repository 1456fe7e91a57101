//! Rules tests on a hand-built room: every command's feedback, invalid input,
//! hidden contents, the one-object hand, the step limit and each task type's
//! success condition.

use serde_json::json;

use super::*;

/// cabinet 1 (closed: mug 1), countertop 1 (apple 1, knife 1), desk 1
/// (desklamp 1, book 1), drawer 1 (open: cd 1), fridge 1 (closed: egg 1),
/// microwave 1 (open, empty), sinkbasin 1 (empty).
fn room(task_type: &str, object: &str, target: &str) -> serde_json::Value {
    json!({
        "receptacles": [
            {"name": "cabinet 1", "open": false},
            {"name": "countertop 1"},
            {"name": "desk 1"},
            {"name": "drawer 1", "open": true},
            {"name": "fridge 1", "open": false},
            {"name": "microwave 1", "open": true},
            {"name": "sinkbasin 1"}
        ],
        "objects": [
            {"name": "mug 1", "at": "cabinet 1"},
            {"name": "apple 1", "at": "countertop 1"},
            {"name": "knife 1", "at": "countertop 1"},
            {"name": "desklamp 1", "at": "desk 1"},
            {"name": "book 1", "at": "desk 1"},
            {"name": "cd 1", "at": "drawer 1"},
            {"name": "egg 1", "at": "fridge 1"}
        ],
        "agent": {"at": null, "holding": null},
        "goal": {"type": task_type, "object": object, "target": target}
    })
}

fn task(world: serde_json::Value, goal: &str) -> Task {
    Task {
        id: "t".into(),
        task_type: world["goal"]["type"].as_str().unwrap_or("").into(),
        goal: goal.into(),
        world,
        expert: vec![],
        difficulty: 0,
    }
}

fn start(world: serde_json::Value) -> (HouseholdEnv, Observation) {
    let mut env = HouseholdEnv::default();
    let obs = env
        .reset(&task(world, "look at book under the desklamp"))
        .unwrap();
    (env, obs)
}

fn step(env: &mut HouseholdEnv, action: &str) -> Observation {
    env.step(action).unwrap()
}

/// Run `actions`; each must be valid and admissible, and only the last
/// one may (and must) succeed.
fn solve(world: serde_json::Value, actions: &[&str]) {
    let (mut env, mut obs) = start(world);
    for (i, a) in actions.iter().enumerate() {
        assert!(
            obs.admissible.iter().any(|x| x == a),
            "{a:?} not in {:?}",
            obs.admissible
        );
        obs = step(&mut env, a);
        assert!(obs.valid, "{a:?}: {}", obs.text);
        let last = i + 1 == actions.len();
        assert_eq!(obs.success, last, "success after {a:?}");
        assert_eq!(obs.done, last);
        assert_eq!(obs.reward, if last { 1.0 } else { 0.0 });
    }
}

#[test]
fn start_text_is_alfworlds() {
    let (_, obs) = start(room("look_at_obj_in_light", "book", "desklamp"));
    assert_eq!(
        obs.text,
        "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, \
         a countertop 1, a desk 1, a drawer 1, a fridge 1, a microwave 1, and a sinkbasin 1.\
         \n\nYour task is to: look at book under the desklamp."
    );
    assert!(obs.valid && !obs.done && !obs.success && obs.reward == 0.0);
}

#[test]
fn start_text_of_an_in_region_state() {
    let mut w = room("pick_clean_then_place", "mug", "desk");
    w["agent"] = json!({"at": "countertop 1", "holding": "mug 1"});
    w["objects"][0] = json!({"name": "mug 1", "clean": true});
    let (env, obs) = start(w);
    assert_eq!(
        obs.text,
        "You are at countertop 1. Looking quickly around you, you see a cabinet 1, \
         a countertop 1, a desk 1, a drawer 1, a fridge 1, a microwave 1, and a sinkbasin 1. \
         On the countertop 1, you see a apple 1, and a knife 1. \
         You are carrying: a mug 1 (clean).\n\nYour task is to: look at book under the desklamp."
    );
    assert_eq!(
        env.status(),
        "You are at countertop 1. You are carrying: a mug 1 (clean). \
         Seen: apple 1 at countertop 1, knife 1 at countertop 1."
    );
}

#[test]
fn every_commands_feedback() {
    let (mut env, obs) = start(room("look_at_obj_in_light", "book", "desklamp"));
    assert_eq!(
        env.status(),
        "You are in the middle of the room. You are carrying: nothing. Seen: nothing."
    );
    assert_eq!(obs.admissible.len(), 7 + 2);
    let script = [
        ("look", "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a desk 1, a drawer 1, a fridge 1, a microwave 1, and a sinkbasin 1."),
        ("inventory", "You are carrying: nothing."),
        ("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a apple 1, and a knife 1."),
        ("examine countertop 1", "On the countertop 1, you see a apple 1, and a knife 1."),
        ("examine knife 1", "This is a knife 1."),
        ("take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1."),
        ("inventory", "You are carrying: a apple 1."),
        ("examine apple 1", "This is a apple 1."),
        ("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."),
        ("clean apple 1 with sinkbasin 1", "You clean the apple 1 using the sinkbasin 1."),
        ("go to microwave 1", "You arrive at microwave 1. The microwave 1 is open. In it, you see nothing."),
        ("heat apple 1 with microwave 1", "You heat the apple 1 using the microwave 1."),
        ("inventory", "You are carrying: a apple 1 (clean, hot)."),
        ("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed."),
        ("cool apple 1 with fridge 1", "You cool the apple 1 using the fridge 1."),
        ("examine apple 1", "This is a apple 1 (clean, cool)."),
        ("open fridge 1", "You open the fridge 1. The fridge 1 is open. In it, you see a egg 1."),
        ("move apple 1 to fridge 1", "You move the apple 1 to the fridge 1."),
        ("look", "You are at fridge 1. The fridge 1 is open. In it, you see a apple 1 (clean, cool), and a egg 1."),
        ("close fridge 1", "You close the fridge 1."),
        ("examine fridge 1", "The fridge 1 is closed."),
        ("go to desk 1", "You arrive at desk 1. On the desk 1, you see a desklamp 1, and a book 1."),
        ("use desklamp 1", "You turn on the desklamp 1."),
        ("examine desklamp 1", "This is a desklamp 1 (on)."),
    ];
    for (action, want) in script {
        let obs = step(&mut env, action);
        assert_eq!(obs.text, want, "after {action:?}");
        assert!(obs.valid && !obs.done, "{action:?}");
    }
    assert_eq!(
        env.status(),
        "You are at desk 1. You are carrying: nothing. Seen: apple 1 (clean, cool) at fridge 1, \
         knife 1 at countertop 1, egg 1 at fridge 1, desklamp 1 (on) at desk 1, book 1 at desk 1."
    );
    // Lamp on, book taken at the lamp: the light task is done.
    let obs = step(&mut env, "take book 1 from desk 1");
    assert_eq!(obs.text, "You pick up the book 1 from the desk 1.");
    assert!(obs.success && obs.done && obs.reward == 1.0);
    assert!(
        env.step("look").is_err(),
        "stepping a finished episode is an error"
    );
}

#[test]
fn admissible_list_order() {
    let (mut env, _) = start(room("pick_and_place", "apple", "fridge"));
    step(&mut env, "go to countertop 1");
    let obs = step(&mut env, "take apple 1 from countertop 1");
    step(&mut env, "go to desk 1");
    let obs2 = step(&mut env, "go to microwave 1");
    assert_eq!(
        obs2.admissible,
        [
            "go to cabinet 1",
            "go to countertop 1",
            "go to desk 1",
            "go to drawer 1",
            "go to fridge 1",
            "go to sinkbasin 1",
            "close microwave 1",
            "move apple 1 to microwave 1",
            "heat apple 1 with microwave 1",
            "examine microwave 1",
            "examine apple 1",
            "inventory",
            "look"
        ]
    );
    assert!(
        !obs.admissible.iter().any(|a| a.starts_with("take")),
        "hand is full"
    );
    let obs = step(&mut env, "go to desk 1");
    assert!(obs.admissible.contains(&"use desklamp 1".to_string()));
    assert!(!obs.admissible.iter().any(|a| a.starts_with("heat")));
}

#[test]
fn invalid_commands_do_nothing() {
    let (mut env, _) = start(room("pick_and_place", "apple", "fridge"));
    step(&mut env, "go to cabinet 1");
    let before = env.status();
    for bad in [
        "",
        "   ",
        "asdf qwerty",
        "go to",
        "go to cabinet 1",                // already there
        "go to cabinet 9",                // no such receptacle
        "take mug 1 from cabinet 1",      // closed
        "take apple 1 from countertop 1", // not there
        "open countertop 1",
        "close cabinet 1",           // already closed
        "move apple 1 to cabinet 1", // not holding
        "use desklamp 1",            // lamp is elsewhere
        "heat apple 1 with microwave 1",
        "examine mug 1",        // hidden in the closed cabinet
        "examine countertop 1", // not here
        "take",
        "put apple 1 into cabinet 1",
        "go to cabinet 1.",
    ] {
        let obs = step(&mut env, bad);
        assert_eq!(obs.text, "Nothing happens.", "{bad:?}");
        assert!(!obs.valid && !obs.done && !obs.success, "{bad:?}");
    }
    assert_eq!(env.status(), before, "invalid commands change nothing");
    // Capabilities: a book cannot be cleaned, an apple cannot be used.
    step(&mut env, "go to desk 1");
    step(&mut env, "take book 1 from desk 1");
    step(&mut env, "go to sinkbasin 1");
    assert!(!step(&mut env, "clean book 1 with sinkbasin 1").valid);
    assert!(!step(&mut env, "use book 1").valid);
    assert!(!step(&mut env, "take desklamp 1 from desk 1").valid);
}

#[test]
fn input_is_normalized_and_put_aliases_work() {
    let (mut env, _) = start(room("pick_and_place", "apple", "fridge"));
    assert!(step(&mut env, "  GO   to  CounterTop 1 ").valid);
    for (i, put) in [
        "put apple 1 in countertop 1",
        "put apple 1 on countertop 1",
        "Put apple 1 in/on countertop 1",
    ]
    .iter()
    .enumerate()
    {
        assert!(
            step(&mut env, "take apple 1 from countertop 1").valid,
            "{i}"
        );
        let obs = step(&mut env, put);
        assert_eq!(obs.text, "You move the apple 1 to the countertop 1.");
    }
}

#[test]
fn closed_container_hides_contents() {
    let (mut env, _) = start(room("pick_and_place", "mug", "desk"));
    let obs = step(&mut env, "go to cabinet 1");
    assert_eq!(
        obs.text,
        "You arrive at cabinet 1. The cabinet 1 is closed."
    );
    assert!(!obs.admissible.iter().any(|a| a.contains("mug")));
    assert!(!env.status().contains("mug"));
    let obs = step(&mut env, "open cabinet 1");
    assert_eq!(
        obs.text,
        "You open the cabinet 1. The cabinet 1 is open. In it, you see a mug 1."
    );
    assert!(obs
        .admissible
        .contains(&"take mug 1 from cabinet 1".to_string()));
    assert!(env.status().contains("mug 1 at cabinet 1"));
    // Memory survives closing the door.
    step(&mut env, "close cabinet 1");
    assert!(env.status().contains("mug 1 at cabinet 1"));
    assert!(!step(&mut env, "take mug 1 from cabinet 1").valid);
}

#[test]
fn one_object_in_hand() {
    let (mut env, _) = start(room("pick_and_place", "apple", "fridge"));
    step(&mut env, "go to countertop 1");
    assert!(step(&mut env, "take apple 1 from countertop 1").valid);
    let obs = step(&mut env, "take knife 1 from countertop 1");
    assert!(!obs.valid);
    assert_eq!(env.status().matches("carrying: a apple 1.").count(), 1);
    assert!(step(&mut env, "move apple 1 to countertop 1").valid);
    assert!(step(&mut env, "take knife 1 from countertop 1").valid);
}

#[test]
fn step_limit_ends_the_episode() {
    let mut env = HouseholdEnv::new(3);
    env.reset(&task(
        room("pick_and_place", "apple", "fridge"),
        "put a apple in fridge",
    ))
    .unwrap();
    assert!(!env.step("look").unwrap().done);
    assert!(!env.step("nonsense").unwrap().done);
    let last = env.step("inventory").unwrap();
    assert!(last.done && !last.success && last.reward == 0.0);
    assert!(env.step("look").is_err());
    // Reset starts a fresh episode.
    assert!(
        !env.reset(&task(room("pick_and_place", "apple", "fridge"), "g"))
            .unwrap()
            .done
    );
}

#[test]
fn success_conditions_of_each_task_type() {
    solve(
        room("pick_and_place", "apple", "fridge"),
        &[
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to fridge 1",
            "open fridge 1",
            "move apple 1 to fridge 1",
        ],
    );
    // Clean: placing it unclean does not count; it must be taken out again.
    solve(
        room("pick_clean_then_place", "apple", "fridge"),
        &[
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to fridge 1",
            "open fridge 1",
            "move apple 1 to fridge 1",
            "take apple 1 from fridge 1",
            "go to sinkbasin 1",
            "clean apple 1 with sinkbasin 1",
            "go to fridge 1",
            "move apple 1 to fridge 1",
        ],
    );
    solve(
        room("pick_heat_then_place", "mug", "countertop"),
        &[
            "go to cabinet 1",
            "open cabinet 1",
            "take mug 1 from cabinet 1",
            "go to microwave 1",
            "heat mug 1 with microwave 1",
            "go to countertop 1",
            "move mug 1 to countertop 1",
        ],
    );
    // Cool, then heat again: heating undoes the cooling.
    solve(
        room("pick_cool_then_place", "apple", "microwave"),
        &[
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to fridge 1",
            "cool apple 1 with fridge 1",
            "go to microwave 1",
            "heat apple 1 with microwave 1",
            "go to fridge 1",
            "cool apple 1 with fridge 1",
            "go to microwave 1",
            "move apple 1 to microwave 1",
        ],
    );
    let mut two = room("pick_two_obj", "apple", "desk");
    two["objects"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "apple 2", "at": "sinkbasin 1"}));
    solve(
        two,
        &[
            "go to countertop 1",
            "take apple 1 from countertop 1",
            "go to desk 1",
            "move apple 1 to desk 1",
            "go to sinkbasin 1",
            "take apple 2 from sinkbasin 1",
            "go to desk 1",
            "move apple 2 to desk 1",
        ],
    );
    // Light: holding the object where the lamp is lit, in either order.
    solve(
        room("look_at_obj_in_light", "book", "desklamp"),
        &["go to desk 1", "take book 1 from desk 1", "use desklamp 1"],
    );
    solve(
        room("look_at_obj_in_light", "cd", "desklamp"),
        &[
            "go to desk 1",
            "use desklamp 1",
            "go to drawer 1",
            "take cd 1 from drawer 1",
            "go to desk 1",
        ],
    );
}

#[test]
fn expert_plans_the_hand_built_room() {
    for (tt, obj, target, len) in [
        ("pick_and_place", "mug", "desk", 5),
        ("pick_clean_then_place", "knife", "drawer", 6),
        ("pick_heat_then_place", "egg", "countertop", 7),
        ("pick_cool_then_place", "apple", "cabinet", 7),
        ("look_at_obj_in_light", "cd", "desklamp", 4),
    ] {
        let world: World = serde_json::from_value(room(tt, obj, target)).unwrap();
        let plan = expert_plan(&world);
        assert_eq!(plan.len(), len, "{tt}: {plan:?}");
        solve(
            room(tt, obj, target),
            &plan.iter().map(String::as_str).collect::<Vec<_>>(),
        );
    }
    // Holding something else: the expert puts it down first.
    let mut w = room("pick_and_place", "apple", "fridge");
    w["agent"] = json!({"at": "countertop 1", "holding": "mug 1"});
    w["objects"][0] = json!({"name": "mug 1"});
    let plan = expert_plan(&serde_json::from_value(w.clone()).unwrap());
    assert_eq!(plan[0], "move mug 1 to countertop 1");
    solve(w, &plan.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn bad_worlds_are_task_errors() {
    let mut env = HouseholdEnv::default();
    let bad = [
        json!({"nonsense": true}),
        json!({"receptacles": [], "objects": [], "agent": {}, "goal": {"type": "pick_and_place", "object": "apple", "target": "fridge"}}),
    ];
    for w in bad {
        assert!(matches!(
            env.reset(&task(w, "g")),
            Err(EnvError::BadTask { .. })
        ));
    }
    let mut w = room("pick_and_place", "apple", "fridge");
    w["objects"][1]["at"] = json!("fridge 1");
    let err = env.reset(&task(w, "g")).unwrap_err();
    assert!(err.to_string().contains("already satisfied"), "{err}");
    let mut w = room("pick_and_place", "apple", "fridge");
    w["receptacles"][1]["open"] = json!(true);
    assert!(
        env.reset(&task(w, "g")).is_err(),
        "countertops have no door"
    );
    let mut w = room("pick_heat_then_place", "book", "desk");
    w["goal"]["target"] = json!("desk");
    assert!(env.reset(&task(w, "g")).is_err(), "books cannot be heated");
    assert!(env.step("look").is_err(), "no episode after a failed reset");
    assert_eq!(HouseholdEnv::default().status(), "No task loaded.");
}

#[test]
fn a_revealed_world_starts_with_every_object_in_memory() {
    let (env, _) = start(room("pick_and_place", "mug", "countertop"));
    assert_eq!(
        env.status(),
        "You are in the middle of the room. You are carrying: nothing. Seen: nothing."
    );
    let mut w = room("pick_and_place", "mug", "countertop");
    w["reveal"] = json!(true);
    let (env, obs) = start(w);
    // The first observation is unchanged; the memory knows what is hidden
    // (mug 1 in the closed cabinet).
    assert!(obs.text.starts_with("You are in the middle of a room."));
    assert_eq!(
        env.status(),
        "You are in the middle of the room. You are carrying: nothing. Seen: mug 1 at cabinet 1, \
         apple 1 at countertop 1, knife 1 at countertop 1, desklamp 1 at desk 1, book 1 at desk 1, \
         cd 1 at drawer 1, egg 1 at fridge 1."
    );
    // The flag round-trips; absent, it is not written.
    let t = task(
        room("pick_and_place", "mug", "countertop"),
        "put a mug in countertop",
    );
    let world = HouseholdEnv::parse_world(&t).unwrap();
    assert!(!world.reveal);
    assert!(serde_json::to_value(&world)
        .unwrap()
        .get("reveal")
        .is_none());
}

#[test]
fn the_procedure_searches_where_it_does_not_know_and_plans_where_it_does() {
    // The mug is in the closed cabinet: without the map the procedure
    // walks the room in order and opens what is closed until it sees one.
    let t = task(
        room("pick_and_place", "mug", "countertop"),
        "put a mug in countertop",
    );
    let (ok, actions) = procedure_episode(&t, 50).unwrap();
    assert!(ok);
    assert_eq!(
        actions,
        [
            "go to cabinet 1",
            "open cabinet 1",
            "take mug 1 from cabinet 1",
            "go to countertop 1",
            "move mug 1 to countertop 1"
        ]
    );
    // The egg is in the fridge, fifth in the room: it searches first.
    let t = task(
        room("pick_cool_then_place", "egg", "countertop"),
        "cool some egg and put it in countertop",
    );
    let (ok, actions) = procedure_episode(&t, 50).unwrap();
    assert!(ok);
    assert_eq!(
        &actions[..4],
        [
            "go to cabinet 1",
            "open cabinet 1",
            "go to countertop 1",
            "go to desk 1"
        ]
    );
    let expert = expert_plan(&HouseholdEnv::parse_world(&t).unwrap());
    assert!(actions.len() > expert.len(), "{actions:?} vs {expert:?}");
    // With the map it goes straight there: the expert's length.
    let mut w = room("pick_cool_then_place", "egg", "countertop");
    w["reveal"] = json!(true);
    let (ok, revealed) = procedure_episode(&task(w, "cool some egg"), 50).unwrap();
    assert!(ok);
    assert_eq!(revealed.len(), expert.len(), "{revealed:?}");
    // A budget below what it needs fails, deterministically.
    let (ok, short) = procedure_episode(&t, 3).unwrap();
    assert!(!ok);
    assert_eq!(short.len(), 3);
}
