//! Every NATS subject, stream, bucket and message-id name HKVM uses, in one place.
//! Names are built only from validated ids, so they never contain `.`, `*`, `>` or
//! whitespace by accident.
//!
//! | what | name |
//! |---|---|
//! | event subject of a sub-cluster | `hkvm.<cluster>.<subcluster>.ev` |
//! | its stream | `HKVM_<cluster>_<subcluster>` |
//! | sub-master RPC | `hkvm.<cluster>.<subcluster>.rpc.<op>` |
//! | a new sub-master leader's announcement | `hkvm.<cluster>.<subcluster>.leader` |
//! | global-master RPC | `hkvm.<cluster>.global.rpc.<op>` |
//! | inter-DC fetch RPC | `hkvm.<cluster>.interdc.fetch` |
//! | KV buckets / object stores | `hkvm_<cluster>_<purpose>` ([`Bucket`]) |
//! | a sub-master snapshot | `<subcluster>.<covered sequence, 20 digits>` |
//! | a global-master checkpoint | `projection-<replica>` |
//! | a sub-cluster's bloom filter | `<subcluster>` |

use crate::id::{ClusterId, ProducerId, SubclusterId};

/// Prefix of every subject.
pub const SUBJECT_PREFIX: &str = "hkvm";
/// Prefix of every event stream name.
pub const STREAM_PREFIX: &str = "HKVM";

/// The subject a sub-cluster's events are appended to.
pub fn event_subject(cluster: &ClusterId, subcluster: &SubclusterId) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.{subcluster}.ev")
}

/// The JetStream stream holding one sub-cluster's events (one stream per
/// sub-cluster: independent leaders and failure domains in a NATS cluster).
pub fn stream_name(cluster: &ClusterId, subcluster: &SubclusterId) -> String {
    format!("{STREAM_PREFIX}_{cluster}_{subcluster}")
}

/// The prefix shared by all event stream names of a cluster (for listing them).
pub fn stream_name_prefix(cluster: &ClusterId) -> String {
    format!("{STREAM_PREFIX}_{cluster}_")
}

/// The sub-cluster a stream name belongs to, if it is one of `cluster`'s streams.
pub fn subcluster_of_stream(cluster: &ClusterId, stream: &str) -> Option<SubclusterId> {
    let rest = stream.strip_prefix(&stream_name_prefix(cluster))?;
    SubclusterId::new(rest).ok()
}

/// The subject of a sub-master RPC operation (`op` is a fixed operation name).
pub fn submaster_rpc_subject(cluster: &ClusterId, subcluster: &SubclusterId, op: &str) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.{subcluster}.rpc.{op}")
}

/// The subject of a sub-master operation only the admin role may send
/// ([`Audience::Admin`](crate::rpc::submaster::Audience::Admin)): under
/// `rpc.admin`, which the generated permissions give the `admin` user alone.
pub fn submaster_admin_subject(cluster: &ClusterId, subcluster: &SubclusterId, op: &str) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.{subcluster}.rpc.admin.{op}")
}

/// The subject of a sub-master operation that node `node` sends about its own
/// segments ([`Audience::Node`](crate::rpc::submaster::Audience::Node)): under
/// `rpc.node.<node>`, which the generated permissions give that node's user
/// alone (`node` may be `*`, for the sub-master's subscription).
pub fn submaster_node_subject(
    cluster: &ClusterId,
    subcluster: &SubclusterId,
    node: &str,
    op: &str,
) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.{subcluster}.rpc.node.{node}.{op}")
}

/// The subject on which a sub-master that starts leading its sub-cluster says so
/// (core NATS, not stored): clients waiting out a failover retry at once.
pub fn leader_subject(cluster: &ClusterId, subcluster: &SubclusterId) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.{subcluster}.leader")
}

/// The inbox prefix of a connection logged in as NATS user `user`: replies to
/// its requests (and JetStream deliveries to it) arrive under
/// `<prefix>.>`, which only that user may subscribe to.
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX_{user}")
}

/// The NATS user whose [`inbox_prefix`] `inbox` (a reply subject) is under;
/// none for the default `_INBOX.` prefix of a connection without a user.
pub fn user_of_inbox(inbox: &str) -> Option<&str> {
    let rest = inbox.strip_prefix("_INBOX_")?;
    Some(rest.split_once('.').map_or(rest, |(user, _)| user))
}

/// The subject of a global-master RPC operation.
pub fn global_rpc_subject(cluster: &ClusterId, op: &str) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.global.rpc.{op}")
}

/// The subject on which a cluster's inter-DC gateways take fetch requests (the
/// gateway reads a block from its cluster and sends it over the WAN).
pub fn interdc_fetch_subject(cluster: &ClusterId) -> String {
    format!("{SUBJECT_PREFIX}.{cluster}.interdc.fetch")
}

/// The name of a cluster-wide KV bucket or object store (`purpose` such as
/// `leader`, `registry`, `snapshots`).
pub fn bucket_name(cluster: &ClusterId, purpose: &str) -> String {
    format!("{}_{cluster}_{purpose}", SUBJECT_PREFIX)
}

/// Every cluster-wide KV bucket and object store, by purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// KV: each sub-cluster's leader lease.
    Leader,
    /// KV: the sub-master registry (labels, capacity, liveness).
    Registry,
    /// Object store: sub-master snapshots.
    Snapshots,
    /// Object store: global-master checkpoints.
    Checkpoints,
    /// Object store: per-sub-cluster bloom filters published by the global master.
    Blooms,
    /// KV: where each reader of each stream has got to (the purge point's bound).
    Positions,
    /// KV: each sub-cluster's data-port grant key (read by its sub-masters and
    /// nodes only).
    Grants,
}

