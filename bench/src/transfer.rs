//! The `transfer` workload: TCP transport GB/s for 64 KiB, 1 MiB and 16 MiB values
//! with 1 and 8 streams against plain tokio TCP moving the same values with one round
//! trip each (the shape of a transfer answered before the next), and against a plain
//! stream of the same bytes (no framing, no checksums, no responses), and that
//! stream against memcpy; Reed–Solomon encode and
//! decode GB/s against memcpy; WAN goodput over the in-process lossy link against the
//! pacing cap, in process and over UDP loopback sockets with an emulated delay and
//! loss (with the wire bytes per payload byte of two stripe shapes); the data
//! port checking grants against the same port admitting all. Everything in
//! the same run.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hkvm_client::grants::GrantChecker;
use hkvm_events::grant::{Access, GrantKey, GrantRequest};
use hkvm_log::registry::now_unix_ms;
use hkvm_transfer::wan::{
    lossy_link, udp_endpoint, FecConfig, Impairment, LinkConfig, StripeCodec, WanConfig,
    WanReceiver, WanSender,
};
use hkvm_transfer::{
    AdmitAll, ReadInto, RegionId, Segment, TcpConfig, TcpTransport, Transport, WriteOp,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::report::{BenchResult, Printer};

const WORKLOAD: &str = "transfer";
const REGION: &str = "bench";

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 29) as u8)
        .collect()
}

fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

fn label(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s => format!("{} KiB", s >> 10),
    }
}

/// One configuration: `streams` tasks moving `per_stream` values of `value.len()`.
struct Shape {
    value: Arc<Vec<u8>>,
    streams: usize,
    per_stream: usize,
}

impl Shape {
    fn bytes(&self) -> u64 {
        (self.value.len() * self.streams * self.per_stream) as u64
    }

    /// Each stream alternates between two slots of its own.
    fn offset(&self, stream: usize, i: usize) -> u64 {
        ((stream * 2 + i % 2) * self.value.len()) as u64
    }
}

/// The grants a client presents: a write and a read grant over the whole bench
/// region, as a sub-master signs them (or none, for a port that admits all).
#[derive(Clone)]
struct Grants {
    write: Arc<[u8]>,
    read: Arc<[u8]>,
}

impl Grants {
    fn none() -> Self {
        Self {
            write: Arc::from(&[][..]),
            read: Arc::from(&[][..]),
        }
    }

    fn signed(key: &GrantKey, len: u64) -> Self {
        let grant = |access| -> Arc<[u8]> {
            let grant = key.sign(GrantRequest {
                segment: REGION,
                access,
                offset: 0,
                len,
                expires_unix_ms: now_unix_ms() + 3_600_000,
            });
            Arc::from(&grant.to_wire()[..])
        };
        Self {
            write: grant(Access::Write),
            read: grant(Access::Read),
        }
    }
}

