//! Deleting from a JetStream object store for good.
//!
//! An object store keeps each object's metadata as the last message on its own
//! subject (`$O.<bucket>.M.<base64url(name)>`). Deleting an object purges its
//! chunks but leaves a metadata message marked `deleted`, and every listing reads
//! one message per subject: a name that is never written again (a snapshot named
//! after the sequence it covers, a checkpoint named after a replica's process id)
//! leaves its marker for ever. A sub-master snapshots about once a minute, so in
//! a cluster-wide bucket the markers grew by thousands a day per sub-cluster, and
//! every snapshot round listed all of them. [`delete_for_good`] deletes an object
//! and then purges its marker; [`forget_markers`] purges the markers of objects
//! deleted earlier (by an older build, or by a process that died between the two
//! steps). A listing never shows markers (the client skips them after reading
//! them), so the sweep reads the bucket's metadata subjects instead.

use async_nats::jetstream::{self, object_store::ObjectStore};
use base64::engine::general_purpose::URL_SAFE;
use base64::Engine as _;

/// Why an object could not be deleted for good.
#[derive(Debug, thiserror::Error)]
pub enum ObjectsError {
    /// The object store refused the delete.
    #[error("deleting {name}: {source}")]
    Delete {
        /// The object.
        name: String,
        /// What the store said.
        source: async_nats::jetstream::object_store::DeleteError,
    },
    /// The bucket's stream could not be opened.
    #[error("opening the stream of bucket {bucket}: {source}")]
    Stream {
        /// The bucket.
        bucket: String,
        /// What JetStream said.
        source: jetstream::context::GetStreamError,
    },
    /// The marker could not be read.
    #[error("reading the metadata of {name}: {source}")]
    Read {
        /// The object.
        name: String,
        /// What JetStream said.
        source: jetstream::stream::LastRawMessageError,
    },
    /// The bucket's metadata subjects could not be read.
    #[error("reading the metadata subjects of bucket {bucket}: {source}")]
    Subjects {
        /// The bucket.
        bucket: String,
        /// What JetStream said.
        source: jetstream::stream::InfoError,
    },
    /// The marker could not be purged.
    #[error("purging the metadata of {name}: {source}")]
    Purge {
        /// The object.
        name: String,
        /// What JetStream said.
        source: jetstream::stream::PurgeError,
    },
}

/// The stream behind the object store `bucket` (async-nats names it
/// `OBJ_<bucket>`), without asking the server for its info.
async fn bucket_stream(
    js: &jetstream::Context,
    bucket: &str,
) -> Result<jetstream::stream::Stream<()>, ObjectsError> {
    js.get_stream_no_info(format!("OBJ_{bucket}"))
        .await
        .map_err(|source| ObjectsError::Stream {
            bucket: bucket.to_owned(),
            source,
        })
}

/// The subject holding the metadata of object `name` in `bucket` (the encoding
/// async-nats and the other NATS clients use: URL-safe base64 with padding).
fn metadata_subject(bucket: &str, name: &str) -> String {
    format!(
        "{}{}",
        metadata_subject_prefix(bucket),
        URL_SAFE.encode(name)
    )
}

/// What every metadata subject of `bucket` starts with.
fn metadata_subject_prefix(bucket: &str) -> String {
    format!("$O.{bucket}.M.")
}

/// Deletes object `name` from `store` (the object store `bucket`), then purges the
/// marker the delete leaves.
///
/// # Errors
/// [`ObjectsError`] naming the step that failed; a failed purge leaves the object
/// deleted, with its marker for a later [`forget_markers`].
pub async fn delete_for_good(
    js: &jetstream::Context,
    store: &ObjectStore,
    bucket: &str,
    name: &str,
) -> Result<(), ObjectsError> {
    store
        .delete(name)
        .await
        .map_err(|source| ObjectsError::Delete {
            name: name.to_owned(),
            source,
        })?;
    forget_if_deleted(js, bucket, name).await.map(|_| ())
}

