//! One module per subcommand.

pub mod attend;
pub mod bench;
pub mod cache;
pub mod cp_sim;
pub mod demo;
pub mod env;
pub mod pack;
pub mod plan;
pub mod telemetry;
