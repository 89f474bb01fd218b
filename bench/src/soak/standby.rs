//! The hot standby of the soak workload's snapshot-under-load rows, in a
//! process of its own (this binary's hidden `soak-standby` command): a standby
//! runs on a host or at least in a process of its own, so neither its memory
//! traffic nor its allocator's page returns land in the leader's. It tells the
//! bench when each phase of the snapshot ends (encoded, stored, verified), so
//! that put latencies can be told apart by the phase they were served in.

use std::sync::atomic::AtomicBool;

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_log::SnapshotStore;
use hkvm_submaster::server::load_state;
use hkvm_submaster::snapshot;

use crate::recover::Bench;

/// The phases of writing a snapshot, in order, as the standby reports their ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Encoding the state (paced, on a thread at the lowest priority).
    Encode,
    /// Storing the bytes in the snapshot store (at the paced byte rate).
    Store,
    /// Reading them back to verify them (at the paced byte rate).
    Verify,
}

impl Phase {
    /// Every phase, in the order they run.
    pub(super) const ALL: [Phase; 3] = [Phase::Encode, Phase::Store, Phase::Verify];

    /// The line the standby prints when this phase ends.
    const fn done_line(self) -> &'static str {
        match self {
            Phase::Encode => "encoded",
            Phase::Store => "stored",
            Phase::Verify => "verified",
        }
    }

    /// What a row calls the phase.
    pub(super) const fn describe(self) -> &'static str {
        match self {
            Phase::Encode => "encoded",
            Phase::Store => "stored",
            Phase::Verify => "read back",
        }
    }
}

/// What the standby process prints once it has folded the stream.
const READY: &str = "ready";

/// The standby child process, driven over its stdin and stdout.
pub(super) struct StandbyProcess {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl StandbyProcess {
    /// Starts the child for the bench cluster `cluster` and waits until it has
    /// folded the stream.
    pub(super) async fn start(nats_url: &str, cluster: &str) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(std::env::current_exe()?)
            .args(["soak-standby", "--nats", nats_url, "--cluster", cluster])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().context("the standby's stdin")?;
        let stdout = child.stdout.take().context("the standby's stdout")?;
        let mut standby = Self {
            child,
            stdin,
            lines: tokio::io::BufReader::new(stdout).lines(),
        };
        standby.expect(READY).await?;
        Ok(standby)
    }

    /// Asks for the snapshot; the standby starts encoding it.
    pub(super) async fn ask_for_snapshot(&mut self) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        self.stdin.write_all(b"go\n").await?;
        Ok(self.stdin.flush().await?)
    }

    /// Waits until the standby says `phase` is over.
    pub(super) async fn phase_done(&mut self, phase: Phase) -> anyhow::Result<()> {
        self.expect(phase.done_line()).await
    }

    /// Waits for the child to exit (it frees its state first: not part of the
    /// snapshot).
    pub(super) async fn finish(mut self) -> anyhow::Result<()> {
        let status = self.child.wait().await?;
        anyhow::ensure!(status.success(), "the standby process ended with {status}");
        Ok(())
    }

    async fn expect(&mut self, line: &str) -> anyhow::Result<()> {
        match self.lines.next_line().await? {
            Some(got) if got == line => Ok(()),
            got => anyhow::bail!("the standby process said {got:?}, not {line:?}"),
        }
    }
}

/// The standby process itself: folds the bench cluster `cluster`'s stream, says
/// it is ready, and on a line on stdin writes its snapshot as a hot standby
/// does (encoded at low priority and paced, then stored and read back on the
/// low-priority writer thread at the paced byte rate), saying when each
/// [`Phase`] ends.
///
/// # Errors
/// When NATS fails, stdin closes early, or the snapshot does not read back
/// intact.
pub async fn standby_snapshot(nats_url: &str, cluster: &str) -> anyhow::Result<()> {
    use tokio::io::AsyncBufReadExt as _;
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    let config = Bench::config(cluster)?;
    let state = load_state(&js, &config, false).await?.state;
    let pace = config.snapshot_pace;
    let store = SnapshotStore::open(
        &js,
        &config.cluster,
        &config.subcluster,
        config.stream.replicas,
    )
    .await?
    .with_write_rate(Some(pace.write_bytes_per_sec));
    println!("{READY}");
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    stdin
        .next_line()
        .await?
        .context("stdin closed before the snapshot was asked for")?;
    let bytes = snapshot::encode_at_low_priority(&state, pace.cpu_share, &AtomicBool::new(false))?;
    println!("{}", Phase::Encode.done_line());
    let covers = state.applied_seq;
    let writer = store.clone();
    let (name, checksum) =
        snapshot::on_writer_thread(
            move || async move { Ok(writer.save_encoded(covers, bytes).await?) },
        )
        .await?;
    println!("{}", Phase::Store.done_line());
    snapshot::on_writer_thread(move || async move { Ok(store.verify(&name, checksum).await?) })
        .await?;
    println!("{}", Phase::Verify.done_line());
    Ok(())
}
