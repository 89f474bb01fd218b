//! Who may use a dummy channel. The channel is an abstract Unix socket, which
//! has no file permissions: anyone on the host can connect to it, or bind its
//! name while the real client is down. So both sides ask the kernel who the peer
//! is (`SO_PEERCRED`) before any memory changes hands: the real client serves
//! only dummies of its own user (or of users it is told to trust), and a dummy
//! sends its memory only to a real client of its own user (or of users it is
//! told to trust).

use std::os::fd::AsFd;

/// The environment variable a dummy reads for further users whose real client it
/// trusts (comma-separated numeric uids).
pub const TRUSTED_SERVER_UIDS_ENV: &str = "HKVM_DUMMY_SERVER_UIDS";

/// The users a side of the channel accepts as its peer: its own effective user
/// always, and any listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAccess {
    uids: Vec<u32>,
}

impl Default for PeerAccess {
    fn default() -> Self {
        Self::own_user()
    }
}

impl PeerAccess {
    /// This process's effective user only.
    pub fn own_user() -> Self {
        Self {
            uids: vec![rustix::process::geteuid().as_raw()],
        }
    }

    /// This process's effective user and `uids`.
    pub fn with_uids(uids: impl IntoIterator<Item = u32>) -> Self {
        let mut access = Self::own_user();
        access.uids.extend(uids);
        access.uids.sort_unstable();
        access.uids.dedup();
        access
    }

    /// This process's effective user and the uids in the environment variable
    /// `name`, if set.
    ///
    /// # Errors
    /// When the variable holds something else than comma-separated uids.
    pub fn from_env(name: &str) -> Result<Self, String> {
        match std::env::var(name) {
            Ok(text) => Ok(Self::with_uids(
                parse_uids(&text).map_err(|e| format!("{name}: {e}"))?,
            )),
            Err(_) => Ok(Self::own_user()),
        }
    }

    /// Exactly `uids`, not even this process's user: to judge a peer as a
    /// stranger would be judged, in tests.
    #[cfg(test)]
    pub(crate) fn only(uids: Vec<u32>) -> Self {
        Self { uids }
    }

    /// Whether a peer of user `uid` is accepted.
    pub fn allows(&self, uid: u32) -> bool {
        self.uids.contains(&uid)
    }

    /// Checks the peer of `socket`.
    ///
    /// # Errors
    /// `PermissionDenied` naming the peer's user (and process) when it is not
    /// accepted; the socket's error when the kernel cannot tell.
    pub fn check(&self, socket: impl AsFd) -> std::io::Result<u32> {
        let peer = rustix::net::sockopt::socket_peercred(socket)?;
        let uid = peer.uid.as_raw();
        if self.allows(uid) {
            return Ok(uid);
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the peer (pid {}) runs as uid {uid}, which is not {}",
                peer.pid.as_raw_nonzero(),
                self.describe()
            ),
        ))
    }

    fn describe(&self) -> String {
        let listed: Vec<String> = self.uids.iter().map(u32::to_string).collect();
        format!("an accepted user (uid {})", listed.join(", "))
    }
}

/// Comma-separated numeric uids (spaces allowed; empty entries skipped).
///
/// # Errors
/// The first entry that is not a uid.
pub fn parse_uids(text: &str) -> Result<Vec<u32>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            entry
                .parse::<u32>()
                .map_err(|_| format!("{entry:?} is not a numeric uid"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_user_is_always_accepted_and_others_only_when_listed() {
        let own = rustix::process::geteuid().as_raw();
        let access = PeerAccess::own_user();
        assert!(access.allows(own));
        assert!(!access.allows(own.wrapping_add(1)));
        let listed = PeerAccess::with_uids([own.wrapping_add(1), own]);
        assert!(listed.allows(own) && listed.allows(own.wrapping_add(1)));
        assert!(!listed.allows(own.wrapping_add(2)));
    }

    #[test]
    fn uid_lists_parse_or_say_what_is_wrong() {
        assert_eq!(parse_uids(" 1000, 1001 ,,"), Ok(vec![1000, 1001]));
        assert_eq!(parse_uids(""), Ok(vec![]));
        assert!(parse_uids("1000,alice").unwrap_err().contains("alice"));
        assert!(parse_uids("-1").is_err());
    }

    #[test]
    fn a_peer_of_this_user_passes_the_check_and_a_stranger_would_not() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let own = rustix::process::geteuid().as_raw();
        assert_eq!(PeerAccess::own_user().check(&a).unwrap(), own);
        // The same peer, judged by a side that accepts only another user.
        let other = PeerAccess::only(vec![own.wrapping_add(1)]);
        let error = other.check(&a).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(error.to_string().contains(&format!("uid {own}")), "{error}");
    }
}
