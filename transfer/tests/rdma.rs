//! The RDMA backend on a real device: nodes and clients are `RdmaTransport`s of one
//! process on the device named by `HKVM_RDMA_DEVICE` (`ibv_devices` lists them; with
//! soft-RoCE, `rdma link add rxe0 type rxe netdev eth0` and `HKVM_RDMA_DEVICE=rxe0`).
//! RoCE v2 needs the index of an IPv4-mapped GID in `HKVM_RDMA_GID_INDEX`
//! (`ibv_devinfo -v`; default 0). The tests are `#[ignore]`d, so a run without a
//! device reports them as skipped; `scripts/test` runs them (`--run-ignored only`)
//! when `HKVM_RDMA_DEVICE` is set, and one run by hand without it fails rather than
//! pass. Device-free coverage of the backend is in the unit tests of
//! `transfer/src/rdma/`.

#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use hkvm_transfer::rdma::{RdmaConfig, RdmaTransport};
use hkvm_transfer::{ErrorKind, ReadOp, RegionId, Segment, ServerHandle, Transport, WriteOp};
use tokio::net::TcpListener;

/// The device's config from the environment; a test asked to run without one
/// fails (they are ignored unless a device is named).
fn device(test: &str) -> RdmaConfig {
    let name = std::env::var("HKVM_RDMA_DEVICE")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| {
            panic!(
                "{test} needs an RDMA device: set HKVM_RDMA_DEVICE=<device, e.g. mlx5_0 or rxe0>"
            )
        });
    let gid_index = std::env::var("HKVM_RDMA_GID_INDEX")
        .ok()
        .and_then(|index| index.parse().ok())
        .unwrap_or(0);
    RdmaConfig {
        device: Some(name),
        gid_index,
        ..RdmaConfig::default()
    }
}

