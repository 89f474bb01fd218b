//! The servers each side of the `mooncake` workload runs against: Mooncake's
//! `mooncake_master` from its PyPI wheel (installed into a venv of the workload's
//! own under the project's `.tools/`), and HKVM's sub-master and global master as
//! `hkvm` processes on a nats-server of their own.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_client::SubmasterClient;
use hkvm_events::{ClusterId, SubclusterId};
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::scale::{clean, cpu_seconds, Master};
use crate::BenchNats;

/// The wheel that carries Mooncake Store's Python client and `mooncake_master`.
const WHEEL: &str = "mooncake-transfer-engine-non-cuda";
/// The pinned version of [`WHEEL`].
const WHEEL_VERSION: &str = "0.3.13.post1";
/// The venv the workload installs [`WHEEL`] into, under the project's `.tools/`.
const VENV: &str = "mooncake-venv";
/// Env var naming a Python interpreter that has the Mooncake wheel installed; the
/// workload then installs nothing.
pub const MOONCAKE_PYTHON_ENV: &str = "HKVM_MOONCAKE_PYTHON";
/// How long `pip install` may take (the wheel is about 100 MB).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a server may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a server's port is probed while waiting.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// The sub-cluster HKVM's side runs.
pub const SUBCLUSTER: &str = "sc-0";

/// Mooncake Store, installed: its Python interpreter and its master binary.
#[derive(Debug)]
pub struct Mooncake {
    /// An interpreter that imports `mooncake.store`.
    pub python: PathBuf,
    /// `mooncake_master` from the same wheel.
    master: PathBuf,
    /// The wheel's version.
    pub version: String,
}

/// What a probe of an interpreter found: the wheel's version and the package's
/// directory.
async fn probe(python: &Path) -> anyhow::Result<(String, PathBuf)> {
    let script = format!(
        "import importlib.metadata, os, mooncake, mooncake.store\n\
         print(importlib.metadata.version({WHEEL:?}))\n\
         print(os.path.dirname(mooncake.__file__))"
    );
    let output = Command::new(python)
        .args(["-c", &script])
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "{} cannot import mooncake.store: {}",
        python.display(),
        last_line(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lines = stdout.lines();
    match (lines.next(), lines.next()) {
        (Some(version), Some(dir)) => Ok((version.to_owned(), PathBuf::from(dir))),
        _ => anyhow::bail!(
            "unexpected probe output from {}: {stdout}",
            python.display()
        ),
    }
}

/// The last non-empty line of a command's output, for error messages.
fn last_line(output: &[u8]) -> String {
    String::from_utf8_lossy(output)
        .lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .unwrap_or("(no output)")
        .trim()
        .to_owned()
}

/// The project's `.tools/` directory: the nearest above this executable.
fn tools_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .skip(1)
        .map(|dir| dir.join(".tools"))
        .find(|candidate| candidate.is_dir())
}

/// Runs one set-up command to its end, failing on a non-zero exit.
async fn run_step(what: &str, command: &mut Command) -> anyhow::Result<()> {
    let output = tokio::time::timeout(
        INSTALL_TIMEOUT,
        command.stdin(Stdio::null()).kill_on_drop(true).output(),
    )
    .await
    .with_context(|| format!("{what} took longer than {INSTALL_TIMEOUT:?}"))?
    .with_context(|| format!("{what}: cannot run it"))?;
    anyhow::ensure!(
        output.status.success(),
        "{what} failed ({}): {}",
        output.status,
        last_line(&output.stderr)
    );
    Ok(())
}

