//! Locating the `nats-server` binary: an explicit env var, the project-local tools dir
//! filled by `scripts/provision`, then `PATH`.

use std::path::{Path, PathBuf};

use crate::TestkitError;

/// Env var naming the `nats-server` binary to use, overriding every other lookup.
pub const NATS_SERVER_ENV: &str = "HKVM_NATS_SERVER";

/// The binary `scripts/provision` installs (pinned version, git-ignored dir).
fn project_local_binary() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/nats-server")
}

/// Finds the `nats-server` binary to run.
///
/// # Errors
/// [`TestkitError::BinaryNotFound`] when neither the env var, the tools dir nor
/// `PATH` has one.
pub fn find_nats_server() -> Result<PathBuf, TestkitError> {
    if let Some(explicit) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(explicit);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(TestkitError::BinaryNotFound(path))
        };
    }
    let local = project_local_binary();
    if local.is_file() {
        return Ok(local);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file());
    on_path.ok_or(TestkitError::BinaryNotFound(local))
}
