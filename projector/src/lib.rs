//! The projector: folds every sub-cluster's event stream into compact cluster-wide
//! indexes (key hash to sub-clusters, roaring bitmaps, bloom filters).
//!
//! [`Projection::apply`] is pure (no I/O, no clock) and [`checkpoint`] turns a
//! projection into a self-checking blob stamped with each source's sequence, so a
//! restart is `checkpoint::decode` plus folding each stream's tail. Reading the
//! streams, the registry and storing checkpoints is the global master's job.

pub mod checkpoint;
mod error;
pub mod index;
mod prefetch;
mod projection;
mod table;

pub use error::{ProjectorError, ProjectorErrorKind};
pub use index::{Holders, KeyIndex, SourceWriter};
pub use projection::{Applied, Projection, SourceContent, SourceState};
