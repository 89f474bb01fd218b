//! Who the data port serves: every request is put to an [`Admission`] before any
//! byte of a region is read or written. A node admits what its sub-master granted
//! (`hkvm-client`'s grant checker); [`AdmitAll`] serves everyone, for a transport
//! measured or tested on its own.

use crate::frame::Op;

/// One operation as the data port received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asked<'a> {
    /// Read or write.
    pub op: Op,
    /// The region (a segment id).
    pub region: &'a str,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
    /// What the requester presented (empty: nothing).
    pub grant: &'a [u8],
}

/// Decides, per operation and without a round trip, whether the data port serves
/// it.
pub trait Admission: Send + Sync {
    /// `Ok` to serve; otherwise why not (sent back to the requester).
    ///
    /// # Errors
    /// The refusal, in words.
    fn admit(&self, asked: &Asked<'_>) -> Result<(), String>;
}

/// Serves every operation: for a transport on its own (benchmarks, tests of the
/// transport), never for a node's data port.
#[derive(Debug, Clone, Copy, Default)]
pub struct AdmitAll;

impl Admission for AdmitAll {
    fn admit(&self, _asked: &Asked<'_>) -> Result<(), String> {
        Ok(())
    }
}
