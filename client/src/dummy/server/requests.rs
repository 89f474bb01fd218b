//! Serving a dummy's requests through the real client's store, reading and
//! writing values straight in the regions the dummy shares.

use hkvm_events::rpc::dummy::{DummyReply, DummyRequest, ReplicaDesc, Span};

use super::Regions;
use crate::kv::PutOptions;
use crate::store::{segment_for, ErrorCode, Store};

/// Slices of the regions for `spans`, or `None` when one lies outside them.
fn read_slices<'r>(regions: &'r Regions, spans: &[Span]) -> Option<Vec<&'r [u8]>> {
    spans
        .iter()
        // SAFETY: the dummy hands these ranges to this request and does not write
        // them until it has the reply (the protocol's contract, as with DMA).
        .map(|span| unsafe { regions.get(&span.region)?.slice(span.offset, span.len) })
        .collect()
}

/// The keys (indexes) whose spans share bytes with an earlier key's spans or
/// with each other; empty spans share none.
fn overlapping_keys(spans: &[Vec<Span>]) -> Vec<usize> {
    use std::collections::BTreeMap;
    // Accepted spans: (region, start) -> end.
    let mut taken: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let clashes = |taken: &BTreeMap<(u32, u64), u64>, span: &Span| {
        let end = span.offset.saturating_add(span.len);
        let before = taken
            .range(..=(span.region, span.offset))
            .next_back()
            .is_some_and(|(&(region, _), &taken_end)| {
                region == span.region && taken_end > span.offset
            });
        let after = taken
            .range((span.region, span.offset)..(span.region, end))
            .next()
            .is_some();
        before || after
    };
    let mut refused = Vec::new();
    for (index, key_spans) in spans.iter().enumerate() {
        let mut mine: BTreeMap<(u32, u64), u64> = BTreeMap::new();
        let mut clash = false;
        for span in key_spans.iter().filter(|span| span.len > 0) {
            if clashes(&taken, span) || clashes(&mine, span) {
                clash = true;
                break;
            }
            mine.insert(
                (span.region, span.offset),
                span.offset.saturating_add(span.len),
            );
        }
        if clash {
            refused.push(index);
        } else {
            taken.extend(mine);
        }
    }
    refused
}

