//! Checkpoints live with the rest of the run directory in
//! [`crate::rundir::checkpoint`]; this path re-exports them for callers.

pub use crate::rundir::checkpoint::*;
