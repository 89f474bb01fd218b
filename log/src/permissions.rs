//! The NATS authorization of an HKVM deployment: one user per sub-master that may
//! write only its own event stream, lease, registry entry and snapshots; one user
//! for global masters that reads streams and writes only its own checkpoints; one
//! user for clients that may only send RPC requests and read the leader lease
//! (where the leader takes direct requests); one user per listed node
//! (`node-<id>`) with a client's rights that may also mount, unmount and remount
//! that node's segments only, in its own sub-cluster, and read the data-port
//! grant keys; a shared `node` user for nodes not listed ahead (it may act for
//! any node). Only the admin and the `pool-admin` user (an engine's nodes that
//! may also empty their pool) may remove everything (the `rpc.admin` subjects).
//! Every user subscribes under its own inbox prefix only. `docs/security.md`
//! shows the output of [`nats_conf`] (with the test passwords of `hkvm-itests`)
//! and a test keeps the two identical;
//! `hkvm local --secure` runs its cluster under it with random passwords.

use std::fmt::Write as _;

pub mod interdc;

use hkvm_events::rpc::submaster::Op;
use hkvm_events::subject::{
    event_subject, global_rpc_subject, inbox_prefix, leader_subject, stream_name,
    submaster_admin_subject, submaster_node_subject, submaster_rpc_subject, Bucket,
};
use hkvm_events::{ClusterId, IdError, NodeId, SubclusterId};

/// The user name of a sub-cluster's sub-masters.
pub fn submaster_user(subcluster: &str) -> String {
    format!("sm-{subcluster}")
}

/// The global masters' user.
pub const GLOBAL_USER: &str = "global";
/// The clients' user.
pub const CLIENT_USER: &str = "client";
/// The shared user of nodes not listed in the config ahead (real clients: they
/// serve a segment, so they read the grant keys their data ports check). It may
/// mount, unmount and remount the segments of any node; a listed node's own user
/// ([`node_user`]) only its own.
pub const NODE_USER: &str = "node";

/// The user of node `node`, bound to its own segments.
pub fn node_user(node: &str) -> String {
    format!("node-{node}")
}

/// Whether user `user` of the generated config may send the admin's
/// operations: not a client, node, sub-master or global master (the admin, or a
/// user of a config made otherwise, may try; its NATS permissions decide).
pub fn may_administer(user: &str) -> bool {
    ![CLIENT_USER, NODE_USER, GLOBAL_USER].contains(&user)
        && !user.starts_with("node-")
        && !user.starts_with("sm-")
}

/// A node given a user of its own by [`nats_conf`].
#[derive(Debug, Clone, Copy)]
pub struct ListedNode<'a> {
    /// The node's id.
    pub node: &'a str,
    /// The sub-cluster it serves (the only one it may mount in).
    pub subcluster: &'a str,
}
/// The operators' user (creates nothing at runtime; `hkvm replay`, repairs).
pub const ADMIN_USER: &str = "admin";
/// The user of an engine that owns its pool and empties it (vLLM's connector
/// on a prefix-cache reset, SGLang's `clear`): the shared node user's rights
/// (its processes serve memory) and `remove_all` / `remove_matching`, nothing of
/// the operator's JetStream rights.
pub const POOL_ADMIN_USER: &str = "pool-admin";

/// Reading a stream: direct gets, and consumers on it with their acks and flow
/// control.
fn stream_consume_api(stream: &str) -> Vec<String> {
    vec![
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.CONSUMER.*.{stream}"),
        format!("$JS.API.CONSUMER.*.{stream}.>"),
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.>"),
        format!("$JS.ACK.{stream}.>"),
        format!("$JS.FC.{stream}.>"),
    ]
}

/// The JetStream API subjects that touch one stream, its messages and consumers.
fn stream_api(stream: &str) -> Vec<String> {
    let mut subjects = vec![
        format!("$JS.API.STREAM.*.{stream}"),
        format!("$JS.API.STREAM.MSG.*.{stream}"),
    ];
    subjects.extend(stream_consume_api(stream));
    subjects
}

/// A shared KV bucket's stream: created by whoever comes first, inspected and
/// read; never purged, deleted or reconfigured.
fn shared_bucket_api(stream: &str) -> Vec<String> {
    let mut subjects = vec![format!("$JS.API.STREAM.CREATE.{stream}")];
    subjects.extend(stream_read_api(stream));
    subjects
}

