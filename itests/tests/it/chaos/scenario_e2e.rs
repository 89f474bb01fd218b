//! Scenario 1: end to end. Puts in both sub-clusters (through nodes in other
//! containers), every acknowledged value read back byte-exact in its own
//! sub-cluster and from the other one (through the global master), nothing revoked
//! visible, and labels honoured by `batch_is_exist`.

use hkvm_events::rpc::global::LabelMode;

use super::topology::{Spec, Topology};
use super::{global, loadgen, report};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_within_and_across_subclusters() {
    let Some(scenario) = report::Scenario::start("1 end to end") else {
        return;
    };
    let topology = Topology::start(&Spec::default()).await;
    let (a, b) = tokio::join!(
        loadgen::puts(&topology, "sc-0", "e2e-a", 4, "2s"),
        loadgen::puts(&topology, "sc-1", "e2e-b", 4, "2s"),
    );
    let (a, b) = tokio::join!(a.finish_puts(), b.finish_puts());
    let keys = |run: &loadgen::PutRun| run.acked.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    let (keys_a, keys_b) = (keys(&a), keys(&b));
    assert!(
        keys_a.len() > 20 && keys_b.len() > 20,
        "{} / {}",
        a.summary,
        b.summary
    );
    assert!(
        a.failed.is_empty() && b.failed.is_empty() && a.uncertain.is_empty(),
        "no put fails without faults"
    );
    let absent_a: Vec<String> = a.revoked.iter().chain(&a.failed).cloned().collect();

    // Within each sub-cluster, then across: sc-1 reads sc-0's keys and vice versa.
    let global = global::client(&topology, 0).await;
    let caught_up =
        global::wait_all_held(&global, &[keys_a.clone(), keys_b.clone()].concat()).await;
    let local_a = loadgen::verify(&topology, "sc-0", &keys_a, &absent_a).await;
    let local_b = loadgen::verify(&topology, "sc-1", &keys_b, &b.revoked).await;
    let cross_a = loadgen::verify(&topology, "sc-1", &keys_a, &[]).await;
    let cross_b = loadgen::verify(&topology, "sc-0", &keys_b, &[]).await;
    loadgen::assert_verified(&local_a, keys_a.len());
    loadgen::assert_verified(&local_b, keys_b.len());
    loadgen::assert_verified(&cross_a, keys_a.len());
    loadgen::assert_verified(&cross_b, keys_b.len());

    // Labels: sc-0 is zone=a, sc-1 zone=b.
    let probe = vec![keys_a[0].clone(), keys_b[0].clone(), "nowhere".to_owned()];
    let all = global::holders(&global, &probe, None).await;
    assert_eq!(
        all,
        vec![vec!["sc-0".to_owned()], vec!["sc-1".to_owned()], vec![]]
    );
    let hard_b = global::holders(
        &global,
        &probe,
        global::labels("zone", "b", LabelMode::Hard),
    )
    .await;
    assert_eq!(
        hard_b,
        vec![vec![], vec!["sc-1".to_owned()], vec![]],
        "a hard partition never crosses"
    );
    let soft_b = global::holders(
        &global,
        &probe,
        global::labels("zone", "b", LabelMode::Soft),
    )
    .await;
    assert_eq!(
        soft_b[0],
        vec!["sc-0".to_owned()],
        "a soft label still answers from elsewhere"
    );
    let revoked = global::holders(&global, &a.revoked, None).await;
    assert!(
        revoked.iter().all(Vec::is_empty),
        "a revoked put is nowhere"
    );

    scenario.passed(
        &format!("index caught up in {} ms", caught_up.as_millis()),
        0,
        &format!(
            "{} + {} puts read back locally and across",
            keys_a.len(),
            keys_b.len()
        ),
    );
}
