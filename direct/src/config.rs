//! Where a direct front listens and what it tells its clients, as a sub-master
//! or a global-master replica is configured.

use std::net::{IpAddr, SocketAddr};

/// Where a server listens for direct requests, and what it tells clients (in a
/// TOML file: `listen = "auto"`, `advertise = "host"`, both optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DirectConfig {
    /// The listening address.
    pub listen: DirectListen,
    /// The `host` or `host:port` clients are told to connect to, when it is not
    /// the listening address (behind NAT, a proxy, a container port mapping);
    /// without a port, the listening port.
    pub advertise: Option<String>,
}

/// Whether and where a server listens for direct requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DirectListen {
    /// No direct front: every request crosses NATS.
    Off,
    /// The address the NATS server sees this process connect from (so one that
    /// routes from the network NATS serves), on a port the system picks.
    #[default]
    Auto,
    /// This address.
    At(SocketAddr),
}

impl<'de> serde::Deserialize<'de> for DirectListen {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for DirectListen {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            addr => addr.parse().map(Self::At).map_err(|_| {
                format!("{addr:?} is neither `off`, `auto` nor an address like 10.0.0.5:4100")
            }),
        }
    }
}

impl DirectConfig {
    /// The address to listen on, given the address the NATS server sees this
    /// process at (`client_ip` of its server info): none when direct requests
    /// are off, or `auto` and that address is unknown.
    pub fn listen_addr(&self, seen_by_nats: &str) -> Option<SocketAddr> {
        match self.listen {
            DirectListen::Off => None,
            DirectListen::At(addr) => Some(addr),
            DirectListen::Auto => match seen_by_nats.parse::<IpAddr>() {
                Ok(ip) => Some(SocketAddr::new(ip, 0)),
                Err(_) => {
                    tracing::warn!(
                        client_ip = %seen_by_nats,
                        "the NATS server did not say which address it sees this process at: \
                         no direct front (set --direct to an address to have one)"
                    );
                    None
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn listen_addresses_parse_and_auto_takes_the_address_nats_sees() {
        assert_eq!("off".parse::<DirectListen>(), Ok(DirectListen::Off));
        assert_eq!("auto".parse::<DirectListen>(), Ok(DirectListen::Auto));
        let at: SocketAddr = "10.0.0.5:4100".parse().unwrap();
        assert_eq!(
            "10.0.0.5:4100".parse::<DirectListen>(),
            Ok(DirectListen::At(at))
        );
        assert!("nowhere".parse::<DirectListen>().is_err());
        let auto = DirectConfig::default();
        assert_eq!(
            auto.listen_addr("172.17.0.3"),
            Some("172.17.0.3:0".parse().unwrap())
        );
        assert_eq!(auto.listen_addr(""), None);
        let off = DirectConfig {
            listen: DirectListen::Off,
            advertise: None,
        };
        assert_eq!(off.listen_addr("172.17.0.3"), None);
        let read: DirectConfig = toml::from_str("listen = \"off\"\nadvertise = \"h\"").unwrap();
        assert_eq!(read.listen, DirectListen::Off);
        assert_eq!(read.advertise.as_deref(), Some("h"));
        assert!(toml::from_str::<DirectConfig>("listen = \"nowhere\"").is_err());
    }
}
