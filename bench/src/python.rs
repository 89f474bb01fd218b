//! `python`: the `hkvm` Python package's operations (put and get of 4 KiB and
//! 1 MiB, put_from / get_into of 1 MiB, batch_is_exist of 1000 keys), timed from
//! Python by `python -m hkvm.bench`, against the same operations through the Rust
//! client (`hkvm_client::store::Store`) in the same run, one client each, against
//! the same sub-master. The interpreter is `$HKVM_PYTHON`, else the project's
//! `.tools/venv/bin/python` (made by `scripts/python`).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_client::PutOptions;
use hkvm_events::{ClusterId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};

use crate::report::{BenchResult, Printer};
use crate::BenchNats;

const WORKLOAD: &str = "python";
const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

/// The Python interpreter that has the `hkvm` package.
pub(crate) fn interpreter() -> Option<PathBuf> {
    if let Some(explicit) = std::env::var_os("HKVM_PYTHON") {
        return Some(PathBuf::from(explicit));
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .map(|dir| dir.join(".tools/venv/bin/python"))
        .find(|candidate| candidate.is_file())
}

/// 1 MiB values one phase writes at most: well inside the 4 GiB segment, below
/// the eviction watermark, whatever the rate (as `hkvm.bench` does).
const LARGE_VALUES: u64 = 1536;

/// Operations per second of `step(i)` run for `duration` (and at least
/// `at_least` times, at most `at_most` times).
async fn rate<F, Fut>(
    duration: Duration,
    at_least: u64,
    at_most: u64,
    mut step: F,
) -> anyhow::Result<f64>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        step(done).await?;
        done += 1;
        if (started.elapsed() >= duration && done >= at_least) || done >= at_most {
            return Ok(done as f64 / started.elapsed().as_secs_f64());
        }
    }
}

/// The Rust client's rates of the same operations as `hkvm.bench`.
async fn rust_rates(
    address: StoreAddress,
    duration: Duration,
) -> anyhow::Result<Vec<(&'static str, f64)>> {
    let mut config = StoreConfig::new(address, "localhost");
    config.global_segment_size = 4 << 30;
    let store = Store::open(config)
        .await
        .context("opening the Rust store")?;
    let options = PutOptions::default();
    let small = vec![7u8; 4 * KIB];
    let large = vec![9u8; MIB];
    let mut results = Vec::new();
    let store = &store;
    let put = |prefix: &'static str, value: &'static [u8]| {
        let options = options.clone();
        move |i: u64| {
            let options = options.clone();
            async move {
                let key = format!("rs-{prefix}-{i}");
                let mut out = store.put(&[(key.as_str(), &[value][..])], &options).await?;
                out.pop().context("no result")??;
                anyhow::Ok(())
            }
        }
    };
    let get = |prefix: &'static str, count: u64, size: usize| {
        move |i: u64| async move {
            let key = format!("rs-{prefix}-{}", i % count);
            let fetched = store.kv().get(&key).await?;
            anyhow::ensure!(fetched.value.len() == size, "short value");
            Ok(())
        }
    };
    let small: &'static [u8] = Box::leak(small.into_boxed_slice());
    let large: &'static [u8] = Box::leak(large.into_boxed_slice());
    let put_small = rate(duration, 1000, u64::MAX, put("s", small)).await?;
    results.push(("put_4k", put_small));
    results.push((
        "get_4k",
        rate(duration, 1, u64::MAX, get("s", 1000, small.len())).await?,
    ));
    let put_large = rate(duration, 1, LARGE_VALUES, put("l", large)).await?;
    results.push(("put_1m", put_large));
    let written = ((put_large * duration.as_secs_f64()) as u64).clamp(1, LARGE_VALUES);
    results.push((
        "get_1m",
        rate(duration, 1, u64::MAX, get("l", written, large.len())).await?,
    ));
    // Room for the next phase's values: the segment holds only so many.
    store.remove_all(Some("^rs-l-"), None, true).await?;
    // The zero-copy pair: put straight from a buffer, read straight into one.
    let put_from = rate(duration, 1, LARGE_VALUES, put("f", large)).await?;
    results.push(("put_from_1m", put_from));
    let written = ((put_from * duration.as_secs_f64()) as u64).clamp(1, LARGE_VALUES);
    let mut buffer = vec![0u8; MIB];
    let buffer = &mut buffer;
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < duration || done == 0 {
        let key = format!("rs-f-{}", done % written);
        let mut parts = [buffer.as_mut_slice()];
        let mut items = [(key.as_str(), &mut parts[..])];
        let mut read = store.get_into(&mut items).await?;
        read.pop().context("no result")??;
        done += 1;
    }
    results.push(("get_into_1m", done as f64 / started.elapsed().as_secs_f64()));
    let keys: Vec<String> = (0..1000).map(|i| format!("rs-s-{i}")).collect();
    anyhow::ensure!(
        store.exist(&keys).await?.iter().all(|e| *e),
        "the 1000 small values are not all there"
    );
    let keys = &keys;
    let exist = rate(duration, 1, u64::MAX, |_| async move {
        store.exist(keys).await?;
        Ok(())
    })
    .await?;
    results.push(("batch_is_exist_1000", exist));
    store.remove_all(Some("^rs-"), None, true).await?;
    store.close().await;
    Ok(results)
}

