//! The container images the suite runs, named by env so that users with a registry
//! can substitute official ones (`HKVM_NATS_IMAGE=nats:2.15` works: its entrypoint
//! is `/nats-server` too).

use testcontainers::core::{IntoContainerPort as _, WaitFor};
use testcontainers::GenericImage;

/// Env var naming the NATS image (`name:tag`).
pub const NATS_IMAGE_ENV: &str = "HKVM_NATS_IMAGE";
/// Env var naming the hkvm image (`name:tag`).
pub const HKVM_IMAGE_ENV: &str = "HKVM_IMAGE";
/// The NATS image `scripts/build-images` builds.
pub const DEFAULT_NATS_IMAGE: &str = "hkvm/nats:2.15.1";
/// The hkvm image `scripts/build-images` builds.
pub const DEFAULT_HKVM_IMAGE: &str = "hkvm/hkvm:dev";
/// The NATS client port inside containers.
pub const NATS_CLIENT_PORT: u16 = 4222;

/// Splits `registry:5000/name:tag` into name and tag (the tag follows the last `:`
/// after the last `/`; `latest` when absent).
pub fn split_image_ref(reference: &str) -> (String, String) {
    let name_start = reference.rfind('/').map_or(0, |slash| slash + 1);
    match reference[name_start..].rfind(':') {
        Some(colon) => {
            let at = name_start + colon;
            (reference[..at].to_owned(), reference[at + 1..].to_owned())
        }
        None => (reference.to_owned(), "latest".to_owned()),
    }
}

fn image_from_env(var: &str, default: &str) -> GenericImage {
    let reference = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let (name, tag) = split_image_ref(&reference);
    GenericImage::new(name, tag)
}

/// The NATS image, exposing the client port and ready once the server says so.
/// Pass the server's arguments with `ImageExt::with_cmd` (e.g. `["-js"]`).
pub fn nats_image() -> GenericImage {
    image_from_env(NATS_IMAGE_ENV, DEFAULT_NATS_IMAGE)
        .with_exposed_port(NATS_CLIENT_PORT.tcp())
        .with_wait_for(WaitFor::message_on_stderr("Server is ready"))
}

/// The hkvm image (entrypoint `/hkvm`); pass the subcommand with `with_cmd`.
pub fn hkvm_image() -> GenericImage {
    image_from_env(HKVM_IMAGE_ENV, DEFAULT_HKVM_IMAGE)
}
