//! Guidance: the specs a strategy can ask for (none, prefix, plan, expert),
//! task clusters, the records scripts see and the decoding of what they
//! return, the runtime that calls the guidance, reward and
//! intervention scripts, the review-round driver shared by training runs
//! and `simulate`, the synthetic learner of `simulate`, and `actguide
//! check`.
//!
//! Dependencies run one way: `spec` ← `script_inputs`, `decode` ← `runtime` ←
//! `rounds` ← `simulate` ← `check` (each file imports only files to its
//! left).

pub mod check;
pub mod clusters;
pub mod decode;
pub mod rounds;
pub mod runtime;
pub mod script_inputs;
pub mod simulate;
pub mod spec;

pub use check::check_script;
pub use clusters::Clusters;
pub use runtime::GuidanceRuntime;
pub use script_inputs::{TaskResult, TaskView};
pub use spec::{GuidanceSpec, PlanLoss, ResolvedSpec};

/// Script handles whose engines know guidance's `Spec` constructors
/// (`prefix(n)`, `plan(k)`, …): every guidance, reward and intervention
/// script, `check`, and experiment files are compiled over these.
pub fn script_handles() -> crate::script::ScriptHandles {
    crate::script::ScriptHandles::new().with_registrar(spec::register)
}
