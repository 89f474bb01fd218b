//! Connecting to NATS from a URL list as operators write it (`--nats`,
//! `NATS_URL:CLUSTER`): comma-separated servers, credentials in any of them.

use hkvm_events::subject::inbox_prefix;

/// Why a connection could not be made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectError {
    /// A URL of the list does not parse.
    #[error("parsing the NATS URLs {urls}: {reason}")]
    BadUrl {
        /// The list as given.
        urls: String,
        /// What is wrong.
        reason: String,
    },
    /// No server of the list accepted the connection.
    #[error("connecting to NATS at {urls}: {reason}")]
    Unreachable {
        /// The list as given.
        urls: String,
        /// The client library's reason.
        reason: String,
    },
}

/// Connects to the servers of `urls` (comma-separated), naming the connection
/// `name`. `user:password@` in one of the URLs is used for the connection (the
/// client library applies credentials of a list only when told to), with that
/// user's inbox prefix. The
/// connection's losses and reconnections are logged, and a reconnection ends the
/// wait of every request whose answer it lost ([`hkvm_log::connection`]).
///
/// # Errors
/// [`ConnectError`].
pub async fn connect(urls: &str, name: &str) -> Result<async_nats::Client, ConnectError> {
    // A plain string is parsed as one URL; a list must be split first.
    let servers = urls
        .split(',')
        .map(|url| url.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConnectError::BadUrl {
            urls: urls.to_owned(),
            reason: e.to_string(),
        })?;
    let connection = name.to_owned();
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .event_callback(move |event| {
            hkvm_log::connection::observe(&connection, &event);
            async {}
        });
    if let Some((user, password)) = servers
        .iter()
        .find_map(|server| Some((server.username()?.to_owned(), server.password()?.to_owned())))
    {
        // Replies come back under the user's own inbox prefix, the only one
        // its permissions let it subscribe to (docs/security.md).
        options = options
            .custom_inbox_prefix(inbox_prefix(&user))
            .user_and_password(user, password);
    }
    options
        .connect(servers)
        .await
        .map_err(|e| ConnectError::Unreachable {
            urls: urls.to_owned(),
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bad_url_is_a_typed_error() {
        let error = connect("nats://a:4222,nats://b:notaport", "t")
            .await
            .unwrap_err();
        assert!(matches!(error, ConnectError::BadUrl { .. }), "{error}");
    }
}