/// Writes (one value per batch, as a put to one replica does), then reads back.
async fn transport_rates(
    shape: &Shape,
    endpoint: &str,
    client: &Arc<TcpTransport>,
    grants: &Grants,
) -> anyhow::Result<(f64, f64)> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for stream in 0..shape.streams {
        let (client, value, endpoint, grant) = (
            Arc::clone(client),
            Arc::clone(&shape.value),
            endpoint.to_owned(),
            Arc::clone(&grants.write),
        );
        let offsets: Vec<u64> = (0..shape.per_stream)
            .map(|i| shape.offset(stream, i))
            .collect();
        tasks.push(tokio::spawn(async move {
            for offset in offsets {
                let op = WriteOp {
                    region: REGION,
                    offset,
                    data: &value,
                    grant: &grant,
                };
                client.write_batch(&endpoint, &[op]).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let write = gbps(shape.bytes(), started.elapsed());

    let started = Instant::now();
    let mut tasks = Vec::new();
    for stream in 0..shape.streams {
        let (client, endpoint, grant) = (
            Arc::clone(client),
            endpoint.to_owned(),
            Arc::clone(&grants.read),
        );
        let offsets: Vec<u64> = (0..shape.per_stream)
            .map(|i| shape.offset(stream, i))
            .collect();
        let expected = Arc::clone(&shape.value);
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; expected.len()];
            for offset in offsets {
                let mut op = [ReadInto {
                    region: REGION,
                    offset,
                    buf: &mut buf,
                    grant: &grant,
                }];
                client.read_batch_into(&endpoint, &mut op).await?;
            }
            anyhow::ensure!(buf == *expected, "read back different bytes");
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((write, gbps(shape.bytes(), started.elapsed())))
}

/// How plain tokio TCP moves the values of a baseline.
#[derive(Clone, Copy)]
enum Plain {
    /// One stream of all the values, answered with one byte at the end: the
    /// pipe's capacity.
    Stream,
    /// The client sends each value, the server answers one byte (a write that is
    /// confirmed before the next).
    WriteTrips,
    /// The client sends a 16-byte request per value, the server answers the value
    /// (a read).
    ReadTrips,
}

/// The request of [`Plain::ReadTrips`]: as long as a transfer's read header.
const PLAIN_READ_REQUEST: usize = 16;

/// The GB/s of the shape's values over plain tokio TCP streams moved as `plain`
/// says (no framing beyond that, no checksums).
async fn plain_tcp_rate(shape: &Shape, plain: Plain) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (count, streams) = (shape.per_stream, shape.streams);
    let value = Arc::clone(&shape.value);
    let server = tokio::spawn(async move {
        let mut servers = Vec::new();
        for _ in 0..streams {
            let (mut socket, _) = listener.accept().await?;
            socket.set_nodelay(true)?;
            let value = Arc::clone(&value);
            servers.push(tokio::spawn(async move {
                // Two slots per stream, used in turn, as the node's segment is.
                let len = value.len();
                let mut slots = [value.to_vec(), value.to_vec()];
                let mut request = [0u8; PLAIN_READ_REQUEST];
                for i in 0..count {
                    let slot = &mut slots[i % 2][..len];
                    match plain {
                        Plain::Stream => socket.read_exact(slot).await.map(drop)?,
                        Plain::WriteTrips => {
                            socket.read_exact(slot).await?;
                            socket.write_all(&[1]).await?;
                        }
                        Plain::ReadTrips => {
                            socket.read_exact(&mut request).await?;
                            socket.write_all(slot).await?;
                        }
                    }
                }
                if let Plain::Stream = plain {
                    socket.write_all(&[1]).await?;
                }
                std::io::Result::Ok(())
            }));
        }
        for server in servers {
            server.await??;
        }
        std::io::Result::Ok(())
    });
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let value = Arc::clone(&shape.value);
        tasks.push(tokio::spawn(async move {
            let mut socket = TcpStream::connect(addr).await?;
            socket.set_nodelay(true)?;
            let mut buf = vec![0u8; value.len()];
            for _ in 0..count {
                match plain {
                    Plain::Stream => socket.write_all(&value).await?,
                    Plain::WriteTrips => {
                        socket.write_all(&value).await?;
                        socket.read_exact(&mut buf[..1]).await?;
                    }
                    Plain::ReadTrips => {
                        socket.write_all(&[0u8; PLAIN_READ_REQUEST]).await?;
                        socket.read_exact(&mut buf).await?;
                    }
                }
            }
            if let Plain::Stream = plain {
                socket.read_exact(&mut buf[..1]).await?;
            }
            std::io::Result::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let rate = gbps(shape.bytes(), started.elapsed());
    server.await??;
    Ok(rate)
}

fn memcpy_rate(value: &[u8], copies: usize) -> f64 {
    let mut dst = vec![0u8; value.len()];
    let started = Instant::now();
    for _ in 0..copies {
        dst.copy_from_slice(black_box(value));
        black_box(&mut dst);
    }
    gbps((value.len() * copies) as u64, started.elapsed())
}

async fn tcp(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let sizes: [usize; 3] = if quick {
        [4 << 10, 64 << 10, 256 << 10]
    } else {
        [64 << 10, 1 << 20, 16 << 20]
    };
    let total: usize = if quick { 4 << 20 } else { 512 << 20 };
    let largest = sizes[2];
    let node = TcpTransport::default();
    let region_len = (8 * 2 * largest) as u64;
    node.register(Segment::allocate(RegionId::new(REGION)?, region_len)?)?;
    // A node's port, checking every operation's grant, and a second port of the
    // same node admitting all: the grant check's cost is their difference.
    let key = hkvm_log::grants::generate_key();
    let grants = Grants::signed(&key, region_len);
    let server = node
        .bind("127.0.0.1:0", Arc::new(GrantChecker::with_key(key)))
        .await?;
    let endpoint = server.local_addr().to_string();
    let open_server = node.bind("127.0.0.1:0", Arc::new(AdmitAll)).await?;
    let open_endpoint = open_server.local_addr().to_string();
    let client = Arc::new(TcpTransport::default());
    let unchecked = Arc::new(TcpTransport::new(TcpConfig {
        write_checksums: false,
        read_checksums: false,
        ..TcpConfig::default()
    }));
    for size in sizes {
        let value = Arc::new(pattern(size));
        for streams in [1usize, 8] {
            let shape = Shape {
                value: Arc::clone(&value),
                streams,
                per_stream: (total / size / streams).max(2),
            };
            eprintln!(
                "bench transfer: {} values, {streams} streams, {} MiB",
                label(size),
                shape.bytes() >> 20
            );
            // Best of three, interleaved, because the machine is shared and noisy.
            let (mut plain, mut write, mut read) = (0f64, 0f64, 0f64);
            let (mut write_unchecked, mut read_unchecked) = (0f64, 0f64);
            let (mut write_open, mut read_open) = (0f64, 0f64);
            let (mut plain_write_trip, mut plain_read_trip) = (0f64, 0f64);
            for _ in 0..3 {
                plain = plain.max(
                    plain_tcp_rate(&shape, Plain::Stream)
                        .await
                        .context("plain TCP stream")?,
                );
                plain_write_trip = plain_write_trip.max(
                    plain_tcp_rate(&shape, Plain::WriteTrips)
                        .await
                        .context("plain TCP write round trips")?,
                );
                plain_read_trip = plain_read_trip.max(
                    plain_tcp_rate(&shape, Plain::ReadTrips)
                        .await
                        .context("plain TCP read round trips")?,
                );
                let (w, r) = transport_rates(&shape, &endpoint, &client, &grants).await?;
                (write, read) = (write.max(w), read.max(r));
                let (w, r) =
                    transport_rates(&shape, &open_endpoint, &client, &Grants::none()).await?;
                (write_open, read_open) = (write_open.max(w), read_open.max(r));
                let (w, r) = transport_rates(&shape, &endpoint, &unchecked, &grants).await?;
                (write_unchecked, read_unchecked) = (write_unchecked.max(w), read_unchecked.max(r));
            }
            let memcpy = memcpy_rate(&value, streams * shape.per_stream);
            let what = format!(
                "{} x{streams} stream{}",
                label(size),
                if streams > 1 { "s" } else { "" }
            );
            let baseline = "plain tokio TCP, same bytes";
            let memcpy_baseline = "memcpy, same bytes";
            let no_grants = "the same port admitting all (no grant check)";
            let write_trip = "plain tokio TCP, a value then a 1-byte answer each";
            let read_trip = "plain tokio TCP, a 16-byte request then the value each";
            let rows = [
                (
                    format!("TCP write {what}"),
                    write,
                    write_trip,
                    plain_write_trip,
                ),
                (format!("TCP read {what}"), read, read_trip, plain_read_trip),
                (format!("TCP write {what}"), write, baseline, plain),
                (format!("TCP read {what}"), read, baseline, plain),
                (format!("TCP write {what}"), write, no_grants, write_open),
                (format!("TCP read {what}"), read, no_grants, read_open),
                (
                    format!("TCP write {what}, unchecked"),
                    write_unchecked,
                    write_trip,
                    plain_write_trip,
                ),
                (
                    format!("TCP read {what}, unchecked"),
                    read_unchecked,
                    read_trip,
                    plain_read_trip,
                ),
                (
                    format!("TCP write {what}, unchecked"),
                    write_unchecked,
                    baseline,
                    plain,
                ),
                (
                    format!("TCP read {what}, unchecked"),
                    read_unchecked,
                    baseline,
                    plain,
                ),
                (
                    format!("plain tokio TCP {what}"),
                    plain,
                    memcpy_baseline,
                    memcpy,
                ),
                (
                    format!("plain tokio TCP {what}, a round trip per value (write)"),
                    plain_write_trip,
                    baseline,
                    plain,
                ),
                (
                    format!("plain tokio TCP {what}, a round trip per value (read)"),
                    plain_read_trip,
                    baseline,
                    plain,
                ),
            ];
            for (metric, value, against, base) in rows {
                printer.print(&BenchResult::new(
                    WORKLOAD, metric, value, "GB/s", against, base,
                ));
            }
        }
    }
    server.shutdown().await;
    open_server.shutdown().await;
    Ok(())
}

fn fec(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    for (data_shards, parity_shards) in [(16, 4), (64, 16)] {
        let config = FecConfig {
            data_shards,
            parity_shards,
            shard_bytes: 1024,
        };
        fec_shape(config, quick, printer)?;
    }
    Ok(())
}

fn fec_shape(config: FecConfig, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let bytes = if quick { 2 << 20 } else { 64 << 20 };
    let data = pattern(bytes);
    let mut codec = StripeCodec::new(config)?;
    let stripe = config.stripe_bytes();
    let started = Instant::now();
    let mut encoded = Vec::new();
    for chunk in data.chunks(stripe) {
        encoded.push(codec.encode(chunk)?);
    }
    let encode = gbps(bytes as u64, started.elapsed());

    // Worst case for the decoder: the first `parity_shards` originals of every stripe
    // are lost and rebuilt from every recovery shard.
    let mut out = vec![0u8; stripe];
    let started = Instant::now();
    for (chunk, parity) in data.chunks(stripe).zip(&encoded) {
        let mut shards: Vec<Option<&[u8]>> = chunk.chunks(config.shard_bytes).map(Some).collect();
        for lost in shards.iter_mut().take(config.parity_shards) {
            *lost = None;
        }
        shards.extend(parity.iter().map(|p| Some(p.as_slice())));
        codec.decode(&shards, &mut out[..chunk.len()])?;
        black_box(&out);
    }
    let decode = gbps(bytes as u64, started.elapsed());
    anyhow::ensure!(out[..] == data[data.len() - stripe..], "decode differs");
    let memcpy = memcpy_rate(&data, 3);
    let shape = format!(
        "{}+{} x {} B",
        config.data_shards, config.parity_shards, config.shard_bytes
    );
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("FEC encode {shape}"),
        encode,
        "GB/s",
        "memcpy, same bytes",
        memcpy,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("FEC decode {shape}, {} lost", config.parity_shards),
        decode,
        "GB/s",
        "memcpy, same bytes",
        memcpy,
    ));
    Ok(())
}

async fn wan(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let cap: u64 = if quick { 50_000_000 } else { 200_000_000 };
    let value = pattern(if quick { 1 << 20 } else { 64 << 20 });
    for loss in [0.01, 0.05] {
        let config = WanConfig {
            rate_bytes_per_sec: cap,
            // Five milliseconds of sending: well above the timer's granularity.
            burst_bytes: cap / 200,
            ..WanConfig::default()
        };
        let forward = LinkConfig {
            loss,
            delay: Duration::from_millis(5),
            seed: 3,
            ..LinkConfig::default()
        };
        let back = LinkConfig {
            loss,
            delay: Duration::from_millis(5),
            seed: 4,
            ..LinkConfig::default()
        };
        let (data_tx, data_rx) = lossy_link(forward)?;
        let (feedback_tx, feedback_rx) = lossy_link(back)?;
        let mut sender = WanSender::new(config, data_tx, feedback_rx)?;
        let mut receiver = WanReceiver::new(config, data_rx, feedback_tx)?;
        let started = Instant::now();
        let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
        let elapsed = started.elapsed();
        let (sent, (bytes, received)) = (sent?, received?);
        anyhow::ensure!(bytes == value, "WAN copy differs");
        let goodput = value.len() as f64 / elapsed.as_secs_f64();
        let what = format!("{}% loss", loss * 100.0);
        for result in [
            BenchResult::new(
                WORKLOAD,
                format!("WAN goodput, {what}"),
                goodput / 1e6,
                "MB/s",
                "pacing cap",
                cap as f64 / 1e6,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("WAN shards repaired by FEC, {what}"),
                received.fec_recoveries as f64,
                "shards",
                "none",
                0.0,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("WAN stripes retransmitted, {what}"),
                sent.stripes_retransmitted as f64,
                "stripes",
                "none",
                0.0,
            ),
        ] {
            printer.print(&result);
        }
    }
    Ok(())
}

/// WAN copies between two UDP sockets on loopback, each end's egress delayed by
/// 25 ms and losing 1% of its datagrams, at a 200 MB/s cap; with the default stripe
/// shape and a lighter one, to show what the recovery shards cost and save.
async fn wan_udp(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    const CAP: u64 = 200_000_000;
    let value = pattern(if quick { 8 << 20 } else { 256 << 20 });
    let impairment = Impairment {
        delay: Duration::from_millis(25),
        loss: 0.01,
        seed: 5,
    };
    for (data_shards, parity_shards) in [(64, 16), (64, 4)] {
        let fec = FecConfig {
            data_shards,
            parity_shards,
            shard_bytes: 1024,
        };
        let config = WanConfig {
            fec,
            rate_bytes_per_sec: CAP,
            // Five milliseconds of sending: well above the timer's granularity.
            burst_bytes: CAP / 200,
            ..WanConfig::default()
        };
        let (near, far) = (
            UdpSocket::bind("127.0.0.1:0").await?,
            UdpSocket::bind("127.0.0.1:0").await?,
        );
        let far_addr = far.local_addr()?;
        let (data_tx, feedback_rx) = udp_endpoint(near, Some(far_addr), impairment)?;
        let back = Impairment {
            seed: impairment.seed + 1,
            ..impairment
        };
        let (feedback_tx, data_rx) = udp_endpoint(far, None, back)?;
        let (out, into) = (data_tx.stats(), data_rx.stats());
        let mut sender = WanSender::new(config, data_tx, feedback_rx)?;
        let mut receiver = WanReceiver::new(config, data_rx, feedback_tx)?;
        let started = Instant::now();
        let (sent, received) = tokio::join!(sender.send(&value), receiver.receive());
        let elapsed = started.elapsed();
        let (sent, (bytes, _)) = (sent?, received?);
        anyhow::ensure!(bytes == value, "WAN copy over UDP differs");
        let goodput = value.len() as f64 / elapsed.as_secs_f64();
        let what = format!("{data_shards}+{parity_shards}, 25ms 1% loss");
        let nominal = (data_shards + parity_shards) as f64 / data_shards as f64;
        for result in [
            BenchResult::new(
                WORKLOAD,
                format!("WAN UDP goodput, {what}"),
                goodput / 1e6,
                "MB/s",
                "pacing cap",
                CAP as f64 / 1e6,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("WAN UDP wire/payload, {what}"),
                sent.wire_bytes as f64 / sent.bytes.max(1) as f64,
                "x",
                "(data + parity) / data shards",
                nominal,
            ),
            // Beyond the emulated loss: datagrams the receiving socket's buffer had
            // no room for (a receiver slower than the cap), the few probes still in
            // flight at the end.
            BenchResult::new(
                WORKLOAD,
                format!("WAN UDP datagrams lost in kernel, {what}"),
                out.sent().saturating_sub(into.received()) as f64,
                "packets",
                "datagrams dropped by the emulation",
                out.dropped() as f64,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("WAN UDP rounds, {what}"),
                f64::from(sent.rounds),
                "rounds",
                "none",
                0.0,
            ),
            BenchResult::new(
                WORKLOAD,
                format!("WAN UDP stripes resent, {what}"),
                sent.stripes_retransmitted as f64,
                "stripes",
                "none",
                0.0,
            ),
        ] {
            printer.print(&result);
        }
    }
    Ok(())
}

/// Runs the workload.
///
/// # Errors
/// When a transfer fails or returns different bytes (which would be a bug).
pub async fn run(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    tcp(quick, printer).await?;
    eprintln!("bench transfer: Reed-Solomon encode/decode");
    fec(quick, printer)?;
    eprintln!("bench transfer: WAN copies over the lossy link");
    wan(quick, printer).await?;
    eprintln!("bench transfer: WAN copies over UDP loopback, 25 ms and 1% loss each way");
    wan_udp(quick, printer).await
}
