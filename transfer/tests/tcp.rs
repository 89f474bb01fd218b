#![allow(clippy::unwrap_used)]
//! The TCP backend end to end: an in-process server on 127.0.0.1:0 and a client.

use std::sync::Arc;
use std::time::Duration;

use hkvm_transfer::frame::{self, Op, Request, Response, RESPONSE_LEN};
use hkvm_transfer::{
    Admission, AdmitAll, Asked, ErrorKind, ReadInto, ReadOp, RegionId, Segment, ServerHandle,
    TcpConfig, TcpTransport, TransferError, Transport, WriteOp,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use xxhash_rust::xxh3::xxh3_64;

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn read_op(offset: u64, len: u64) -> ReadOp<'static> {
    ReadOp {
        grant: &[],
        region: "seg",
        offset,
        len,
    }
}

fn write_op(offset: u64, data: &[u8]) -> WriteOp<'_> {
    WriteOp {
        grant: &[],
        region: "seg",
        offset,
        data,
    }
}

/// A node serving one segment of `size` bytes named `seg`.
async fn node(size: u64, config: TcpConfig) -> (TcpTransport, ServerHandle, String) {
    let transport = TcpTransport::new(config);
    transport
        .register(Segment::allocate(RegionId::new("seg").unwrap(), size).unwrap())
        .unwrap();
    let server = transport
        .bind("127.0.0.1:0", Arc::new(AdmitAll))
        .await
        .unwrap();
    let endpoint = server.local_addr().to_string();
    (transport, server, endpoint)
}

#[tokio::test]
async fn round_trips_are_byte_exact_from_one_byte_to_64_mib() {
    let (_node, _server, endpoint) = node(160 << 20, TcpConfig::default()).await;
    let client = TcpTransport::default();
    let sizes = [
        1usize,
        2,
        1000,
        4096,
        65_535,
        65_536,
        1 << 20,
        16 << 20,
        64 << 20,
    ];
    let mut offset = 3u64;
    for (i, &size) in sizes.iter().enumerate() {
        let value = pattern(size, i as u64);
        client
            .write_batch(
                &endpoint,
                &[WriteOp {
                    grant: &[],
                    region: "seg",
                    offset,
                    data: &value,
                }],
            )
            .await
            .unwrap();
        let read = client
            .read_batch(
                &endpoint,
                &[ReadOp {
                    grant: &[],
                    region: "seg",
                    offset,
                    len: size as u64,
                }],
            )
            .await
            .unwrap();
        assert_eq!(read.len(), 1);
        assert!(read[0] == value, "size {size} differs");
        let mut into = vec![0u8; size];
        client
            .read_batch_into(
                &endpoint,
                &mut [ReadInto {
                    grant: &[],
                    region: "seg",
                    offset,
                    buf: &mut into,
                }],
            )
            .await
            .unwrap();
        assert!(into == value, "size {size} differs when read into a buffer");
        offset += size as u64 + 1;
    }
}

