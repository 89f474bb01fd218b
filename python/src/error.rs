//! How core errors reach Python: a failed store call becomes the Mooncake code
//! the caller sees (calls never raise after setup), and a failed setup raises
//! [`HkvmError`] with that code and the error's causes.

use hkvm_client::dummy::DummyError;
use hkvm_client::store::{ErrorCode, StoreError};
use pyo3::PyErr;

pyo3::create_exception!(
    _native,
    HkvmError,
    pyo3::exceptions::PyException,
    "A store could not be set up; `args` are (Mooncake error code, message)."
);

/// Mooncake's `INVALID_PARAMS`: bad arguments, or memory outside every
/// registered buffer.
pub const INVALID: i32 = ErrorCode::InvalidParams as i32;
/// Mooncake's `BUFFER_OVERFLOW`: a value larger than the staging buffer.
pub const OVERFLOW: i32 = ErrorCode::BufferOverflow as i32;
/// Mooncake's `INTERNAL_ERROR`: a reply of the wrong shape.
pub const INTERNAL: i32 = ErrorCode::InternalError as i32;

/// A core error with the Mooncake code Python sees for it.
pub trait Coded: std::error::Error {
    /// The Mooncake error code (negative).
    fn mooncake_code(&self) -> i32;
}

impl Coded for StoreError {
    fn mooncake_code(&self) -> i32 {
        self.code().value()
    }
}

impl Coded for DummyError {
    fn mooncake_code(&self) -> i32 {
        match self {
            Self::Refused(_) | Self::Region(_) | Self::Untrusted { .. } => INVALID,
            Self::Unreachable { .. } | Self::Disconnected | Self::Frame(_) => {
                ErrorCode::RpcFail.value()
            }
        }
    }
}

/// The message of an error with its causes, outermost first.
pub fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The code of a failed call. Python sees only the code, so the error itself is
/// logged at debug level.
pub fn code_of<E: Coded>(error: &E) -> i32 {
    let code = error.mooncake_code();
    tracing::debug!(code, error = describe(error), "store call failed");
    code
}

/// The exception of a setup that failed with `error`.
pub fn setup_failed<E: Coded>(error: &E) -> PyErr {
    setup_refused(error.mooncake_code(), describe(error))
}

/// The exception of a setup refused with `code`, for failures that are no core
/// error (an argument, the runtime).
pub fn setup_refused(code: i32, message: String) -> PyErr {
    HkvmError::new_err((code, message))
}
