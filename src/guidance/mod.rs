//! Guidance: the specs a strategy can ask for (none, prefix, plan, expert),
//! task clusters, and the strategy host that calls the guidance script.

pub mod clusters;
pub mod host;
pub mod spec;

pub use clusters::Clusters;
pub use host::{GuidanceHost, TaskResult, TaskView};
pub use spec::{GuidanceSpec, ResolvedSpec};