pub(super) async fn handle(store: &Store, regions: &Regions, request: DummyRequest) -> DummyReply {
    let invalid = ErrorCode::InvalidParams.value();
    match request {
        DummyRequest::Put {
            keys,
            spans,
            placement,
        } => {
            if spans.len() != keys.len() {
                return DummyReply::Codes(vec![invalid; keys.len()]);
            }
            let mut codes = vec![0; keys.len()];
            let mut slices = Vec::with_capacity(keys.len());
            let mut indexes = Vec::with_capacity(keys.len());
            for (index, spans) in spans.iter().enumerate() {
                match read_slices(regions, spans) {
                    Some(parts) => {
                        slices.push(parts);
                        indexes.push(index);
                    }
                    None => codes[index] = invalid,
                }
            }
            let items: Vec<(&str, &[&[u8]])> = indexes
                .iter()
                .zip(&slices)
                .map(|(&i, parts)| (keys[i].as_str(), parts.as_slice()))
                .collect();
            let options = PutOptions {
                replicas: placement.replicas.max(1),
                preferred_segment: placement
                    .preferred_segment
                    .as_deref()
                    .filter(|s| !s.is_empty())
                    .and_then(segment_for),
                hard_pin: placement.hard_pin,
            };
            if !items.is_empty() {
                match store.put(&items, &options).await {
                    Ok(results) => {
                        for (&index, result) in indexes.iter().zip(results) {
                            codes[index] = result.map_or_else(|e| e.code().value(), |()| 0);
                        }
                    }
                    Err(error) => {
                        for &index in &indexes {
                            codes[index] = error.code().value();
                        }
                    }
                }
            }
            DummyReply::Codes(codes)
        }
        DummyRequest::GetInto { keys, spans } => {
            if spans.len() != keys.len() {
                return DummyReply::Sizes(vec![i64::from(invalid); keys.len()]);
            }
            // Two writable slices of the same bytes at once would alias: a key
            // whose destination overlaps an earlier key's (or its own) is refused.
            let clashing = overlapping_keys(&spans);
            if !clashing.is_empty() {
                tracing::warn!(keys = ?clashing, "get_into destinations that overlap earlier ones; refused");
            }
            let mut sizes = vec![0i64; keys.len()];
            let mut parts: Vec<Vec<&mut [u8]>> = Vec::with_capacity(keys.len());
            let mut indexes = Vec::with_capacity(keys.len());
            for (index, spans) in spans.iter().enumerate() {
                if clashing.contains(&index) {
                    sizes[index] = i64::from(invalid);
                    continue;
                }
                // SAFETY: as for reads; the dummy leaves these ranges to this
                // request until the reply, and no two of them overlap (above).
                let buffers: Option<Vec<&mut [u8]>> = spans
                    .iter()
                    .map(|span| unsafe {
                        regions.get(&span.region)?.slice_mut(span.offset, span.len)
                    })
                    .collect();
                match buffers {
                    Some(buffers) => {
                        parts.push(buffers);
                        indexes.push(index);
                    }
                    None => sizes[index] = i64::from(invalid),
                }
            }
            let mut items: Vec<(&str, &mut [&mut [u8]])> = indexes
                .iter()
                .zip(parts.iter_mut())
                .map(|(&i, buffers)| (keys[i].as_str(), buffers.as_mut_slice()))
                .collect();
            if !items.is_empty() {
                match store.get_into(&mut items).await {
                    Ok(results) => {
                        for (&index, result) in indexes.iter().zip(results) {
                            sizes[index] = result.map_or_else(
                                |e| i64::from(e.code().value()),
                                |n| i64::try_from(n).unwrap_or(i64::MAX),
                            );
                        }
                    }
                    Err(error) => {
                        for &index in &indexes {
                            sizes[index] = i64::from(error.code().value());
                        }
                    }
                }
            }
            DummyReply::Sizes(sizes)
        }
        DummyRequest::Size { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.locate(&refs).await {
                Ok(located) => DummyReply::Sizes(
                    located
                        .into_iter()
                        .map(|l| {
                            l.map_or_else(
                                |e| i64::from(e.code().value()),
                                |l| i64::try_from(l.list.size).unwrap_or(i64::MAX),
                            )
                        })
                        .collect(),
                ),
                Err(error) => DummyReply::Sizes(vec![i64::from(error.code().value()); keys.len()]),
            }
        }
        DummyRequest::Replicas { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.locate(&refs).await {
                Ok(located) => DummyReply::Replicas(
                    located
                        .into_iter()
                        .map(|l| {
                            l.map(|l| ReplicaDesc::of(&l.list))
                                .map_err(|e| e.code().value())
                        })
                        .collect(),
                ),
                Err(error) => DummyReply::Refused {
                    code: error.code().value(),
                    reason: error.to_string(),
                },
            }
        }
        DummyRequest::Exist { keys } => match store.exist(&keys).await {
            Ok(exists) => DummyReply::Exist(exists.into_iter().map(i32::from).collect()),
            Err(_) => DummyReply::Exist(vec![-1; keys.len()]),
        },
        DummyRequest::Remove { keys, force } => match store.remove(&keys, force).await {
            Ok(results) => DummyReply::Codes(
                results
                    .into_iter()
                    .map(|r| r.map_or_else(|e| e.code().value(), |()| 0))
                    .collect(),
            ),
            Err(error) => DummyReply::Codes(vec![error.code().value(); keys.len()]),
        },
        DummyRequest::RemoveAll {
            pattern,
            force,
            tenant,
        } => {
            match store
                .remove_all(pattern.as_deref(), tenant.as_deref(), force)
                .await
            {
                Ok(removed) => DummyReply::Count(i64::try_from(removed).unwrap_or(i64::MAX)),
                Err(error) => DummyReply::Count(i64::from(error.code().value())),
            }
        }
        DummyRequest::Health => DummyReply::Health(store.health().await as i32),
        // Answered in order by the session loop, never here.
        DummyRequest::ReleaseRegion { .. } => DummyReply::Refused {
            code: invalid,
            reason: "a region is released by its session".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_that_share_bytes_are_found() {
        let span = |region, offset, len| Span {
            region,
            offset,
            len,
        };
        let apart = vec![
            vec![span(0, 0, 100), span(0, 100, 100)],
            vec![span(1, 50, 100)],
            vec![span(0, 200, 1)],
        ];
        assert_eq!(overlapping_keys(&apart), Vec::<usize>::new());
        // The later key is refused, the first one served.
        let shared = vec![vec![span(0, 0, 100)], vec![span(0, 99, 10)]];
        assert_eq!(overlapping_keys(&shared), vec![1]);
        // A span inside, or around, an earlier one; across keys, out of order.
        let inside = vec![
            vec![span(2, 500, 10)],
            vec![span(2, 0, 5), span(2, 505, 1)],
            vec![span(2, 400, 200)],
            vec![span(2, 10, 5)],
        ];
        assert_eq!(overlapping_keys(&inside), vec![1, 2]);
        // A key's own spans that overlap; a refused key's spans do not count.
        let own = vec![vec![span(0, 0, 10), span(0, 5, 10)], vec![span(0, 0, 10)]];
        assert_eq!(overlapping_keys(&own), vec![0]);
        // Empty spans share nothing.
        assert!(
            overlapping_keys(&[vec![span(0, 5, 0), span(0, 5, 0)], vec![span(0, 5, 0)]]).is_empty()
        );
    }
}