/// Random mixes of sizes (0 B to 100 KiB, across the 32 KiB send-coalescing
/// threshold), offsets and batch lengths agree with a local model of the segment.
#[tokio::test]
async fn random_batches_agree_with_a_model_of_the_segment() {
    use rand::{Rng as _, SeedableRng as _};
    const SIZE: usize = 4 << 20;
    let (_node, _server, endpoint) = node(SIZE as u64, TcpConfig::default()).await;
    let client = TcpTransport::default();
    let mut model = vec![0u8; SIZE];
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for round in 0..40u64 {
        let count = rng.gen_range(1..40);
        let mut values = Vec::new();
        let mut offsets = Vec::new();
        for i in 0..count {
            let len = match rng.gen_range(0..4) {
                0 => rng.gen_range(0..64),
                1 => rng.gen_range(0..32 * 1024),
                _ => rng.gen_range(32 * 1024 - 8..100 * 1024),
            };
            // Disjoint ranges inside one batch, as placements are.
            let slot = SIZE / count;
            let offset = i * slot + rng.gen_range(0..=slot - len.min(slot));
            values.push(pattern(len.min(slot), round * 100 + i as u64));
            offsets.push(offset as u64);
        }
        let ops: Vec<WriteOp<'_>> = values
            .iter()
            .zip(&offsets)
            .map(|(v, &o)| write_op(o, v))
            .collect();
        client.write_batch(&endpoint, &ops).await.unwrap();
        for (v, &o) in values.iter().zip(&offsets) {
            model[o as usize..o as usize + v.len()].copy_from_slice(v);
        }
        let reads: Vec<ReadOp<'_>> = (0..count)
            .map(|_| {
                let len = rng.gen_range(0..100 * 1024) as u64;
                read_op(rng.gen_range(0..SIZE as u64 - len), len)
            })
            .collect();
        let got = client.read_batch(&endpoint, &reads).await.unwrap();
        for (read, bytes) in reads.iter().zip(&got) {
            let at = read.offset as usize;
            assert!(
                bytes[..] == model[at..at + read.len as usize],
                "round {round}"
            );
        }
    }
}

