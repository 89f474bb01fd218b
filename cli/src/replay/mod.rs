//! `hkvm replay`: prints the decoded events of one or all sub-cluster streams, for
//! debugging. An undecodable message is printed as an error line with its sequence
//! and the replay goes on; `--stats` prints counts instead of events.

mod render;
mod stats;

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::subject::{event_subject, stream_name, stream_name_prefix, subcluster_of_stream};
use hkvm_events::{decode_message, EventKind, Limits, SubclusterId};
use hkvm_log::{EventLog, JetStreamLog, LogEntry, ReadOptions};

use crate::target::Target;
use render::{OutputFormat, Renderer};
use stats::Stats;

/// Options of `hkvm replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    target: Target,
    /// One sub-cluster, or `all`.
    #[arg(long, default_value = "all")]
    subcluster: String,
    /// Start at this stream sequence.
    #[arg(long, conflicts_with_all = ["since", "last"])]
    from_seq: Option<u64>,
    /// Start at this time: RFC 3339 (`2026-11-29T09:00:00Z`) or a duration ago (`10m`).
    #[arg(long, conflicts_with = "last")]
    since: Option<String>,
    /// Only the last N messages of each stream.
    #[arg(long)]
    last: Option<u64>,
    /// Stop after this stream sequence (inclusive).
    #[arg(long)]
    until_seq: Option<u64>,
    /// Only events that mention this key.
    #[arg(long)]
    key: Option<String>,
    /// Only these kinds, comma-separated (put, evicted, removed, segment_mounted,
    /// segment_unmounted, node_lost, snapshot).
    #[arg(long, value_delimiter = ',', value_parser = parse_kind)]
    kind: Vec<EventKind>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    format: OutputFormat,
    /// Keep waiting for new events.
    #[arg(long)]
    follow: bool,
    /// Print counts per kind and sub-cluster and the sequence range instead of events.
    #[arg(long)]
    stats: bool,
}

fn parse_kind(name: &str) -> Result<EventKind, String> {
    EventKind::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.name()).collect();
        format!("unknown kind {name:?}; known: {}", known.join(", "))
    })
}

/// Parses `--since`: RFC 3339, or a duration meaning "that long ago".
fn parse_since(text: &str) -> anyhow::Result<u64> {
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    if let Ok(ago) = humantime::parse_duration(text) {
        return Ok(now_ms().saturating_sub(ago.as_millis() as u64));
    }
    let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .with_context(|| format!("--since {text:?} is neither RFC 3339 nor a duration"))?;
    Ok(u64::try_from(at.unix_timestamp_nanos() / 1_000_000).unwrap_or_default())
}

/// One stream to replay.
struct Source {
    subcluster: SubclusterId,
    log: JetStreamLog,
}

async fn sources(js: &jetstream::Context, args: &ReplayArgs) -> anyhow::Result<Vec<Source>> {
    let cluster = &args.target.cluster;
    let subclusters: Vec<SubclusterId> = if args.subcluster == "all" {
        let prefix = stream_name_prefix(cluster);
        let mut names = js.stream_names();
        let mut found = Vec::new();
        while let Some(name) = names.next().await {
            let name = name.context("listing streams")?;
            if name.starts_with(&prefix) {
                found.extend(subcluster_of_stream(cluster, &name));
            }
        }
        found.sort();
        found
    } else {
        vec![SubclusterId::new(args.subcluster.as_str())?]
    };
    if subclusters.is_empty() {
        anyhow::bail!("cluster {cluster} has no event streams");
    }
    Ok(subclusters
        .into_iter()
        .map(|sc| Source {
            log: JetStreamLog::new(
                js.clone(),
                stream_name(cluster, &sc),
                event_subject(cluster, &sc),
            ),
            subcluster: sc,
        })
        .collect())
}

