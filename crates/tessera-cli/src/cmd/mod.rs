//! One module per subcommand.

pub mod demo;
pub mod plan;
pub mod pack;
