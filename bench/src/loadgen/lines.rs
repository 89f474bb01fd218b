//! Where the load generator's JSON result lines go: stdout, or a file
//! (`--output`). A test that runs it in a container reads the file through a bind
//! mount, so neither the result nor the run's progress depends on the container
//! engine copying stdout (an engine that falls behind can hold a process on a full
//! pipe, and the last lines reach its log late).

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;

/// A shared writer of result lines; each line reaches its destination whole, in one
/// write, before [`ResultLines::line`] returns.
#[derive(Clone)]
pub struct ResultLines {
    sink: Arc<Mutex<Sink>>,
}

struct Sink {
    out: Box<dyn Write + Send>,
    /// The first failed write: reported by [`ResultLines::finish`], since a lost
    /// line would make the run's record incomplete.
    failed: Option<std::io::Error>,
}

impl ResultLines {
    /// Lines to `path` (created or truncated), or to stdout without one.
    ///
    /// # Errors
    /// When the file cannot be created.
    pub fn open(path: Option<&Path>) -> anyhow::Result<Self> {
        let out: Box<dyn Write + Send> = match path {
            Some(path) => Box::new(
                File::create(path).with_context(|| format!("creating {}", path.display()))?,
            ),
            None => Box::new(std::io::stdout()),
        };
        Ok(Self {
            sink: Arc::new(Mutex::new(Sink { out, failed: None })),
        })
    }

    /// Writes `value` as one line.
    pub fn line(&self, value: &serde_json::Value) {
        let mut text = value.to_string();
        text.push('\n');
        let mut sink = self
            .sink
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if sink.failed.is_some() {
            return;
        }
        let written = sink
            .out
            .write_all(text.as_bytes())
            .and_then(|()| sink.out.flush());
        if let Err(error) = written {
            sink.failed = Some(error);
        }
    }

    /// Ends the run's output.
    ///
    /// # Errors
    /// When any line could not be written.
    pub fn finish(&self) -> anyhow::Result<()> {
        let mut sink = self
            .sink
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match sink.failed.take() {
            Some(error) => Err(anyhow::Error::from(error).context("writing a result line")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ResultLines;
    use serde_json::json;

    #[test]
    fn every_line_is_in_the_file_when_it_returns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lines.jsonl");
        let lines = ResultLines::open(Some(&path)).unwrap();
        lines.line(&json!({"type": "ack", "key": "a"}));
        let written = std::fs::read_to_string(&path).unwrap();
        assert!(written.ends_with('\n'));
        let parsed: serde_json::Value = serde_json::from_str(&written).unwrap();
        assert_eq!(parsed, json!({"type": "ack", "key": "a"}));
        lines.line(&json!({"type": "summary"}));
        lines.finish().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 2);
    }

    #[test]
    fn a_failed_write_fails_the_run() {
        let lines = ResultLines::open(Some(std::path::Path::new("/dev/full"))).unwrap();
        lines.line(&json!({"type": "ack"}));
        assert!(lines.finish().is_err());
    }

    #[test]
    fn a_file_that_cannot_be_created_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ResultLines::open(Some(&dir.path().join("no/such/dir"))).is_err());
    }
}
