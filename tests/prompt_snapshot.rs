//! Snapshot of what the policy sees: the first prompt of a test task with a
//! two-action plan, and after an executed expert action.

use std::path::PathBuf;

use actguide::env::household::HouseholdEnv;
use actguide::env::{panel, Env};
use actguide::rollout::chat::{render_agent, ChatTemplate};
use actguide::rollout::prompt::{render, PromptParts, Step};

#[test]
fn prompt_rendering_is_pinned() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tasks = panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap();
    let task = tasks.iter().find(|t| t.difficulty >= 4).unwrap();
    let mut env = HouseholdEnv::new(50);
    let obs = env.reset(task).unwrap();
    let plan = task.expert[..2].to_vec();
    let first = render(&PromptParts {
        goal: &task.goal,
        plan: &plan,
        history: &[],
        window: 2,
        status: &env.status(),
        observation: &obs.text,
        admissible: &obs.admissible,
        show_actions: true,
        conversation: false,
    });
    let next = env.step(&task.expert[0]).unwrap();
    let history = vec![Step {
        observation: obs.text.clone(),
        action: task.expert[0].clone(),
        ..Default::default()
    }];
    let second = render(&PromptParts {
        goal: &task.goal,
        plan: &[],
        history: &history,
        window: 2,
        status: &env.status(),
        observation: &next.text,
        admissible: &next.admissible,
        show_actions: false,
        conversation: false,
    });
    insta::assert_snapshot!(format!(
        "{}\n\n----- after `{}` -----\n\n{}",
        first, task.expert[0], second
    ));
}

/// The same states in the chat format: ChatML with the plan and the
/// admissible actions, then Llama 3 after an executed action (history as a
/// user/assistant exchange, actions not listed).
#[test]
fn chat_prompt_rendering_is_pinned() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tasks = panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap();
    let task = tasks.iter().find(|t| t.difficulty >= 4).unwrap();
    let mut env = HouseholdEnv::new(50);
    let obs = env.reset(task).unwrap();
    let plan = task.expert[..2].to_vec();
    let first = render_agent(
        ChatTemplate::ChatMl,
        &PromptParts {
            goal: &task.goal,
            plan: &plan,
            history: &[],
            window: 2,
            status: &env.status(),
            observation: &obs.text,
            admissible: &obs.admissible,
            show_actions: true,
            conversation: false,
        },
    );
    let next = env.step(&task.expert[0]).unwrap();
    let history = vec![Step {
        observation: obs.text.clone(),
        action: task.expert[0].clone(),
        ..Default::default()
    }];
    let second = render_agent(
        ChatTemplate::Llama3,
        &PromptParts {
            goal: &task.goal,
            plan: &plan,
            history: &history,
            window: 2,
            status: &env.status(),
            observation: &next.text,
            admissible: &next.admissible,
            show_actions: false,
            conversation: false,
        },
    );
    insta::assert_snapshot!(format!(
        "{}\n\n----- after `{}` (Llama 3) -----\n\n{}",
        first, task.expert[0], second
    ));
}