/// Where each stream's replay starts, from `--from-seq`, `--since` or `--last`,
/// clamped to what is still stored (a purged prefix is announced, not an error).
async fn read_options(
    source: &Source,
    args: &ReplayArgs,
    since_ms: Option<u64>,
) -> anyhow::Result<ReadOptions> {
    let bounds = source.log.bounds().await?;
    let wanted = match (args.from_seq, since_ms, args.last) {
        (Some(seq), _, _) => seq,
        (_, Some(ms), _) => source.log.first_seq_since(ms).await?,
        (_, _, Some(last)) => bounds.last_seq.saturating_sub(last) + 1,
        _ => 1,
    };
    let first = bounds.first_seq.max(1);
    if wanted < first {
        tracing::warn!(
            stream = source.log.stream_name(),
            wanted,
            first,
            "history before the first stored sequence was purged"
        );
    }
    Ok(ReadOptions {
        from_seq: wanted.max(first),
        until_seq: args.until_seq,
        follow: args.follow,
        ..ReadOptions::default()
    })
}

/// Runs the replay.
///
/// # Errors
/// When NATS is unreachable, a stream is missing, or output fails.
pub async fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let client = args.target.connect().await?;
    let js = jetstream::new(client);
    let since_ms = args.since.as_deref().map(parse_since).transpose()?;
    let sources = sources(&js, &args).await?;

    let mut total_expected = 0u64;
    let mut streams = Vec::new();
    for source in &sources {
        let options = read_options(source, &args, since_ms).await?;
        if !args.follow {
            let last = args
                .until_seq
                .unwrap_or(source.log.bounds().await?.last_seq);
            total_expected += last.saturating_sub(options.from_seq) + 1;
        }
        let subcluster = source.subcluster.clone();
        let entries = source.log.read(options).await?;
        streams.push(
            entries
                .map(move |entry| (subcluster.clone(), entry))
                .boxed(),
        );
    }
    let mut merged = futures::stream::select_all(streams);

    let limits = Limits::default();
    let mut stats = Stats::default();
    let renderer = Renderer::new(args.format);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let started = Instant::now();
    let mut last_progress = Instant::now();
    let mut messages = 0u64;

    while let Some((subcluster, entry)) = merged.next().await {
        let entry: LogEntry = match entry {
            Ok(entry) => entry,
            Err(error) => {
                writeln!(out, "{}", renderer.stream_error(&subcluster, &error))?;
                stats.stream_errors += 1;
                continue;
            }
        };
        messages += 1;
        match decode_message(&entry.payload, &limits) {
            Err(error) => {
                stats.record_bad_message(&subcluster);
                if !args.stats {
                    writeln!(out, "{}", renderer.bad_message(&subcluster, &entry, &error))?;
                }
            }
            Ok(message) => {
                stats.record_message(&subcluster, entry.seq, entry.payload.len());
                for (index, event) in message.events.enumerate() {
                    match event {
                        Ok(event) => {
                            if !args.kind.is_empty() && !args.kind.contains(&event.kind()) {
                                continue;
                            }
                            if args
                                .key
                                .as_deref()
                                .is_some_and(|key| !event.mentions_key(key))
                            {
                                continue;
                            }
                            stats.record_event(&subcluster, event.kind());
                            if !args.stats {
                                let line = renderer.event(
                                    &subcluster,
                                    &entry,
                                    &message.header,
                                    index,
                                    &event,
                                );
                                writeln!(out, "{line}")?;
                            }
                        }
                        Err(error) => {
                            stats.bad_events += 1;
                            if !args.stats {
                                writeln!(
                                    out,
                                    "{}",
                                    renderer.bad_event(&subcluster, &entry, &error)
                                )?;
                            }
                        }
                    }
                }
            }
        }
        if args.follow {
            out.flush()?;
        }
        if last_progress.elapsed() >= Duration::from_secs(1) {
            last_progress = Instant::now();
            let rate = messages as f64 / started.elapsed().as_secs_f64();
            if total_expected > 0 {
                eprintln!(
                    "replay: {messages}/{total_expected} messages, {} events, {rate:.0} msg/s",
                    stats.events
                );
            } else {
                eprintln!(
                    "replay: {messages} messages, {} events, {rate:.0} msg/s",
                    stats.events
                );
            }
        }
    }
    if args.stats {
        stats.print(&mut out, args.format)?;
    }
    out.flush()?;
    Ok(())
}
