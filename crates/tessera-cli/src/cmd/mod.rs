//! One module per subcommand.

pub mod demo;
pub mod plan;
pub mod pack;
pub mod cache;
pub mod env;
pub mod attend;
pub mod bench;
pub mod telemetry;