impl Mooncake {
    /// Finds Mooncake Store: `$HKVM_MOONCAKE_PYTHON`, else the venv
    /// `.tools/mooncake-venv`, made with `python3 -m venv` and the pinned wheel
    /// installed with pip when it is missing or holds another version.
    ///
    /// # Errors
    /// When no interpreter has the wheel and it cannot be installed (no
    /// `.tools/`, no venv module, no network, no wheel for this Python or
    /// platform), or the wheel holds no `mooncake_master`.
    pub async fn install() -> anyhow::Result<Self> {
        let python = match std::env::var_os(MOONCAKE_PYTHON_ENV) {
            Some(explicit) => PathBuf::from(explicit),
            None => {
                let tools = tools_dir().context(
                    "no .tools directory above this executable to install the wheel into \
                     (run scripts/provision, or set $HKVM_MOONCAKE_PYTHON)",
                )?;
                let venv = tools.join(VENV);
                let python = venv.join("bin/python");
                let current = probe(&python).await.ok();
                if current.as_ref().map(|(version, _)| version.as_str()) != Some(WHEEL_VERSION) {
                    install_wheel(&venv).await?;
                }
                python
            }
        };
        let (version, dir) = probe(&python).await?;
        let master = dir.join("mooncake_master");
        anyhow::ensure!(
            master.is_file(),
            "the wheel has no mooncake_master at {}",
            master.display()
        );
        Ok(Self {
            python,
            master,
            version,
        })
    }
}

/// Makes the venv (when it has no interpreter) and installs the pinned wheel.
async fn install_wheel(venv: &Path) -> anyhow::Result<()> {
    let python = venv.join("bin/python");
    if !python.is_file() {
        eprintln!("bench mooncake: creating the venv {}", venv.display());
        run_step(
            "python3 -m venv",
            Command::new("python3").arg("-m").arg("venv").arg(venv),
        )
        .await?;
    }
    eprintln!(
        "bench mooncake: installing {WHEEL}=={WHEEL_VERSION} into {}",
        venv.display()
    );
    run_step(
        "pip install",
        Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("{WHEEL}=={WHEEL_VERSION}"),
        ]),
    )
    .await
}

/// A free loopback port: bound to port 0 and released (another process may take
/// it in between, which is accepted here as in the test kit).
fn free_port() -> anyhow::Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until every one of `ports` on loopback accepts a TCP connection, or the
/// child exits, or [`READY_TIMEOUT`] passes.
async fn wait_for_ports(child: &mut Child, ports: &[u16], log: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    for &port in ports {
        loop {
            if tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
                .await
                .is_ok()
            {
                break;
            }
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "mooncake_master exited ({status}) before it listened on port {port}: {}",
                    tail(log)
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "mooncake_master did not listen on port {port} within {READY_TIMEOUT:?}: {}",
                tail(log)
            );
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    }
    Ok(())
}

/// The last lines of a log file, for error messages.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A running `mooncake_master`, killed when dropped; its logs live in a temp dir.
pub struct MooncakeMaster {
    child: Child,
    rpc_port: u16,
    http_port: u16,
    _dir: TempDir,
}

impl MooncakeMaster {
    /// Starts the master on free loopback ports with its HTTP metadata server and
    /// waits until its RPC port and its metadata port accept connections.
    ///
    /// # Errors
    /// When it cannot be started, exits, or does not listen in time.
    pub async fn start(mooncake: &Mooncake) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("a temp dir for mooncake_master")?;
        let (rpc_port, http_port, metrics_port) = (free_port()?, free_port()?, free_port()?);
        let log = dir.path().join("master.out");
        let output = std::fs::File::create(&log)?;
        let mut child = Command::new(&mooncake.master)
            .arg("--rpc_address=127.0.0.1")
            .arg(format!("--rpc_port={rpc_port}"))
            .arg("--enable_http_metadata_server=true")
            .arg("--http_metadata_server_host=127.0.0.1")
            .arg(format!("--http_metadata_server_port={http_port}"))
            .arg(format!("--metrics_port={metrics_port}"))
            .arg(format!("--log_dir={}", dir.path().display()))
            .stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", mooncake.master.display()))?;
        wait_for_ports(&mut child, &[rpc_port, http_port], &log).await?;
        Ok(Self {
            child,
            rpc_port,
            http_port,
            _dir: dir,
        })
    }

    /// The `master_server_addr` clients give `setup`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.rpc_port)
    }

    /// The `metadata_server` clients give `setup`.
    pub fn metadata(&self) -> String {
        format!("http://127.0.0.1:{}/metadata", self.http_port)
    }

    /// The master's CPU seconds so far.
    pub fn cpu(&self) -> ServerCpu {
        ServerCpu {
            masters: cpu_seconds(self.child.id()),
            nats: 0.0,
        }
    }

    /// Stops the master.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// CPU seconds (user + system) of one side's server processes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerCpu {
    /// The masters: Mooncake's master, or HKVM's sub-master and global master.
    pub masters: f64,
    /// HKVM's nats-server (0 for Mooncake, and when the server was given).
    pub nats: f64,
}

