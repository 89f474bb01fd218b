//! The nats-server of `hkvm local`: one child process with JetStream, its config,
//! log and store in a temp dir (removed on drop), on the preferred client port when
//! it is free and an ephemeral one otherwise. It counts as started once its
//! monitoring endpoint's `/healthz` answers 200 (JetStream up), and it is killed
//! when dropped.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Read as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Env var naming the `nats-server` binary to use, overriding every other lookup.
pub const NATS_SERVER_ENV: &str = "HKVM_NATS_SERVER";

/// Where `scripts/provision` installs nats-server, relative to the checkout.
const PROVISIONED: &str = ".tools/bin/nats-server";

/// How long the server may take to report healthy JetStream.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How often readiness is probed while waiting.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// How long one health probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A running `nats-server` child process with JetStream.
#[derive(Debug)]
pub struct EmbeddedNats {
    dir: TempDir,
    client_port: u16,
    monitor_port: u16,
    child: Option<Child>,
}

impl EmbeddedNats {
    /// Starts a server named `name` listening on `127.0.0.1:preferred_port` when
    /// that port is free (on an ephemeral port otherwise) and waits until it is
    /// healthy.
    ///
    /// # Errors
    /// No binary, a spawn failure, an early exit (with the server's last log
    /// lines), or no healthy answer within 30 s.
    pub async fn start(name: &str, preferred_port: u16) -> anyhow::Result<Self> {
        let binary = find_nats_server()?;
        let dir = tempfile::Builder::new()
            .prefix("hkvm-nats-")
            .tempdir()
            .context("creating the nats-server temp dir")?;
        let client_port = if preferred_port != 0 && port_is_free(preferred_port) {
            preferred_port
        } else {
            free_port()?
        };
        let mut server = Self {
            dir,
            client_port,
            monitor_port: free_port()?,
            child: None,
        };
        std::fs::write(server.config_path(), server.render_config(name))
            .context("writing the nats-server config")?;
        server.spawn(&binary)?;
        server.wait_ready(name).await?;
        Ok(server)
    }

    fn render_config(&self, name: &str) -> String {
        let mut config = String::new();
        // Writing into a String cannot fail.
        let _ = writeln!(config, "server_name: \"{name}\"");
        let _ = writeln!(config, "listen: \"127.0.0.1:{}\"", self.client_port);
        let _ = writeln!(config, "http: \"127.0.0.1:{}\"", self.monitor_port);
        let _ = writeln!(
            config,
            "jetstream {{\n  store_dir: \"{}\"\n}}",
            self.store_dir().display()
        );
        config
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("nats.conf")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    /// The JetStream store directory.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("jetstream")
    }

    /// The client URL, e.g. `nats://127.0.0.1:4222`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    /// The monitoring (HTTP) port, serving `/healthz`, `/jsz`, `/varz`.
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    fn spawn(&mut self, binary: &Path) -> anyhow::Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .context("opening the nats-server log")?;
        let mut command = Command::new(binary);
        command
            .arg("--config")
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut command);
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        self.child = Some(child);
        tracing::debug!(binary = %binary.display(), url = %self.url(), "nats-server spawned");
        Ok(())
    }

    /// Probes `/healthz` until it answers 200, failing early if the process exits.
    async fn wait_ready(&mut self, name: &str) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut last = String::from("not probed yet");
        while started.elapsed() < READY_TIMEOUT {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    anyhow::bail!(
                        "nats-server {name} exited early with {status}; log tail:\n{}",
                        self.log_tail()
                    );
                }
            }
            match probe_health(self.monitor_port).await {
                Ok(()) => return Ok(()),
                Err(seen) => last = seen,
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
        anyhow::bail!(
            "nats-server {name} not healthy after {} ms: {last}; log tail:\n{}",
            started.elapsed().as_millis(),
            self.log_tail()
        )
    }

    /// The last 40 lines the server logged.
    fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Connects a client to this server.
    ///
    /// # Errors
    /// When the server does not accept the connection.
    pub async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        let url = self.url();
        async_nats::connect(&url)
            .await
            .with_context(|| format!("connecting to {url}"))
    }

    /// Asks the process to shut down gracefully (SIGTERM) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            #[cfg(unix)]
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: kill(2) with a pid we spawned and have not reaped yet.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            #[cfg(not(unix))]
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EmbeddedNats {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether `127.0.0.1:port` can be bound right now.
fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Reserves a free loopback port by binding port 0 and releasing it (the tiny race
/// with other processes is accepted).
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// `GET /healthz` on `127.0.0.1:port`; `Ok(())` when it answered 200, otherwise
/// what the probe saw.
async fn probe_health(port: u16) -> Result<(), String> {
    let attempt = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .write_all(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::with_capacity(512);
        stream
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&answer);
        let status_line = text.lines().next().unwrap_or_default();
        if status_line.contains(" 200 ") {
            Ok(())
        } else {
            let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
            Err(format!("{status_line} {body}"))
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(result) => result,
        Err(_) => Err("health probe timed out".to_owned()),
    }
}

/// Finds the `nats-server` binary: `$HKVM_NATS_SERVER`, else `.tools/bin/nats-server`
/// (installed by `scripts/provision`) under any ancestor of this executable's
/// directory (`target/release/hkvm` finds the checkout's), else `PATH`.
///
/// # Errors
/// When `$HKVM_NATS_SERVER` names no file, or none of the places has one; the
/// message lists where it looked.
pub fn find_nats_server() -> anyhow::Result<PathBuf> {
    if let Some(explicit) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(explicit);
        anyhow::ensure!(
            path.is_file(),
            "nats-server not found: ${NATS_SERVER_ENV} is {}, which is not a file",
            path.display()
        );
        return Ok(path);
    }
    let exe = std::env::current_exe().ok();
    let provisioned: Vec<PathBuf> = exe
        .iter()
        .flat_map(|exe| exe.ancestors().skip(1))
        .map(|dir| dir.join(PROVISIONED))
        .collect();
    if let Some(found) = provisioned.iter().find(|candidate| candidate.is_file()) {
        return Ok(found.clone());
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(format!("nats-server{}", std::env::consts::EXE_SUFFIX)))
        .find(|candidate| candidate.is_file());
    on_path.with_context(|| {
        let looked: Vec<String> = provisioned
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        format!(
            "nats-server not found (looked at ${NATS_SERVER_ENV}, {} and PATH); run scripts/provision",
            if looked.is_empty() {
                format!("{PROVISIONED} (this executable's path is unknown)")
            } else {
                looked.join(", ")
            }
        )
    })
}

/// Makes the child receive SIGKILL when the thread that spawned it dies, so that an
/// aborted `hkvm local` does not leave its nats-server behind.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Elsewhere the child outlives an aborted parent; a clean stop still stops it.
#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_has_jetstream_in_the_temp_dir() {
        let server = EmbeddedNats {
            dir: tempfile::tempdir().unwrap(),
            client_port: 4222,
            monitor_port: 8222,
            child: None,
        };
        let config = server.render_config("hkvm-local");
        assert!(config.contains("server_name: \"hkvm-local\""));
        assert!(config.contains("listen: \"127.0.0.1:4222\""));
        assert!(config.contains("http: \"127.0.0.1:8222\""));
        assert!(config.contains(&format!("store_dir: \"{}\"", server.store_dir().display())));
    }
}
