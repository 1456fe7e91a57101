//! A noisy demonstrator: expert action data that still reaches the goal
//! but takes detours, as action logs of real operators do. At each step it
//! takes, with probability ε, a uniformly drawn admissible action other
//! than the expert's next one, and otherwise the expert planner's first
//! action from the true current state (so it recovers from its own
//! detours). Behaviour cloning copies the detours along with the
//! procedure; reward-driven training can tell them apart — one of the
//! regimes where the literature expects RL to beat imitation.

use rand::seq::IndexedRandom;
use rand::Rng;

use super::expert::expert_plan;
use super::sim::Sim;
use crate::env::{EnvError, Task};

/// One noisy demonstration of `task` of at most `max_len` actions, or
/// `None` if this draw did not reach the goal within it. Every action is
/// valid (drawn from the admissible list or planned by the rules engine).
pub fn noisy_demo(
    task: &Task,
    eps: f64,
    max_len: usize,
    rng: &mut impl Rng,
) -> Result<Option<Vec<String>>, EnvError> {
    let world = super::HouseholdEnv::parse_world(task)?;
    let bad = |msg: String| EnvError::BadTask {
        task: task.id.clone(),
        msg,
    };
    let mut sim = Sim::new(world).map_err(|e| bad(e.to_string()))?;
    let mut actions = Vec::new();
    while !sim.satisfied() {
        if actions.len() == max_len {
            return Ok(None);
        }
        let Some(next) = expert_plan(&sim.world).into_iter().next() else {
            // A detour left no way to the goal.
            return Ok(None);
        };
        let action = if rng.random_bool(eps.clamp(0.0, 1.0)) {
            let others: Vec<String> = sim
                .admissible()
                .into_iter()
                .filter(|a| *a != next)
                .collect();
            others.choose(rng).cloned().unwrap_or(next)
        } else {
            next
        };
        let (_, valid) = sim.exec(&action);
        if !valid {
            return Err(bad(format!("noisy demonstrator: \"{action}\" was refused")));
        }
        actions.push(action);
    }
    Ok(Some(actions))
}

/// What [`add_expert_noise`] did to a panel.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NoiseStats {
    /// Tasks with expert actions.
    pub tasks: usize,
    /// Of them, tasks whose demonstration now differs from the expert's.
    pub changed: usize,
    /// Tasks left with the clean expert actions because no draw reached
    /// the goal within the length cap.
    pub kept_clean: usize,
    /// Expert actions over the tasks with expert actions, before and after.
    pub clean_actions: usize,
    pub noisy_actions: usize,
}

/// Draws per task before falling back to the clean expert actions.
const DRAWS: usize = 16;

/// Replace the expert actions of every task that has them by a noisy
/// demonstration ([`noisy_demo`], `eps`, at most `max_len` actions), drawn
/// per task from `seed` and the task's id, so a panel's noise does not
/// depend on the order or the selection of its tasks. `difficulty` keeps
/// the clean expert length. A task that is not a household world is
/// refused with its id.
pub fn add_expert_noise(
    tasks: &mut [Task],
    eps: f64,
    max_len: usize,
    seed: u64,
) -> Result<NoiseStats, EnvError> {
    let mut st = NoiseStats::default();
    for t in tasks.iter_mut().filter(|t| !t.expert.is_empty()) {
        st.tasks += 1;
        st.clean_actions += t.expert.len();
        let mut rng = crate::seed::rng(
            seed,
            &[
                crate::seed::label("expert-noise"),
                crate::seed::label(&t.id),
            ],
        );
        let mut demo = None;
        for _ in 0..DRAWS {
            demo = noisy_demo(t, eps, max_len, &mut rng)?;
            if demo.is_some() {
                break;
            }
        }
        match demo {
            Some(d) => {
                st.changed += usize::from(d != t.expert);
                t.expert = d;
            }
            None => st.kept_clean += 1,
        }
        st.noisy_actions += t.expert.len();
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Env;

    fn panel() -> Vec<Task> {
        super::super::generate_panels(5, 40, 0).unwrap().0
    }

    /// Replays `actions` on `task` in the env: all valid, goal reached on
    /// the last one.
    fn solves(task: &Task, actions: &[String]) -> bool {
        let mut env = super::super::HouseholdEnv::new(64);
        env.reset(task).unwrap();
        actions.iter().enumerate().all(|(i, a)| {
            let o = env.step(a).unwrap();
            o.valid && (o.success == (i + 1 == actions.len()))
        })
    }

    #[test]
    fn without_noise_the_demo_is_the_expert_plan() {
        let mut rng = crate::seed::rng(1, &[]);
        for t in panel().iter().filter(|t| !t.expert.is_empty()) {
            let d = noisy_demo(t, 0.0, 64, &mut rng).unwrap().unwrap();
            assert_eq!(d, t.expert, "{}", t.id);
        }
    }

    #[test]
    fn noisy_demos_take_detours_and_still_solve_their_task() {
        let clean = panel();
        let mut noisy = clean.clone();
        let st = add_expert_noise(&mut noisy, 0.3, 20, 9).unwrap();
        assert_eq!(
            st.tasks,
            clean.iter().filter(|t| !t.expert.is_empty()).count()
        );
        assert!(st.changed * 2 > st.tasks, "{st:?}");
        assert!(st.noisy_actions > st.clean_actions, "{st:?}");
        for (c, n) in clean.iter().zip(&noisy) {
            assert!(solves(n, &n.expert), "{}: {:?}", n.id, n.expert);
            assert!(n.expert.len() <= 20 || n.expert == c.expert);
            assert_eq!(n.difficulty, c.difficulty);
        }
        // One seed, one panel; the draw is per task id, so a task's demo
        // does not depend on the tasks beside it.
        let mut again = clean.clone();
        assert_eq!(add_expert_noise(&mut again, 0.3, 20, 9).unwrap(), st);
        assert_eq!(again, noisy);
        let mut alone = vec![clean[7].clone()];
        add_expert_noise(&mut alone, 0.3, 20, 9).unwrap();
        assert_eq!(alone[0], noisy[7]);
        let mut other = clean.clone();
        add_expert_noise(&mut other, 0.3, 20, 10).unwrap();
        assert_ne!(other, noisy);
    }

    #[test]
    fn a_cap_too_short_keeps_the_clean_expert() {
        let clean = panel();
        let mut t = clean.clone();
        let st = add_expert_noise(&mut t, 0.5, 1, 3).unwrap();
        let multi = clean.iter().filter(|t| t.expert.len() > 1).count();
        assert!(st.kept_clean >= multi, "{st:?}");
        assert_eq!(st.noisy_actions, st.clean_actions);
    }

    #[test]
    fn a_task_that_is_not_a_household_world_is_refused() {
        let mut t = panel()[0].clone();
        t.world = serde_json::json!({"questions": []});
        let e = add_expert_noise(&mut [t], 0.3, 20, 1).unwrap_err();
        assert!(e.to_string().contains("household-"), "{e}");
    }
}
