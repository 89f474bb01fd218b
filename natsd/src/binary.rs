//! Locating the `nats-server` binary: an explicit env var, the project-local tools
//! dir filled by `scripts/provision`, then `PATH`.

use std::path::{Path, PathBuf};

use crate::NatsdError;

/// Env var naming the `nats-server` binary to use, overriding every other lookup.
pub const NATS_SERVER_ENV: &str = "HKVM_NATS_SERVER";

/// Where `scripts/provision` installs nats-server (a pinned version, in a
/// git-ignored dir), relative to the checkout.
const PROVISIONED: &str = ".tools/bin/nats-server";

/// Which checkout's provisioned binary ([`PROVISIONED`]) to look for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ToolsDir {
    /// The checkout these crates were built from: tests and benchmarks run there.
    #[default]
    BuildCheckout,
    /// Any ancestor of the running executable's directory, so that
    /// `target/release/hkvm` finds its own checkout's and a binary installed
    /// elsewhere does not reach back to the machine it was built on.
    AboveExecutable,
}

impl ToolsDir {
    /// The places to look, best first.
    fn candidates(self) -> Vec<PathBuf> {
        match self {
            Self::BuildCheckout => {
                vec![Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("..")
                    .join(PROVISIONED)]
            }
            Self::AboveExecutable => std::env::current_exe()
                .ok()
                .iter()
                .flat_map(|exe| exe.ancestors().skip(1))
                .map(|dir| dir.join(PROVISIONED))
                .collect(),
        }
    }
}

/// Finds the `nats-server` binary to run: `$HKVM_NATS_SERVER`, else the one
/// `scripts/provision` installed in the checkout `tools_dir` names, else `PATH`.
///
/// # Errors
/// [`NatsdError::NotAFile`] when `$HKVM_NATS_SERVER` names no file;
/// [`NatsdError::NotFound`], listing where it looked, when no place has one.
pub fn find_nats_server(tools_dir: ToolsDir) -> Result<PathBuf, NatsdError> {
    if let Some(explicit) = std::env::var_os(NATS_SERVER_ENV) {
        let path = PathBuf::from(explicit);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(NatsdError::NotAFile(path))
        };
    }
    let provisioned = tools_dir.candidates();
    if let Some(found) = provisioned.iter().find(|candidate| candidate.is_file()) {
        return Ok(found.clone());
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(format!("nats-server{}", std::env::consts::EXE_SUFFIX)))
        .find(|candidate| candidate.is_file());
    on_path.ok_or_else(|| NatsdError::NotFound {
        looked: if provisioned.is_empty() {
            format!("{PROVISIONED} (this executable's path is unknown)")
        } else {
            provisioned
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        },
    })
}