/// Read-only access to a stream: info, message reads, and consumers on it.
fn stream_read_api(stream: &str) -> Vec<String> {
    let mut subjects = vec![
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
    ];
    subjects.extend(stream_consume_api(stream));
    subjects
}

fn user_block(
    out: &mut String,
    (user, password): (&str, &str),
    publish: &[String],
    subscribe: &[String],
) {
    let list = |items: &[String]| {
        items
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "      {{\n        user: \"{user}\", password: \"{}\"\n        permissions: {{\n          \
         publish: {{ allow: [{}] }}\n          subscribe: {{ allow: [{}] }}\n          \
         allow_responses: true\n        }}\n      }}",
        password,
        list(publish),
        list(subscribe),
    );
}

/// The subject of sub-master operation `op` (which may be a wildcard) of every
/// sub-cluster of `cluster`: [`submaster_rpc_subject`] with the sub-cluster token
/// replaced by `*` (found as the one token in which two sub-clusters' subjects
/// differ).
fn every_subcluster_rpc_subject(cluster: &ClusterId, op: &str) -> Result<String, IdError> {
    every_subcluster(|subcluster| submaster_rpc_subject(cluster, subcluster, op))
}

/// [`leader_subject`] of every sub-cluster of `cluster`, found as above.
fn every_subcluster_leader_subject(cluster: &ClusterId) -> Result<String, IdError> {
    every_subcluster(|subcluster| leader_subject(cluster, subcluster))
}

/// The subject `of` builds, with the sub-cluster token replaced by `*`.
fn every_subcluster(of: impl Fn(&SubclusterId) -> String) -> Result<String, IdError> {
    let one = of(&SubclusterId::new("a")?);
    let other = of(&SubclusterId::new("b")?);
    Ok(one
        .split('.')
        .zip(other.split('.'))
        .map(|(a, b)| if a == b { a } else { "*" })
        .collect::<Vec<_>>()
        .join("."))
}

/// What `user` may subscribe to for its replies: its own inbox prefix only, so
/// no user reads another's replies or JetStream deliveries.
fn inbox(user: &str) -> String {
    format!("{}.>", inbox_prefix(user))
}

/// The JetStream stream behind KV bucket `bucket`.
fn kv_stream(cluster: &ClusterId, bucket: Bucket) -> String {
    format!("KV_{}", bucket.name(cluster))
}

/// The JetStream stream behind object store `bucket`.
fn object_stream(cluster: &ClusterId, bucket: Bucket) -> String {
    format!("OBJ_{}", bucket.name(cluster))
}

/// What [`nats_conf`] writes users for: one cluster's sub-clusters, the nodes
/// that get users of their own, and the inter-DC copies it takes part in.
#[derive(Debug, Clone, Copy, Default)]
pub struct Deployment<'a> {
    /// The cluster.
    pub cluster: &'a str,
    /// Its sub-clusters.
    pub subclusters: &'a [&'a str],
    /// Nodes with users of their own.
    pub nodes: &'a [ListedNode<'a>],
    /// Clusters whose inter-DC masters copy from this one (this cluster is
    /// their source): each gets [`interdc::source_user`], and the gateway
    /// user [`interdc::GATEWAY_USER`] is written when there is any.
    pub copied_to: &'a [&'a str],
    /// Clusters this one's inter-DC masters copy from (this cluster is their
    /// target): each gets [`interdc::target_user`].
    pub copied_from: &'a [&'a str],
}

