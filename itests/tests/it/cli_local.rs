//! `hkvm local` as a developer runs it: it records the NATS URL it really uses
//! (an ephemeral port here, as when 4222 is busy), and `hkvm` commands given no
//! `--nats` find that cluster; its nats-server runs the durability profile asked
//! for (`--durable`: every JetStream write fsynced, as nats-server's `/varz` says;
//! `--secure`: one NATS user per role, and no anonymous login).

use std::time::Duration;

use crate::fixture::http_get;
use crate::process::{hkvm, run, Process, Stream};

/// Starts `hkvm local` for `cluster` with `extra` arguments; returns it with its
/// stdout up to "Press Ctrl-C" (everything is up).
async fn local(cluster: &str, extra: &[&str]) -> (Process, String) {
    let mut args = vec![
        "local",
        "--cluster",
        cluster,
        "--port",
        "0",
        "--metrics-base-port",
        "0",
        "--no-demo",
        "--node-mib",
        "64",
    ];
    args.extend_from_slice(extra);
    let local = Process::hkvm("hkvm local", &args, "warn").await;
    local
        .wait_for_line(Stream::Stdout, "Press Ctrl-C", Duration::from_secs(120))
        .await;
    let stdout = local.stdout();
    (local, stdout)
}

/// Whether the nats-server whose monitoring URL `hkvm local` printed fsyncs every
/// JetStream write.
fn syncs_always(stdout: &str) -> bool {
    let port = stdout
        .split("(monitoring http://127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|port| port.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no monitoring URL in:\n{stdout}"));
    let varz = http_get(port, "/varz");
    assert!(varz.contains("\"jetstream\""), "{varz}");
    varz.contains("\"sync_always\": true")
}

#[tokio::test]
async fn commands_without_nats_find_the_url_hkvm_local_recorded() {
    let cluster = format!("rec{}", std::process::id());
    let (_local, stdout) = local(&cluster, &[]).await;
    assert!(stdout.contains("use it without --nats"), "{stdout}");
    assert!(!syncs_always(&stdout), "the default profile");
    let mut status = hkvm(["status", "--cluster", &cluster]).await;
    status.env_remove("HKVM_NATS_URL");
    let ran = run(status).await;
    assert!(
        ran.success(),
        "{stdout}\nstatus without --nats failed:\n{}\n{}",
        ran.stdout,
        ran.stderr
    );
    assert!(
        ran.stdout.contains("sc-0") && ran.stdout.contains("sc-1"),
        "{}",
        ran.stdout
    );
}

#[tokio::test]
async fn durable_starts_a_nats_server_that_fsyncs_every_write() {
    let cluster = format!("dur{}", std::process::id());
    let (_local, stdout) = local(&cluster, &["--durable"]).await;
    assert!(stdout.contains("durability:    durable"), "{stdout}");
    assert!(syncs_always(&stdout), "the durable profile");
}

/// The URL `hkvm local --secure` printed for `role` (`clients`, `nodes`).
fn printed_url(stdout: &str, role: &str) -> String {
    stdout
        .lines()
        .find_map(|line| line.trim().strip_prefix(&format!("{role}:")))
        .map(|url| url.trim().to_owned())
        .unwrap_or_else(|| panic!("no {role} URL in:\n{stdout}"))
}

#[tokio::test]
async fn secure_runs_every_service_under_its_role_and_refuses_anonymous_logins() {
    let cluster = format!("sec{}", std::process::id());
    let (_local, stdout) = local(&cluster, &["--secure"]).await;
    let client_url = printed_url(&stdout, "clients");
    assert!(client_url.starts_with("nats://client:"), "{client_url}");
    assert!(printed_url(&stdout, "nodes").starts_with("nats://node:"));

    // Every service started under its role (the nodes mounted, so they read the
    // grant key), and a client puts and gets through them with its credential.
    let dir = tempfile::tempdir().unwrap();
    let value = dir.path().join("value");
    std::fs::write(&value, b"secured bytes").unwrap();
    let value = value.to_str().unwrap();
    // `hkvm <op> --nats <client url> --cluster <cluster> --subcluster sc-0 <rest>`.
    let as_client = |op: &'static str, rest: Vec<String>| {
        let mut args = vec![op.to_owned(), "--nats".into(), client_url.clone()];
        args.extend([
            "--cluster".into(),
            cluster.clone(),
            "--subcluster".into(),
            "sc-0".into(),
        ]);
        args.extend(rest);
        async move { run(hkvm(args).await).await }
    };
    let put = as_client("put", vec!["k".into(), value.into()]).await;
    assert!(put.success(), "{stdout}\nput failed:\n{}", put.stderr);
    let get = as_client("get", vec!["k".into()]).await;
    assert!(get.success(), "get failed:\n{}", get.stderr);
    assert_eq!(get.stdout, "secured bytes");

    // The recorded URL is the operator's: `hkvm status` reads the registry.
    let mut status = hkvm(["status", "--cluster", &cluster]).await;
    status.env_remove("HKVM_NATS_URL");
    let ran = run(status).await;
    assert!(
        ran.success() && ran.stdout.contains("sc-1"),
        "{}\n{}",
        ran.stdout,
        ran.stderr
    );

    // Without credentials nothing gets in.
    let anonymous = stdout
        .lines()
        .find_map(|line| line.trim().strip_prefix("NATS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no NATS URL in:\n{stdout}"));
    assert!(async_nats::connect(anonymous).await.is_err(), "{anonymous}");
}