/// Runs the workload.
///
/// # Errors
/// When the sub-master, the Rust store or the Python side fails.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let Some(python) = interpreter() else {
        eprintln!(
            "bench python: no interpreter with the hkvm package (run scripts/python, or set \
             HKVM_PYTHON); no python rows"
        );
        return Ok(());
    };
    let duration = if quick {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(3)
    };
    let cluster = ClusterId::new("bench")?;
    let subcluster = SubclusterId::new("py")?;
    let config = SubmasterConfig::new(
        cluster.clone(),
        subcluster.clone(),
        ProducerId::new("bench-py")?,
    );
    let master = SubmasterHandle::spawn(nats.connect().await?, config);
    let address: StoreAddress = format!("{}/{cluster}/{subcluster}", nats.url)
        .parse()
        .context("the bench's store address")?;
    eprintln!(
        "bench python: {} s per operation, Rust client first",
        duration.as_secs_f64()
    );
    let rust = rust_rates(address.clone(), duration).await?;
    let output = tokio::process::Command::new(&python)
        .args(["-m", "hkvm.bench", "--address"])
        .arg(format!("{}/{cluster}/{subcluster}", nats.url))
        .arg("--seconds")
        .arg(duration.as_secs_f64().to_string())
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {} -m hkvm.bench", python.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "python -m hkvm.bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let measured: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&output.stdout).context("reading hkvm.bench's output")?;
    for (operation, rust_rate) in rust {
        let python_rate = measured
            .get(operation)
            .and_then(serde_json::Value::as_f64)
            .with_context(|| format!("hkvm.bench did not report {operation}"))?;
        let (metric, unit, scale) = match operation {
            "batch_is_exist_1000" => ("batch_is_exist of 1000 keys from Python", "keys/s", 1000.0),
            _ => ("", "ops/s", 1.0),
        };
        let metric = if metric.is_empty() {
            format!("{operation} from Python")
        } else {
            metric.to_owned()
        };
        printer.print(&BenchResult::new(
            WORKLOAD,
            metric,
            python_rate * scale,
            unit,
            "the same through the Rust client (target >= 0.8)",
            rust_rate * scale,
        ));
    }
    print_binding_costs(&measured, printer);
    master.shutdown().await?;
    Ok(())
}

/// The binding's own cost per call, from `hkvm.bench`'s probes: a call that does
/// nothing through the store (GIL released, a finished future waited for the way
/// calls wait) against a plain extension function that does nothing.
fn print_binding_costs(
    measured: &serde_json::Map<String, serde_json::Value>,
    printer: &mut Printer,
) {
    let nanos = |name: &str| {
        measured
            .get(name)
            .and_then(serde_json::Value::as_f64)
            .filter(|rate| *rate > 0.0)
            .map(|rate| 1e9 / rate)
    };
    let (Some(floor), Some(idle), Some(wrapped)) = (
        nanos("noop_pyo3"),
        nanos("idle_call"),
        nanos("idle_call_wrapped"),
    ) else {
        eprintln!("bench python: hkvm.bench reported no binding probes");
        return;
    };
    let floor_name = "a plain PyO3 function that does nothing, per call";
    printer.print(&BenchResult::new(
        WORKLOAD,
        floor_name,
        floor,
        "ns",
        "none (the floor of a call into the extension)",
        0.0,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "the store's binding doing nothing (1 key in, GIL released, a finished future waited for, 1 code out), per call",
        idle,
        "ns",
        floor_name,
        floor,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "the same through a Python function shaped like is_exist's layer, per call",
        wrapped,
        "ns",
        floor_name,
        floor,
    ));
}
