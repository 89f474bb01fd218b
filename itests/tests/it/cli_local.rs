//! `hkvm local` as a developer runs it: it records the NATS URL it really uses
//! (an ephemeral port here, as when 4222 is busy), and `hkvm` commands given no
//! `--nats` find that cluster.

use std::time::Duration;

use crate::process::{hkvm, run, Process, Stream};

#[tokio::test]
async fn commands_without_nats_find_the_url_hkvm_local_recorded() {
    let cluster = format!("rec{}", std::process::id());
    let local = Process::hkvm(
        "hkvm local",
        &[
            "local",
            "--cluster",
            &cluster,
            "--port",
            "0",
            "--no-demo",
            "--node-mib",
            "64",
        ],
        "warn",
    )
    .await;
    let recorded = local
        .wait_for_line(
            Stream::Stdout,
            "use it without --nats",
            Duration::from_secs(120),
        )
        .await;
    local
        .wait_for_line(Stream::Stdout, "Press Ctrl-C", Duration::from_secs(60))
        .await;
    let mut status = hkvm(["status", "--cluster", &cluster]).await;
    status.env_remove("HKVM_NATS_URL");
    let ran = run(status).await;
    assert!(
        ran.success(),
        "{recorded}\nstatus without --nats failed:\n{}\n{}",
        ran.stdout,
        ran.stderr
    );
    assert!(
        ran.stdout.contains("sc-0") && ran.stdout.contains("sc-1"),
        "{}",
        ran.stdout
    );
}
