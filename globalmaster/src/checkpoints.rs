//! Checkpoints in a JetStream object store (`hkvm_<cluster>_checkpoints`), one
//! object per replica (`projection-<replica>`), and bloom filters in another
//! (`hkvm_<cluster>_blooms`, one object per sub-cluster). A restart loads the newest
//! checkpoint that decodes and passes its checksum, from any replica. Only the
//! newest [`CHECKPOINTS_KEPT`] are kept: replicas that are gone (a replica named
//! after its process id gets a new name on every restart) do not leave theirs
//! behind for ever.

use async_nats::jetstream::{self, object_store};
use futures::StreamExt as _;
use hkvm_events::checkpoint::{Checkpoint, CheckpointError, CheckpointReader};
use hkvm_events::subject::{bloom_object_name, checkpoint_object_name, Bucket};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_log::objects;
use hkvm_log::positions::{Positions, ReaderKind};
use hkvm_projector::{checkpoint, Projection};
use tokio::io::AsyncReadExt as _;

use crate::state::Shared;
use crate::GlobalMasterError;

/// Opens or creates an object store.
///
/// # Errors
/// When JetStream refuses.
pub async fn object_store(
    js: &jetstream::Context,
    cluster: &ClusterId,
    bucket: Bucket,
) -> Result<object_store::ObjectStore, GlobalMasterError> {
    let bucket = bucket.name(cluster);
    if let Ok(store) = js.get_object_store(&bucket).await {
        return Ok(store);
    }
    js.create_object_store(object_store::Config {
        bucket,
        ..Default::default()
    })
    .await
    .map_err(GlobalMasterError::nats("creating an object store"))
}

/// How many checkpoints (the newest, whoever wrote them) a write leaves in the
/// store: more than the replicas a cluster runs, so a live replica's is kept.
pub const CHECKPOINTS_KEPT: usize = 4;

/// The checkpoints in `store`, newest first.
async fn newest_first(
    store: &object_store::ObjectStore,
) -> Result<Vec<object_store::ObjectInfo>, GlobalMasterError> {
    let mut list = store
        .list()
        .await
        .map_err(GlobalMasterError::nats("listing checkpoints"))?;
    let mut infos = Vec::new();
    while let Some(info) = list.next().await {
        let info = info.map_err(GlobalMasterError::nats("listing checkpoints"))?;
        if !info.deleted {
            infos.push(info);
        }
    }
    infos.sort_by_key(|info| std::cmp::Reverse(info.modified));
    Ok(infos)
}

/// Bytes asked of the object store at a time while a checkpoint streams in.
const READ_PIECE: usize = 256 * 1024;

