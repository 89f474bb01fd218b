//! Integration and chaos tests: real nats-server processes, `hkvm` processes and
//! real containers built from local images (`scripts/build-images`; no registry is
//! needed). The tests live in one test binary, `tests/it`; this library holds the
//! container images and the NATS authorization the containers run with.

pub mod images;
pub mod security;
