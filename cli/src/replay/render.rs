//! One output line per event (or per error) of `hkvm replay`, as text or JSON.

use hkvm_events::{DecodeError, EventError, Header, KvEvent, SubclusterId};
use hkvm_log::{LogEntry, LogError};
use serde_json::{json, Value};

/// How replay lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line.
    Json,
}

/// Formats replay lines in one format.
pub struct Renderer {
    format: OutputFormat,
}

/// RFC 3339 with milliseconds, UTC.
pub fn format_ms(unix_ms: u64) -> String {
    let nanos = i128::from(unix_ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| unix_ms.to_string())
}

/// The kind-specific fields of an event, as JSON.
fn event_fields(event: &KvEvent) -> Value {
    match event {
        KvEvent::SegmentMounted(e) => json!({
            "node": e.node.as_str(), "segment": e.segment.as_str(),
            "size": e.size, "endpoint": e.endpoint,
            "rdma": e.rdma.as_ref().map(|r| json!({
                "device": r.device, "gid": r.gid_text(), "lid": r.lid,
                "exchange": r.exchange, "rkey": r.rkey, "addr": format!("{:#x}", r.addr),
            })),
        }),
        KvEvent::SegmentUnmounted(e) => {
            json!({"node": e.node.as_str(), "segment": e.segment.as_str()})
        }
        KvEvent::NodeLost(e) => json!({"node": e.node.as_str()}),
        KvEvent::PutCommitted(e) => json!({
            "key": e.key, "key_hash": format!("{:016x}", e.key_hash), "size": e.size,
            "checksum": format!("{:016x}", e.checksum),
            "placements": e.placements.iter()
                .map(|p| json!({"segment": p.segment.as_str(), "offset": p.offset}))
                .collect::<Vec<_>>(),
            "hard_pin": e.flags.hard_pinned(),
        }),
        KvEvent::Evicted(e) => json!({"keys": e.keys}),
        KvEvent::Removed(e) => json!({"keys": e.keys}),
        KvEvent::Snapshot(e) => json!({
            "covers_seq": e.covers_seq, "object": e.object,
            "checksum": format!("{:016x}", e.checksum),
        }),
    }
}

/// The kind-specific part of a text line.
fn event_text(event: &KvEvent) -> String {
    match event {
        KvEvent::SegmentMounted(e) => match &e.rdma {
            None => format!(
                "node={} segment={} size={} endpoint={}",
                e.node, e.segment, e.size, e.endpoint
            ),
            Some(rdma) => format!(
                "node={} segment={} size={} endpoint={} rdma={rdma}",
                e.node, e.segment, e.size, e.endpoint
            ),
        },
        KvEvent::SegmentUnmounted(e) => format!("node={} segment={}", e.node, e.segment),
        KvEvent::NodeLost(e) => format!("node={}", e.node),
        KvEvent::PutCommitted(e) => {
            let replicas: Vec<String> = e
                .placements
                .iter()
                .map(|p| format!("{}@{}", p.segment, p.offset))
                .collect();
            format!(
                "key={:?} size={} checksum={:016x} replicas={}{}",
                e.key,
                e.size,
                e.checksum,
                replicas.join(","),
                if e.flags.hard_pinned() {
                    " hard_pin"
                } else {
                    ""
                }
            )
        }
        KvEvent::Evicted(e) => format!("{} keys={:?}", e.keys.len(), e.keys),
        KvEvent::Removed(e) => format!("{} keys={:?}", e.keys.len(), e.keys),
        KvEvent::Snapshot(e) => format!(
            "covers_seq={} object={} checksum={:016x}",
            e.covers_seq, e.object, e.checksum
        ),
    }
}

impl Renderer {
    /// A renderer for `format`.
    pub fn new(format: OutputFormat) -> Self {
        Self { format }
    }

    /// The line of one decoded event.
    pub fn event(
        &self,
        subcluster: &SubclusterId,
        entry: &LogEntry,
        header: &Header,
        index: usize,
        event: &KvEvent,
    ) -> String {
        match self.format {
            OutputFormat::Text => format!(
                "{subcluster} #{}.{index} {} {}/e{} {} {}",
                entry.seq,
                format_ms(entry.unix_ms),
                header.producer,
                header.epoch,
                event.kind(),
                event_text(event)
            ),
            OutputFormat::Json => json!({
                "subcluster": subcluster.as_str(), "seq": entry.seq, "index": index,
                "time": format_ms(entry.unix_ms), "producer": header.producer.as_str(),
                "epoch": header.epoch, "kind": event.kind().name(), "event": event_fields(event),
            })
            .to_string(),
        }
    }

    /// The line of a message that does not decode at all.
    pub fn bad_message(
        &self,
        subcluster: &SubclusterId,
        entry: &LogEntry,
        error: &DecodeError,
    ) -> String {
        self.error_line(
            subcluster,
            Some(entry.seq),
            None,
            &format!(
                "undecodable message ({} bytes): {error}",
                entry.payload.len()
            ),
        )
    }

    /// The line of one event that does not decode.
    pub fn bad_event(
        &self,
        subcluster: &SubclusterId,
        entry: &LogEntry,
        error: &EventError,
    ) -> String {
        self.error_line(
            subcluster,
            Some(entry.seq),
            Some(error.index),
            &error.kind.to_string(),
        )
    }

    /// The line of a failed read (the stream's replay ends after it).
    pub fn stream_error(&self, subcluster: &SubclusterId, error: &LogError) -> String {
        self.error_line(subcluster, None, None, &error.to_string())
    }

    fn error_line(
        &self,
        subcluster: &SubclusterId,
        seq: Option<u64>,
        index: Option<usize>,
        what: &str,
    ) -> String {
        match self.format {
            OutputFormat::Text => {
                let at = match (seq, index) {
                    (Some(seq), Some(index)) => format!(" #{seq}.{index}"),
                    (Some(seq), None) => format!(" #{seq}"),
                    _ => String::new(),
                };
                format!("{subcluster}{at} ERROR {what}")
            }
            OutputFormat::Json => json!({
                "subcluster": subcluster.as_str(), "seq": seq, "index": index, "error": what,
            })
            .to_string(),
        }
    }
}