/// A `nats.conf` fragment (accounts and users) for `deployment`, each user's
/// password from `password` (the system account's user is `sys`); pass it to
/// every NATS node of the cluster with `-c`. A node added later gets its user by
/// a new config and a reload (`nats-server --signal reload`), or logs in as the
/// shared [`NODE_USER`].
///
/// # Errors
/// When a name is not a valid cluster, sub-cluster or node id.
pub fn nats_conf(
    deployment: &Deployment<'_>,
    mut password: impl FnMut(&str) -> String,
) -> Result<String, IdError> {
    let Deployment {
        cluster,
        subclusters,
        nodes,
        copied_to,
        copied_from,
    } = *deployment;
    let cluster = ClusterId::new(cluster)?;
    let leader = kv_stream(&cluster, Bucket::Leader);
    let registry = kv_stream(&cluster, Bucket::Registry);
    let snapshots = object_stream(&cluster, Bucket::Snapshots);
    let positions = kv_stream(&cluster, Bucket::Positions);
    let grants = kv_stream(&cluster, Bucket::Grants);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HKVM cluster \"{cluster}\": who may publish what.\nsystem_account: SYS\n\
         accounts {{\n  SYS {{ users: [ {{ user: \"sys\", password: \"{}\" }} ] }}\n  HKVM {{\n    \
         jetstream: enabled\n    users: [\n      {{ user: \"{ADMIN_USER}\", password: \"{}\" }}",
        password("sys"),
        password(ADMIN_USER)
    );
    let mut streams = Vec::new();
    for name in subclusters {
        let subcluster = SubclusterId::new(*name)?;
        let stream = stream_name(&cluster, &subcluster);
        let mut publish = vec![
            // Its own event stream and nothing else's.
            event_subject(&cluster, &subcluster),
            leader_subject(&cluster, &subcluster),
            "$JS.API.INFO".to_owned(),
            format!("$KV.{}.{subcluster}", Bucket::Leader.name(&cluster)),
            format!("$KV.{}.{subcluster}", Bucket::Registry.name(&cluster)),
            format!("$O.{}.>", Bucket::Snapshots.name(&cluster)),
            // Its standby's position; every reader's is read before a purge.
            format!("$KV.{}.{subcluster}.>", Bucket::Positions.name(&cluster)),
            // Its sub-cluster's grant key, created once.
            format!("$KV.{}.{subcluster}", Bucket::Grants.name(&cluster)),
        ];
        // Its own stream and the snapshots store whole (it updates, purges and
        // reads them); the shared KV buckets only to create, inspect and read
        // (entries are written by publishing to the keys above): no purge,
        // delete or update of what every sub-cluster shares.
        for s in [&stream, &snapshots] {
            publish.extend(stream_api(s));
        }
        for s in [&leader, &registry, &positions, &grants] {
            publish.extend(shared_bucket_api(s));
        }
        let subscribe = vec![
            inbox(&submaster_user(name)),
            submaster_rpc_subject(&cluster, &subcluster, ">"),
        ];
        let user = submaster_user(name);
        user_block(&mut out, (&user, &password(&user)), &publish, &subscribe);
        streams.push(stream);
    }
    let mut publish = vec![
        "$JS.API.INFO".to_owned(),
        "$JS.API.STREAM.NAMES".to_owned(),
        "$JS.API.STREAM.LIST".to_owned(),
        format!("$O.{}.>", Bucket::Checkpoints.name(&cluster)),
        format!("$O.{}.>", Bucket::Blooms.name(&cluster)),
        // Where its checkpoints cover each stream, so purges wait for them.
        format!("$KV.{}.*.global.>", Bucket::Positions.name(&cluster)),
        // Forwarding `get_replica_list` to the owning sub-master.
        every_subcluster_rpc_subject(&cluster, Op::GetReplicaList.name())?,
    ];
    for stream in &streams {
        publish.extend(stream_read_api(stream));
    }
    publish.extend(stream_read_api(&registry));
    publish.extend(stream_api(&positions));
    for bucket in [Bucket::Checkpoints, Bucket::Blooms] {
        publish.extend(stream_api(&object_stream(&cluster, bucket)));
    }
    let subscribe = vec![inbox(GLOBAL_USER), global_rpc_subject(&cluster, ">")];
    user_block(
        &mut out,
        (GLOBAL_USER, &password(GLOBAL_USER)),
        &publish,
        &subscribe,
    );
    let client_publish = vec![
        every_subcluster_rpc_subject(&cluster, "*")?,
        // Reading the leader lease, for the leader's direct endpoint.
        format!("$JS.API.STREAM.INFO.{leader}"),
        format!("$JS.API.DIRECT.GET.{leader}"),
        format!("$JS.API.DIRECT.GET.{leader}.>"),
    ];
    let leaders = every_subcluster_leader_subject(&cluster)?;
    user_block(
        &mut out,
        (CLIENT_USER, &password(CLIENT_USER)),
        &client_publish,
        &[inbox(CLIENT_USER), leaders.clone()],
    );
    // A node: a client that also sends its own mounts and reads (and follows)
    // the grant keys.
    for listed in nodes {
        let node = NodeId::new(listed.node)?;
        let subcluster = SubclusterId::new(listed.subcluster)?;
        let user = node_user(node.as_str());
        let mut publish = client_publish.clone();
        publish.push(submaster_node_subject(
            &cluster,
            &subcluster,
            node.as_str(),
            "*",
        ));
        // The whole grant bucket: a key's watch is an ordered consumer, whose
        // filter travels in the request body, out of the permissions' reach.
        publish.extend(stream_read_api(&grants));
        user_block(
            &mut out,
            (&user, &password(&user)),
            &publish,
            &[inbox(&user), leaders.clone()],
        );
    }
    let mut node_publish = client_publish;
    node_publish.push(every_subcluster(|subcluster| {
        submaster_node_subject(&cluster, subcluster, "*", "*")
    })?);
    node_publish.extend(stream_read_api(&grants));
    user_block(
        &mut out,
        (NODE_USER, &password(NODE_USER)),
        &node_publish,
        &[inbox(NODE_USER), leaders.clone()],
    );
    // An engine that owns its pool: its processes serve memory (the shared
    // node user's rights) and may empty the pool.
    let mut pool_admin_publish = node_publish;
    pool_admin_publish.push(every_subcluster(|subcluster| {
        submaster_admin_subject(&cluster, subcluster, "*")
    })?);
    user_block(
        &mut out,
        (POOL_ADMIN_USER, &password(POOL_ADMIN_USER)),
        &pool_admin_publish,
        &[inbox(POOL_ADMIN_USER), leaders],
    );
    let reading = interdc::Reading {
        streams: &streams,
        registry: &registry,
        snapshots: &snapshots,
        positions: &positions,
    };
    for target in copied_to {
        let target = ClusterId::new(*target)?;
        let user = interdc::source_user(&target);
        let publish = interdc::source_publish(&cluster, &reading);
        user_block(
            &mut out,
            (&user, &password(&user)),
            &publish,
            &[inbox(&user)],
        );
    }
    if !copied_to.is_empty() {
        let user = interdc::GATEWAY_USER;
        let (publish, subscribe) = interdc::gateway_rights(&cluster)?;
        let mut subscribe = subscribe;
        subscribe.insert(0, inbox(user));
        user_block(&mut out, (user, &password(user)), &publish, &subscribe);
    }
    for source in copied_from {
        let source = ClusterId::new(*source)?;
        let user = interdc::target_user(&source);
        let publish = interdc::target_publish(&cluster, &source, &reading)?;
        user_block(
            &mut out,
            (&user, &password(&user)),
            &publish,
            &[inbox(&user)],
        );
    }
    out.push_str("    ]\n  }\n}\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_admins_and_users_of_other_configs_may_administer() {
        assert!(may_administer(ADMIN_USER));
        assert!(may_administer(POOL_ADMIN_USER));
        assert!(may_administer("operator"));
        for user in [CLIENT_USER, NODE_USER, GLOBAL_USER] {
            assert!(!may_administer(user), "{user}");
        }
        assert!(!may_administer(&node_user("n1")));
        assert!(!may_administer(&submaster_user("sc-0")));
    }

    #[test]
    fn a_listed_node_may_send_its_own_operations_only_and_the_client_none() {
        let node = ListedNode {
            node: "n1",
            subcluster: "sc-0",
        };
        let deployment = Deployment {
            cluster: "prod",
            subclusters: &["sc-0"],
            nodes: &[node],
            ..Deployment::default()
        };
        let conf = nats_conf(&deployment, |user| format!("{user}-pw")).unwrap();
        let block_of = |user: &str| {
            let start = conf.find(&format!("user: \"{user}\"")).unwrap();
            let end = conf[start..].find("allow_responses").unwrap();
            conf[start..start + end].to_owned()
        };
        assert!(block_of("node-n1").contains("\"hkvm.prod.sc-0.rpc.node.n1.*\""));
        assert!(!block_of("node-n1").contains("rpc.node.*"));
        assert!(block_of(NODE_USER).contains("\"hkvm.prod.*.rpc.node.*.*\""));
        let client = block_of(CLIENT_USER);
        assert!(client.contains("\"hkvm.prod.*.rpc.*\""));
        assert!(!client.contains("rpc.node") && !client.contains("rpc.admin"));
        assert!(!client.contains("rpc.>"));
        let pool_admin = block_of(POOL_ADMIN_USER);
        assert!(pool_admin.contains("\"hkvm.prod.*.rpc.admin.*\""));
        assert!(!pool_admin.contains("$JS.API.STREAM.PURGE") && !pool_admin.contains("$JS.API.>"));
    }
}
