//! Global-master RPCs, one subject per operation:
//! `hkvm.<cluster>.global.rpc.<op>` with `op` from [`GlobalOp::name`], served by
//! every global-master replica in one queue group. Every answer carries its
//! [`Staleness`]: per source sub-cluster, the last applied sequence and the lag.
//! Also the wire format of the per-sub-cluster bloom filters the global master
//! publishes, so that clients can answer "nowhere" locally.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::key_hash;
use crate::id::{ProducerId, SubclusterId};
use crate::rpc::submaster::GetReplicaListReply;

pub use crate::rpc::packed::{KeyHashes, Packed};

/// Most keys in one `prefix_hit` request (how SGLang/vLLM probe prefixes).
pub const MAX_PREFIX_KEYS: usize = 256;
/// Most keys in one `batch_is_exist`, `locate` or proxied `get_replica_list`.
pub const MAX_BATCH_KEYS: usize = 16_384;

/// The global-master operations and their subject suffixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GlobalOp {
    /// [`BatchIsExist`].
    BatchIsExist,
    /// [`BatchIsExistHashed`].
    BatchIsExistHashed,
    /// [`BatchIsExistHashed`] answered with its counts and holders packed.
    BatchIsExistPacked,
    /// [`PrefixHit`].
    PrefixHit,
    /// [`Locate`].
    Locate,
    /// [`ProxyGetReplicaList`].
    GetReplicaList,
    /// [`GlobalStatus`].
    Status,
}

impl GlobalOp {
    /// Every operation.
    pub const ALL: [GlobalOp; 7] = [
        GlobalOp::BatchIsExist,
        GlobalOp::BatchIsExistHashed,
        GlobalOp::BatchIsExistPacked,
        GlobalOp::PrefixHit,
        GlobalOp::Locate,
        GlobalOp::GetReplicaList,
        GlobalOp::Status,
    ];

    /// The last subject token.
    pub fn name(self) -> &'static str {
        match self {
            GlobalOp::BatchIsExist => "batch_is_exist",
            GlobalOp::BatchIsExistHashed => "batch_is_exist_hashed",
            GlobalOp::BatchIsExistPacked => "batch_is_exist_packed",
            GlobalOp::PrefixHit => "prefix_hit",
            GlobalOp::Locate => "locate",
            GlobalOp::GetReplicaList => "get_replica_list",
            GlobalOp::Status => "status",
        }
    }

    /// The operation with this subject token.
    pub fn from_name(name: &str) -> Option<GlobalOp> {
        GlobalOp::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// How labels restrict an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LabelMode {
    /// Never answer with a sub-cluster whose labels do not match.
    #[serde(rename = "hard")]
    Hard,
    /// Answer with every sub-cluster, matching ones first.
    #[default]
    #[serde(rename = "soft")]
    Soft,
}

/// Labels a sub-cluster must carry (all of them) to match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelFilter {
    /// Required `name = value` pairs.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Hard or soft partitioning.
    #[serde(default)]
    pub mode: LabelMode,
}

impl LabelFilter {
    /// Whether `labels` carries every required pair.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels
            .iter()
            .all(|(name, value)| labels.get(name) == Some(value))
    }
}

/// How current the projection of one source sub-cluster is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceLag {
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// The last stream sequence folded into the projection.
    pub applied_seq: u64,
    /// The stream's last sequence when last looked at.
    pub last_seq: u64,
    /// `last_seq - applied_seq`.
    pub lag_events: u64,
    /// How old the newest applied message is when behind, in ms; 0 when caught up.
    pub lag_ms: u64,
}

/// The staleness every answer carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staleness {
    /// The answering replica.
    pub replica: String,
    /// One entry per source.
    pub sources: Vec<SourceLag>,
}

/// Which sub-clusters hold each key (batch).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchIsExist {
    /// The keys.
    pub keys: Vec<String>,
    /// Restrict or rank by labels; the server's default when absent.
    #[serde(default)]
    pub labels: Option<LabelFilter>,
}

/// [`BatchIsExist`] with each key sent as its key hash (`crate::key_hash`,
/// unseeded xxh3-64, what the index is keyed by): 8 bytes a key on the wire,
/// packed ([`KeyHashes`]), instead of the key, and nothing for the global master
/// to check or hash. The reply is a [`BatchIsExistReply`], in the same order:
/// as integer arrays to `batch_is_exist_hashed` (what clients before packed
/// replies decode, [`BatchIsExistArrays`]), packed to `batch_is_exist_packed`.
/// Two keys with the same 64-bit hash are one key to the index either way.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchIsExistHashed {
    /// The key hashes.
    pub hashes: KeyHashes,
    /// Restrict or rank by labels; the server's default when absent.
    #[serde(default)]
    pub labels: Option<LabelFilter>,
}