/// Why one stored checkpoint was passed over.
#[derive(Debug, thiserror::Error)]
enum Unreadable {
    #[error("reading: {0}")]
    Read(String),
    #[error(transparent)]
    Format(#[from] CheckpointError),
}

/// Reads the checkpoint `info` names, decoding each piece as it arrives (its
/// arrays are filled while the rest is still coming, and the whole blob is
/// never held); checked against its checksum at the end.
async fn read(
    store: &object_store::ObjectStore,
    info: &object_store::ObjectInfo,
) -> Result<Checkpoint, Unreadable> {
    let mut object = store
        .get(&info.name)
        .await
        .map_err(|e| Unreadable::Read(e.to_string()))?;
    let mut reader = CheckpointReader::new(info.size as u64)?;
    let mut piece = vec![0u8; READ_PIECE];
    loop {
        let len = object
            .read(&mut piece)
            .await
            .map_err(|e| Unreadable::Read(e.to_string()))?;
        if len == 0 {
            return Ok(reader.finish()?);
        }
        reader.feed(&piece[..len])?;
    }
}

/// Loads the newest valid checkpoint; `None` when there is none.
///
/// # Errors
/// When the store cannot be listed.
pub async fn load_newest(
    store: &object_store::ObjectStore,
) -> Result<Option<(String, Projection)>, GlobalMasterError> {
    for info in newest_first(store).await? {
        let started = std::time::Instant::now();
        let decoded = match read(store, &info).await {
            Ok(decoded) => decoded,
            Err(error) => {
                tracing::warn!(name = %info.name, %error, "skipping a checkpoint");
                continue;
            }
        };
        let read_ms = started.elapsed().as_millis() as u64;
        // Rebuilding the index of millions of keys is CPU for a while: not on a
        // runtime worker, where it would hold up this process's NATS connection.
        let restored = tokio::task::spawn_blocking(move || checkpoint::from_checkpoint(decoded))
            .await
            .map_err(|e| {
                GlobalMasterError::caused(
                    crate::GlobalMasterErrorKind::Checkpoint,
                    "rebuilding the index of a checkpoint",
                    e,
                )
            })?;
        match restored {
            Ok(projection) => {
                tracing::info!(
                    name = %info.name,
                    bytes = info.size,
                    read_ms,
                    index_ms = started.elapsed().as_millis() as u64 - read_ms,
                    "checkpoint loaded"
                );
                return Ok(Some((info.name, projection)));
            }
            Err(error) => tracing::warn!(name = %info.name, %error, "skipping a checkpoint"),
        }
    }
    Ok(None)
}

/// Writes this replica's checkpoint of the current projection, records in
/// `positions` how far it covers each stream (a restart from it reads on from
/// there, so the streams may be purged up to it), then drops all but the newest
/// [`CHECKPOINTS_KEPT`] for good (their deleted markers too, see
/// [`hkvm_log::objects`]).
///
/// # Errors
/// When encoding or storing fails.
pub(crate) async fn write(
    shared: &Shared,
    js: &jetstream::Context,
    store: &object_store::ObjectStore,
    positions: Option<&Positions>,
) -> Result<usize, GlobalMasterError> {
    let (bytes, covered) = {
        let projection = shared.read();
        let covered: Vec<(SubclusterId, u64)> = projection
            .sources()
            .iter()
            .filter_map(|source| Some((source.subcluster.clone()?, source.applied_seq)))
            .collect();
        let bytes = checkpoint::encode(&projection).map_err(|e| {
            GlobalMasterError::caused(crate::GlobalMasterErrorKind::Checkpoint, "encoding", e)
        })?;
        (bytes, covered)
    };
    let name = checkpoint_object_name(&shared.config.replica);
    store
        .put(name.as_str(), &mut bytes.as_slice())
        .await
        .map_err(GlobalMasterError::nats("storing a checkpoint"))?;
    shared.metrics.checkpoints.inc();
    tracing::info!(name, bytes = bytes.len(), "checkpoint written");
    if let Some(positions) = positions {
        for (subcluster, seq) in &covered {
            let recorded = positions
                .record(
                    subcluster,
                    ReaderKind::GlobalMaster,
                    &shared.config.replica,
                    *seq,
                )
                .await;
            if let Err(error) = recorded {
                tracing::warn!(%error, %subcluster, "recording the checkpoint's position");
            }
        }
    }
    let bucket = Bucket::Checkpoints.name(&shared.config.cluster);
    let live = newest_first(store).await?;
    for old in live.iter().skip(CHECKPOINTS_KEPT) {
        if old.name == name {
            continue;
        }
        match objects::delete_for_good(js, store, &bucket, &old.name).await {
            Ok(()) => tracing::info!(name = %old.name, "dropped an old checkpoint"),
            Err(error) => {
                tracing::warn!(name = %old.name, %error, "could not drop an old checkpoint")
            }
        }
    }
    // Markers left by deletes before this build, or by a replica that died between
    // a delete and its purge.
    let candidate = |old: &str| !live.iter().any(|info| info.name == old);
    if let Err(error) = objects::forget_markers(js, &bucket, candidate).await {
        tracing::warn!(%error, "could not purge deleted checkpoints' markers");
    }
    Ok(bytes.len())
}

/// Rebuilds and publishes the bloom filter of every named source.
///
/// # Errors
/// When storing fails.
pub(crate) async fn publish_blooms(
    shared: &Shared,
    store: &object_store::ObjectStore,
) -> Result<(), GlobalMasterError> {
    let blooms: Vec<(String, Vec<u8>)> = {
        let projection = shared.read();
        projection
            .sources()
            .iter()
            .enumerate()
            .filter_map(|(source, state)| {
                let subcluster = state.subcluster.as_ref()?;
                Some((
                    bloom_object_name(subcluster),
                    projection.bloom(source).to_bytes(),
                ))
            })
            .collect()
    };
    for (name, bytes) in blooms {
        store
            .put(name.as_str(), &mut bytes.as_slice())
            .await
            .map_err(GlobalMasterError::nats("storing a bloom filter"))?;
    }
    Ok(())
}
