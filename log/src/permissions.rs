//! The NATS authorization of an HKVM deployment: one user per sub-master that may
//! write only its own event stream, lease, registry entry and snapshots; one user
//! for global masters that reads streams and writes only its own checkpoints; one
//! user for clients that may only send RPC requests and read the leader lease
//! (where the leader takes direct requests); one user for nodes with a client's
//! rights that may also read the data-port grant keys. Every user subscribes under
//! its own inbox prefix only. `docs/security.md` shows the output of [`nats_conf`]
//! (with the test passwords of `hkvm-itests`) and a test keeps the two identical;
//! `hkvm local --secure` runs its cluster under it with random passwords.

use std::fmt::Write as _;

use hkvm_events::rpc::submaster::Op;
use hkvm_events::subject::{
    event_subject, global_rpc_subject, inbox_prefix, leader_subject, stream_name,
    submaster_rpc_subject, Bucket,
};
use hkvm_events::{ClusterId, IdError, SubclusterId};

/// The user name of a sub-cluster's sub-masters.
pub fn submaster_user(subcluster: &str) -> String {
    format!("sm-{subcluster}")
}

/// The global masters' user.
pub const GLOBAL_USER: &str = "global";
/// The clients' user.
pub const CLIENT_USER: &str = "client";
/// The nodes' user (real clients: they serve a segment, so they read the grant
/// keys their data ports check).
pub const NODE_USER: &str = "node";
/// The operators' user (creates nothing at runtime; `hkvm replay`, repairs).
pub const ADMIN_USER: &str = "admin";

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

/// A `nats.conf` fragment (accounts and users) for cluster `cluster` with these
/// sub-clusters, each user's password from `password` (the system account's
/// user is `sys`); pass it to every NATS node with `-c`.
///
/// # Errors
/// When a name is not a valid cluster or sub-cluster id.
pub fn nats_conf(
    cluster: &str,
    subclusters: &[&str],
    mut password: impl FnMut(&str) -> String,
) -> Result<String, IdError> {
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
    // A node: a client that also reads (and follows) the grant keys.
    let mut node_publish = client_publish;
    node_publish.extend(stream_read_api(&grants));
    user_block(
        &mut out,
        (NODE_USER, &password(NODE_USER)),
        &node_publish,
        &[inbox(NODE_USER), leaders],
    );
    out.push_str("    ]\n  }\n}\n");
    Ok(out)
}
