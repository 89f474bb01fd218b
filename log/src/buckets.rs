//! Opening the shared KV buckets (leader leases, registry, reader positions,
//! grant keys, inter-DC progress): whichever process comes first creates one,
//! every other opens it.

use async_nats::jetstream::{self, context::CreateKeyValueError, kv};

/// The KV bucket `config.bucket`, created with `config` when it does not exist
/// yet. Two processes creating it at once with the same config both get it
/// (JetStream's create is idempotent for an identical config).
///
/// # Errors
/// When JetStream refuses to create it (or it exists with another config, or
/// the credential may not create it).
pub async fn open_or_create(
    js: &jetstream::Context,
    config: kv::Config,
) -> Result<kv::Store, CreateKeyValueError> {
    if let Ok(store) = js.get_key_value(&config.bucket).await {
        return Ok(store);
    }
    js.create_key_value(config).await
}