/// A node serving the given regions of `size` bytes each on 127.0.0.1.
async fn node(
    config: &RdmaConfig,
    regions: &[&str],
    size: u64,
) -> (RdmaTransport, ServerHandle, String) {
    let transport = RdmaTransport::open(config.clone()).unwrap();
    for region in regions {
        let segment = Segment::allocate(RegionId::new(*region).unwrap(), size).unwrap();
        transport.register(segment).unwrap();
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = transport.serve(listener).unwrap();
    let endpoint = server.local_addr().to_string();
    (transport, server, endpoint)
}

/// A client whose small staging buffers make large ops take several rounds.
fn client(config: &RdmaConfig, staging_buffers: usize) -> RdmaTransport {
    RdmaTransport::open(RdmaConfig {
        staging_bytes: 64 * 1024,
        staging_buffers,
        queue_depth: 8,
        ..config.clone()
    })
    .unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_writes_and_reads_round_trip_across_rounds() {
    let config = device("device_writes_and_reads_round_trip_across_rounds");
    let (_node, _server, endpoint) = node(&config, &["seg"], 16 << 20).await;
    let client = client(&config, 2);
    let sizes = [1usize, 4096, 100_000, 1 << 20];
    let values: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| pattern(i as u64, len))
        .collect();
    let offsets: Vec<u64> = (0..sizes.len() as u64).map(|i| i * (2 << 20)).collect();
    let writes: Vec<WriteOp<'_>> = values
        .iter()
        .zip(&offsets)
        .map(|(value, &offset)| WriteOp {
            grant: &[],
            region: "seg",
            offset,
            data: value,
        })
        .collect();
    client.write_batch(&endpoint, &writes).await.unwrap();
    let reads: Vec<ReadOp<'_>> = sizes
        .iter()
        .zip(&offsets)
        .map(|(&len, &offset)| ReadOp {
            grant: &[],
            region: "seg",
            offset,
            len: len as u64,
        })
        .collect();
    let got = client.read_batch(&endpoint, &reads).await.unwrap();
    for (value, got) in values.iter().zip(&got) {
        assert_eq!(&got[..], &value[..]);
    }
    let outside = [ReadOp {
        grant: &[],
        region: "seg",
        offset: (16 << 20) - 1,
        len: 2,
    }];
    let error = client.read_batch(&endpoint, &outside).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::OutOfBounds);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_concurrent_batches_each_get_their_own_bytes() {
    let config = device("device_concurrent_batches_each_get_their_own_bytes");
    let (_node, _server, endpoint) = node(&config, &["seg"], 16 << 20).await;
    // Sixteen batches over four staging buffers.
    let client = Arc::new(client(&config, 4));
    let mut tasks = Vec::new();
    for batch in 0..16u64 {
        let client = Arc::clone(&client);
        let endpoint = endpoint.clone();
        tasks.push(tokio::spawn(async move {
            let value = pattern(batch, 300_000);
            let offset = batch * (512 << 10);
            let write = [WriteOp {
                grant: &[],
                region: "seg",
                offset,
                data: &value,
            }];
            client.write_batch(&endpoint, &write).await.unwrap();
            let read = [ReadOp {
                grant: &[],
                region: "seg",
                offset,
                len: value.len() as u64,
            }];
            let got = client.read_batch(&endpoint, &read).await.unwrap();
            assert_eq!(&got[0][..], &value[..], "batch {batch}");
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .unwrap()
            .unwrap();
    }
}

/// A batch to node A fails at the NIC (A deregistered the region after the client
/// connected) and its remaining requests are flushed; the batch to node B that
/// starts right after polls the same completion queue and must not take A's
/// flushes for its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_a_failed_batch_fails_alone() {
    let config = device("device_a_failed_batch_fails_alone");
    let (node_a, _server_a, endpoint_a) = node(&config, &["a"], 8 << 20).await;
    let (_node_b, _server_b, endpoint_b) = node(&config, &["b"], 8 << 20).await;
    let client = client(&config, 2);
    let value = pattern(1, 4 << 20);
    // 4 KiB ops: eight requests per round (the queue depth), so a failed request is
    // followed by flushed ones.
    let write_a: Vec<WriteOp<'_>> = value
        .chunks(4096)
        .enumerate()
        .map(|(i, chunk)| WriteOp {
            grant: &[],
            region: "a",
            offset: i as u64 * 4096,
            data: chunk,
        })
        .collect();
    client.write_batch(&endpoint_a, &write_a).await.unwrap();
    // The client still holds A's old rkey.
    node_a.unregister(&RegionId::new("a").unwrap()).unwrap();
    let error = client.write_batch(&endpoint_a, &write_a).await.unwrap_err();
    assert!(
        matches!(error.kind(), ErrorKind::Rdma | ErrorKind::Disconnected),
        "{error}"
    );
    let write_b = [WriteOp {
        grant: &[],
        region: "b",
        offset: 0,
        data: &value,
    }];
    client.write_batch(&endpoint_b, &write_b).await.unwrap();
    let read_b = [ReadOp {
        grant: &[],
        region: "b",
        offset: 0,
        len: value.len() as u64,
    }];
    let got = client.read_batch(&endpoint_b, &read_b).await.unwrap();
    assert_eq!(&got[0][..], &value[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_registered_caller_memory_moves_without_staging() {
    let config = device("device_registered_caller_memory_moves_without_staging");
    let (_node, _server, endpoint) = node(&config, &["seg"], 4 << 20).await;
    let client = client(&config, 1);
    let mut source = pattern(5, 1 << 20);
    let mut sink = vec![0u8; 1 << 20];
    // SAFETY: both vectors outlive their registrations (unregistered below).
    unsafe {
        client
            .register_local(source.as_mut_ptr(), source.len())
            .unwrap();
        client
            .register_local(sink.as_mut_ptr(), sink.len())
            .unwrap();
    }
    let before = client.staging_stats();
    let write = [WriteOp {
        grant: &[],
        region: "seg",
        offset: 4096,
        data: &source,
    }];
    client.write_batch(&endpoint, &write).await.unwrap();
    let mut read = [hkvm_transfer::ReadInto {
        grant: &[],
        region: "seg",
        offset: 4096,
        buf: &mut sink,
    }];
    client.read_batch_into(&endpoint, &mut read).await.unwrap();
    assert_eq!(sink, source);
    assert_eq!(
        client.staging_stats(),
        before,
        "no staging buffer was checked out or created"
    );
    assert!(client.unregister_local(source.as_mut_ptr()));
    assert!(client.unregister_local(sink.as_mut_ptr()));
    assert!(!client.unregister_local(sink.as_mut_ptr()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set HKVM_RDMA_DEVICE"]
async fn device_a_region_registered_after_connecting_is_reached_through_its_descriptor() {
    let config =
        device("device_a_region_registered_after_connecting_is_reached_through_its_descriptor");
    let (node, _server, endpoint) = node(&config, &["first"], 1 << 20).await;
    let client = client(&config, 1);
    let value = pattern(9, 10_000);
    let first = [WriteOp {
        grant: &[],
        region: "first",
        offset: 0,
        data: &value,
    }];
    client.write_batch(&endpoint, &first).await.unwrap();
    let late = Segment::allocate(RegionId::new("late").unwrap(), 1 << 20).unwrap();
    node.register(late).unwrap();
    let late_write = [WriteOp {
        grant: &[],
        region: "late",
        offset: 100,
        data: &value,
    }];
    let error = client
        .write_batch(&endpoint, &late_write)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::UnknownRegion, "{error}");
    // What the node's segment descriptor advertises for it.
    let advert = node.served_region(&RegionId::new("late").unwrap()).unwrap();
    client.learn_region(&endpoint, advert);
    client.write_batch(&endpoint, &late_write).await.unwrap();
    let got = client
        .read_batch(
            &endpoint,
            &[ReadOp {
                grant: &[],
                region: "late",
                offset: 100,
                len: value.len() as u64,
            }],
        )
        .await
        .unwrap();
    assert_eq!(&got[0][..], &value[..]);
}