impl ServerCpu {
    /// Every server together.
    pub fn total(&self) -> f64 {
        self.masters + self.nats
    }

    /// What was spent between `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            masters: self.masters - before.masters,
            nats: self.nats - before.nats,
        }
    }
}

/// HKVM's side: a sub-master and a global master (`hkvm` processes) of one
/// sub-cluster on a nats-server of their own (or the given one).
pub struct HkvmServers {
    nats: BenchNats,
    cluster: ClusterId,
    submaster: Master,
    global_master: Master,
}

impl HkvmServers {
    /// Starts a nats-server child unless `given` names a server the user gave (a
    /// fresh one for every run, so that each starts from an empty store), then
    /// the masters, and waits until both answer.
    ///
    /// # Errors
    /// When a process cannot be started or a master does not answer.
    pub async fn start(hkvm: &Path, given: Option<&str>, cluster: &str) -> anyhow::Result<Self> {
        let nats = BenchNats::new(given.map(str::to_owned)).await?;
        let cluster = ClusterId::new(cluster)?;
        let control = nats.connect().await?;
        clean(&jetstream::new(control.clone()), &cluster, 1).await;
        let common = [
            "--nats".to_owned(),
            nats.url.clone(),
            "--cluster".to_owned(),
            cluster.to_string(),
        ];
        let mut args = vec!["submaster".to_owned()];
        args.extend_from_slice(&common);
        args.extend(["--subcluster".to_owned(), SUBCLUSTER.to_owned()]);
        let submaster = Master::spawn(hkvm, &args)?;
        let mut args = vec!["globalmaster".to_owned()];
        args.extend_from_slice(&common);
        args.push("--no-restore".to_owned());
        let global_master = Master::spawn(hkvm, &args)?;
        SubmasterClient::new(
            control.clone(),
            cluster.clone(),
            SubclusterId::new(SUBCLUSTER)?,
        )
        .status()
        .await
        .context("the sub-master did not start")?;
        crate::scale::wait_global_serves(control, &cluster).await?;
        Ok(Self {
            nats,
            cluster,
            submaster,
            global_master,
        })
    }

    /// The `master_server_addr` clients give `setup`.
    pub fn address(&self) -> String {
        format!("{}/{}/{SUBCLUSTER}", self.nats.url, self.cluster)
    }

    /// The masters' and the nats-server's CPU seconds so far.
    pub fn cpu(&self) -> ServerCpu {
        ServerCpu {
            masters: cpu_seconds(self.submaster.pid()) + cpu_seconds(self.global_master.pid()),
            nats: cpu_seconds(self.nats.pid()),
        }
    }

    /// Stops the masters, then the nats-server, and drops what a given server
    /// holds of this run.
    pub async fn stop(self) {
        drop(self.submaster);
        drop(self.global_master);
        if self.nats.pid().is_none() {
            if let Ok(control) = self.nats.connect().await {
                clean(&jetstream::new(control), &self.cluster, 1).await;
            }
        }
    }
}