#[tokio::test]
async fn many_concurrent_pipelined_operations() {
    let (_node, _server, endpoint) = node(64 << 20, TcpConfig::default()).await;
    let client = Arc::new(TcpTransport::new(TcpConfig {
        max_connections_per_endpoint: 4,
        ..TcpConfig::default()
    }));
    let mut tasks = Vec::new();
    for task in 0..16u64 {
        let client = Arc::clone(&client);
        let endpoint = endpoint.clone();
        tasks.push(tokio::spawn(async move {
            // 16 tasks x 500 ops of 1 KiB on 4 connections: every batch has hundreds
            // of operations outstanding on its connection.
            let values: Vec<Vec<u8>> = (0..500).map(|i| pattern(1024, task * 1000 + i)).collect();
            let base = task * 500 * 1024;
            let ops: Vec<WriteOp<'_>> = values
                .iter()
                .enumerate()
                .map(|(i, v)| write_op(base + i as u64 * 1024, v))
                .collect();
            client.write_batch(&endpoint, &ops).await.unwrap();
            let reads: Vec<ReadOp<'_>> = (0..500).map(|i| read_op(base + i * 1024, 1024)).collect();
            let got = client.read_batch(&endpoint, &reads).await.unwrap();
            for (value, read) in values.iter().zip(&got) {
                assert_eq!(&read[..], &value[..]);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test]
async fn out_of_bounds_and_unknown_regions_are_typed_errors() {
    let (_node, _server, endpoint) = node(4096, TcpConfig::default()).await;
    let client = TcpTransport::default();
    let data = [1u8; 100];
    let ops = [write_op(0, &data), write_op(4000, &data)];
    match client.write_batch(&endpoint, &ops).await.unwrap_err() {
        TransferError::Remote { index, kind, .. } => {
            assert_eq!((index, kind), (1, ErrorKind::OutOfBounds));
        }
        other => panic!("unexpected {other}"),
    }
    let error = client
        .read_batch(
            &endpoint,
            &[ReadOp {
                grant: &[],
                region: "nope",
                offset: 0,
                len: 1,
            }],
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::UnknownRegion);
    let error = client
        .read_batch(&endpoint, &[read_op(u64::MAX, 2)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::OutOfBounds);
    // The refusals left the connection in step: the next batch works.
    let read = client
        .read_batch(&endpoint, &[read_op(0, 100)])
        .await
        .unwrap();
    assert_eq!(&read[0][..], &data[..]);
    // The refused write wrote nothing past the end.
    let tail = client
        .read_batch(&endpoint, &[read_op(4000, 96)])
        .await
        .unwrap();
    assert!(tail[0].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn oversized_operations_are_refused() {
    let (_node, _server, endpoint) = node(
        1 << 20,
        TcpConfig {
            max_op_bytes: 1024,
            ..TcpConfig::default()
        },
    )
    .await;
    let small_client = TcpTransport::new(TcpConfig {
        max_op_bytes: 512,
        ..TcpConfig::default()
    });
    let data = vec![0u8; 600];
    let error = small_client
        .write_batch(&endpoint, &[write_op(0, &data)])
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        TransferError::TooLarge {
            len: 600,
            max: 512,
            ..
        }
    ));
    let error = small_client
        .read_batch(&endpoint, &[read_op(0, u64::MAX)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::TooLarge);

    // The server's own limit, below the client's.
    let client = TcpTransport::default();
    let error = client
        .read_batch(&endpoint, &[read_op(0, 2048)])
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        TransferError::Remote {
            kind: ErrorKind::TooLarge,
            ..
        }
    ));
    let big = vec![0u8; 2048];
    let error = client
        .write_batch(&endpoint, &[write_op(0, &big)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::TooLarge);
}

#[tokio::test]
async fn a_server_that_dies_mid_transfer_is_a_typed_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut some = vec![0u8; 100_000];
        socket.read_exact(&mut some).await.unwrap();
        // Dies with most of the 16 MiB write still to come.
    });
    let client = TcpTransport::new(TcpConfig {
        request_timeout: Duration::from_secs(10),
        ..TcpConfig::default()
    });
    let value = vec![5u8; 16 << 20];
    let error = client
        .write_batch(&endpoint, &[write_op(0, &value)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Disconnected, "{error}");
}

#[tokio::test]
async fn a_real_server_shut_down_during_reads_is_a_typed_error() {
    let (_node, server, endpoint) = node(64 << 20, TcpConfig::default()).await;
    let client = Arc::new(TcpTransport::default());
    let reader = {
        let client = Arc::clone(&client);
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            loop {
                let ops: Vec<ReadOp<'_>> = (0..4).map(|i| read_op(i << 24, 16 << 20)).collect();
                if let Err(error) = client.read_batch(&endpoint, &ops).await {
                    return error;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.shutdown().await;
    let error = reader.await.unwrap();
    assert!(
        matches!(error.kind(), ErrorKind::Disconnected | ErrorKind::Connect),
        "{error}"
    );
}

#[tokio::test]
async fn an_unresponsive_server_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(socket);
    });
    let client = TcpTransport::new(TcpConfig {
        request_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    });
    let error = client
        .read_batch(&endpoint, &[read_op(0, 8)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Timeout);
}

#[tokio::test]
async fn refused_connections_are_connect_errors() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    drop(listener);
    let error = TcpTransport::default()
        .read_batch(&endpoint, &[read_op(0, 8)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Connect);
}

/// A fake node that answers every read with the right length and checksum header
/// but one flipped payload byte.
#[tokio::test]
async fn a_corrupted_read_payload_is_detected() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut header = vec![0u8; frame::REQUEST_FIXED_LEN];
        socket.read_exact(&mut header).await.unwrap();
        let mut fixed = [0u8; frame::REQUEST_FIXED_LEN];
        fixed.copy_from_slice(&header);
        let mut rest = vec![0u8; frame::request_rest_len(&fixed).unwrap()];
        socket.read_exact(&mut rest).await.unwrap();
        header.extend_from_slice(&rest);
        let request = frame::decode_request(&header).unwrap();
        let mut data = pattern(request.len as usize, 1);
        let response = Response::ok(request.id, request.len, xxh3_64(&data));
        data[17] ^= 0x40;
        socket.write_all(&response.encode()).await.unwrap();
        socket.write_all(&data).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let error = TcpTransport::default()
        .read_batch(&endpoint, &[read_op(0, 4096)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Corrupt);
}

async fn raw_request(
    socket: &mut tokio::net::TcpStream,
    request: Request<'_>,
    payload: &[u8],
    flip: Option<usize>,
) -> Response {
    let mut bytes = Vec::new();
    request.encode(&mut bytes).unwrap();
    if let Some(at) = flip {
        bytes[at] ^= 1;
    }
    bytes.extend_from_slice(payload);
    socket.write_all(&bytes).await.unwrap();
    let mut raw = [0u8; RESPONSE_LEN];
    socket.read_exact(&mut raw).await.unwrap();
    let response = Response::decode(&raw).unwrap();
    let mut message = vec![0u8; response.len as usize];
    socket.read_exact(&mut message).await.unwrap();
    response
}

#[tokio::test]
async fn the_server_refuses_corrupted_frames() {
    let (node, _server, endpoint) = node(1 << 20, TcpConfig::default()).await;
    let mut socket = tokio::net::TcpStream::connect(&endpoint).await.unwrap();
    let payload = pattern(1000, 3);
    // A payload that does not match its checksum is refused, the stream stays usable.
    let request = Request {
        grant: &[],
        op: Op::Write,
        id: 1,
        region: "seg",
        offset: 0,
        len: 1000,
        checksum: xxh3_64(&payload) ^ 1,
        checked: true,
    };
    let response = raw_request(&mut socket, request, &payload, None).await;
    assert_eq!(
        (response.id, ErrorKind::from_code(response.status)),
        (1, ErrorKind::Corrupt)
    );
    let request = Request {
        grant: &[],
        op: Op::Write,
        id: 2,
        region: "seg",
        offset: 0,
        len: 1000,
        checksum: xxh3_64(&payload),
        checked: true,
    };
    let response = raw_request(&mut socket, request, &payload, None).await;
    assert_eq!((response.id, response.status), (2, frame::STATUS_OK));
    // A header with a flipped offset bit is refused before it redirects the write,
    // and the connection is closed.
    let request = Request {
        grant: &[],
        op: Op::Write,
        id: 3,
        region: "seg",
        offset: 0,
        len: 1000,
        checksum: xxh3_64(&payload),
        checked: true,
    };
    let response = raw_request(&mut socket, request, &[7u8; 1000], Some(12)).await;
    assert_eq!(ErrorKind::from_code(response.status), ErrorKind::Corrupt);
    assert_eq!(
        socket.read(&mut [0u8; 1]).await.unwrap(),
        0,
        "connection closed"
    );
    let mut check = vec![0u8; 1000];
    node.regions()
        .get("seg")
        .unwrap()
        .read_at(0, &mut check)
        .unwrap();
    assert_eq!(check, payload, "the corrupted request changed nothing");
    node.regions()
        .get("seg")
        .unwrap()
        .read_at(1 << 12, &mut check)
        .unwrap();
    assert!(check.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn payload_checksums_can_be_left_to_the_caller() {
    let (node, _server, endpoint) = node(1 << 20, TcpConfig::default()).await;
    let client = TcpTransport::new(TcpConfig {
        write_checksums: false,
        read_checksums: false,
        ..TcpConfig::default()
    });
    let value = pattern(300_000, 9);
    client
        .write_batch(&endpoint, &[write_op(100, &value)])
        .await
        .unwrap();
    let read = client
        .read_batch(&endpoint, &[read_op(100, value.len() as u64)])
        .await
        .unwrap();
    assert!(read[0] == value);
    // An unchecked write is not verified by the node; its header still is.
    let mut socket = tokio::net::TcpStream::connect(&endpoint).await.unwrap();
    let request = Request {
        grant: &[],
        op: Op::Write,
        id: 4,
        region: "seg",
        offset: 0,
        len: 3,
        checksum: 0,
        checked: false,
    };
    let response = raw_request(&mut socket, request, b"abc", None).await;
    assert_eq!(response.status, frame::STATUS_OK);
    let mut check = [0u8; 3];
    node.regions()
        .get("seg")
        .unwrap()
        .read_at(0, &mut check)
        .unwrap();
    assert_eq!(&check, b"abc");
}

#[tokio::test]
async fn a_dead_pooled_connection_is_replaced_once() {
    let (node_a, server, endpoint) = node(1 << 20, TcpConfig::default()).await;
    let client = TcpTransport::default();
    client
        .write_batch(&endpoint, &[write_op(0, b"first")])
        .await
        .unwrap();
    server.shutdown().await;
    // The same node comes back on the same port; the pooled connection is stale.
    let listener = TcpListener::bind(&endpoint).await.unwrap();
    let _server = node_a.serve(listener, Arc::new(AdmitAll)).unwrap();
    let read = client
        .read_batch(&endpoint, &[read_op(0, 5)])
        .await
        .unwrap();
    assert_eq!(&read[0][..], b"first");
}

#[tokio::test]
async fn unregistered_segments_are_no_longer_served() {
    let (node, _server, endpoint) = node(4096, TcpConfig::default()).await;
    let client = TcpTransport::default();
    client
        .read_batch(&endpoint, &[read_op(0, 1)])
        .await
        .unwrap();
    node.unregister(&RegionId::new("seg").unwrap()).unwrap();
    let error = client
        .read_batch(&endpoint, &[read_op(0, 1)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::UnknownRegion);
    assert!(client.write_batch(&endpoint, &[]).await.is_ok());
}

/// Admits only operations whose grant reads `ok` and that stay below offset 4096.
struct OkBelow4k;

impl Admission for OkBelow4k {
    fn admit(&self, asked: &Asked<'_>) -> Result<(), String> {
        if asked.grant == b"ok" && asked.offset + asked.len <= 4096 {
            Ok(())
        } else {
            Err(format!(
                "{:?} of {}+{} not granted",
                asked.op, asked.offset, asked.len
            ))
        }
    }
}

#[tokio::test]
async fn the_admission_decides_before_any_byte_moves_and_the_stream_stays_in_step() {
    let transport = TcpTransport::new(TcpConfig::default());
    let segment = Segment::allocate(RegionId::new("seg").unwrap(), 1 << 20).unwrap();
    transport.register(Arc::clone(&segment)).unwrap();
    let server = transport
        .bind("127.0.0.1:0", Arc::new(OkBelow4k))
        .await
        .unwrap();
    let endpoint = server.local_addr().to_string();
    let client = TcpTransport::default();
    let refused_write = |offset, grant: &'static [u8]| WriteOp {
        region: "seg",
        offset,
        data: b"intruder",
        grant,
    };
    // Without a grant, with a wrong one, or outside what it allows: refused, and
    // the region is untouched.
    for (offset, grant) in [(0, &b""[..]), (0, &b"no"[..]), (8192, &b"ok"[..])] {
        let error = client
            .write_batch(&endpoint, &[refused_write(offset, grant)])
            .await
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Denied, "{error}");
    }
    let mut region = vec![0u8; 16];
    segment.read_at(0, &mut region).unwrap();
    assert_eq!(region, vec![0u8; 16]);
    segment.read_at(8192, &mut region).unwrap();
    assert_eq!(region, vec![0u8; 16]);
    // Admitted operations are then served.
    client
        .write_batch(&endpoint, &[refused_write(0, b"ok")])
        .await
        .unwrap();
    let read_8 = |grant: &'static [u8]| {
        let client = &client;
        let endpoint = &endpoint;
        async move {
            client
                .read_batch(
                    endpoint,
                    &[ReadOp {
                        region: "seg",
                        offset: 0,
                        len: 8,
                        grant,
                    }],
                )
                .await
        }
    };
    assert_eq!(read_8(b"").await.unwrap_err().kind(), ErrorKind::Denied);
    assert_eq!(&read_8(b"ok").await.unwrap()[0][..], b"intruder");
}
