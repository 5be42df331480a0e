//! The one error type of the library.
//!
//! Contract: every variant says which argument or file is at fault, what was expected and what
//! was found. [`Error::is_user_error`] separates bad input (CLI exit code 2) from internal
//! failures (exit code 1).

use std::path::PathBuf;

/// Result alias used across Tessera.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
/// Every failure Tessera reports (`Display` is the one-line message the CLI prints).
pub enum Error {
    /// A mask expression could not be parsed.
    #[error("mask expression, column {column}: expected {expected}, found {found}")]
    Parse {
        /// 1-based column of the offending character.
        column: usize,
        /// What was expected at that column.
        expected: String,
        /// What was found there instead.
        found: String,
    },
    /// An argument has the wrong value, shape, dtype or length.
    #[error("{arg}: expected {expected}, found {found}")]
    InvalidArgument {
        /// The argument at fault (its CLI / API name).
        arg: String,
        /// What a valid value looks like.
        expected: String,
        /// What was given.
        found: String,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        #[source]
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A file was read but its content is malformed.
    #[error("{}: {msg}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        msg: String,
    },
    /// The input declares more memory than the budget allows (see [`crate::budget`]): refused
    /// before anything is allocated.
    #[error("{what}: needs {}, more than the memory budget of {} ({source_of_budget})", crate::budget::human_bytes(*.need), crate::budget::human_bytes(*.budget))]
    OverBudget {
        /// What would have been allocated (a file, a plan, an output), as the user named it.
        what: String,
        /// Bytes it needs.
        need: u128,
        /// Bytes the budget allows.
        budget: u64,
        /// Where the budget comes from (the variable, or available memory).
        source_of_budget: String,
    },
    /// A requested capability is not available on this machine or build.
    #[error("{0}")]
    Unsupported(String),
    /// A bug or an environment failure that is not the user's input.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(
        arg: impl Into<String>,
        expected: impl Into<String>,
        found: impl std::fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            expected: expected.into(),
            found: found.to_string(),
        }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// Shorthand for [`Error::Format`].
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// True when the failure is caused by the caller's input (CLI exit code 2).
    pub fn is_user_error(&self) -> bool {
        !matches!(self, Error::Internal(_))
    }

    /// The CLI exit code for this error: 2 for bad input, 1 for internal failure.
    pub fn exit_code(&self) -> i32 {
        if self.is_user_error() {
            2
        } else {
            1
        }
    }
}
