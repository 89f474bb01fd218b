//! Tenants: isolated key spaces in one pool, as Mooncake's `tenant_id` gives
//! them. A key of the default tenant is stored as it is; a key `k` of tenant `t`
//! is stored as [`TENANT_MARK`] `t` [`TENANT_END`] `k`. A tenant name holds no
//! control character (Mooncake's rule), so a scoped key names its tenant without
//! ambiguity, and a key of one tenant never equals a key of another. Clients
//! scope the keys of a store set up for a tenant; a sub-master scopes the
//! pattern removals a tenant asks for ([`crate::rpc::submaster::RemoveMatching`]).

/// The tenant of keys stored as they are.
pub const DEFAULT_TENANT: &str = "default";
/// The first character of a key that belongs to a tenant other than the default.
pub const TENANT_MARK: char = '\u{1e}';
/// The character that ends the tenant's name in a scoped key.
pub const TENANT_END: char = '\u{1f}';
/// Longest tenant name, in bytes.
pub const MAX_TENANT_LEN: usize = 128;

/// Why a tenant name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// Empty.
    #[error("a tenant name cannot be empty")]
    Empty,
    /// Longer than [`MAX_TENANT_LEN`].
    #[error("a tenant name of {0} bytes is longer than {MAX_TENANT_LEN}")]
    TooLong(usize),
    /// Starts with `_` (reserved, as on Mooncake).
    #[error("a tenant name cannot start with '_'")]
    Reserved,
    /// Holds a control character.
    #[error("a tenant name cannot hold control characters")]
    ControlCharacter,
}

/// Checks a tenant name: not empty, at most [`MAX_TENANT_LEN`] bytes, not
/// starting with `_`, without control characters.
///
/// # Errors
/// The [`TenantError`] that refuses it.
pub fn check_tenant(tenant: &str) -> Result<(), TenantError> {
    if tenant.is_empty() {
        return Err(TenantError::Empty);
    }
    if tenant.len() > MAX_TENANT_LEN {
        return Err(TenantError::TooLong(tenant.len()));
    }
    if tenant.starts_with('_') {
        return Err(TenantError::Reserved);
    }
    if tenant.chars().any(char::is_control) {
        return Err(TenantError::ControlCharacter);
    }
    Ok(())
}

/// What every stored key of `tenant` starts with: nothing for the default
/// tenant.
pub fn key_prefix(tenant: &str) -> String {
    if tenant == DEFAULT_TENANT {
        String::new()
    } else {
        format!("{TENANT_MARK}{tenant}{TENANT_END}")
    }
}

/// The key a tenant calls `stored` by, when `stored` is one of `tenant`'s keys.
pub fn key_of<'k>(tenant: &str, stored: &'k str) -> Option<&'k str> {
    if tenant == DEFAULT_TENANT {
        return (!stored.starts_with(TENANT_MARK)).then_some(stored);
    }
    stored
        .strip_prefix(TENANT_MARK)?
        .strip_prefix(tenant)?
        .strip_prefix(TENANT_END)
}

/// The tenant a stored key belongs to: `None` for the default tenant.
pub fn tenant_of(stored: &str) -> Option<&str> {
    let scoped = stored.strip_prefix(TENANT_MARK)?;
    scoped.split_once(TENANT_END).map(|(tenant, _)| tenant)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn names_follow_mooncakes_rules() {
        assert_eq!(check_tenant("team-a"), Ok(()));
        assert_eq!(check_tenant("模型"), Ok(()));
        assert_eq!(check_tenant(""), Err(TenantError::Empty));
        assert_eq!(check_tenant("_admin"), Err(TenantError::Reserved));
        assert_eq!(check_tenant("a\u{1f}b"), Err(TenantError::ControlCharacter));
        assert_eq!(check_tenant("a\u{7f}"), Err(TenantError::ControlCharacter));
        assert_eq!(
            check_tenant(&"t".repeat(MAX_TENANT_LEN + 1)),
            Err(TenantError::TooLong(MAX_TENANT_LEN + 1))
        );
    }

    #[test]
    fn the_default_tenant_keeps_keys_as_they_are_and_owns_no_scoped_key() {
        assert_eq!(key_prefix(DEFAULT_TENANT), "");
        assert_eq!(key_of(DEFAULT_TENANT, "k"), Some("k"));
        let scoped = format!("{}k", key_prefix("a"));
        assert_eq!(key_of(DEFAULT_TENANT, &scoped), None);
        assert_eq!(key_of("a", &scoped), Some("k"));
        assert_eq!(key_of("a", "k"), None);
    }

    proptest! {
        #[test]
        fn a_scoped_key_belongs_to_its_tenant_alone(
            a in "[a-z]{1,6}",
            b in "[a-z]{1,6}",
            key in "\\PC{0,12}",
        ) {
            let stored = format!("{}{key}", key_prefix(&a));
            prop_assert_eq!(key_of(&a, &stored), Some(key.as_str()));
            if a != b {
                prop_assert_eq!(key_of(&b, &stored), None);
            }
            prop_assert_eq!(key_of(DEFAULT_TENANT, &stored), None);
            prop_assert_eq!(tenant_of(&stored), Some(a.as_str()));
            // Generated keys hold no control character: the default tenant's.
            prop_assert_eq!(tenant_of(&key), None);
        }
    }
}
