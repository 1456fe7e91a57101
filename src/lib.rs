//! actguide (modules being assembled).

pub mod env;
pub mod model;
