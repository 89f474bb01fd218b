//! Per-tenant quotas: the bytes of a tenant's objects ([`hkvm_events::tenant`];
//! each object counted once, whatever its replicas) may not pass the quota its
//! sub-master is configured with. A put that would pass it is refused with
//! [`ItemError::QuotaExceeded`]; other tenants' puts, and eviction, are not
//! affected. Puts of one request count together; puts still in flight from
//! other requests are not counted, so a burst can pass a quota by what it holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hkvm_events::rpc::submaster::ItemError;
use hkvm_events::tenant;

use crate::state::State;

/// Bytes each named tenant may hold (tenants not named: no limit).
pub type TenantQuotas = Arc<BTreeMap<String, u64>>;

/// The quota check of one request.
pub(super) struct QuotaCheck<'q> {
    quotas: &'q BTreeMap<String, u64>,
    /// Bytes this request's admitted puts add, per tenant.
    added: HashMap<String, u64>,
}

impl<'q> QuotaCheck<'q> {
    /// A check against `quotas`.
    pub(super) fn new(quotas: &'q BTreeMap<String, u64>) -> Self {
        Self {
            quotas,
            added: HashMap::new(),
        }
    }

    /// Admits a put of `size` bytes under `key` when its tenant stays within its
    /// quota, counting it for the rest of the request.
    ///
    /// # Errors
    /// [`ItemError::QuotaExceeded`].
    pub(super) fn admit(&mut self, state: &State, key: &str, size: u64) -> Result<(), ItemError> {
        if self.quotas.is_empty() {
            return Ok(());
        }
        let Some(tenant) = tenant::tenant_of(key) else {
            return Ok(());
        };
        let Some(&quota) = self.quotas.get(tenant) else {
            return Ok(());
        };
        let added = self.added.get(tenant).copied().unwrap_or(0);
        let held = state.tenant_bytes(tenant).saturating_add(added);
        if held.saturating_add(size) > quota {
            return Err(ItemError::QuotaExceeded { quota, held });
        }
        *self.added.entry(tenant.to_owned()).or_insert(0) += size;
        Ok(())
    }
}