impl BatchIsExistHashed {
    /// The request for `keys`.
    pub fn of_keys(keys: &[impl AsRef<str>], labels: Option<LabelFilter>) -> Self {
        Self {
            hashes: keys.iter().map(|key| key_hash(key.as_ref())).collect(),
            labels,
        }
    }
}

/// The reply to [`BatchIsExist`] and [`BatchIsExistHashed`]. The holders of all keys are flattened into one
/// list (two allocations per batch instead of one per key): key `i`'s holders are
/// the next `counts[i]` entries of `holders`. Counts and holders travel packed
/// (2 bytes each, encoded and decoded as a block); their older form, integer
/// arrays ([`BatchIsExistArrays`]), decodes alike.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchIsExistReply {
    /// The sub-clusters the answer refers to, by index.
    pub subclusters: Vec<SubclusterId>,
    /// Per key (request order), how many sub-clusters hold it (0: nowhere).
    pub counts: Packed<u16>,
    /// Indexes into `subclusters`, key after key, label-matching ones first.
    pub holders: Packed<u16>,
    /// How current the answer is.
    pub staleness: Staleness,
}

/// A [`BatchIsExistReply`] in its older wire form, counts and holders as integer
/// arrays: what `batch_is_exist` and `batch_is_exist_hashed` answer, so that
/// clients from before packed replies keep decoding them.
#[derive(Debug, Serialize)]
pub struct BatchIsExistArrays<'a> {
    /// As [`BatchIsExistReply::subclusters`].
    pub subclusters: &'a [SubclusterId],
    /// As [`BatchIsExistReply::counts`].
    pub counts: &'a [u16],
    /// As [`BatchIsExistReply::holders`].
    pub holders: &'a [u16],
    /// As [`BatchIsExistReply::staleness`].
    pub staleness: &'a Staleness,
}

impl BatchIsExistReply {
    /// The reply in its older wire form.
    pub fn as_arrays(&self) -> BatchIsExistArrays<'_> {
        BatchIsExistArrays {
            subclusters: &self.subclusters,
            counts: &self.counts,
            holders: &self.holders,
            staleness: &self.staleness,
        }
    }

    /// Per key, the indexes (into `subclusters`) of its holders, in rank order.
    pub fn per_key(&self) -> impl Iterator<Item = &[u16]> + '_ {
        let mut rest: &[u16] = &self.holders;
        self.counts.iter().map(move |&count| {
            let (mine, after) = rest.split_at(usize::from(count).min(rest.len()));
            rest = after;
            mine
        })
    }

    /// The sub-clusters holding the `index`-th key, in rank order.
    pub fn holders_of(&self, index: usize) -> Vec<&SubclusterId> {
        self.per_key()
            .nth(index)
            .map(|list| {
                list.iter()
                    .filter_map(|&i| self.subclusters.get(usize::from(i)))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Per sub-cluster, the length of the cached prefix of `keys`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixHit {
    /// The keys, in prefix order (at most [`MAX_PREFIX_KEYS`]).
    pub keys: Vec<String>,
    /// Restrict or rank by labels; the server's default when absent.
    #[serde(default)]
    pub labels: Option<LabelFilter>,
}

/// One sub-cluster's prefix length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixLength {
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// How many leading keys it holds (stops at the first miss).
    pub hits: u32,
}

/// The reply to [`PrefixHit`]: sub-clusters with a non-empty prefix, longest
/// first (label-matching first under soft labels).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixHitReply {
    /// The prefixes.
    pub prefixes: Vec<PrefixLength>,
    /// How current the answer is.
    pub staleness: Staleness,
}

/// Which sub-masters own each key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Locate {
    /// The keys.
    pub keys: Vec<String>,
    /// Restrict or rank by labels; the server's default when absent.
    #[serde(default)]
    pub labels: Option<LabelFilter>,
}

/// A sub-master holding a key, with how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// The registered sub-master instance, if registered.
    pub submaster: Option<ProducerId>,
    /// Its RPC subject prefix (`hkvm.<cluster>.<subcluster>.rpc`).
    pub rpc_prefix: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Whether its registration is alive.
    pub alive: bool,
}

/// The reply to [`Locate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocateReply {
    /// Per key (request order), its owners in rank order.
    pub owners: Vec<Vec<Owner>>,
    /// How current the answer is.
    pub staleness: Staleness,
}

