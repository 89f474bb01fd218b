//! Finding the binary through `$HKVM_NATS_SERVER`, and what a start reports when
//! that binary is no nats-server. One test, since it sets the process environment.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use hkvm_natsd::{find_nats_server, NatsServer, NatsdError, ServerOptions, ToolsDir};

#[tokio::test]
async fn the_env_var_wins_and_a_binary_that_exits_is_reported_with_its_log() {
    let dir = tempfile::tempdir().unwrap();

    let missing = dir.path().join("missing");
    std::env::set_var(hkvm_natsd::NATS_SERVER_ENV, &missing);
    let error = find_nats_server(ToolsDir::default()).unwrap_err();
    assert!(matches!(&error, NatsdError::NotAFile(path) if *path == missing));
    assert!(error.to_string().contains("which is not a file"), "{error}");

    let fake = dir.path().join("nats-server");
    std::fs::write(&fake, "#!/bin/sh\necho 'no config for you' >&2\nexit 3\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::env::set_var(hkvm_natsd::NATS_SERVER_ENV, &fake);
    assert_eq!(find_nats_server(ToolsDir::AboveExecutable).unwrap(), fake);
    let error = NatsServer::start_with(ServerOptions {
        name: "hkvm-fake".to_owned(),
        ready_timeout: Duration::from_secs(10),
        ..ServerOptions::default()
    })
    .await
    .unwrap_err();
    match &error {
        NatsdError::Exited { name, log_tail, .. } => {
            assert_eq!(name, "hkvm-fake");
            assert!(log_tail.contains("no config for you"), "{log_tail}");
        }
        other => panic!("expected an early exit, got {other}"),
    }
}
