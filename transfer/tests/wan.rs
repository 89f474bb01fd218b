#![allow(clippy::unwrap_used)]
//! WAN copies over the in-process lossy link, on tokio's paused clock: FEC repairs
//! losses within its capacity, whole stripes are sent again beyond it, and the
//! sender keeps to its bandwidth cap.

use std::time::Duration;

use hkvm_transfer::wan::{
    lossy_link, FecConfig, LinkConfig, LinkRx, LinkTx, ReceiveReport, SendReport, WanConfig,
    WanReceiver, WanSender,
};
use hkvm_transfer::ErrorKind;
use tokio::time::Instant;

fn object(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
        .collect()
}

type Ends = (WanSender<LinkTx, LinkRx>, WanReceiver<LinkTx, LinkRx>);

fn ends(config: WanConfig, forward: LinkConfig, back: LinkConfig) -> Ends {
    let (data_tx, data_rx) = lossy_link(forward).unwrap();
    let (feedback_tx, feedback_rx) = lossy_link(back).unwrap();
    (
        WanSender::new(config, data_tx, feedback_rx).unwrap(),
        WanReceiver::new(config, data_rx, feedback_tx).unwrap(),
    )
}

async fn copy(
    config: WanConfig,
    forward: LinkConfig,
    back: LinkConfig,
    value: &[u8],
) -> (SendReport, ReceiveReport) {
    let (mut sender, mut receiver) = ends(config, forward, back);
    let (sent, received) = tokio::join!(sender.send(value), receiver.receive());
    let (bytes, received) = received.unwrap();
    assert!(bytes == value, "the copy differs");
    (sent.unwrap(), received)
}

#[tokio::test(start_paused = true)]
async fn fec_repairs_losses_within_its_capacity_without_retransmission() {
    let config = WanConfig {
        fec: FecConfig {
            data_shards: 16,
            parity_shards: 4,
            shard_bytes: 1024,
        },
        ..WanConfig::default()
    };
    let forward = LinkConfig {
        loss: 0.02,
        seed: 7,
        ..LinkConfig::default()
    };
    let value = object(2 << 20);
    let (sent, received) = copy(config, forward, LinkConfig::default(), &value).await;
    assert_eq!(sent.stripes, 128);
    assert_eq!(sent.rounds, 1);
    assert_eq!(sent.stripes_retransmitted, 0);
    assert!(received.fec_recoveries > 0, "{received:?}");
    assert!(received.stripes_recovered > 0);
    assert_eq!(received.nacks, 0);
}

#[tokio::test(start_paused = true)]
async fn heavy_loss_retransmits_whole_stripes_until_byte_exact() {
    let config = WanConfig {
        fec: FecConfig {
            data_shards: 8,
            parity_shards: 2,
            shard_bytes: 512,
        },
        ..WanConfig::default()
    };
    let forward = LinkConfig {
        loss: 0.25,
        jitter: Duration::from_millis(10),
        seed: 11,
        ..LinkConfig::default()
    };
    let back = LinkConfig {
        loss: 0.2,
        seed: 12,
        ..LinkConfig::default()
    };
    // An object whose last stripe is short, to exercise padding.
    let value = object(300_001);
    let (sent, received) = copy(config, forward, back, &value).await;
    assert!(sent.rounds > 1, "{sent:?}");
    assert!(sent.stripes_retransmitted > 0);
    assert!(received.fec_recoveries > 0);
    assert!(received.nacks > 0);
}

#[tokio::test(start_paused = true)]
async fn the_sender_keeps_to_its_bandwidth_cap() {
    let config = WanConfig {
        rate_bytes_per_sec: 1_000_000,
        burst_bytes: 16 * 1024,
        ..WanConfig::default()
    };
    let (mut sender, mut receiver) = ends(config, LinkConfig::default(), LinkConfig::default());
    let value = object(1 << 20);
    let start = Instant::now();
    let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
    let sent = sent.unwrap();
    assert!(received.unwrap().0 == value);
    // Token accounting: every byte on the wire went through the bucket...
    assert_eq!(sender.pacer().granted(), sent.wire_bytes);
    assert!(sender.pacer().waits() > 0);
    // ...so on the virtual clock the copy cannot have beaten the cap.
    let elapsed = start.elapsed().as_secs_f64();
    let allowed = config.burst_bytes as f64 + config.rate_bytes_per_sec as f64 * elapsed;
    assert!(
        sent.wire_bytes as f64 <= allowed,
        "{} > {allowed}",
        sent.wire_bytes
    );
    // The recovery shards and headers are the overhead: 16 + 4 shards of 1 KiB.
    assert!(sent.wire_bytes > value.len() as u64 * 20 / 16);
}

#[tokio::test(start_paused = true)]
async fn a_dead_link_is_a_typed_error_not_a_hang() {
    let config = WanConfig {
        max_rounds: 3,
        idle_timeout: Duration::from_secs(5),
        ..WanConfig::default()
    };
    let forward = LinkConfig {
        loss: 1.0,
        ..LinkConfig::default()
    };
    let (mut sender, mut receiver) = ends(config, forward, LinkConfig::default());
    let value = object(100_000);
    let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
    assert_eq!(sent.unwrap_err().kind(), ErrorKind::Timeout);
    assert_eq!(received.unwrap_err().kind(), ErrorKind::Timeout);
}

#[tokio::test(start_paused = true)]
async fn empty_and_consecutive_objects_arrive() {
    let (mut sender, mut receiver) = ends(
        WanConfig::default(),
        LinkConfig::default(),
        LinkConfig::default(),
    );
    for len in [0usize, 1, 16 * 1024, 50_000] {
        let value = object(len);
        let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
        sent.unwrap();
        assert_eq!(received.unwrap().0, value);
    }
}

#[tokio::test(start_paused = true)]
async fn corrupted_packets_are_dropped_and_repaired() {
    let forward = LinkConfig {
        loss: 0.01,
        corrupt: 0.02,
        seed: 21,
        ..LinkConfig::default()
    };
    let back = LinkConfig {
        corrupt: 0.1,
        seed: 22,
        ..LinkConfig::default()
    };
    let (mut sender, mut receiver) = ends(WanConfig::default(), forward, back);
    let value = object(1 << 20);
    let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
    sent.unwrap();
    let (bytes, report) = received.unwrap();
    assert!(bytes == value);
    assert!(report.corrupt > 0, "{report:?}");
    assert!(report.fec_recoveries >= report.corrupt);
}
