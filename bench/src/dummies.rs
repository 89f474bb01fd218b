//! `dummies`: 16 dummy clients behind one real client against 16 independent
//! clients, same offered load, same run, one sub-master: sub-master requests per
//! operation (the coalescing), a dummy's 1 MiB put_from / get_into against the
//! same on a full client, and the p50 latency a real client's coalescing adds.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::dummy::{DummyClient, DummyServer};
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_client::PutOptions;
use hkvm_events::rpc::dummy::{DummyReply, DummyRequest, Placement, Span};
use hkvm_events::{ClusterId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};

use crate::report::{BenchResult, Printer};
use crate::BenchNats;

const WORKLOAD: &str = "dummies";
const CLIENTS: usize = 16;
const SMALL: u64 = 4096;
const LARGE: u64 = 1 << 20;
/// 1 MiB values each put phase writes at most: both phases together stay well
/// inside the holder's segment, below its eviction watermark, whatever the rate.
const LARGE_PUTS: u64 = 1536;

async fn open(
    address: &StoreAddress,
    segment: u64,
    coalesce: Option<CoalesceConfig>,
) -> anyhow::Result<Store> {
    let mut config = StoreConfig::new(address.clone(), "127.0.0.1");
    config.global_segment_size = segment;
    config.coalesce = coalesce;
    Ok(Store::open(config).await?)
}

fn requests(store: &Store) -> u64 {
    store
        .kv()
        .metadata()
        .stats()
        .requests
        .load(Ordering::Relaxed)
}

/// One client's mixed operation `i`: put a 4 KiB value, then check it exists and
/// read it back, through a dummy.
async fn dummy_op(dummy: &DummyClient, span: Span, tag: &str, i: u64) -> anyhow::Result<()> {
    let key = format!("{tag}-{i}");
    let put = dummy
        .call(&DummyRequest::Put {
            keys: vec![key.clone()],
            spans: vec![vec![span]],
            placement: Placement {
                replicas: 1,
                ..Placement::default()
            },
        })
        .await?;
    anyhow::ensure!(put == DummyReply::Codes(vec![0]), "put: {put:?}");
    let exist = dummy
        .call(&DummyRequest::Exist {
            keys: vec![key.clone()],
        })
        .await?;
    anyhow::ensure!(exist == DummyReply::Exist(vec![1]), "exist: {exist:?}");
    let got = dummy
        .call(&DummyRequest::GetInto {
            keys: vec![key],
            spans: vec![vec![span]],
        })
        .await?;
    anyhow::ensure!(got == DummyReply::Sizes(vec![SMALL as i64]), "get: {got:?}");
    Ok(())
}

/// The same operation on a full client.
async fn full_op(
    store: &Store,
    value: &[u8],
    buffer: &mut [u8],
    tag: usize,
    i: u64,
) -> anyhow::Result<()> {
    let key = format!("f{tag}-{i}");
    store
        .put(&[(key.as_str(), &[value][..])], &PutOptions::default())
        .await?
        .pop()
        .context("no result")??;
    anyhow::ensure!(
        store.exist(std::slice::from_ref(&key)).await?[0],
        "not there"
    );
    let mut parts = [buffer];
    let mut items = [(key.as_str(), &mut parts[..])];
    store
        .get_into(&mut items)
        .await?
        .pop()
        .context("no result")??;
    Ok(())
}

