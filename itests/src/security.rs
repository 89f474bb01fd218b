//! The NATS authorization of an HKVM deployment: one user per sub-master that may
//! write only its own event stream, lease, registry entry and snapshots; one user
//! for global masters that reads streams and writes only its own checkpoints; one
//! user for nodes and clients that may only send RPC requests. `docs/security.md`
//! shows the output of [`nats_conf`] and a test keeps the two identical.

use std::fmt::Write as _;

/// The password of a user in the generated config (tests only: a deployment sets
/// real secrets or uses NKeys/JWTs with the same permissions).
pub fn password(user: &str) -> String {
    format!("{user}-secret")
}

/// The user name of a sub-cluster's sub-masters.
pub fn submaster_user(subcluster: &str) -> String {
    format!("sm-{subcluster}")
}

/// The global masters' user.
pub const GLOBAL_USER: &str = "global";
/// The nodes' and clients' user.
pub const CLIENT_USER: &str = "client";
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

/// Read-only access to a stream: info, message reads, and consumers on it.
fn stream_read_api(stream: &str) -> Vec<String> {
    let mut subjects = vec![
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
    ];
    subjects.extend(stream_consume_api(stream));
    subjects
}

fn user_block(out: &mut String, user: &str, publish: &[String], subscribe: &[String]) {
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
        password(user),
        list(publish),
        list(subscribe),
    );
}

/// A `nats.conf` fragment (accounts and users) for cluster `cluster` with these
/// sub-clusters; pass it to every NATS node with `-c`.
pub fn nats_conf(cluster: &str, subclusters: &[&str]) -> String {
    let leader = format!("KV_hkvm_{cluster}_leader");
    let registry = format!("KV_hkvm_{cluster}_registry");
    let snapshots = format!("OBJ_hkvm_{cluster}_snapshots");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HKVM cluster \"{cluster}\": who may publish what.\nsystem_account: SYS\n\
         accounts {{\n  SYS {{ users: [ {{ user: \"sys\", password: \"{}\" }} ] }}\n  HKVM {{\n    \
         jetstream: enabled\n    users: [\n      {{ user: \"{ADMIN_USER}\", password: \"{}\" }}",
        password("sys"),
        password(ADMIN_USER)
    );
    for subcluster in subclusters {
        let stream = format!("HKVM_{cluster}_{subcluster}");
        let mut publish = vec![
            // Its own event stream and nothing else's.
            format!("hkvm.{cluster}.{subcluster}.ev"),
            "$JS.API.INFO".to_owned(),
            format!("$KV.hkvm_{cluster}_leader.{subcluster}"),
            format!("$KV.hkvm_{cluster}_registry.{subcluster}"),
            format!("$O.hkvm_{cluster}_snapshots.>"),
        ];
        for s in [&stream, &leader, &registry, &snapshots] {
            publish.extend(stream_api(s));
        }
        let subscribe = vec![
            "_INBOX.>".to_owned(),
            format!("hkvm.{cluster}.{subcluster}.rpc.>"),
        ];
        user_block(&mut out, &submaster_user(subcluster), &publish, &subscribe);
    }
    let mut publish = vec![
        "$JS.API.INFO".to_owned(),
        "$JS.API.STREAM.NAMES".to_owned(),
        "$JS.API.STREAM.LIST".to_owned(),
        format!("$O.hkvm_{cluster}_checkpoints.>"),
        format!("$O.hkvm_{cluster}_blooms.>"),
        // Forwarding `get_replica_list` to the owning sub-master.
        format!("hkvm.{cluster}.*.rpc.get_replica_list"),
    ];
    for subcluster in subclusters {
        publish.extend(stream_read_api(&format!("HKVM_{cluster}_{subcluster}")));
    }
    publish.extend(stream_read_api(&registry));
    for purpose in ["checkpoints", "blooms"] {
        publish.extend(stream_api(&format!("OBJ_hkvm_{cluster}_{purpose}")));
    }
    let subscribe = vec![
        "_INBOX.>".to_owned(),
        format!("hkvm.{cluster}.global.rpc.>"),
    ];
    user_block(&mut out, GLOBAL_USER, &publish, &subscribe);
    user_block(
        &mut out,
        CLIENT_USER,
        &[format!("hkvm.{cluster}.*.rpc.*")],
        &["_INBOX.>".to_owned()],
    );
    out.push_str("    ]\n  }\n}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::nats_conf;

    /// docs/security.md shows the config this module generates, verbatim.
    #[test]
    fn the_documented_config_is_the_generated_one() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md"))
                .unwrap_or_default();
        let generated = nats_conf("prod", &["sc-0", "sc-1"]);
        assert!(
            doc.contains(&generated),
            "docs/security.md must contain the output of nats_conf(\"prod\", [\"sc-0\", \"sc-1\"]):\n{generated}"
        );
    }
}
