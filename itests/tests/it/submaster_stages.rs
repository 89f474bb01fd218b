//! The sub-master's write-stage metrics against a real nats-server: every write
//! that appends is timed once in each stage, receipt to reply.

use hkvm_submaster::metrics::WriteStage;

use crate::fixture::{poll_until, Fixture, WAIT};
use crate::submaster_server::{client, config, mount, put};

/// The count and the sum of seconds of one write stage in a metrics text.
fn stage_totals(metrics: &str, stage: &str) -> (u64, f64) {
    let value = |part: &str| {
        let prefix = format!("hkvm_submaster_write_stage_seconds_{part}{{stage=\"{stage}\"}} ");
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no {part} of stage {stage} in:\n{metrics}"))
    };
    (
        value("count").parse().unwrap(),
        value("sum").parse().unwrap(),
    )
}

#[tokio::test]
async fn every_durable_write_is_timed_in_each_of_its_stages() {
    let fixture = Fixture::new("t").await;
    let master = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    // Three mounts and two put_ends append; put_start and exist do not.
    for node in ["n1", "n2", "n3"] {
        mount(&client, node, 1 << 20).await;
    }
    put(&client, "a").await.unwrap();
    put(&client, "b").await.unwrap();
    client.exist(vec!["a".into()]).await.unwrap();
    // A reply is sent before its stages are recorded: wait for the last one.
    let metrics = poll_until("the last write's stages", WAIT, || async {
        let metrics = master.metrics_text();
        metrics
            .contains("hkvm_submaster_write_stage_seconds_count{stage=\"replied\"} 5\n")
            .then_some(metrics)
    })
    .await;
    let mut total = 0.0;
    for stage in WriteStage::ALL.map(WriteStage::name) {
        let (count, seconds) = stage_totals(&metrics, stage);
        assert_eq!(count, 5, "stage {stage}");
        total += seconds;
    }
    // Storing is a JetStream round trip: never free.
    assert!(stage_totals(&metrics, "stored").1 > 0.0);
    assert!(total > stage_totals(&metrics, "stored").1);
    master.shutdown().await.unwrap();
}