/// Purges the metadata of object `name` in `bucket` if its last message marks it
/// deleted; returns whether it did. Only that message and older ones go (the purge
/// stops at its sequence), so an object written again under the same name in the
/// meantime is left alone.
///
/// # Errors
/// [`ObjectsError`] when the stream cannot be read or purged.
pub async fn forget_if_deleted(
    js: &jetstream::Context,
    bucket: &str,
    name: &str,
) -> Result<bool, ObjectsError> {
    let stream = bucket_stream(js, bucket).await?;
    let subject = metadata_subject(bucket, name);
    let last = match stream.get_last_raw_message_by_subject(&subject).await {
        Ok(last) => last,
        Err(error)
            if error.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
        {
            return Ok(false)
        }
        Err(source) => {
            return Err(ObjectsError::Read {
                name: name.to_owned(),
                source,
            })
        }
    };
    if !marks_deleted(&last.payload) {
        return Ok(false);
    }
    stream
        .purge()
        .filter(subject)
        .sequence(last.sequence + 1)
        .await
        .map_err(|source| ObjectsError::Purge {
            name: name.to_owned(),
            source,
        })?;
    Ok(true)
}

/// Purges the marker of every deleted object in `bucket` whose name `candidate`
/// accepts (pass one that skips the names a listing just showed live, to spare a
/// read each); returns how many it purged.
///
/// # Errors
/// [`ObjectsError`] when the subjects cannot be read or a marker not purged.
pub async fn forget_markers(
    js: &jetstream::Context,
    bucket: &str,
    candidate: impl Fn(&str) -> bool,
) -> Result<usize, ObjectsError> {
    let mut purged = 0;
    for name in metadata_names(js, bucket).await? {
        if candidate(&name) && forget_if_deleted(js, bucket, &name).await? {
            purged += 1;
        }
    }
    Ok(purged)
}

/// The name of every object that has metadata in `bucket`, live or deleted: what
/// a listing reads, one message each. Subjects that do not decode to a name are
/// left out.
///
/// # Errors
/// [`ObjectsError`] when the stream or its subjects cannot be read.
pub async fn metadata_names(
    js: &jetstream::Context,
    bucket: &str,
) -> Result<Vec<String>, ObjectsError> {
    let stream = bucket_stream(js, bucket).await?;
    let subjects_error = |source| ObjectsError::Subjects {
        bucket: bucket.to_owned(),
        source,
    };
    let prefix = metadata_subject_prefix(bucket);
    let mut subjects = stream
        .info_with_subjects(format!("{prefix}>"))
        .await
        .map_err(subjects_error)?;
    let mut names = Vec::new();
    while let Some(subject) = futures::StreamExt::next(&mut subjects).await {
        let (subject, _) = subject.map_err(subjects_error)?;
        names.extend(
            subject
                .strip_prefix(&prefix)
                .and_then(|encoded| URL_SAFE.decode(encoded).ok())
                .and_then(|name| String::from_utf8(name).ok()),
        );
    }
    Ok(names)
}

/// Whether an object's metadata message says it was deleted; metadata that does
/// not parse is not a marker (and is left alone).
fn marks_deleted(metadata: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Marker {
        #[serde(default)]
        deleted: bool,
    }
    serde_json::from_slice::<Marker>(metadata).is_ok_and(|marker| marker.deleted)
}

#[cfg(test)]
mod tests {
    use super::{marks_deleted, metadata_subject};

    #[test]
    fn the_metadata_subject_is_url_safe_base64_of_the_name() {
        // URL-safe: '-' and '_' where standard base64 has '+' and '/'.
        assert_eq!(metadata_subject("b", "a"), "$O.b.M.YQ==");
        assert_eq!(metadata_subject("b", "??>"), "$O.b.M.Pz8-");
        assert_eq!(metadata_subject("b", "???"), "$O.b.M.Pz8_");
    }

    #[test]
    fn only_metadata_marked_deleted_is_a_marker() {
        assert!(marks_deleted(br#"{"name":"x","deleted":true,"size":0}"#));
        assert!(!marks_deleted(br#"{"name":"x","deleted":false}"#));
        assert!(!marks_deleted(br#"{"name":"x"}"#));
        assert!(!marks_deleted(b"not json"));
    }
}