/// Get replicas (with read leases) from whichever sub-master holds each key: the
/// global master forwards to the owners (authoritative), so a stale positive comes
/// back as a clean `NotFound`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyGetReplicaList {
    /// The keys.
    pub keys: Vec<String>,
    /// Restrict or rank by labels; the server's default when absent.
    #[serde(default)]
    pub labels: Option<LabelFilter>,
    /// Read your writes: before answering that a key is held nowhere, the replica
    /// catches up with every event stream as far as it went when the request
    /// arrived, so every put acknowledged before it is seen (bounded; an
    /// `RpcErrorCode::Stale` error otherwise).
    #[serde(default)]
    pub sync: bool,
}

/// The reply to [`ProxyGetReplicaList`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyGetReplicaListReply {
    /// Per key, the sub-cluster that answered (none when no one holds the key).
    pub from: Vec<Option<SubclusterId>>,
    /// Per key, the owning sub-master's answer.
    pub items: GetReplicaListReply,
    /// How current the projection that routed the request is.
    pub staleness: Staleness,
}

/// Ask a replica for its state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalStatus {}

/// One source as a replica sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    /// Position and lag.
    pub lag: SourceLag,
    /// The stream followed.
    pub stream: String,
    /// Keys present in the sub-cluster according to the projection.
    pub keys: u64,
    /// Times this source was re-read from scratch (gap, reset, corrupt message).
    pub resyncs: u64,
}

/// A replica's state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GlobalStatusReply {
    /// The replica.
    pub replica: String,
    /// Whether it is still replaying (answers `Busy`).
    pub replaying: bool,
    /// Distinct keys indexed.
    pub keys: u64,
    /// Index memory per key, bytes.
    pub bytes_per_key: f64,
    /// The sources.
    pub sources: Vec<SourceStatus>,
    /// `host:port` where this replica takes direct queries, if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<String>,
    /// The ticket a client shows on that endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct_ticket: Option<super::direct::DirectTicket>,
}

/// A bloom filter over the key hashes of one sub-cluster: no false negatives, so
/// "not in the filter" means "not in the sub-cluster" as of `covers_seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BloomFilter {
    /// The last stream sequence of the sub-cluster the filter reflects.
    pub covers_seq: u64,
    /// Probes per key.
    pub hashes: u32,
    /// The bit array (length a power of two, at least one word).
    pub words: Vec<u64>,
}

/// Magic prefix of an encoded [`BloomFilter`].
const BLOOM_MAGIC: &[u8; 8] = b"HKVMBLM1";

impl BloomFilter {
    /// An empty filter sized for `keys` at about 1% false positives.
    pub fn with_capacity(keys: usize, covers_seq: u64) -> Self {
        let bits = (keys.max(64) as u64 * 10).next_power_of_two();
        Self {
            covers_seq,
            hashes: 7,
            words: vec![0; usize::try_from(bits / 64).unwrap_or(1).max(1)],
        }
    }