/// Runs the workload.
///
/// # Errors
/// When the sub-master, a store or a dummy fails.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let duration = if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    let cluster = ClusterId::new("bench")?;
    let subcluster = SubclusterId::new("dummies")?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("bench-dm")?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let address: StoreAddress = format!("{}/{cluster}/{subcluster}", nats.url).parse()?;
    eprintln!(
        "bench dummies: {CLIENTS} clients, {} s per case",
        duration.as_secs_f64()
    );

    // The node that holds every value, and 16 independent client-only stores.
    let holder = open(&address, 8 << 30, None).await?;
    let mut full = Vec::new();
    for _ in 0..CLIENTS {
        full.push(open(&address, 0, None).await?);
    }
    let before: u64 = full.iter().map(requests).sum();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (tag, store) in full.iter().enumerate() {
        tasks.push(async move {
            let value = vec![7u8; SMALL as usize];
            let mut buffer = vec![0u8; SMALL as usize];
            let mut ops = 0u64;
            while started.elapsed() < duration {
                full_op(store, &value, &mut buffer, tag, ops).await?;
                ops += 1;
            }
            anyhow::Ok(ops)
        });
    }
    let full_ops: u64 = futures::future::try_join_all(tasks)
        .await?
        .into_iter()
        .sum();
    let full_requests = full.iter().map(requests).sum::<u64>() - before;

    // 16 dummies behind one coalescing real client: the default window, then
    // none (what the window buys in requests and costs in throughput).
    let real = Arc::new(open(&address, 0, Some(CoalesceConfig::default())).await?);
    let port = 40_000 + (std::process::id() % 20_000) as u16;
    let _server = DummyServer::start(Arc::clone(&real), port)?;
    let dummies = connect_dummies(port).await?;
    let (dummy_ops, dummy_requests) = run_dummies(&real, &dummies, "d", duration).await?;
    let unwindowed = Arc::new(
        open(
            &address,
            0,
            Some(CoalesceConfig {
                window: Duration::ZERO,
                ..CoalesceConfig::default()
            }),
        )
        .await?,
    );
    let unwindowed_port = port.wrapping_add(2);
    let _unwindowed_server = DummyServer::start(Arc::clone(&unwindowed), unwindowed_port)?;
    let (zero_ops, zero_requests) = run_dummies(
        &unwindowed,
        &connect_dummies(unwindowed_port).await?,
        "z",
        duration,
    )
    .await?;
    let per_op = |requests: u64, ops: u64| requests as f64 / ops.max(1) as f64;
    let window_us = CoalesceConfig::default().window.as_micros();
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("sub-master requests per operation, {CLIENTS} dummies behind one real client, {window_us} us window (put+exist+get of 4 KiB)"),
        per_op(dummy_requests, dummy_ops),
        "requests/op",
        format!("{CLIENTS} independent clients, same operations (target ratio <= 0.125)"),
        per_op(full_requests, full_ops),
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("sub-master requests per operation, {CLIENTS} dummies, no window"),
        per_op(zero_requests, zero_ops),
        "requests/op",
        format!("{CLIENTS} independent clients (target ratio <= 0.125)"),
        per_op(full_requests, full_ops),
    ));
    for (label, ops) in [
        (format!("{window_us} us window"), dummy_ops),
        ("no window".to_owned(), zero_ops),
    ] {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("operations/s, {CLIENTS} dummies, {label}"),
            ops as f64 / duration.as_secs_f64(),
            "ops/s",
            format!("{CLIENTS} independent clients"),
            full_ops as f64 / duration.as_secs_f64(),
        ));
    }

    // One client's 1 MiB put_from and get_into: a dummy against a full client.
    let dummy = &dummies[0];
    let offset = dummy.pool_alloc(LARGE).context("pool")?;
    let span = Span::in_pool(offset, LARGE);
    let single = &full[0];
    let value = vec![9u8; LARGE as usize];
    let mut buffer = vec![0u8; LARGE as usize];
    for (name, dummy_rate, full_rate) in [
        (
            "put_from of 1 MiB",
            rate_at_most(duration, LARGE_PUTS, |i| async move {
                let put = dummy
                    .call(&DummyRequest::Put {
                        keys: vec![format!("dl-{i}")],
                        spans: vec![vec![span]],
                        placement: Placement {
                            replicas: 1,
                            ..Placement::default()
                        },
                    })
                    .await?;
                anyhow::ensure!(put == DummyReply::Codes(vec![0]), "put: {put:?}");
                Ok(())
            })
            .await?,
            rate_at_most(duration, LARGE_PUTS, |i| {
                let value = &value;
                async move {
                    let key = format!("fl-{i}");
                    single
                        .put(
                            &[(key.as_str(), &[value.as_slice()][..])],
                            &PutOptions::default(),
                        )
                        .await?
                        .pop()
                        .context("no result")??;
                    Ok(())
                }
            })
            .await?,
        ),
        (
            "get_into of 1 MiB",
            rate(duration, |_| async move {
                let got = dummy
                    .call(&DummyRequest::GetInto {
                        keys: vec!["dl-0".into()],
                        spans: vec![vec![span]],
                    })
                    .await?;
                anyhow::ensure!(got == DummyReply::Sizes(vec![LARGE as i64]), "get: {got:?}");
                Ok(())
            })
            .await?,
            {
                let started = Instant::now();
                let mut done = 0u64;
                while started.elapsed() < duration || done == 0 {
                    let mut parts = [buffer.as_mut_slice()];
                    let mut items = [("fl-0", &mut parts[..])];
                    single
                        .get_into(&mut items)
                        .await?
                        .pop()
                        .context("no result")??;
                    done += 1;
                }
                done as f64 / started.elapsed().as_secs_f64()
            },
        ),
    ] {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("a dummy's {name}"),
            dummy_rate,
            "ops/s",
            "the same on a full client (target >= 0.8)",
            full_rate,
        ));
    }

    // The p50 latency coalescing adds: one dummy's exist, sequential, behind a
    // coalescing real client against one that does not coalesce.
    let plain = Arc::new(open(&address, 0, None).await?);
    let plain_port = port.wrapping_add(1);
    let _plain_server = DummyServer::start(Arc::clone(&plain), plain_port)?;
    let plain_dummy = DummyClient::connect(plain_port, 1 << 20, 0).await?;
    let coalesced_p50 = p50_exist(dummy, duration).await?;
    let plain_p50 = p50_exist(&plain_dummy, duration).await?;
    printer.print(&BenchResult::new(
        WORKLOAD,
        "p50 of a dummy's exist, coalescing real client",
        coalesced_p50,
        "us",
        "the same without coalescing (target: at most 100 us more)",
        plain_p50,
    ));
    for store in full {
        store.close().await;
    }
    real.close().await;
    unwindowed.close().await;
    plain.close().await;
    holder.close().await;
    master.shutdown().await?;
    Ok(())
}

