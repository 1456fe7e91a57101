//! Guidance: the specs a strategy can ask for (none, prefix, plan, expert),
//! task clusters, the strategy host that calls the guidance, reward and
//! intervention scripts, the review-round driver shared by training runs
//! and `simulate`, and the synthetic learner of `simulate`.

pub mod clusters;
pub mod host;
pub mod rounds;
pub mod simulate;
pub mod spec;

pub use clusters::Clusters;
pub use host::{GuidanceHost, TaskResult, TaskView};
pub use spec::{GuidanceSpec, PlanLoss, ResolvedSpec};
