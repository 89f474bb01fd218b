//! One `nats-server` child process with JetStream, on ephemeral loopback ports and a
//! temp store dir that survives [`NatsServer::kill`] + [`NatsServer::restart`] (so a
//! restart finds its data again) and is removed on drop.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Read as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{find_nats_server, health, TestkitError};

/// How to start a server. Fill what you need and take the rest from `Default`.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// `server_name`, also used in logs and errors.
    pub name: String,
    /// Enable JetStream (file storage in the temp dir).
    pub jetstream: bool,
    /// Raw config text appended to the generated config (accounts, users, limits).
    pub extra_config: String,
    /// How long to wait for `/healthz` to answer 200.
    pub ready_timeout: Duration,
    /// A fixed client port; an ephemeral one when `None`.
    pub client_port: Option<u16>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            name: "hkvm-test".to_owned(),
            jetstream: true,
            extra_config: String::new(),
            ready_timeout: Duration::from_secs(30),
            client_port: None,
        }
    }
}

/// Cluster membership of one node: its route port and its peers' route ports.
#[derive(Debug, Clone)]
pub(crate) struct RouteConfig {
    pub(crate) cluster_name: String,
    pub(crate) route_port: u16,
    pub(crate) peer_route_ports: Vec<u16>,
}

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

/// Reserves a free loopback port by binding port 0 and releasing it. The tiny race
/// with other processes is accepted: tests need ports they can reuse on restart.
pub(crate) fn free_port() -> Result<u16, TestkitError> {
    let listener = TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

impl NatsServer {
    /// Starts a single JetStream server with default options.
    ///
    /// # Errors
    /// See [`NatsServer::start_with`].
    pub async fn start() -> Result<Self, TestkitError> {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts a single server with `options` and waits until it is healthy.
    ///
    /// # Errors
    /// No binary, a spawn failure, an early exit or a health timeout.
    pub async fn start_with(options: ServerOptions) -> Result<Self, TestkitError> {
        let mut server = Self::prepare(options, None)?;
        server.spawn()?;
        server.wait_ready().await?;
        Ok(server)
    }

    /// Writes the config and reserves ports without starting the process.
    pub(crate) fn prepare(
        options: ServerOptions,
        routes: Option<RouteConfig>,
    ) -> Result<Self, TestkitError> {
        let binary = find_nats_server()?;
        let dir = tempfile::Builder::new().prefix("hkvm-nats-").tempdir()?;
        let client_port = match options.client_port {
            Some(port) => port,
            None => free_port()?,
        };
        let server = Self {
            client_port,
            monitor_port: free_port()?,
            options,
            binary,
            dir,
            child: None,
        };
        std::fs::write(server.config_path(), server.render_config(routes.as_ref()))?;
        Ok(server)
    }

    fn render_config(&self, routes: Option<&RouteConfig>) -> String {
        let mut config = String::new();
        // Writing into a String cannot fail.
        let _ = writeln!(config, "server_name: \"{}\"", self.options.name);
        let _ = writeln!(config, "listen: \"127.0.0.1:{}\"", self.client_port);
        let _ = writeln!(config, "http: \"127.0.0.1:{}\"", self.monitor_port);
        if self.options.jetstream {
            let _ = writeln!(
                config,
                "jetstream {{\n  store_dir: \"{}\"\n}}",
                self.store_dir().display()
            );
        }
        if let Some(routes) = routes {
            let peers: Vec<String> = routes
                .peer_route_ports
                .iter()
                .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
                .collect();
            let _ = writeln!(
                config,
                "cluster {{\n  name: \"{}\"\n  listen: \"127.0.0.1:{}\"\n  routes: [{}]\n}}",
                routes.cluster_name,
                routes.route_port,
                peers.join(", ")
            );
        }
        config.push_str(&self.options.extra_config);
        config.push('\n');
        config
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

    pub(crate) fn spawn(&mut self) -> Result<(), TestkitError> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut command = Command::new(&self.binary);
        command
            .arg("--config")
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut command);
        self.child = Some(command.spawn()?);
        tracing::debug!(name = %self.options.name, url = %self.url(), "nats-server spawned");
        Ok(())
    }

    pub(crate) async fn wait_ready(&mut self) -> Result<(), TestkitError> {
        let started = Instant::now();
        let mut last = String::from("not probed yet");
        while started.elapsed() < self.options.ready_timeout {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(TestkitError::Exited {
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
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(TestkitError::NotReady {
            name: self.options.name.clone(),
            waited_ms: started.elapsed().as_millis(),
            last,
        })
    }

    /// The last 40 lines the server logged.
    pub fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
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
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: kill(2) with a pid we spawned and have not reaped yet.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            let _ = child.wait();
        }
    }

    /// Restarts the process on the same ports and store dir (killing it first if it
    /// still runs) and waits until it is healthy.
    ///
    /// # Errors
    /// As for [`NatsServer::start_with`].
    pub async fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill();
        self.spawn()?;
        self.wait_ready().await
    }

    /// Connects a client to this server.
    ///
    /// # Errors
    /// [`TestkitError::Connect`] when the server does not accept the connection.
    pub async fn connect(&self) -> Result<async_nats::Client, TestkitError> {
        let url = self.url();
        async_nats::connect(&url)
            .await
            .map_err(|source| TestkitError::Connect { url, source })
    }

    /// The path of the server's working dir (config, log, store).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Makes the child receive SIGKILL when the thread that spawned it dies, so a test
/// process that aborts does not leave nats-servers behind.
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