/// Connects the dummies of one real client.
async fn connect_dummies(port: u16) -> anyhow::Result<Vec<DummyClient>> {
    let mut dummies = Vec::new();
    for _ in 0..CLIENTS {
        dummies.push(DummyClient::connect(port, 4 << 20, 0).await?);
    }
    Ok(dummies)
}

/// Runs the mixed operation on every dummy for `duration`: operations done, and
/// the requests the real client sent meanwhile.
async fn run_dummies(
    real: &Store,
    dummies: &[DummyClient],
    prefix: &str,
    duration: Duration,
) -> anyhow::Result<(u64, u64)> {
    let before = requests(real);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (tag, dummy) in dummies.iter().enumerate() {
        tasks.push(async move {
            let offset = dummy.pool_alloc(SMALL).context("pool")?;
            let span = Span::in_pool(offset, SMALL);
            let mut ops = 0u64;
            while started.elapsed() < duration {
                dummy_op(dummy, span, &format!("{prefix}{tag}"), ops).await?;
                ops += 1;
            }
            anyhow::Ok(ops)
        });
    }
    let ops: u64 = futures::future::try_join_all(tasks)
        .await?
        .into_iter()
        .sum();
    Ok((ops, requests(real) - before))
}

async fn rate<F, Fut>(duration: Duration, step: F) -> anyhow::Result<f64>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    rate_at_most(duration, u64::MAX, step).await
}

/// As [`rate`], stopping after `at_most` steps.
async fn rate_at_most<F, Fut>(duration: Duration, at_most: u64, mut step: F) -> anyhow::Result<f64>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    let mut done = 0u64;
    while (started.elapsed() < duration || done == 0) && done < at_most {
        step(done).await?;
        done += 1;
    }
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

async fn p50_exist(dummy: &DummyClient, duration: Duration) -> anyhow::Result<f64> {
    let mut latencies = Vec::new();
    let started = Instant::now();
    while started.elapsed() < duration || latencies.is_empty() {
        let call = Instant::now();
        dummy
            .call(&DummyRequest::Exist {
                keys: vec!["dl-0".into()],
            })
            .await?;
        latencies.push(call.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    Ok(latencies[latencies.len() / 2])
}
