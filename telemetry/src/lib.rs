//! The Prometheus side of every HKVM service: [`metrics`] builds a service's
//! metrics in one registry, and [`MetricsServer`] is a minimal HTTP/1.1 server
//! answering `GET /metrics` with that registry's text exposition, and the
//! routes a service adds beside it ([`HttpRoutes`]; any other path gets 404). [`logging`] sets up the `tracing` logs every binary writes.

mod error;
pub mod logging;
pub mod metrics;
pub mod repeats;
mod server;

pub use error::TelemetryError;
pub use metrics::{MetricsRegistry, Registrar};
pub use server::{HttpAnswer, HttpAnswerFuture, HttpRoutes, MetricsServer};