impl Bucket {
    /// Every bucket.
    pub const ALL: [Bucket; 7] = [
        Bucket::Leader,
        Bucket::Registry,
        Bucket::Snapshots,
        Bucket::Checkpoints,
        Bucket::Blooms,
        Bucket::Positions,
        Bucket::Grants,
    ];

    /// The purpose part of its name.
    pub fn purpose(self) -> &'static str {
        match self {
            Self::Leader => "leader",
            Self::Registry => "registry",
            Self::Snapshots => "snapshots",
            Self::Checkpoints => "checkpoints",
            Self::Blooms => "blooms",
            Self::Positions => "positions",
            Self::Grants => "grants",
        }
    }

    /// Whether it is an object store (otherwise a KV bucket).
    pub fn is_object_store(self) -> bool {
        matches!(self, Self::Snapshots | Self::Checkpoints | Self::Blooms)
    }

    /// Its full name in `cluster`.
    pub fn name(self, cluster: &ClusterId) -> String {
        bucket_name(cluster, self.purpose())
    }
}

/// The inter-DC progress KV bucket, kept in the `target` cluster, of copies from
/// `source` into `target`.
pub fn interdc_progress_bucket(source: &ClusterId, target: &ClusterId) -> String {
    bucket_name(target, &format!("interdc-{source}"))
}

/// The prefix of every snapshot object name of `subcluster`.
pub fn snapshot_object_prefix(subcluster: &SubclusterId) -> String {
    format!("{subcluster}.")
}

/// The object name of `subcluster`'s snapshot covering `covers_seq` (zero-padded,
/// so lexical order is sequence order).
pub fn snapshot_object_name(subcluster: &SubclusterId, covers_seq: u64) -> String {
    format!("{}{covers_seq:020}", snapshot_object_prefix(subcluster))
}

/// The object name of a global-master replica's checkpoint.
pub fn checkpoint_object_name(replica: &str) -> String {
    format!("projection-{replica}")
}

/// The object name of a sub-cluster's bloom filter.
pub fn bloom_object_name(subcluster: &SubclusterId) -> String {
    subcluster.to_string()
}

/// The `Nats-Msg-Id` of the `counter`-th message a producer appended in an epoch:
/// a retried append reuses it, so JetStream stores the message once.
pub fn message_id(producer: &ProducerId, epoch: u64, counter: u64) -> String {
    format!("{producer}-{epoch}-{counter}")
}

/// The `Nats-Msg-Id` of the empty message a new leader appends to open its epoch
/// (which fences any older leader still trying to write).
pub fn epoch_marker_id(producer: &ProducerId, epoch: u64) -> String {
    format!("{producer}-{epoch}-start")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_audience_has_its_subjects_and_an_inbox_names_its_user() {
        use crate::rpc::submaster::{Audience, Op};
        let cluster = ClusterId::new("prod").unwrap();
        let sc = SubclusterId::new("sc-0").unwrap();
        assert_eq!(
            submaster_admin_subject(&cluster, &sc, "remove_all"),
            "hkvm.prod.sc-0.rpc.admin.remove_all"
        );
        assert_eq!(
            submaster_node_subject(&cluster, &sc, "n1", "mount_segment"),
            "hkvm.prod.sc-0.rpc.node.n1.mount_segment"
        );
        for op in Op::ALL {
            let expected = match op {
                Op::MountSegment | Op::UnmountSegment | Op::Remount => Audience::Node,
                Op::RemoveAll | Op::RemoveMatching => Audience::Admin,
                _ => Audience::Anyone,
            };
            assert_eq!(op.audience(), expected, "{}", op.name());
        }
        assert_eq!(user_of_inbox("_INBOX_node-n1.abc.def"), Some("node-n1"));
        assert_eq!(user_of_inbox("_INBOX_client"), Some("client"));
        assert_eq!(user_of_inbox("_INBOX.abc"), None);
    }

    #[test]
    fn names_follow_the_design() {
        let cluster = ClusterId::new("prod").unwrap();
        let sc = SubclusterId::new("sc-0").unwrap();
        assert_eq!(event_subject(&cluster, &sc), "hkvm.prod.sc-0.ev");
        assert_eq!(stream_name(&cluster, &sc), "HKVM_prod_sc-0");
        assert_eq!(
            submaster_rpc_subject(&cluster, &sc, "put_start"),
            "hkvm.prod.sc-0.rpc.put_start"
        );
        assert_eq!(
            global_rpc_subject(&cluster, "batch_is_exist"),
            "hkvm.prod.global.rpc.batch_is_exist"
        );
        assert_eq!(
            subcluster_of_stream(&cluster, "HKVM_prod_sc-0"),
            Some(sc.clone())
        );
        assert_eq!(subcluster_of_stream(&cluster, "HKVM_other_sc-0"), None);
        let producer = ProducerId::new("sm-a").unwrap();
        assert_eq!(message_id(&producer, 3, 17), "sm-a-3-17");
        assert_eq!(Bucket::Snapshots.name(&cluster), "hkvm_prod_snapshots");
        assert_eq!(snapshot_object_name(&sc, 42), "sc-0.00000000000000000042");
        assert_eq!(checkpoint_object_name("r1"), "projection-r1");
        assert_eq!(bloom_object_name(&sc), "sc-0");
        assert_eq!(
            interdc_progress_bucket(&ClusterId::new("a").unwrap(), &cluster),
            "hkvm_prod_interdc-a"
        );
        assert_eq!(interdc_fetch_subject(&cluster), "hkvm.prod.interdc.fetch");
    }
}
