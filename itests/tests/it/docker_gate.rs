//! The Docker suites ([`crate::containers`], [`crate::chaos`]) need a Docker engine
//! and the images of `scripts/build-images`: they run only with
//! `HKVM_DOCKER_TESTS=1`. Otherwise each of their tests returns at once and says
//! on stderr that it was skipped (and a chaos scenario records a `skipped` row).

/// Env var that turns the Docker suites on (`1` or `true`).
pub const DOCKER_TESTS_ENV: &str = "HKVM_DOCKER_TESTS";

/// Env var that skips the slowest chaos scenario (`1` or `true`).
pub const QUICK_ENV: &str = "HKVM_ITESTS_QUICK";

/// Whether a flag's value turns it on: `1` or `true` (any other value is off).
fn is_on(value: &str) -> bool {
    let value = value.trim();
    value == "1" || value.eq_ignore_ascii_case("true")
}

/// Whether env var `name` is set to a value that turns it on.
fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|value| is_on(&value))
}

/// Whether the Docker suites run.
pub fn docker_tests_enabled() -> bool {
    flag(DOCKER_TESTS_ENV)
}

/// Whether the slowest chaos scenario is skipped.
pub fn quick() -> bool {
    flag(QUICK_ENV)
}

/// Whether the Docker test `name` runs; when it does not, says so on stderr.
pub fn docker_or_skip(name: &str) -> bool {
    if docker_tests_enabled() {
        return true;
    }
    eprintln!(
        "SKIPPED (set {DOCKER_TESTS_ENV}=1 to run the Docker suites; they need a Docker \
         engine and the images of scripts/build-images): {name}"
    );
    false
}

#[test]
fn only_one_or_true_turns_a_flag_on() {
    for (value, on) in [
        ("1", true),
        ("true", true),
        ("TRUE", true),
        (" 1 ", true),
        ("0", false),
        ("false", false),
        ("", false),
        ("yes", false),
    ] {
        assert_eq!(is_on(value), on, "{value:?}");
    }
}
