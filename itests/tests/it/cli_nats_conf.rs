//! `hkvm nats-conf` writes the users of a deployment as a config a nats-server
//! runs, their passwords in a file only its owner may read; run again for one
//! more node, it keeps every other user's password.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;

use hkvm_testkit::{NatsServer, ServerOptions};

use crate::process::run_hkvm;

/// The `<user> <password>` lines of a passwords file.
fn passwords(path: &std::path::Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split_once(' '))
        .map(|(user, password)| (user.to_owned(), password.to_owned()))
        .collect()
}

#[tokio::test]
async fn the_config_runs_and_one_more_node_keeps_every_other_password() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("passwords");
    let conf = dir.path().join("nats.conf");
    let (file_arg, conf_arg) = (file.to_str().unwrap(), conf.to_str().unwrap());
    let base = [
        "nats-conf",
        "--cluster",
        "prod",
        "--subcluster",
        "sc-0,sc-1",
        "--node",
        "n1@sc-0",
        "--passwords",
        file_arg,
        "--out",
        conf_arg,
    ];
    let first = run_hkvm(&base).await;
    assert!(first.success(), "{}", first.stderr);
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the passwords file is its owner's alone");
    let before = passwords(&file);
    for user in [
        "admin",
        "client",
        "node",
        "node-n1",
        "pool-admin",
        "sm-sc-0",
        "sm-sc-1",
    ] {
        assert!(before.contains_key(user), "{user} has a password");
    }

    // A nats-server runs it: the client logs in with its password, nobody
    // without one.
    let server = NatsServer::start_with(ServerOptions {
        extra_config: std::fs::read_to_string(&conf).unwrap(),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let client_url = server.url().replacen(
        "nats://",
        &format!("nats://client:{}@", before["client"]),
        1,
    );
    hkvm_client::connect::connect(&client_url, "test")
        .await
        .expect("the client logs in with its password");
    assert!(
        server.connect().await.is_err(),
        "an anonymous login is refused"
    );

    // One more node: every user keeps its password, the new node gets one.
    let mut again = base.to_vec();
    again.extend(["--node", "n2@sc-1"]);
    let second = run_hkvm(&again).await;
    assert!(second.success(), "{}", second.stderr);
    let after = passwords(&file);
    for (user, password) in &before {
        assert_eq!(after.get(user), Some(password), "{user} kept its password");
    }
    assert!(after.contains_key("node-n2"));
    let regenerated = std::fs::read_to_string(&conf).unwrap();
    assert!(regenerated.contains("\"hkvm.prod.sc-1.rpc.node.n2.*\""));

    let refused = run_hkvm(&[
        "nats-conf",
        "--cluster",
        "prod",
        "--subcluster",
        "sc-0",
        "--node",
        "n1",
        "--passwords",
        file_arg,
    ])
    .await;
    assert!(
        !refused.success(),
        "a node without its sub-cluster is refused"
    );
}
