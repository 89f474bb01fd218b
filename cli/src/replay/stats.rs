//! `hkvm replay --stats`: counts per kind and per sub-cluster and sequence ranges.

use std::collections::BTreeMap;
use std::io::Write;

use hkvm_events::{EventKind, SubclusterId};
use serde_json::json;

use super::render::OutputFormat;

/// What one sub-cluster's stream held.
#[derive(Debug, Default)]
struct PerStream {
    messages: u64,
    bytes: u64,
    events: u64,
    bad_messages: u64,
    first_seq: Option<u64>,
    last_seq: Option<u64>,
}

/// Counters of a replay.
#[derive(Debug, Default)]
pub struct Stats {
    /// Events counted (after filters).
    pub events: u64,
    /// Events that did not decode.
    pub bad_events: u64,
    /// Reads that ended with an error.
    pub stream_errors: u64,
    per_kind: BTreeMap<EventKind, u64>,
    per_stream: BTreeMap<SubclusterId, PerStream>,
}

impl Stats {
    /// Counts a decodable message.
    pub fn record_message(&mut self, subcluster: &SubclusterId, seq: u64, bytes: usize) {
        let stream = self.per_stream.entry(subcluster.clone()).or_default();
        stream.messages += 1;
        stream.bytes += bytes as u64;
        stream.first_seq.get_or_insert(seq);
        stream.last_seq = Some(seq);
    }

    /// Counts a message that did not decode.
    pub fn record_bad_message(&mut self, subcluster: &SubclusterId) {
        self.per_stream
            .entry(subcluster.clone())
            .or_default()
            .bad_messages += 1;
    }

    /// Counts one event.
    pub fn record_event(&mut self, subcluster: &SubclusterId, kind: EventKind) {
        self.events += 1;
        *self.per_kind.entry(kind).or_default() += 1;
        self.per_stream
            .entry(subcluster.clone())
            .or_default()
            .events += 1;
    }

    /// Prints the summary.
    ///
    /// # Errors
    /// When writing fails.
    pub fn print(&self, out: &mut impl Write, format: OutputFormat) -> std::io::Result<()> {
        match format {
            OutputFormat::Json => {
                let kinds: BTreeMap<&str, u64> =
                    self.per_kind.iter().map(|(k, n)| (k.name(), *n)).collect();
                let streams: BTreeMap<&str, serde_json::Value> = self
                    .per_stream
                    .iter()
                    .map(|(sc, s)| {
                        (
                            sc.as_str(),
                            json!({"messages": s.messages, "bytes": s.bytes, "events": s.events,
                                   "bad_messages": s.bad_messages,
                                   "first_seq": s.first_seq, "last_seq": s.last_seq}),
                        )
                    })
                    .collect();
                let summary = json!({
                    "events": self.events, "bad_events": self.bad_events,
                    "stream_errors": self.stream_errors, "kinds": kinds, "subclusters": streams,
                });
                writeln!(out, "{summary}")
            }
            OutputFormat::Text => {
                writeln!(
                    out,
                    "events: {} (undecodable events: {}, read errors: {})",
                    self.events, self.bad_events, self.stream_errors
                )?;
                writeln!(out, "{:<20} {:>12}", "kind", "events")?;
                for (kind, count) in &self.per_kind {
                    writeln!(out, "{:<20} {:>12}", kind.name(), count)?;
                }
                writeln!(
                    out,
                    "{:<20} {:>10} {:>12} {:>10} {:>8} {:>10} {:>10}",
                    "subcluster", "messages", "bytes", "events", "bad", "first_seq", "last_seq"
                )?;
                for (sc, s) in &self.per_stream {
                    let seq = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
                    writeln!(
                        out,
                        "{:<20} {:>10} {:>12} {:>10} {:>8} {:>10} {:>10}",
                        sc.as_str(),
                        s.messages,
                        s.bytes,
                        s.events,
                        s.bad_messages,
                        seq(s.first_seq),
                        seq(s.last_seq)
                    )?;
                }
                Ok(())
            }
        }
    }
}
