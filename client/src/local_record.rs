//! Where `hkvm local` records the NATS URL it really uses (4222 when free, else
//! another port), so that commands given no `--nats` find that cluster rather
//! than whatever listens on 4222.

use std::path::PathBuf;

use hkvm_events::ClusterId;

/// The URL commands use when neither `--nats`, `HKVM_NATS_URL` nor a running
/// `hkvm local` of the cluster names one.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The record of `hkvm local` for `cluster`: in `$XDG_RUNTIME_DIR`, else the
/// temp directory.
pub fn path(cluster: &ClusterId) -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("hkvm-local-{cluster}.url"))
}

/// Records `url` as the NATS URL of `cluster`, served by this process, in a file
/// only this user may read; returns the record's path.
///
/// # Errors
/// When the file cannot be written.
pub fn write(cluster: &ClusterId, url: &str) -> std::io::Result<PathBuf> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let path = path(cluster);
    // The URL may carry the operator's password: readable by this user only.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(format!("{url}\n{}\n", std::process::id()).as_bytes())?;
    Ok(path)
}

/// Removes the record of `cluster` if this process wrote it.
pub fn remove(cluster: &ClusterId) {
    let path = path(cluster);
    if read_at(&path).is_some_and(|(_, pid)| pid == std::process::id()) {
        let _ = std::fs::remove_file(path);
    }
}

/// The URL recorded for `cluster` by a process that is still running.
pub fn read(cluster: &ClusterId) -> Option<String> {
    let (url, pid) = read_at(&path(cluster))?;
    std::path::Path::new(&format!("/proc/{pid}"))
        .exists()
        .then_some(url)
}

fn read_at(path: &std::path::Path) -> Option<(String, u32)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    let url = lines.next()?.trim().to_owned();
    let pid = lines.next()?.trim().parse().ok()?;
    (!url.is_empty()).then_some((url, pid))
}

/// The NATS URL a command uses: `explicit` (its `--nats` or `HKVM_NATS_URL`),
/// else the one a running `hkvm local` of `cluster` recorded, else
/// [`DEFAULT_NATS_URL`].
pub fn resolve(explicit: Option<&str>, cluster: &ClusterId) -> String {
    explicit
        .map(str::to_owned)
        .or_else(|| read(cluster))
        .unwrap_or_else(|| DEFAULT_NATS_URL.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_found_while_its_writer_runs_and_removed_by_it() {
        let cluster = ClusterId::new(format!("rec{}", std::process::id())).unwrap();
        assert_eq!(resolve(None, &cluster), DEFAULT_NATS_URL);
        write(&cluster, "nats://127.0.0.1:34567").unwrap();
        assert_eq!(resolve(None, &cluster), "nats://127.0.0.1:34567");
        assert_eq!(resolve(Some("nats://h:1"), &cluster), "nats://h:1");
        remove(&cluster);
        assert_eq!(resolve(None, &cluster), DEFAULT_NATS_URL);
    }

    #[test]
    fn a_record_left_by_a_dead_process_is_ignored() {
        let cluster = ClusterId::new(format!("dead{}", std::process::id())).unwrap();
        // A pid above the kernel's maximum never runs.
        std::fs::write(path(&cluster), "nats://127.0.0.1:1\n4294967295\n").unwrap();
        assert_eq!(read(&cluster), None);
        let _ = std::fs::remove_file(path(&cluster));
    }
}