    fn probes(&self, key_hash: u64) -> impl Iterator<Item = u64> {
        let mask = self.words.len() as u64 * 64 - 1;
        let h1 = key_hash;
        let h2 = key_hash.rotate_left(32) | 1;
        (0..u64::from(self.hashes)).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) & mask)
    }

    /// Adds a key hash (xxh3-64 of the key).
    pub fn insert(&mut self, key_hash: u64) {
        let mask = self.words.len() as u64 * 64 - 1;
        let h2 = key_hash.rotate_left(32) | 1;
        for i in 0..u64::from(self.hashes) {
            let bit = key_hash.wrapping_add(i.wrapping_mul(h2)) & mask;
            if let Some(word) = self.words.get_mut((bit / 64) as usize) {
                *word |= 1 << (bit % 64);
            }
        }
    }

    /// Whether the key hash may be present (false: certainly absent).
    pub fn may_contain(&self, key_hash: u64) -> bool {
        self.probes(key_hash).all(|bit| {
            self.words
                .get((bit / 64) as usize)
                .is_some_and(|word| word & (1 << (bit % 64)) != 0)
        })
    }

    /// Encodes as `HKVMBLM1`, covers_seq, hashes (u32), word count (u32), words,
    /// xxh3-64 of everything before it; little endian.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.words.len() * 8);
        out.extend_from_slice(BLOOM_MAGIC);
        out.extend_from_slice(&self.covers_seq.to_le_bytes());
        out.extend_from_slice(&self.hashes.to_le_bytes());
        out.extend_from_slice(&(self.words.len() as u32).to_le_bytes());
        for word in &self.words {
            out.extend_from_slice(&word.to_le_bytes());
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Decodes [`BloomFilter::to_bytes`], checking the checksum.
    ///
    /// # Errors
    /// A reason when the bytes are not a valid filter.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let body_len = bytes
            .len()
            .checked_sub(8)
            .ok_or_else(|| "too short".to_owned())?;
        let (body, sum) = bytes.split_at(body_len);
        let sum = u64::from_le_bytes(sum.try_into().map_err(|_| "bad checksum field")?);
        if xxhash_rust::xxh3::xxh3_64(body) != sum {
            return Err("checksum mismatch".to_owned());
        }
        let rest = body
            .strip_prefix(BLOOM_MAGIC)
            .ok_or_else(|| "not a bloom filter".to_owned())?;
        if rest.len() < 16 {
            return Err("truncated header".to_owned());
        }
        let (header, words) = rest.split_at(16);
        let le64 = |b: &[u8]| b.try_into().map(u64::from_le_bytes);
        let le32 = |b: &[u8]| b.try_into().map(u32::from_le_bytes);
        let covers_seq = le64(&header[..8]).map_err(|_| "bad header")?;
        let hashes = le32(&header[8..12]).map_err(|_| "bad header")?;
        let count = le32(&header[12..16]).map_err(|_| "bad header")? as usize;
        if count == 0 || !count.is_power_of_two() || words.len() != count * 8 || hashes > 32 {
            return Err("inconsistent sizes".to_owned());
        }
        let words = words
            .chunks_exact(8)
            .map(|chunk| le64(chunk).unwrap_or_default())
            .collect();
        Ok(Self {
            covers_seq,
            hashes,
            words,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_round_trip() {
        for op in GlobalOp::ALL {
            assert_eq!(GlobalOp::from_name(op.name()), Some(op));
        }
    }

    /// The reply as clients from before packed replies declare it.
    #[derive(Debug, Deserialize)]
    struct OlderReply {
        subclusters: Vec<SubclusterId>,
        counts: Vec<u16>,
        holders: Vec<u16>,
        staleness: Staleness,
    }

    proptest::proptest! {
        #[test]
        fn both_reply_forms_decode_alike_and_older_clients_read_the_array_form(
            counts in proptest::collection::vec(0u16..4, 0..300),
            subclusters in 1usize..5,
        ) {
            let holders: Vec<u16> = counts
                .iter()
                .flat_map(|&count| (0..count).map(move |i| i % subclusters as u16))
                .collect();
            let reply = BatchIsExistReply {
                subclusters: (0..subclusters)
                    .map(|i| SubclusterId::new(format!("sc-{i}")).unwrap())
                    .collect(),
                counts: counts.clone().into(),
                holders: holders.clone().into(),
                staleness: Staleness::default(),
            };
            let packed = crate::rpc::encode(&reply).unwrap();
            let arrays = crate::rpc::encode(&reply.as_arrays()).unwrap();
            proptest::prop_assert_eq!(&crate::rpc::decode::<BatchIsExistReply>(&packed).unwrap(), &reply);
            proptest::prop_assert_eq!(&crate::rpc::decode::<BatchIsExistReply>(&arrays).unwrap(), &reply);
            let older: OlderReply = crate::rpc::decode(&arrays).unwrap();
            proptest::prop_assert_eq!(&older.subclusters, &reply.subclusters);
            proptest::prop_assert_eq!(&older.counts, &counts);
            proptest::prop_assert_eq!(&older.holders, &holders);
            proptest::prop_assert_eq!(&older.staleness, &reply.staleness);
        }
    }

    #[test]
    fn bloom_has_no_false_negatives_and_round_trips() {
        let mut bloom = BloomFilter::with_capacity(1000, 42);
        for i in 0..1000u64 {
            bloom.insert(crate::key_hash(&format!("k{i}")));
        }
        assert!((0..1000u64).all(|i| bloom.may_contain(crate::key_hash(&format!("k{i}")))));
        let false_positives = (0..10_000u64)
            .filter(|i| bloom.may_contain(crate::key_hash(&format!("other{i}"))))
            .count();
        assert!(false_positives < 500, "{false_positives}");
        let bytes = bloom.to_bytes();
        assert_eq!(BloomFilter::from_bytes(&bytes).unwrap(), bloom);
        let mut broken = bytes.clone();
        broken[20] ^= 1;
        assert!(BloomFilter::from_bytes(&broken).is_err());
        assert!(BloomFilter::from_bytes(&bytes[..10]).is_err());
    }

    #[test]
    fn hard_labels_need_every_pair() {
        let filter = LabelFilter {
            labels: BTreeMap::from([("pool".into(), "a".into())]),
            mode: LabelMode::Hard,
        };
        assert!(filter.matches(&BTreeMap::from([
            ("pool".into(), "a".into()),
            ("zone".into(), "z".into())
        ])));
        assert!(!filter.matches(&BTreeMap::new()));
    }
}
