//! One `nats-server` child process on loopback ports, with its config, log and
//! JetStream store in a temp dir that survives [`NatsServer::kill`] and
//! [`NatsServer::restart`] (so a restart finds its data again) and is removed on
//! drop.

use std::fs::File;
use std::io::Read as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::options::render;
use crate::{find_nats_server, health, ClientPort, NatsdError, ServerOptions};

/// How often readiness is probed while waiting.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// How many of the server's last log lines an error report carries.
const LOG_TAIL_LINES: usize = 40;

/// A running (or killed, restartable) `nats-server` child process.
#[derive(Debug)]
pub struct NatsServer {
    options: ServerOptions,
    binary: PathBuf,
    dir: TempDir,
    client_port: u16,
    monitor_port: u16,
    child: Option<Child>,
}

/// Whether `127.0.0.1:port` can be bound right now.
pub fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Reserves a free loopback port by binding port 0 and releasing it. The tiny race
/// with other processes is accepted: a server needs ports it can reuse on restart,
/// and a cluster needs its peers' route ports before any node runs.
///
/// # Errors
/// [`NatsdError::Io`] when no port can be bound.
pub fn free_port() -> Result<u16, NatsdError> {
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).map_err(NatsdError::io("finding a free port"))?;
    let addr = listener
        .local_addr()
        .map_err(NatsdError::io("finding a free port"))?;
    Ok(addr.port())
}

impl NatsServer {
    /// Starts a single JetStream server with default options.
    ///
    /// # Errors
    /// See [`NatsServer::start_with`].
    pub async fn start() -> Result<Self, NatsdError> {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts a server with `options` and waits until it is healthy.
    ///
    /// # Errors
    /// No binary, a spawn failure, an early exit or a health timeout.
    pub async fn start_with(options: ServerOptions) -> Result<Self, NatsdError> {
        let mut server = Self::prepare(options)?;
        server.spawn()?;
        server.wait_ready().await?;
        Ok(server)
    }

    /// Finds the binary, reserves the ports and writes the config without starting
    /// the process: the nodes of a cluster must all run before any is healthy.
    ///
    /// # Errors
    /// No binary, no free port, or the temp dir or config cannot be written.
    pub fn prepare(options: ServerOptions) -> Result<Self, NatsdError> {
        let binary = find_nats_server(options.tools_dir)?;
        let dir = tempfile::Builder::new()
            .prefix("hkvm-nats-")
            .tempdir()
            .map_err(NatsdError::io("creating the nats-server temp dir"))?;
        let client_port = match options.client_port {
            ClientPort::Fixed(port) => port,
            ClientPort::Preferred(port) if port != 0 && port_is_free(port) => port,
            ClientPort::Preferred(_) | ClientPort::Ephemeral => free_port()?,
        };
        let server = Self {
            client_port,
            monitor_port: free_port()?,
            options,
            binary,
            dir,
            child: None,
        };
        let config = render(
            &server.options,
            server.client_port,
            server.monitor_port,
            &server.store_dir(),
        );
        std::fs::write(server.config_path(), config)
            .map_err(NatsdError::io("writing the nats-server config"))?;
        Ok(server)
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("nats.conf")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    /// The JetStream store directory (kept across kill and restart).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("jetstream")
    }

    /// The path of the server's working dir (config, log, store).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server name from its options.
    pub fn name(&self) -> &str {
        &self.options.name
    }

    /// The client URL, e.g. `nats://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The monitoring (HTTP) port, serving `/healthz`, `/jsz`, `/varz`.
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the child process is alive.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Spawns the process with the written config, its output going to the log.
    ///
    /// # Errors
    /// [`NatsdError::Io`] when the log cannot be opened or the process not spawned.
    pub fn spawn(&mut self) -> Result<(), NatsdError> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(NatsdError::io("opening the nats-server log"))?;
        let stdout = log
            .try_clone()
            .map_err(NatsdError::io("opening the nats-server log"))?;
        let mut command = Command::new(&self.binary);
        command
            .arg("--config")
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log);
        die_with_parent(&mut command);
        let child = command.spawn().map_err(NatsdError::io(format!(
            "starting {}",
            self.binary.display()
        )))?;
        self.child = Some(child);
        tracing::debug!(
            name = %self.options.name,
            binary = %self.binary.display(),
            url = %self.url(),
            "nats-server spawned"
        );
        Ok(())
    }

    /// Probes `/healthz` until it answers 200, failing early if the process exits.
    ///
    /// # Errors
    /// [`NatsdError::Exited`] when the process ends first, [`NatsdError::NotReady`]
    /// when the ready timeout passes first; both carry the log's tail.
    pub async fn wait_ready(&mut self) -> Result<(), NatsdError> {
        let started = Instant::now();
        let mut last = String::from("not probed yet");
        while started.elapsed() < self.options.ready_timeout {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(NatsdError::Exited {
                        name: self.options.name.clone(),
                        status,
                        log_tail: self.log_tail(),
                    });
                }
            }
            match health::probe(self.monitor_port).await {
                Ok(()) => return Ok(()),
                Err(seen) => last = seen,
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
        Err(NatsdError::NotReady {
            name: self.options.name.clone(),
            waited_ms: started.elapsed().as_millis(),
            last,
            log_tail: self.log_tail(),
        })
    }

    /// The last 40 lines the server logged.
    pub fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// Kills the process with SIGKILL (a crash, no graceful shutdown) and reaps it.
    /// The store dir stays, so [`NatsServer::restart`] recovers from it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
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

    /// Restarts the process on the same ports and store dir (killing it first if it
    /// still runs) and waits until it is healthy.
    ///
    /// # Errors
    /// As for [`NatsServer::start_with`].
    pub async fn restart(&mut self) -> Result<(), NatsdError> {
        self.kill();
        self.spawn()?;
        self.wait_ready().await
    }

    /// Connects a client to this server.
    ///
    /// # Errors
    /// [`NatsdError::Connect`] when the server does not accept the connection.
    pub async fn connect(&self) -> Result<async_nats::Client, NatsdError> {
        let url = self.url();
        async_nats::connect(&url)
            .await
            .map_err(|source| NatsdError::Connect { url, source })
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Makes the child receive SIGKILL when the thread that spawned it dies, so that an
/// aborted `hkvm local` or test process does not leave its nats-servers behind.
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
