//! The users of the inter-DC level, in the config of each cluster it touches:
//! in the source cluster, the inter-DC master of each target (it follows the
//! source's streams and asks its gateway for blocks) and the gateway (it
//! locates and reads blocks for fetches); in the target cluster, the inter-DC
//! master of each source (it follows the target's streams, keeps its progress
//! there, and puts the blocks it receives).

use hkvm_events::rpc::submaster::Op;
use hkvm_events::subject::{interdc_fetch_subject, interdc_progress_bucket, Bucket};
use hkvm_events::{ClusterId, IdError};

use super::{every_subcluster_rpc_subject, stream_api, stream_read_api};

/// The gateway's user in its (source) cluster.
pub const GATEWAY_USER: &str = "interdc-gateway";

/// The user of the inter-DC master copying into `target`, in the source
/// cluster's config.
pub fn source_user(target: &ClusterId) -> String {
    format!("interdc-to-{target}")
}

/// The user of the inter-DC master copying from `source`, in the target
/// cluster's config.
pub fn target_user(source: &ClusterId) -> String {
    format!("interdc-from-{source}")
}

/// The streams an inter-DC master reads in a cluster it follows.
pub(super) struct Reading<'a> {
    /// The event streams.
    pub(super) streams: &'a [String],
    /// The registry bucket's stream.
    pub(super) registry: &'a str,
    /// The snapshots store's stream (a stream purged up to a snapshot is
    /// seeded from it).
    pub(super) snapshots: &'a str,
    /// The reader positions bucket's stream.
    pub(super) positions: &'a str,
}

/// Following a cluster: reading its event streams, registry and snapshots,
/// and recording where it is in each stream (so purges wait for it).
fn following(cluster: &ClusterId, reading: &Reading<'_>) -> Vec<String> {
    let mut publish = vec![
        "$JS.API.INFO".to_owned(),
        "$JS.API.STREAM.NAMES".to_owned(),
        "$JS.API.STREAM.LIST".to_owned(),
        format!("$KV.{}.*.interdc.>", Bucket::Positions.name(cluster)),
    ];
    for stream in reading.streams {
        publish.extend(stream_read_api(stream));
    }
    publish.extend(stream_read_api(reading.registry));
    publish.extend(stream_read_api(reading.snapshots));
    publish.extend(stream_api(reading.positions));
    publish
}

/// What the inter-DC master of another cluster may publish in its source
/// cluster `cluster`: following it, and fetch requests to its gateways.
pub(super) fn source_publish(cluster: &ClusterId, reading: &Reading<'_>) -> Vec<String> {
    let mut publish = following(cluster, reading);
    publish.push(interdc_fetch_subject(cluster));
    publish
}

/// What the inter-DC master copying from `source` may publish in its target
/// cluster `cluster`: following it, its progress bucket, and the sub-master
/// operations of a put (puts, space leases, revokes, lookups).
///
/// # Errors
/// Never for valid ids (the sub-cluster wildcard is derived from two).
pub(super) fn target_publish(
    cluster: &ClusterId,
    source: &ClusterId,
    reading: &Reading<'_>,
) -> Result<Vec<String>, IdError> {
    let mut publish = following(cluster, reading);
    let progress = interdc_progress_bucket(source, cluster);
    publish.push(format!("$KV.{progress}.>"));
    publish.extend(stream_api(&format!("KV_{progress}")));
    for op in [
        Op::PutStart,
        Op::PutEnd,
        Op::PutRevoke,
        Op::PutCommit,
        Op::LeaseSpace,
        Op::LeaseReturn,
        Op::Mixed,
        Op::Exist,
        Op::GetReplicaList,
        Op::Remove,
        Op::Status,
    ] {
        publish.push(every_subcluster_rpc_subject(cluster, op.name())?);
    }
    Ok(publish)
}

/// What the gateway of source cluster `cluster` may publish (locating blocks;
/// it reads their bytes with the grants the sub-masters hand it, never the
/// grant key) and subscribe to (the fetch requests), besides its inbox.
///
/// # Errors
/// Never for valid ids.
pub(super) fn gateway_rights(cluster: &ClusterId) -> Result<(Vec<String>, Vec<String>), IdError> {
    let publish = vec![
        "$JS.API.INFO".to_owned(),
        every_subcluster_rpc_subject(cluster, Op::GetReplicaList.name())?,
        every_subcluster_rpc_subject(cluster, Op::Status.name())?,
    ];
    Ok((publish, vec![interdc_fetch_subject(cluster)]))
}

#[cfg(test)]
mod tests {
    use super::super::{nats_conf, Deployment};
    use super::*;

    /// The user block of `user` in `conf`.
    fn block_of(conf: &str, user: &str) -> String {
        let start = conf.find(&format!("user: \"{user}\"")).unwrap();
        let end = conf[start..].find("allow_responses").unwrap();
        conf[start..start + end].to_owned()
    }

    #[test]
    fn each_side_gets_its_users_and_none_may_append_mount_or_remove_everything() {
        let source = nats_conf(
            &Deployment {
                cluster: "prefill",
                subclusters: &["p0"],
                copied_to: &["decode"],
                ..Deployment::default()
            },
            |user| format!("{user}-pw"),
        )
        .unwrap();
        let target = nats_conf(
            &Deployment {
                cluster: "decode",
                subclusters: &["d0"],
                copied_from: &["prefill"],
                ..Deployment::default()
            },
            |user| format!("{user}-pw"),
        )
        .unwrap();
        let decode = ClusterId::new("decode").unwrap();
        let prefill = ClusterId::new("prefill").unwrap();
        let reader = block_of(&source, &source_user(&decode));
        let gateway = block_of(&source, GATEWAY_USER);
        let writer = block_of(&target, &target_user(&prefill));
        assert!(reader.contains("\"hkvm.prefill.interdc.fetch\""));
        assert!(gateway.contains(
            "subscribe: { allow: [\"_INBOX_interdc-gateway.>\", \"hkvm.prefill.interdc.fetch\"]"
        ));
        assert!(writer.contains("\"$KV.hkvm_decode_interdc-prefill.>\""));
        assert!(writer.contains("\"hkvm.decode.*.rpc.put_start\""));
        assert!(!target.contains(&format!("user: \"{GATEWAY_USER}\"")));
        for block in [&reader, &gateway, &writer] {
            assert!(
                !block.contains(".ev\""),
                "appends to an event stream: {block}"
            );
            assert!(!block.contains("rpc.node") && !block.contains("rpc.admin"));
            assert!(!block.contains("rpc.*\"") && !block.contains("$JS.API.>"));
        }
    }
}
