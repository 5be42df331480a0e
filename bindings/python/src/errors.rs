//! Tessera errors as Python exceptions: bad input (`InvalidArgument`, `Format`) is a
//! `ValueError` whose message names the argument; `Unsupported` is `NotImplementedError`, a
//! file that cannot be read or written `OSError`, an internal failure `RuntimeError`.

use pyo3::exceptions::{PyNotImplementedError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;
use tessera::Error;

/// The Python exception of a Tessera error.
pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::Unsupported(_) => PyNotImplementedError::new_err(e.to_string()),
        Error::Internal(_) => PyRuntimeError::new_err(e.to_string()),
        Error::Io { .. } => PyOSError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}
