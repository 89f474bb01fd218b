//! Structured `tracing` logs on stderr for every HKVM binary, filtered by
//! `RUST_LOG` when it is set, else by the binary's [`Verbosity`]: services log
//! at `info`, one-shot commands print their results and log only warnings
//! unless asked for more (NATS client chatter stays at `warn` either way).

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// What is logged when `RUST_LOG` is unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verbosity {
    /// Warnings and errors only (one-shot commands: their output is the result).
    Quiet,
    /// What a service does (start, leadership, recovery) and warnings.
    Info,
    /// Everything HKVM logs at `debug`.
    Debug,
}

impl Verbosity {
    /// The filter directives of this verbosity.
    pub fn directives(self) -> &'static str {
        match self {
            Self::Quiet => "warn",
            Self::Info => "info,async_nats=warn",
            Self::Debug => "debug,async_nats=warn",
        }
    }

    /// `base` raised by `more` steps of `-v` (`Quiet` → `Info` → `Debug`).
    pub fn raised(base: Self, more: u8) -> Self {
        let steps = match base {
            Self::Quiet => 0,
            Self::Info => 1,
            Self::Debug => 2,
        } + u32::from(more);
        match steps {
            0 => Self::Quiet,
            1 => Self::Info,
            _ => Self::Debug,
        }
    }
}

/// Installs the global subscriber at `verbosity` (services: [`Verbosity::Info`]).
pub fn init(format: LogFormat) {
    init_at(format, Verbosity::Info);
}

/// Installs the global subscriber; `RUST_LOG`, when set, wins over `verbosity`.
pub fn init_at(format: LogFormat, verbosity: Verbosity) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(verbosity.directives()));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_v_raises_one_step_up_to_debug() {
        assert_eq!(Verbosity::raised(Verbosity::Quiet, 0), Verbosity::Quiet);
        assert_eq!(Verbosity::raised(Verbosity::Quiet, 1), Verbosity::Info);
        assert_eq!(Verbosity::raised(Verbosity::Quiet, 5), Verbosity::Debug);
        assert_eq!(Verbosity::raised(Verbosity::Info, 1), Verbosity::Debug);
        assert_eq!(Verbosity::Quiet.directives(), "warn");
    }
}
