//! Creating or updating a sub-cluster's event stream, idempotently, with explicit
//! settings. When a limit is hit the stream refuses new appends (`DiscardPolicy::New`)
//! instead of dropping old history: only an explicit purge up to a snapshot's
//! sequence removes events.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::event_log::LogError;
use hkvm_events::id::{ClusterId, SubclusterId};
use hkvm_events::subject::{event_subject, stream_name};

/// Settings of an event stream. `Default` suits a single local server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSettings {
    /// Replicas: 1 locally, 3 in a NATS cluster (acknowledged = on a quorum).
    pub replicas: usize,
    /// Window in which a retried append with the same message id is stored once.
    pub duplicate_window: Duration,
    /// Largest stream in bytes (`-1`: unlimited); when reached, appends fail.
    pub max_bytes: i64,
    /// Most messages (`-1`: unlimited); when reached, appends fail.
    pub max_messages: i64,
    /// Largest single message in bytes.
    pub max_message_size: i32,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            replicas: 1,
            duplicate_window: Duration::from_secs(120),
            max_bytes: -1,
            max_messages: -1,
            max_message_size: 1 << 20,
        }
    }
}

impl StreamSettings {
    /// The JetStream configuration of the stream of `cluster`/`subcluster`.
    pub fn config(&self, cluster: &ClusterId, subcluster: &SubclusterId) -> stream::Config {
        stream::Config {
            name: stream_name(cluster, subcluster),
            description: Some(format!(
                "HKVM event log of sub-cluster {subcluster} in cluster {cluster}"
            )),
            subjects: vec![event_subject(cluster, subcluster)],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::New,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            max_bytes: self.max_bytes,
            max_messages: self.max_messages,
            max_message_size: self.max_message_size,
            max_age: Duration::ZERO,
            // Single events are never deleted; history goes only by a purge up to a
            // snapshot's sequence.
            deny_delete: true,
            allow_direct: true,
            ..Default::default()
        }
    }
}

/// Creates the stream, or updates it to `settings` if it exists with others.
///
/// # Errors
/// [`LogError`] when JetStream refuses (e.g. fewer servers than replicas).
pub async fn ensure_stream(
    js: &jetstream::Context,
    cluster: &ClusterId,
    subcluster: &SubclusterId,
    settings: &StreamSettings,
) -> Result<stream::Stream, LogError> {
    let wanted = settings.config(cluster, subcluster);
    let name = wanted.name.clone();
    let mut stream = js
        .get_or_create_stream(wanted.clone())
        .await
        .map_err(|e| LogError::other(&name, e))?;
    let current = stream
        .info()
        .await
        .map_err(|e| LogError::other(&name, e))?
        .config
        .clone();
    let differs = current.subjects != wanted.subjects
        || current.num_replicas != wanted.num_replicas
        || current.duplicate_window != wanted.duplicate_window
        || current.max_bytes != wanted.max_bytes
        || current.max_messages != wanted.max_messages
        || current.max_message_size != wanted.max_message_size
        || current.discard != wanted.discard
        || current.deny_delete != wanted.deny_delete;
    if differs {
        tracing::info!(stream = %name, "updating stream settings");
        js.update_stream(wanted)
            .await
            .map_err(|e| LogError::other(&name, e))?;
        stream = js
            .get_stream(&name)
            .await
            .map_err(|e| LogError::other(&name, e))?;
    }
    Ok(stream)
}
