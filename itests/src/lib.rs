//! Integration and chaos tests: real nats-server processes and real containers built
//! from local images (`scripts/build-images`; no registry is needed). The tests live
//! in `tests/`; this library holds their shared container helpers.

pub mod images;
pub mod security;
